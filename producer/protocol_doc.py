"""PROTOCOL.md's script reference, made from the headers of the Lua scripts (their one source).

    python3 -m producer.protocol_doc     # rewrite the part of PROTOCOL.md between the markers
"""

from __future__ import annotations

import sys
from pathlib import Path

from producer import scripts

BEGIN = "<!-- scripts: made by `python3 -m producer.protocol_doc` from the scripts' headers; do not edit -->"
END = "<!-- scripts: end -->"
DOC = Path(__file__).resolve().parent.parent / "PROTOCOL.md"


def header(name: str) -> str:
    """The leading comment block of scripts/<name>.lua, without the comment marks."""
    text = (Path(scripts.__file__).parent / "scripts" / f"{name}.lua").read_text()
    lines = []
    for line in text.splitlines():
        if not line.startswith("--"):
            break
        lines.append(line[3:] if line.startswith("-- ") else line[2:])
    return "\n".join(lines).strip()


def reference() -> str:
    parts = [BEGIN]
    for name in scripts.NAMES:
        parts.append(f"### `{name}.lua`\n\n```text\n{header(name)}\n```")
    parts.append(f"### `lib.lua` (prepended to every script)\n\n```text\n{header('lib')}\n```")
    parts.append(END)
    return "\n\n".join(parts)


def render(doc: str) -> str:
    """`doc` with its script reference made anew."""
    start, end = doc.index(BEGIN), doc.index(END) + len(END)
    return doc[:start] + reference() + doc[end:]


if __name__ == "__main__":
    DOC.write_text(render(DOC.read_text()))
    sys.exit(0)
