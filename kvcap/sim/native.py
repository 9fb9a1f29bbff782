"""Which build of the simulator runs: the mypyc-compiled modules (``setup.py``) only when they were built from
these very sources, else the ``.py`` sources themselves.

Why a guard: Python imports a compiled extension ahead of its source, so an edited source, a partial build or
one for another checkout would silently run an older simulator. The build writes, for its Python ABI, the
SHA-256 of every ``kvcap`` source as it compiled them (a compiled module bakes in the types of what it imports)
and the modules it compiled; here they are compared (a few ms) and, on any doubt — a changed or missing source,
a compiled module the manifest does not list, a library that does not load, ``KVCAP_PURE=1`` — every
``kvcap.sim`` module is loaded from its ``.py`` file. Both builds give the same records, byte for byte
(``tests/integration/test_sim_native.py``).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import sys
import sysconfig
from importlib.machinery import ModuleSpec
from pathlib import Path

HERE = Path(__file__).resolve().parent
SUFFIX = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
MANIFEST = f"_native{os.path.splitext(SUFFIX)[0]}.json"
"""This ABI's manifest (``setup.py`` loads this module by its path to write it: one definition of the name, the
digests and the format)."""
PACKAGE = __name__.rpartition(".")[0]


def pure_asked() -> bool:
    return os.environ.get("KVCAP_PURE", "") not in ("", "0")


def digests(root: Path) -> dict[str, str]:
    """Every ``kvcap`` source under ``root`` (the folder holding ``kvcap/``): relative path → SHA-256."""
    return {p.relative_to(root).as_posix(): _digest(p) for p in sorted((root / "kvcap").rglob("*.py"))}


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_manifest(here: Path, group: str, modules: list[str], sources: dict[str, str]) -> None:
    """What ``built_from_these_sources`` checks, written by the build once every extension is built."""
    (here / MANIFEST).write_text(json.dumps({"group": group, "modules": modules, "sources": sources}, indent=1) + "\n")


def built_from_these_sources(here: Path = HERE) -> bool:
    """The compiled build in ``here`` (``kvcap/sim``) was built from the sources beside it, every compiled module
    there is one it built, and its library loads."""
    if pure_asked():
        return False
    try:
        built = json.loads((here / MANIFEST).read_text())
        root = here.parent.parent
        if any(_digest(root / rel) != digest for rel, digest in built["sources"].items()):
            return False
        group = built["group"]
        listed = {*built["modules"], group.rpartition(".")[2] + "__mypyc"}
        if any(p.name[: -len(SUFFIX)] not in listed for p in here.glob(f"*{SUFFIX}")):
            return False
        importlib.import_module(f"{group}__mypyc")
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


def speed_note(native: bool) -> str | None:
    """What a command that simulated says when the sources ran (the answer is the same; only its speed differs)."""
    if native:
        return None
    why = "KVCAP_PURE is set" if pure_asked() else ("no compiled build matches them (reinstall kvcap with pip; it "
                                                    "needs a C compiler and Python's headers)")
    return f"the simulator ran from its Python sources, about half as fast: {why}"


def choose() -> bool:
    """True: the compiled modules load. False: the sources do (a finder ahead of the default ones)."""
    if built_from_these_sources():
        return True
    if _Sources not in sys.meta_path:
        sys.meta_path.insert(0, _Sources)  # type: ignore[arg-type]
    return False
