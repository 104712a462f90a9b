"""The documentation builds strictly (broken links, pages missing from the nav and bad anchors fail), and the
passes reference is generated from the pass registry, so it cannot drift from the code."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HOOK = ROOT / "docs" / "hooks" / "passes_reference.py"


def _hook():
    spec = importlib.util.spec_from_file_location("passes_reference", HOOK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _section(text: str, name: str) -> str:
    start = text.index(f"## `{name}`")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def test_passes_reference_lists_every_registered_pass_and_option():
    from dyncompile.passes._infra import PASS_REGISTRY, known_passes

    text = _hook().render()
    assert set(known_passes()) == set(PASS_REGISTRY)
    for name, spec in PASS_REGISTRY.items():
        section = _section(text, name)
        assert spec.help.split()[0] in section, name
        for option in spec.options:
            assert f"| `{option.name}` |" in section, (name, option.name)
            assert repr(option.default) in section, (name, option.name)


def test_passes_reference_follows_the_registry(monkeypatch):
    """A pass registered now appears in the next render, with its options: the page is generated, not written."""
    from dyncompile.passes._infra import PASS_REGISTRY, register_pass

    monkeypatch.setattr("dyncompile.passes._infra.PASS_REGISTRY", dict(PASS_REGISTRY))
    import dyncompile.passes._infra as infra

    @register_pass("docs-probe", help="a probe pass that only this test registers")
    def _probe(context, *, strength: int = 7, mode: str = "gentle"):
        raise AssertionError("never built")

    assert "docs-probe" in infra.PASS_REGISTRY and "docs-probe" not in PASS_REGISTRY
    section = _section(_hook().render(), "docs-probe")
    assert "a probe pass that only this test registers" in section
    assert "| `strength` | int | `7` |" in section and "| `mode` | str | `'gentle'` |" in section


def test_every_docs_page_is_in_the_nav():
    """mkdocs --strict catches this too; this check runs where mkdocs is not installed."""
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md"))
    assert pages
    missing = [p for p in pages if p not in nav]
    assert not missing, f"docs pages not in mkdocs.yml's nav: {missing}"


def test_mkdocs_builds_strictly(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (it is in the `dev` extra; CI installs it)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(site)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from dyncompile.passes._infra import PASS_REGISTRY

    reference = (site / "passes.html").read_text()
    for name in PASS_REGISTRY:
        assert f"<code>{name}</code>" in reference, name
