"""One-off studies and their data preparation: run from a checkout (``python -m dyncompile.tools.studies.X``), not shipped in the wheel."""
