"""The README and docs/ stay a front page and its pages: short, linked, and naming only commands and options that
exist. A page that drifts from the code fails here rather than in a reader's terminal."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())  # wherever tests/ puts it
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 300  # issue 40: a front page, read in a few minutes


def _pages() -> list[Path]:
    return [README, ROOT / "PROTOCOL.md", *sorted(DOCS.glob("*.md")), DOCS / "bench" / "README.md"]


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _outside_code(text: str) -> list[str]:
    lines, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def _anchors(page: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in _outside_code(page.read_text()) if line.startswith("#")}


def test_the_readme_is_a_front_page():
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move sections to docs/ (at most {README_MAX_LINES})"


def test_the_readme_links_every_docs_page():
    text = README.read_text()
    missing = [p.name for p in sorted(DOCS.glob("*.md")) if f"(docs/{p.name})" not in text]
    assert not missing, f"docs pages the README does not link: {missing}"


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for page in _pages():
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def _commands(text: str) -> list[list[str]]:
    """Each `pagedq ...` line of the pages' bash blocks, as words up to its comment."""
    out, fenced = [], None
    for line in text.replace("\\\n", " ").splitlines():  # a command continued on the next line is one line
        if line.startswith("```"):
            fenced = line[3:].strip() if fenced is None else None
        elif fenced == "bash" and line.lstrip().startswith("pagedq "):
            code = line.split(" #")[0].replace("...", "")
            out.append(shlex.split(code, posix=True)[1:])
    return out


def test_every_pagedq_command_and_option_in_the_pages_exists():
    from cli import main

    wrong = []
    for page in _pages():
        for words in _commands(page.read_text()):
            command, ctx_words = main, []
            while isinstance(command, click.Group) and words and not words[0].startswith("-"):
                sub = command.commands.get(words[0])
                if sub is None:
                    break
                command, ctx_words, words = sub, [*ctx_words, words[0]], words[1:]
            if not ctx_words:
                wrong.append(f"{page.name}: pagedq {' '.join(words)} (no such command)")
                continue
            options = {o for p in command.params for o in (*p.opts, *p.secondary_opts)} | {"-h", "--help"}
            for word in words:
                flag = word.split("=")[0]
                if flag.startswith("-") and flag not in options:
                    wrong.append(f"{page.name}: pagedq {' '.join(ctx_words)} {flag} (no such option)")
    assert not wrong, "commands the pages name that do not exist:\n" + "\n".join(wrong)


def test_every_test_file_the_pages_name_exists():
    """Pages name tests by file (`test_fault_failover.py`), not by folder, so that moving a test keeps them true."""
    have = {p.name for p in (ROOT / "tests").rglob("*.py")}
    named = {name for page in _pages() for name in re.findall(r"\b((?:test_[a-z0-9_]+|compile_triton)\.py)\b",
                                                                 page.read_text())}
    assert not named - have, f"test files the pages name that do not exist: {sorted(named - have)}"


def test_every_test_the_pages_name_exists():
    """The guarantees name the test of each failure (`test_a_stream_that_lost_its_last_tokens_gets_them_again`)."""
    defined = set()
    for path in (ROOT / "tests").rglob("*.py"):
        defined |= set(re.findall(r"def (test_\w+)", path.read_text()))
    named = {name for page in _pages() for name in re.findall(r"`(test_\w+)`", page.read_text())}
    assert not named - defined, f"tests the pages name that do not exist: {sorted(named - defined)}"
