"""Build hook: the simulator's event loop compiled to C with mypyc where it can be, plain Python where it cannot.

Why: the simulator's time is Python's per-step work (a policy decision, a batch, its tokens); the same code
compiled runs ~2× faster (``benchmarks/sim_speed.py --pure``). Nothing else changes: the compiled modules are
the ``.py`` sources, and ``kvcap.sim`` loads those sources instead whenever the build does not match them (an
edited file, ``KVCAP_PURE=1``, a build that failed). Without a C compiler, Python headers or mypy (``KVCAP_PURE=1``
at install time skips it) the install is plain Python and says so.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
NATIVE = ("batch_shape", "cluster", "cost", "cost_empirical", "engine", "kv", "links", "model_shape", "policy",
          "policy_llamacpp", "policy_vllm", "replica", "request", "roofline", "rounding", "run", "sampler")
"""``kvcap/sim`` modules compiled (not ``server``: aiohttp's handlers; not ``calibration_io``: pydantic models)."""
GROUP = "kvcap.sim._native"
"""The shared library every compiled module lives in (``kvcap/sim/_native__mypyc*.so``)."""
MANIFEST = "_native.json"
"""Written beside the compiled modules: each source's SHA-256, so a stale build is never loaded."""


def _warn(msg: str) -> None:
    print(f"kvcap: {msg}; the simulator stays plain Python (correct, about half as fast)", file=sys.stderr)


def _extensions() -> list:
    if os.environ.get("KVCAP_PURE"):
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        _warn("mypyc is not installed")
        return []
    paths = [f"kvcap/sim/{m}.py" for m in NATIVE]
    try:
        return mypycify(["--follow-imports=silent", "--ignore-missing-imports", *paths], opt_level="3",
                        group_name=GROUP)
    except (Exception, SystemExit) as e:  # a type error mypyc refuses: build nothing, never fail the install
        _warn(f"mypyc could not compile the simulator ({e})")
        return []


class OptionalBuildExt(build_ext):
    """Compile what can be compiled; a missing compiler or header is a warning, not a failed install. The
    manifest is written only when every extension was built."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as e:
            _warn(f"the C build failed ({e})")
            return
        sources = {m: hashlib.sha256((ROOT / "kvcap" / "sim" / f"{m}.py").read_bytes()).hexdigest() for m in NATIVE}
        dest = Path(self.get_ext_fullpath(f"kvcap.sim.{NATIVE[0]}")).parent
        dest.mkdir(parents=True, exist_ok=True)
        (dest / MANIFEST).write_text(json.dumps({"group": GROUP, "sources": sources}, indent=1) + "\n")

    def get_outputs(self) -> list[str]:
        manifest = Path(self.get_ext_fullpath(f"kvcap.sim.{NATIVE[0]}")).parent / MANIFEST
        return [*super().get_outputs(), *([str(manifest)] if manifest.exists() else [])]


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})
