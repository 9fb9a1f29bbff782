"""The command registry (kvcap.cli): every command module registers, `kvcap --help` lists every command in its
order, every command's --help works, a usage error is one line with exit 2, and building the parser stays cheap."""

from __future__ import annotations

import argparse
import json
import pkgutil
import re
import subprocess
import sys

import pytest

import kvcap.cli
from kvcap.cli import COMMAND_MODULES, build_parser, main
from tests.conftest import ROOT

COMMANDS = ("plan", "bench", "sim", "serve-sim", "analyze", "compare", "ab", "report", "audit", "demo",
            "calibrate", "search")
"""Every command, in the order `kvcap --help` has always listed them."""

REQUIRED_ARGS = {
    "plan": [], "bench": ["--url", "http://127.0.0.1:1", "--concurrency", "1", "--out", "d"],
    "sim": ["s.yaml", "--out", "d"], "serve-sim": ["s.yaml"], "analyze": ["d"], "compare": ["a", "b"],
    "ab": ["e.yaml", "--out", "d"], "report": ["d"], "audit": ["t.csv"], "demo": [],
    "calibrate": ["d", "--out", "s.yaml"], "search": ["s.yaml", "--out", "d"],
}
"""The least each command needs to get past argparse (nothing here is read: parsing fails first)."""

GPU_PRESETS = "rtx4090, l4, a10, l40s, a100-40gb, a100-80gb, h100-sxm, h100-pcie, h200, b200, mi300x"
"""kvcap/specs/presets/gpus.yaml's entries in its order."""


def _commands_of(parser: argparse.ArgumentParser) -> list[str]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return list(sub.choices)


def test_parser_registers_every_command_in_help_order():
    assert tuple(_commands_of(build_parser())) == COMMANDS


def test_every_command_module_registers_its_commands_with_its_own_handlers():
    in_package = {m.name for m in pkgutil.iter_modules(kvcap.cli.__path__)} - {"common"}
    assert {m.__name__.removeprefix("kvcap.cli.") for m in COMMAND_MODULES} == in_package
    seen: list[str] = []
    for module in COMMAND_MODULES:
        sub = argparse.ArgumentParser().add_subparsers()
        module.register(sub)
        assert sub.choices, f"{module.__name__} registers no command"
        for name, parser in sub.choices.items():
            assert parser.get_default("func").__module__ == module.__name__, name
        seen += list(sub.choices)
    assert sorted(seen) == sorted(COMMANDS)


def test_top_help_lists_every_command_in_order(cli):
    p = cli("--help")
    assert p.returncode == 0, p.stderr
    positions = []
    for name in _commands_of(build_parser()):
        found = re.search(rf"^    {re.escape(name)}(\s|$)", p.stdout, re.MULTILINE)
        assert found, f"{name} missing from kvcap --help"
        positions.append(found.start())
    assert positions == sorted(positions) and len(positions) == len(COMMANDS)
    assert "run 'kvcap COMMAND --help'" in p.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_help_exits_0(command, capsys):
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: kvcap {command} ") and "examples:" in out and f"kvcap {command}" in out


def test_plan_help_lists_the_gpu_catalog(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert f"--gpu GPU GPU preset ({GPU_PRESETS})" in out


def test_gpu_names_follow_the_catalog():
    from kvcap.specs.hardware import gpu_names

    assert ", ".join(gpu_names()) == GPU_PRESETS


@pytest.mark.parametrize("command", COMMANDS)
def test_unknown_flag_is_one_line_exit_2(command, capsys):
    with pytest.raises(SystemExit) as exited:
        main([command, *REQUIRED_ARGS[command], "--no-such-flag"])
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "kvcap: error: unrecognized arguments: --no-such-flag (see --help)\n"


@pytest.mark.parametrize(("args", "line"), [
    (["plan", "--no-such-flag"], "kvcap: error: unrecognized arguments: --no-such-flag (see --help)"),
    (["nosuch"], "kvcap: error: argument COMMAND: invalid choice: 'nosuch' (choose from 'plan', 'bench', 'sim', "
                 "'serve-sim', 'analyze', 'compare', 'ab', 'report', 'audit', 'demo', 'calibrate', 'search') "
                 "(see --help)"),
    ([], "kvcap: error: the following arguments are required: COMMAND (see --help)"),
    (["sim"], "kvcap sim: error: the following arguments are required: SCENARIO.yaml, --out (see --help)"),
    (["plan", "--nodes", "0"], "kvcap plan: error: argument --nodes: expected a positive integer, got '0' "
                               "(see --help)"),
])
def test_usage_errors_through_the_entry_point(cli, args, line):
    p = cli(*args)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr == line + "\n"


def test_version(cli):
    p = cli("--version")
    assert p.returncode == 0 and p.stdout == f"kvcap {kvcap.__version__}\n"


def test_building_the_parser_imports_nothing_heavy():
    """`kvcap --help` stays fast: handlers import the library lazily, and the GPU list is read only for plan's help."""
    code = ("import json, sys; from kvcap.cli import build_parser; build_parser().format_help(); "
            "print(json.dumps(sorted(sys.modules)))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert p.returncode == 0, p.stderr
    loaded = json.loads(p.stdout)
    heavy = [m for m in loaded if m.split(".")[0] in {"pydantic", "yaml", "rich", "numpy", "aiohttp"}
             or (m.startswith("kvcap.") and not m.startswith("kvcap.cli") and m != "kvcap.errors")]
    assert heavy == []
