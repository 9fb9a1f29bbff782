"""Which build of the simulator runs: the mypyc-compiled modules (``setup.py``) only when they were built from
these very sources, else the ``.py`` sources themselves.

Why a guard: Python imports a compiled extension ahead of its source, so an edited source, a partial build or
one for another checkout would silently run an older simulator. The build writes each compiled source's SHA-256
to ``_native.json``; here they are compared (under a millisecond) and, on any doubt or with ``KVCAP_PURE=1``,
every ``kvcap.sim`` module is loaded from its ``.py`` file. Both builds give the same records, byte for byte
(``tests/test_sim_native.py``).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import sys
from importlib.machinery import ModuleSpec
from pathlib import Path

HERE = Path(__file__).resolve().parent
MANIFEST = "_native.json"
PACKAGE = __name__.rpartition(".")[0]


def built_from_these_sources(here: Path = HERE) -> bool:
    """The compiled build is in ``here``, loads, and every compiled module's source is the one it was built
    from."""
    if os.environ.get("KVCAP_PURE"):
        return False
    try:
        built = json.loads((here / MANIFEST).read_text())
        for name, digest in built["sources"].items():
            if hashlib.sha256((here / f"{name}.py").read_bytes()).hexdigest() != digest:
                return False
        importlib.import_module(f"{built['group']}__mypyc")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ImportError):
        return False
    return True


class _Sources:
    """Finds ``kvcap.sim.<name>`` at ``<name>.py`` ahead of any compiled extension of the same name."""

    @staticmethod
    def find_spec(fullname: str, path: object = None, target: object = None) -> ModuleSpec | None:
        package, _, name = fullname.rpartition(".")
        source = HERE / f"{name}.py"
        if package != PACKAGE or not source.is_file():
            return None
        return importlib.util.spec_from_file_location(fullname, source)


def choose() -> bool:
    """True: the compiled modules load. False: the sources do (a finder ahead of the default ones)."""
    if built_from_these_sources():
        return True
    if _Sources not in sys.meta_path:
        sys.meta_path.insert(0, _Sources)  # type: ignore[arg-type]
    return False
