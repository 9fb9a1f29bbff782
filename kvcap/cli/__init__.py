"""The command line: parse flags, turn them into spec overrides, call the library, print. Nothing else.

Each command family is one module of this package with a `register(subparsers)` that adds its parsers (each
parser's `func` is the module's handler); `common` holds what they share. Bad input of any kind ends in one line
on stderr and exit code 2; a refused comparison exits 3; an endpoint that cannot serve the run (down, wrong
model) and a run that failed as a whole (stopped by the error rule, no request succeeded) exit 1.
"""

from __future__ import annotations

import argparse
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
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    for module in COMMAND_MODULES:
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
