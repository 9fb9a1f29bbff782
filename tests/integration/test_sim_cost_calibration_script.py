"""``scripts/calibrate_cost_model.py --check`` (a subprocess): the committed calibration YAML is what the script
fits from ``data/vidur``. Split from ``tests/unit/test_sim_cost_calibration.py``, which checks the fit's errors."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT


def test_yaml_is_what_the_script_fits():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "calibrate_cost_model.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
