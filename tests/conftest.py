"""Shared fixtures: run the real CLI in a subprocess, as a user would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"
"""Data the tests read: vendored into the repository (data/README.md says where each file comes from)."""


def run_cli(*args: str, timeout: float = 120, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvcap", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd or ROOT)


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def cli_json():
    def _run(*args: str) -> dict:
        proc = run_cli(*args, "--json")
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)
    return _run
