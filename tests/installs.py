"""Where the test command's heavy installs live: the cache root they share (``KVCAP_CACHE``, default
``~/.cache/kvcap``) and the versions their install scripts pin (``NAME="..."`` lines), read from the scripts so
the tests look where the scripts put things."""

from __future__ import annotations

import os
import re
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("KVCAP_CACHE") or Path.home() / ".cache" / "kvcap")


def pinned(script: Path, name: str) -> str:
    """The value an install script pins as ``NAME="value"``."""
    m = re.search(rf'^{re.escape(name)}="([^"]+)"', script.read_text(), re.MULTILINE)
    if not m:
        raise RuntimeError(f"no {name} in {script}")
    return m.group(1)
