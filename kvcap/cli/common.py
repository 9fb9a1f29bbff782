"""What the commands' parsers and handlers share, so that one flag reads and behaves the same in every command.

The parser that reports a usage error in one line, the help layout, argparse's value parsers, the flags several
commands take (--set, --slo, --json, --quiet, --out, --arm), and small steps handlers repeat (JSON output, SLO
and --allow-diff parsing, stopping on Ctrl-C, live progress). Building the parser must stay fast (`kvcap --help`),
so nothing here imports the library at module level: what loads it is imported inside the function that needs it.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from kvcap.errors import InputError

if TYPE_CHECKING:
    from kvcap.rundir import RunDir
    from kvcap.rundir.compare import Comparison
    from kvcap.rundir.summary import Summary

Subparsers = argparse._SubParsersAction
"""What `ArgumentParser.add_subparsers` returns: each command module's `register` adds its parsers to it."""

Flags = argparse._ActionsContainer
"""A parser or one of its argument groups: anything `add_argument` can be called on."""

T = TypeVar("T")


class Parser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line (exit 2) instead of usage + message."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def formatter(prog: str) -> argparse.HelpFormatter:
    """The help layout of every command: descriptions and examples as written, flags' help from column 34."""
    return argparse.RawDescriptionHelpFormatter(prog, max_help_position=34, width=100)


def doc(text: str) -> str:
    """A triple-quoted description without its indentation and surrounding blank lines."""
    return textwrap.dedent(text).strip("\n")


# ---------------------------------------------------------------- value parsers argparse calls

def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def parse_levels(text: str, what: str, integer: bool) -> tuple[float, ...]:
    """A comma-separated list of positive load levels (`--concurrency 1,2,4`, `--rate 0.5,1`); empty parts skipped."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            v = int(part) if integer else float(part)
        except ValueError:
            raise InputError(f"{what}: {part!r} is not a {'whole number' if integer else 'number'}") from None
        if v <= 0:
            raise InputError(f"{what}: levels must be positive, got {part!r}")
        out.append(v)
    if not out:
        raise InputError(f"{what}: give at least one level")
    return tuple(out)


class StoreWithPresets(argparse.Action):
    """A plain `store` flag whose help may list a catalog's names as `%(presets)s`.

    The names are read only when that help is printed: loading a catalog imports the spec models, which every
    start-up, `kvcap --help` included, would then pay for.
    """

    def __init__(self, option_strings: Sequence[str], dest: str, presets: Callable[[], Sequence[str]],
                 **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.presets = _JoinedNames(presets)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)


class _JoinedNames:
    """Names joined by ", ", looked up when first turned into text (argparse's help formatting does that)."""

    def __init__(self, names: Callable[[], Sequence[str]]) -> None:
        self._names = names

    def __str__(self) -> str:
        return ", ".join(self._names())


# ---------------------------------------------------------------- flags several commands take

def add_set_flag(p: Flags, help: str = "override any scenario key (repeatable)") -> None:
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help=help)


def add_slo_flag(p: Flags, help: str | None = None) -> None:
    p.add_argument("--slo", metavar="SPEC", help=help)


def add_json_flag(p: Flags, help: str | None = None) -> None:
    p.add_argument("--json", action="store_true", help=help)


def add_quiet_flag(p: Flags, help: str | None = None) -> None:
    p.add_argument("--quiet", action="store_true", help=help)


def add_run_dir_flags(p: Flags) -> None:
    """--out and --overwrite of a command that writes a run directory (bench, sim)."""
    p.add_argument("--out", required=True, metavar="DIR", help="run directory to write")
    p.add_argument("--overwrite", action="store_true", help="replace a run already in --out")


def add_arm_flag(p: Flags) -> None:
    p.add_argument("--arm", help="arm name for A/B (stored in the manifest)")


# ---------------------------------------------------------------- steps handlers share

def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2))


def comparison_json(result: Comparison) -> dict[str, Any]:
    """A comparison as compare.json holds it: without the two full summaries it carries."""
    return result.to_json()


