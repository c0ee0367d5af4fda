"""Nothing outlives a job: the ranks of a launcher killed outright (``kill -9``, the OOM killer; no
cleanup of its own runs) die with it (`launch._die_with_parent`). Before, they lived on as orphans
(reparented to init, ``RANK`` in their environment), blocked in a collective until its timeout."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def _sleeper(path: str) -> None:
    import torch.distributed as dist

    Path(path, str(dist.get_rank())).write_text(str(os.getpid()))
    dist.barrier()
    time.sleep(300)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_ranks_die_with_a_launcher_killed_outright(tmp_path):
    script = ("from megatron_tree.training.launch import run_distributed\n"
              "from test_no_orphans import _sleeper\n"
              f"run_distributed(_sleeper, 2, {str(tmp_path)!r}, timeout=600)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]))
    launcher = subprocess.Popen([sys.executable, "-c", script], env=env)
    try:
        deadline = time.monotonic() + 120
        while not all(Path(tmp_path, str(r)).exists() for r in (0, 1)):
            assert launcher.poll() is None, "the launcher ended before its ranks started"
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.2)
        pids = [int(Path(tmp_path, str(r)).read_text()) for r in (0, 1)]
        assert all(_alive(p) for p in pids)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [p for p in pids if _alive(p)]
        for p in left:  # do not leave them to the next test
            os.kill(p, signal.SIGKILL)
        assert not left, f"ranks {left} outlived their launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
