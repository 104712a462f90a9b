"""The package's shape: imports run one way, every subpackage ships, importing passes loads no executor."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# layer -> the dyncompile modules (prefixes) it must never import, at module level or inside functions.
FORBIDDEN = {
    "runtime": ("dyncompile.passes", "dyncompile.tools", "dyncompile.models"),
    "passes": ("dyncompile.tools", "dyncompile.models"),
    "models": ("dyncompile.runtime", "dyncompile.tools", "dyncompile.passes"),
    "plan": ("dyncompile.passes", "dyncompile.runtime", "dyncompile.tools", "dyncompile.models"),
    "io.py": ("dyncompile.passes", "dyncompile.runtime", "dyncompile.tools", "dyncompile.models", "dyncompile.plan"),
    "errors.py": ("dyncompile.",),
    "_rule_guard.py": ("dyncompile.",),  # an onnxscript helper passes and models both use
    "__init__.py": ("dyncompile.tools",),  # the package's API (load / compile / route) runs without the CLI layer
    "tools/serve": ("dyncompile.passes", "dyncompile.models"),  # a server loads plans; it never compiles
}


# The runtime modules a pass may import (prefixes); every other dyncompile.runtime module is off limits to passes.
# Each is a leaf: numpy-only decision rules the compile must apply exactly as the runtime does, the tokenizer
# wrapper, the provider table, and the denoising loop the step-saver calibration must run as the runtime will.
PASSES_MAY_IMPORT_FROM_RUNTIME = (
    "dyncompile.runtime.rules",
    "dyncompile.runtime.text",
    "dyncompile.runtime.providers",
    "dyncompile.runtime.diffusion.denoise",
    "dyncompile.runtime.kernels",
)


def _under(mod: str, prefixes) -> bool:
    return any(mod == b or mod.startswith(b if b.endswith(".") else b + ".") for b in prefixes)


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def _wrong_way_edges(root: Path) -> list[str]:
    bad = []
    for layer, banned in FORBIDDEN.items():
        files = [root / layer] if layer.endswith(".py") else sorted((root / layer).rglob("*.py"))
        for f in files:
            for lineno, mod in _imports(f):
                if _under(mod, banned):
                    bad.append(f"{f.relative_to(root)}:{lineno} imports {mod}")
    for f in sorted((root / "passes").rglob("*.py")):
        for lineno, mod in _imports(f):
            if _under(mod, ("dyncompile.runtime",)) and not _under(mod, PASSES_MAY_IMPORT_FROM_RUNTIME):
                bad.append(f"{f.relative_to(root)}:{lineno} imports {mod}")
    return bad


def _allowed_runtime_files(root: Path) -> list[Path]:
    out = []
    for prefix in PASSES_MAY_IMPORT_FROM_RUNTIME:
        rel = Path(*prefix.split(".")[1:])
        out += sorted((root / rel).rglob("*.py")) if (root / rel).is_dir() else [root / rel.with_suffix(".py")]
    return out


def test_imports_run_one_way():
    assert _wrong_way_edges(ROOT) == []


def test_the_runtime_modules_passes_may_import_are_leaves():
    # what a pass may import from the runtime imports nothing of the runtime beyond the same allow-list
    bad = []
    for f in _allowed_runtime_files(ROOT):
        assert f.is_file(), f
        for lineno, mod in _imports(f):
            if _under(mod, ("dyncompile.",)) and not _under(mod, ("dyncompile.errors", "dyncompile.plan",
                                                                   *PASSES_MAY_IMPORT_FROM_RUNTIME)):
                bad.append(f"{f.relative_to(ROOT)}:{lineno} imports {mod}")
    assert bad == []


def test_the_import_walker_sees_a_wrong_way_edge(tmp_path):
    # negative control: a function-level import of the CLI inside a pass is found
    for layer in FORBIDDEN:
        if layer.endswith(".py"):
            (tmp_path / layer).write_text("")
        else:
            (tmp_path / layer).mkdir(parents=True)
    (tmp_path / "passes" / "p.py").write_text("def f():\n    from dyncompile.tools.cli import main\n")
    (tmp_path / "models" / "m.py").write_text("import dyncompile.runtime.text\n")
    (tmp_path / "tools" / "serve" / "s.py").write_text("def h():\n    import dyncompile.passes.compiler\n")
    # passes -> runtime: the allow-listed leaves pass, anything else (the executor, a step module) is found
    (tmp_path / "passes" / "q.py").write_text(
        "from dyncompile.runtime.rules.exit_rule import softmax\nimport dyncompile.runtime.text\n"
        "def g():\n    from dyncompile.runtime.executor import load\n    import dyncompile.runtime.decode.generate\n"
    )
    assert sorted(_wrong_way_edges(tmp_path)) == [
        "models/m.py:1 imports dyncompile.runtime.text",
        "passes/p.py:2 imports dyncompile.tools.cli",
        "passes/p.py:2 imports dyncompile.tools.cli.main",
        "passes/q.py:4 imports dyncompile.runtime.executor",
        "passes/q.py:4 imports dyncompile.runtime.executor.load",
        "passes/q.py:5 imports dyncompile.runtime.decode.generate",
        "tools/serve/s.py:2 imports dyncompile.passes.compiler",
    ]


def test_importing_passes_does_not_load_the_runtime_executor():
    code = (
        "import sys, dyncompile.passes, dyncompile.plan, dyncompile.io;"
        "print(sorted(m for m in sys.modules if m.startswith('dyncompile.runtime')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "dyncompile.runtime.executor" not in out and "dyncompile.runtime.steps" not in out, out
    loaded = set(ast.literal_eval(out.strip()))
    packages = {"dyncompile.runtime", "dyncompile.runtime.diffusion"}
    assert {m for m in loaded - packages if not _under(m, PASSES_MAY_IMPORT_FROM_RUNTIME)} == set(), loaded


#: subpackages that stay in the checkout and out of the wheel: one-off studies and their data prep
NOT_SHIPPED = {"dyncompile.tools.studies"}


def test_every_subpackage_ships_in_the_wheel():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert not listed & NOT_SHIPPED, f"listed for the wheel but meant to stay out: {listed & NOT_SHIPPED}"
    found = {"dyncompile"} | {
        "dyncompile." + ".".join(p.parent.relative_to(ROOT).parts)
        for p in ROOT.rglob("__init__.py")
        if p.parent != ROOT and not any(part.startswith(".") or part in ("tests", "build") for part in p.relative_to(ROOT).parts)
    }
    found -= NOT_SHIPPED
    assert found == listed, f"folders with __init__.py vs [tool.setuptools] packages: {found ^ listed}"


def _studies_edges(root: Path) -> list[str]:
    """Imports of ``dyncompile.tools.studies`` from shipped code (the wheel has no studies to import)."""
    bad = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root)
        if rel.parts[0] in ("tests", "build") or rel.parts[0].startswith(".") or rel.parts[:2] == ("tools", "studies"):
            continue
        bad += [f"{rel}:{n} imports {m}" for n, m in _imports(f)
                if m == "dyncompile.tools.studies" or m.startswith("dyncompile.tools.studies.")]
    return bad


def test_shipped_code_never_imports_the_studies(tmp_path):
    assert _studies_edges(ROOT) == []
    (tmp_path / "tools" / "bench").mkdir(parents=True)  # negative control
    (tmp_path / "tools" / "bench" / "b.py").write_text("def f():\n    from dyncompile.tools.studies import x\n")
    assert _studies_edges(tmp_path) == ["tools/bench/b.py:2 imports dyncompile.tools.studies",
                                        "tools/bench/b.py:2 imports dyncompile.tools.studies.x"]
