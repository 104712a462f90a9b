"""The ``dyncompile.*`` model keys are declared in one module (passes/_keys.py): no pass spells one of its own."""

from __future__ import annotations

import re
from pathlib import Path

from dyncompile.passes import _keys

ROOT = Path(__file__).resolve().parent.parent
LITERAL = re.compile(r"""["'](dyncompile\.[a-z_][a-z0-9_.]*)["']""")


def test_every_key_literal_in_passes_is_declared():
    declared = _keys.METADATA_KEYS | _keys.META_KEYS | {_keys.POLICY_PREFIX}
    found = {}
    for path in (ROOT / "passes").rglob("*.py"):
        if path.name == "_keys.py":
            continue
        for m in LITERAL.finditer(path.read_text()):
            key = m.group(1)
            if key.startswith(("dyncompile.passes", "dyncompile.runtime", "dyncompile.io", "dyncompile.plan")):
                continue  # module names (imports, loggers), not model keys
            found.setdefault(key, str(path.relative_to(ROOT)))
    undeclared = {k: where for k, where in found.items() if k not in declared}
    assert not undeclared, f"declare these model keys in passes/_keys.py: {undeclared}"
    assert found, "the scan found no key literals at all: the pattern is wrong"

