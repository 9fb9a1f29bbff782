"""The command line: parse flags, turn them into spec overrides, call the library, print. Nothing else.

Each command family is one module of this package with a `register(subparsers)` that adds its parsers (each
parser's `func` is the module's handler); `common` holds what they share. Bad input of any kind ends in one line
on stderr and exit code 2; a refused comparison exits 3; an endpoint that cannot serve the run (down, wrong
model) and a run that failed as a whole (stopped by the error rule, no request succeeded) exit 1. ``-v`` (before
or after the command) shows kvcap's debug log on stderr: what was worked around and why.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from kvcap import __version__
from kvcap.cli import ab, audit, bench, calibrate, demo, judge, plan, report, search, sim
from kvcap.cli.common import Parser, doc, formatter
from kvcap.errors import EndpointError, InputError, RefusedComparison

COMMAND_MODULES = (plan, bench, sim, judge, ab, report, audit, demo, calibrate, search)
"""Every command family, in the order `kvcap --help` lists their commands. A new command: a module, named here."""


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="kvcap",
        description=doc("""
            kvcap: does more memory (VRAM, host RAM, distributed memory for the KV cache) buy more *stable*
            concurrency within latency targets, or only more *resident* requests?
        """),
        epilog="run 'kvcap COMMAND --help' for each command's flags and examples",
        formatter_class=formatter)
    parser.add_argument("--version", action="version", version=f"kvcap {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    for module in COMMAND_MODULES:
        module.register(sub)
    for command in sub.choices.values():  # also after the command; SUPPRESS keeps a -v given before it
        command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP)
    return parser


VERBOSE_HELP = "log what kvcap works around (debug) on stderr"


class _StderrHandler(logging.StreamHandler):
    """Writes to the ``sys.stderr`` of the moment (a test's capture included), not the one it was made with."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def configure_logging(verbose: bool) -> None:
    """kvcap's loggers on stderr: DEBUG with ``-v``, else WARNING (normal output unchanged). Other libraries'
    loggers are left as they were; calling it again (main called twice in one process) only sets the level."""
    log = logging.getLogger("kvcap")
    log.setLevel(logging.DEBUG if verbose else logging.WARNING)
    if not any(isinstance(h, _StderrHandler) for h in log.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("kvcap: %(levelname)s: %(name)s: %(message)s"))
        log.addHandler(handler)
        log.propagate = False


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.verbose)
    try:
        return int(args.func(args) or 0)
    except InputError as exc:
        print(f"kvcap {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # unwritable --out, a file where a folder should be, a closed pipe…: the user's to fix
        where = f" {exc.filename!r}" if getattr(exc, "filename", None) else ""
        print(f"kvcap {args.command}: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 2
    except EndpointError as exc:
        print(f"kvcap {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except RefusedComparison as exc:
        print(f"kvcap {args.command}: refused: {exc}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print(f"kvcap {args.command}: interrupted", file=sys.stderr)
        return 130
