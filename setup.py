"""Build hook: the simulator's event loop compiled to C with mypyc where it can be, plain Python where it cannot.

Why: the simulator's time is Python's per-step work (a policy decision, a batch, its tokens); the same code compiled
runs faster (how much: ``benchmarks/README.md``, ``sim_speed.py``). Nothing else changes: the compiled modules are
the ``.py`` sources, and ``kvcap.sim.native`` loads those sources instead whenever the build does not match them.
The manifest it checks (``kvcap/sim/_native.<abi>.json``, one per Python ABI, written only when every extension was
built) holds the SHA-256 of every ``kvcap`` source as mypyc read it — the compiled modules and every module whose
types they were compiled against. Without a C compiler, Python's headers or mypy (or with ``KVCAP_PURE=1``) the
install is plain Python; ``kvcap sim`` then says so.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
NATIVE = ("batch_shape", "cluster", "cost", "cost_empirical", "cost_terms", "engine", "events", "kv", "links",
          "model_shape", "policy", "policy_llamacpp", "policy_vllm", "replica", "replica_state", "request", "roofline",
          "records", "request_stream", "rounding", "run", "sampler", "step_cost", "tiers")
"""``kvcap/sim`` modules compiled (not ``server``: aiohttp's handlers; not ``calibration_io``: pydantic models;
not ``native``: it chooses the build)."""
GROUP = "kvcap.sim._native"
"""The shared library every compiled module lives in (``kvcap/sim/_native__mypyc*.so``)."""

_spec = importlib.util.spec_from_file_location("kvcap_native_guard", ROOT / "kvcap" / "sim" / "native.py")
native = importlib.util.module_from_spec(_spec)  # by its path: the package (numpy, …) is not importable here
_spec.loader.exec_module(native)
"""The guard that reads the manifest: its name per ABI, the source digests and the format come from there."""
BUILT: dict[str, str] = {}
"""Each ``kvcap`` source's SHA-256 as mypyc compiled it (relative path → hex), for the manifest."""


def _warn(msg: str) -> None:
    print(f"kvcap: {msg}; the simulator stays plain Python (correct, about half as fast)", file=sys.stderr)


def _extensions() -> list:
    if native.pure_asked():
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        _warn("mypyc is not installed")
        return []
    before = native.digests(ROOT)
    try:
        # "--config-file=": no config file. pyproject.toml's [tool.mypy] is the type gate's (a pydantic plugin the
        # build environment lacks, errors ignored outside the checked packages); mypyc must type the sim itself.
        exts = mypycify(["--config-file=", "--follow-imports=silent", "--ignore-missing-imports",
                         *(f"kvcap/sim/{m}.py" for m in NATIVE)], opt_level="3", group_name=GROUP)
    except (Exception, SystemExit) as e:  # a type error mypyc refuses: build nothing, never fail the install
        _warn(f"mypyc could not compile the simulator ({e})")
        return []
    if native.digests(ROOT) != before:
        _warn("a source changed while mypyc read it")
        return []
    BUILT.update(before)
    return exts


class OptionalBuildExt(build_ext):
    """Compile what can be compiled; a missing compiler or header is a warning, not a failed install. Whatever an
    earlier build left for this ABI (a module no longer compiled, a failed build's pieces, its manifest) is removed
    first, and the manifest is written only when every extension was built."""

    def run(self) -> None:
        target = Path(self.get_ext_fullpath(f"kvcap.sim.{NATIVE[0]}")).parent
        (target / native.MANIFEST).unlink(missing_ok=True)
        for old in target.glob(f"*{native.SUFFIX}"):
            old.unlink()
        if not self.extensions or not BUILT:
            return
        try:
            super().run()
        except Exception as e:
            _warn(f"the C build failed ({e})")
            return
        target.mkdir(parents=True, exist_ok=True)
        native.write_manifest(target, GROUP, list(NATIVE), BUILT)

    def get_outputs(self) -> list[str]:
        manifest = Path(self.get_ext_fullpath(f"kvcap.sim.{NATIVE[0]}")).parent / native.MANIFEST
        return [*super().get_outputs(), *([str(manifest)] if manifest.exists() else [])]


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})
