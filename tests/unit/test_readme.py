"""The README stays true: short, opening with the two commands, every `kvcap` command in it accepted by kvcap's own
parser, and every relative link in it and in docs/ pointing at a file that exists.

The commands are parsed (``build_parser().parse_args``), never run: a renamed command or flag fails here, fast.
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from kvcap.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_LINES = 150
FIRST_COMMANDS = [
    "python3 -m venv .venv && .venv/bin/pip install -q . && .venv/bin/kvcap demo",
    "./scripts/test",
]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
"""An inline Markdown link or image: its target (an optional title after it left out)."""


def fenced_blocks(text: str) -> list[list[str]]:
    """The lines of each fenced code block (``` … ```), in order."""
    blocks: list[list[str]] = []
    current: list[str] | None = None
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if current is None:
                current = []
            else:
                blocks.append(current)
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def prose(text: str) -> str:
    """The text outside fenced code blocks (links inside code are code, not links)."""
    out, inside = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
        elif not inside:
            out.append(line)
    return "\n".join(out)


def shell_lines(block: list[str]) -> list[str]:
    """A block's command lines, backslash-continued lines joined."""
    lines, pending = [], ""
    for line in block:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
        else:
            lines.append(pending + line)
            pending = ""
    if pending:
        lines.append(pending)
    return lines


def kvcap_commands(text: str) -> list[list[str]]:
    """The argument words of every `kvcap …` command in the fenced blocks (also after ``&&``, as
    ``.venv/bin/kvcap``), trailing comments dropped."""
    commands = []
    for block in fenced_blocks(text):
        for line in shell_lines(block):
            words = shlex.split(line, comments=True)
            step: list[str] = []
            for word in [*words, "&&"]:
                if word in ("&&", "||", ";", "|"):
                    if step and Path(step[0]).name == "kvcap":
                        commands.append(step[1:])
                    step = []
                else:
                    step.append(word)
    return commands


def strict_parser() -> argparse.ArgumentParser:
    """kvcap's parser, each command's too, without abbreviations: a README flag must be spelt in full, so one that
    was renamed (``--holdout`` → ``--holdout-level``) is not taken as a prefix of its new name."""
    parser = build_parser()
    todo = [parser]
    while todo:
        p = todo.pop()
        p.allow_abbrev = False
        todo += [sub for a in p._actions if isinstance(a, argparse._SubParsersAction) for sub in a.choices.values()]
    return parser


README_TEXT = README.read_text(encoding="utf-8")
COMMANDS = kvcap_commands(README_TEXT)


def test_readme_is_short():
    assert len(README_TEXT.splitlines()) <= MAX_LINES


def test_readme_opens_with_the_two_commands():
    body = [line for line in README_TEXT.splitlines() if line.strip() and not line.startswith("# ")]
    assert body[:4] == ["```bash", *FIRST_COMMANDS, "```"]


def test_readme_has_kvcap_commands():
    """The parse test below has something to parse: the demo and the three workflows' commands."""
    assert ["demo"] in COMMANDS
    assert {c[0] for c in COMMANDS} >= {"demo", "bench", "analyze", "compare", "report", "sim", "ab", "plan",
                                        "calibrate"}


@pytest.mark.parametrize("words", COMMANDS, ids=[" ".join(c[:2]) for c in COMMANDS])
def test_readme_command_parses(words, capsys):
    try:
        args = strict_parser().parse_args(words)
    except SystemExit as exc:
        pytest.fail(f"`kvcap {' '.join(words)}` is refused by kvcap's parser (exit {exc.code}): "
                    f"{capsys.readouterr().err.strip()}")
    assert args.command == words[0]


@pytest.mark.parametrize("page", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_relative_links_point_at_files(page):
    missing = []
    for target in LINK.findall(prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # a URL (http:, mailto:) or an anchor on the same page
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            missing.append(target)
    assert not missing, f"{page.relative_to(ROOT)} links to files that do not exist: {missing}"