def optional_slo(spec: str | None) -> Any:
    """The parsed --slo, or None (then the run's own SLO applies)."""
    if not spec:
        return None
    from kvcap.analysis.slo import parse_slo

    return parse_slo(spec)


def allowed_differences(text: str | None) -> set[str]:
    """--allow-diff KEY,...: the fixed variables the two runs may differ in."""
    return {k.strip() for k in (text or "").split(",") if k.strip()}


def print_notes(prog: str, summary: Summary | dict[str, Any], arm: str | None = None,
                interrupted: bool = False) -> None:
    """The summary's warnings and why the run failed or stopped, on stderr: what ``bench`` says when it ends,
    ``analyze``, ``report`` and ``sim`` say too (a re-analysed run keeps its ``failed``), so no reader of a run misses
    them. ``arm``: whose notes (a pair's report); ``interrupted``: also say so (where no table said it)."""
    import sys

    who = f"kvcap {prog}: " + (f"{arm}: " if arm else "")
    summary = _as_dict(summary)
    for warning in summary.get("warnings") or []:
        print(f"{who}warning: {warning}", file=sys.stderr)
    stopped = summary.get("stopped")
    if summary.get("failed"):
        print(f"{who}{summary['failed']}", file=sys.stderr)
    elif isinstance(stopped, dict):
        print(f"{who}stopped: {stopped.get('reason')}", file=sys.stderr)
    if interrupted and summary.get("interrupted"):
        print(f"{who}interrupted: the summary covers the requests that finished", file=sys.stderr)


OUTCOME_KEYS = ("interrupted", "stopped", "failed")
"""How a run ended, as only the recording command knew it (``bench``'s summary.json)."""


def carry_outcome(summary: Summary, run: RunDir) -> None:
    """Into a freshly built ``summary``: how ``run`` ended — from its summary.json where the recording command
    wrote one, else from its level lines (a killed run has no summary: each line says ``stopped``/``interrupted``)."""
    old = run.summary
    kept = [key for key in OUTCOME_KEYS if old is not None and key in old.model_fields_set]
    if old is not None and kept:
        for key in kept:
            setattr(summary, key, getattr(old, key))
        return
    lines = run.levels()
    stopped = next((line.stopped for line in lines if line.stopped is not None), None)
    if any(line.interrupted for line in lines):
        summary.interrupted = True
    if stopped is not None:
        from kvcap.loadgen.guard import run_failure

        summary.stopped = stopped
        summary.failed = run_failure(summary.to_json())


def _as_dict(summary: Summary | dict[str, Any]) -> dict[str, Any]:
    return summary if isinstance(summary, dict) else summary.to_json()


def print_build_note(prog: str) -> None:
    """On stderr, when the simulator ran from its sources rather than its compiled build (``kvcap.sim.native``)."""
    import sys

    from kvcap.sim import NATIVE
    from kvcap.sim.native import speed_note

    note = speed_note(NATIVE)
    if note:
        print(f"kvcap {prog}: note: {note}", file=sys.stderr)


def exit_status(summary: Summary) -> int:
    """130 (as after Ctrl-C) when the run was interrupted; 1 when it failed as a whole (``summary["failed"]``:
    stopped by the error rule, or no request succeeded — the records are kept, the sweep is not a result); else 0."""
    if summary.interrupted:
        return 130
    return 1 if summary.failed else 0


def on_stop_signals(callback: Callable[[], None]) -> None:
    """Calls `callback` in the running event loop on Ctrl-C or SIGTERM, instead of raising KeyboardInterrupt."""
    import asyncio
    import signal

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, callback)


async def with_live_progress(quiet: bool, run: Callable[[Any], Awaitable[T]]) -> T:
    """`run(progress)` with a live display on a terminal; `run(None)` when quiet or when stderr is not a terminal."""
    if quiet or not sys.stderr.isatty():
        return await run(None)
    from kvcap.report.live import RichProgress

    with RichProgress() as progress:
        return await run(progress)
