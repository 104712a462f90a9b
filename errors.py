"""User-facing error types.

Every error a user can cause (bad path, bad model, bad option, tampered plan, missing provider...) is a
:class:`DyncompileError`: the CLI prints its message (what, where, how to fix) and exits non-zero
without a traceback. Anything else escaping the CLI is a bug in dyncompile.
"""

from __future__ import annotations


class DyncompileError(Exception):
    """Base class of errors caused by the user's input or environment (printed without traceback)."""

    exit_code = 2


class ModelLoadError(DyncompileError):
    """The input model file is missing, unreadable, not ONNX, or truncated."""


class PassConfigError(DyncompileError):
    """Unknown pass name, bad pass option, or a pass precondition the user can fix."""


class PlanError(DyncompileError):
    """A plan directory is missing, malformed, tampered with, or of an unknown version."""


class OutputExistsError(DyncompileError):
    """The output directory exists and --force was not given."""


class ProviderError(DyncompileError):
    """An execution provider is not available, or two ONNX Runtime flavours clash."""


class DataError(DyncompileError):
    """A data / calibration / prompt file is missing or malformed."""
