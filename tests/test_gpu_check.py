"""tools/gpu_check.sh stays runnable: its CPU dry run prints the one table (every op and the model step)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_prints_one_table(tmp_path):
    env = dict(os.environ, DRY_RUN="1", PYTHON=sys.executable, OUT=str(tmp_path / "out"),
               GPU_CHECK_SITE=str(tmp_path / "site"), GPU_CHECK_WHEELS=str(tmp_path / "no_wheels"))
    env.pop("PYTHON_OLDER", None)
    r = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    table = (tmp_path / "out" / "table.txt").read_text().splitlines()
    assert table[0].split()[:3] == ["op", "stack", "backend"] and "flat MiB" in table[0]
    ops = [line.split("  ")[0].strip() for line in table[2:]]
    assert ops == ["attention", "gated delta rule", "ssd", "model step"], table
    assert r.stdout.count("err grads") == 1  # one table
