"""MkDocs hook: the passes reference, generated from the pass registry at build time.

``docs/passes.md`` holds the marker below; this hook replaces it with one section per registered pass
(name, help, pass classes, options with their types and defaults, ordering constraints and required
compile inputs), read from :data:`dyncompile.passes._infra.PASS_REGISTRY`. The page therefore cannot
drift from the code: a new pass, option or default shows up on the next build.

``render()`` is importable without MkDocs (``tests/test_docs.py`` uses it).
"""

from __future__ import annotations

import inspect

MARKER = "<!-- generated: passes reference -->"


def _summary(doc: str | None) -> str:
    """The first paragraph of a docstring, on one line."""
    if not doc:
        return ""
    para = inspect.cleandoc(doc).split("\n\n", 1)[0]
    return " ".join(para.split())


def _pass_classes(factory) -> list[type]:
    """Pass classes defined in the factory's module (what ``--passes NAME`` builds)."""
    import onnx_ir as ir

    module = inspect.getmodule(factory)
    out = []
    for _, obj in inspect.getmembers(module, inspect.isclass):
        if obj.__module__ == module.__name__ and issubclass(obj, ir.passes.PassBase):
            out.append(obj)
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    """Markdown for every registered pass, in name order."""
    import dyncompile.passes  # noqa: F401 - importing the package registers the built-in passes
    from dyncompile.passes._infra import PASS_REGISTRY

    parts = [
        "| pass | what |",
        "|---|---|",
    ]
    for name, spec in sorted(PASS_REGISTRY.items()):
        parts.append(f"| [`{name}`](#{name}) | {_cell(spec.help)} |")
    for name, spec in sorted(PASS_REGISTRY.items()):
        parts += ["", f"## `{name}`", "", _cell(spec.help), ""]
        classes = _pass_classes(spec.factory)
        if classes:
            parts.append("Pass classes: " + ", ".join(f"`{c.__name__}`" for c in classes) + ".")
            parts.append("")
            for c in classes:
                summary = _summary(c.__doc__)
                if summary:
                    parts.append(f"- `{c.__name__}`: {summary}")
            parts.append("")
        if spec.options:
            parts += ["| option | type | default |", "|---|---|---|"]
            for o in spec.options:
                kind = "\\|".join(map(str, o.choices)) if o.choices else _cell(_type_name(o.type))
                parts.append(f"| `{o.name}` | {kind} | `{o.default!r}` |")
            parts.append("")
        else:
            parts += ["No options.", ""]
        if spec.requires:
            parts.append("Needs: " + ", ".join(f"`--{r}`" for r in spec.requires) + ".")
        if spec.after:
            parts.append("Runs after (when in the same pipeline): " + ", ".join(f"`{a}`" for a in spec.after) + ".")
        if spec.before:
            parts.append("Runs before: " + ", ".join(f"`{b}`" for b in spec.before) + ".")
    return "\n".join(parts).rstrip() + "\n"


def _type_name(tp) -> str:
    from dyncompile.passes._infra import _type_name as name

    return name(tp)


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 - MkDocs hook signature
    if MARKER in markdown:
        return markdown.replace(MARKER, render())
    return markdown
