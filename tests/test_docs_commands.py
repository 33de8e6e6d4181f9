"""Issue 13, item 8: every `kvguard` command line in the README and docs/ parses against the CLI as
it is (subcommands, option names, argument counts), so a renamed option or variable cannot leave a
doc behind. The README's CLI block is also *run*, on the demo's data (tests/test_demo.py)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import typer

from kvguard.cli import app

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_SPAN = re.compile(r"`([^`\n]+)`")  # code spans, paired left to right as Markdown pairs them
_COMMAND = re.compile(r"^(?:\.venv/bin/)?kvguard\s+(.*)$")


def _shell_blocks(text: str) -> list[str]:
    """The bodies of fenced blocks tagged sh/bash/shell/console or untagged, fences paired line
    by line as Markdown pairs them."""
    blocks, body, language = [], [], None
    for line in text.splitlines():
        if line.startswith("```"):
            if language is None:
                language = line[3:].strip() or "text"
                body = []
            else:
                if language in {"sh", "bash", "shell", "console", "text"}:
                    blocks.append("\n".join(body) + "\n")
                language = None
        elif language is not None:
            body.append(line)
    return blocks


def _fenced(text: str) -> list[str]:
    """Command lines of shell blocks: continuations joined, comments and pipes cut off."""
    out = []
    for block in _shell_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            match = _COMMAND.match(line.split(" #")[0].strip())
            if match:
                out.append(re.sub(r"\s+\|\s.*$", "", match.group(1)))
    return out


def _inline(text: str) -> list[str]:
    """Inline `kvguard ...` spans written as real command lines (no [optional] / <placeholder>)."""
    spans = []
    for span in _SPAN.findall(text):
        match = _COMMAND.match(span.strip())
        if match and not any(mark in span for mark in ("[", "<", "...", "\u2026", "|")):
            spans.append(match.group(1))
    return spans


def _lines() -> list[tuple[str, str, bool]]:
    """(where, command line, fenced) for every documented command line."""
    found = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        name = str(path.relative_to(ROOT))
        found += [(name, line, True) for line in _fenced(text)]
        found += [(name, line, False) for line in _inline(text)]
    return found


def _parse(line: str, *, complete: bool) -> None:
    """Resolve the subcommand and parse the rest as the CLI would (values are not converted:
    documents use placeholders for files and keys)."""
    args = shlex.split(re.sub(r"\$\([^)]*\)", "X", line))
    command: Any = typer.main.get_command(app)  # Typer vendors its own click: duck-typed below
    name = "kvguard"
    while hasattr(command, "commands") and args and args[0] in command.commands:
        name = args[0]
        command = command.commands[args.pop(0)]
    if hasattr(command, "commands"):
        assert not args, f"no such command: {line}"
        return  # a group named on its own
    try:
        command.make_context(name, args)
    except Exception as exc:
        kinds = {k.__name__ for k in type(exc).__mro__}
        if (
            kinds & {"BadParameter", "Exit"} - {"MissingParameter"}
            and "MissingParameter" not in kinds
        ):
            return  # a placeholder value, or --help
        if not complete and kinds & {"MissingParameter", "BadOptionUsage"}:
            return  # prose naming a command with some options, or an option without its value
        raise  # NoSuchOption, an extra argument, a missing required option: the doc is wrong


LINES = _lines()


def test_the_docs_hold_command_lines_to_check() -> None:
    assert len([1 for _, _, fenced in LINES if fenced]) >= 10
    assert len(LINES) >= 60


@pytest.mark.parametrize(
    ("where", "line", "fenced"), LINES, ids=[f"{where}:{line[:40]}" for where, line, _ in LINES]
)
def test_every_documented_command_line_parses(where: str, line: str, fenced: bool) -> None:
    """Fenced command lines are complete commands; an inline span may name only some options."""
    _parse(line, complete=fenced)
