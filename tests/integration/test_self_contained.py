"""A clone alone passes its tests: nothing reads beside the checkout (``../shared`` or anywhere else).

The tests that read data run again from a copy of the repository in an empty temporary folder, where nothing
exists next to it; and no file the repository ships names a path outside it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

DATA_TESTS = ("tests/unit/test_workload.py::test_real_traces_read", "tests/unit/test_sim_cost_calibration.py",
              "tests/integration/test_sim_cost_calibration_script.py",
              "tests/integration/test_sim.py::test_mooncake_trace_drives_prefix_caching_and_the_tier",
              "tests/integration/test_calibrate_published.py")
SLOW_REPLAYS = ("tests/integration/test_calibrate_published.py::test_h100_held_out_points_within_the_printed_errors",
                "tests/integration/test_calibrate_published.py::"
                "test_rtx4090_llama_held_out_with_the_pool_reused_as_vllm_reuses_it",
                "tests/integration/test_calibrate_published.py::"
                "test_published_inter_token_gaps_show_where_the_step_is_off")
"""Left out of the copy's run: they read the same published file as the rest of their module (its ``sets``
fixture) and only replay more of it, minutes uncompiled; the main run has them."""
OUTSIDE = re.compile(r"\.\./shared|parents\[2\]|ROOT\.parent|parent\.parent / \"shared\"")


def repository_files() -> list[Path]:
    """What a clone holds: tracked files and the untracked ones git does not ignore (work not yet committed)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout
    return [ROOT / p for p in out.decode().split("\0") if p and (ROOT / p).is_file()]


def test_no_shipped_file_points_outside_the_repository():
    bad = []
    for path in repository_files():
        if path.suffix not in (".py", ".md", ".yaml", ".toml", ".sh", "") or path == Path(__file__):
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        bad += [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1)
                if OUTSIDE.search(line)]
    assert not bad, "\n".join(bad)


@pytest.mark.timeout(600)  # the copy runs its own sources, uncompiled
def test_data_tests_pass_from_a_copy_in_an_empty_folder(tmp_path):
    empty = tmp_path / "alone"
    copy = empty / "kvcap-clone"
    for path in repository_files():
        dest = copy / path.relative_to(ROOT)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest)
    assert sorted(p.name for p in empty.iterdir()) == ["kvcap-clone"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(copy)  # the copy's kvcap, not the checkout's
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           *DATA_TESTS, *(f"--deselect={t}" for t in SLOW_REPLAYS)],
                          cwd=copy, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert re.search(r"\b(\d+) passed\b", proc.stdout) and " failed" not in proc.stdout
    probe = subprocess.run([sys.executable, "-c", "import kvcap; print(kvcap.__file__)"], cwd=copy, env=env,
                           capture_output=True, text=True, check=True)
    assert probe.stdout.strip().startswith(str(copy))
