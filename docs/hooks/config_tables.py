"""MkDocs hook: the configuration reference's tables, from the config dataclasses' fields (name,
default, help), so the page can never disagree with the code."""

from __future__ import annotations

import dataclasses

MARKER = "<!-- config tables -->"


def _tables() -> str:
    from edgefcl.config import SECTIONS, RunConfig

    out = []
    for section, cls in [("run", RunConfig), *SECTIONS.items()]:
        title = "top-level keys" if section == "run" else f"[{section}]"
        out += [f"## {title}", "", (cls.__doc__ or "").strip(), "",
                "| key / flag | default | meaning |", "|---|---|---|"]
        for f in dataclasses.fields(cls):
            if f.name in SECTIONS:
                continue
            text = f.metadata.get("help", "").replace("|", "\\|")
            default = repr(f.default) if isinstance(f.default, str) else f.default
            out.append(f"| `{f.name}` / `--{f.name.replace('_', '-')}` | `{default}` | {text} |")
        out.append("")
    return "\n".join(out)


def on_page_markdown(markdown: str, **kwargs) -> str:  # noqa: ANN003 (MkDocs hook signature)
    """Replace the marker with the tables."""
    return markdown.replace(MARKER, _tables()) if MARKER in markdown else markdown
