"""The SLURM job scripts run for real: a 2-node x 2-rank job on this machine.

``srun`` is a stand-in put first on PATH: it starts the command once per node of the job
(``SLURM_JOB_NUM_NODES``), each with its ``SLURM_NODEID`` / ``SLURM_PROCID`` / ``SLURM_LOCALID``, and
kills the others when one fails (``--kill-on-bad-exit``). Each task is the script's own
``megatron-tree launch --node-rank $SLURM_NODEID ...`` line; the ranks of both "nodes" meet through
the c10d rendezvous on 127.0.0.1. The GPU-only switches are turned off through the scripts' own
variables (``PRECISION= DIST_OPT=0 MOE_GROUPED_GEMM=0``), the launcher adds the non-TE CPU flags,
and the models are made tiny through the scripts' size variables. Losses are read from
Megatron-LM's own log lines. Needs ``megatron.training`` (the megatron-core 0.19.x tier).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_tree.compat import lm_api

ROOT = Path(__file__).resolve().parents[1]
SLURM = ROOT / "examples" / "slurm"

pytestmark = [
    pytest.mark.skipif(not lm_api.have_megatron_training(),
                       reason="megatron.training is not importable (megatron-core 0.16.1 wheel): `make test-latest` "
                              "runs the SLURM jobs on the 0.19.x wheel"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run of the job scripts is for CPU-only hosts"),
    pytest.mark.skipif(shutil.which("bash") is None, reason="the job scripts are bash"),
]

SRUN = r"""#!/bin/bash
# srun stand-in: one task per node of the job, each with its SLURM_NODEID; --kill-on-bad-exit.
while [[ "${1:-}" == --* ]]; do shift; done          # srun's own options
pids=()
for ((node = 0; node < SLURM_JOB_NUM_NODES; node++)); do
    SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 SLURM_NTASKS=$SLURM_JOB_NUM_NODES \
        SLURMD_NODENAME=node$node "$@" &
    pids+=($!)
done
status=0
for _ in "${pids[@]}"; do
    wait -n; rc=$?
    if (( rc != 0 && status == 0 )); then status=$rc; kill "${pids[@]}" 2>/dev/null; fi
done
exit $status
"""

#: the scripts' own variables: CPU switches, tiny sizes, a few iterations
CPU = dict(PRECISION="", DIST_OPT="0", MOE_GROUPED_GEMM="0")
TINY = dict(HIDDEN=32, FFN=64, HEADS=4, KV_HEADS=2, VOCAB=128, MAX_TOKENS=64, SAMPLES_PER_STEP=8, MB_PER_RANK=2,
            LR="1e-3", SAVE_INTERVAL=100, EVAL_ITERS=0, OMP_NUM_THREADS=1)
HYBRID = dict(PATTERN="MG*E", MAMBA_STATE_DIM=8, MAMBA_HEAD_DIM=8, MAMBA_GROUPS=2, GDN_KEY_HEADS=2, GDN_VALUE_HEADS=4,
              GDN_KEY_DIM=8, GDN_VALUE_DIM=8, NUM_EXPERTS=2, MOE_TOPK=2, MOE_FFN=32, WARMUP=0)
LOG_LINE = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*?lm loss: ([-+0-9.Ee]+) \|")


def _rendezvous_store():
    """The job's c10d rendezvous store, held by the test: bound on port 0 before any agent starts (a real
    job's ``MASTER_PORT`` is its scheduler's choice), so no other process on this machine can take the
    port in between. Every node's agent then finds the port in use and joins it as a client, as agents on
    the other nodes of a real job do."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=900), wait_for_workers=False)


def _data(path: Path) -> Path:
    """8 prompt families x 4 completions: branching trees, enough for 3 steps of 8 samples."""
    rng = np.random.default_rng(1)
    lines = []
    for g in range(8):
        prompt = rng.integers(1, 100, int(rng.integers(4, 9))).tolist()
        for _ in range(4):
            comp = rng.integers(1, 100, int(rng.integers(2, 7))).tolist()
            lines.append(json.dumps({"tokens": prompt + comp, "loss_mask": [0] * len(prompt) + [1] * len(comp)}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _descendants(pid: int) -> list:
    """The processes below ``pid`` now (from /proc; whatever their sessions)."""
    children: dict = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(d))
            except (OSError, IndexError, ValueError):
                continue
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo += children.get(p, [])
    return out


def _job(tmp: Path, script: str, name: str, nodes: int, ranks_per_node: int, sigterm_after: int | None = None,
         **variables) -> tuple[str, dict]:
    """Run ``examples/slurm/<script>`` as a job of ``nodes`` x ``ranks_per_node``: (output, {iteration: lm loss}).

    ``sigterm_after``: once Megatron-LM logs that iteration, SIGTERM to every process of the job step
    (what ``#SBATCH --signal=TERM@...`` does before the time limit: the srun tasks and everything below
    them, not the batch shell); ``scontrol`` is then a stand-in that records its arguments."""
    store = _rendezvous_store()  # held until the job has ended
    rc, out = _run_job(tmp, script, name, nodes, ranks_per_node, sigterm_after, variables, store.port)
    del store
    assert rc == 0, f"{script} as {nodes} x {ranks_per_node} failed:\n{out[-8000:]}"
    assert f"nodes={nodes} gpus/node={ranks_per_node} world={nodes * ranks_per_node}" in out
    for node in range(nodes):  # every node's task ran the launcher with its own node rank
        assert re.search(rf"megatron-tree launch: \S+ -m torch\.distributed\.run --nnodes {nodes} --rdzv-backend c10d "
                         rf"--rdzv-endpoint 127\.0\.0\.1:\d+ --rdzv-id \d+ --node-rank {node} ", out), out[-4000:]
    losses = {int(m[0]): float(m[2]) for m in LOG_LINE.findall(out)}
    return out, losses


def _run_job(tmp: Path, script: str, name: str, nodes: int, ranks_per_node: int, sigterm_after, variables: dict,
             port: int):
    bin_dir = tmp / "bin"
    if not (bin_dir / "srun").exists():
        bin_dir.mkdir(exist_ok=True)
        (bin_dir / "srun").write_text(SRUN)
        (bin_dir / "srun").chmod(0o755)
        (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "$@" >> {tmp}/scontrol.log\n')
        (bin_dir / "scontrol").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", PYTHON=sys.executable, MTREE_DIR=str(ROOT),
               DATA=str(_data(tmp / "train.jsonl")), RUN_NAME=name, CKPT_DIR=str(tmp / name / "ckpt"),
               LOG_DIR=str(tmp / name / "logs"), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               SLURM_JOB_NUM_NODES=str(nodes), SLURM_JOB_ID=str(4200 + nodes), SLURM_JOB_NAME=name,
               GPUS_PER_NODE=str(ranks_per_node), REQUEUE=str(int(sigterm_after is not None)))
    env.update({k: str(v) for k, v in {**CPU, **TINY, **variables}.items()})
    proc = subprocess.Popen(["bash", str(SLURM / script)], cwd=tmp, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines, srun = [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            if sigterm_after is not None and srun is None and f"iteration {sigterm_after:8d}/" in line:
                shells = [p for p in _descendants(proc.pid) if "bin/srun" in Path(f"/proc/{p}/cmdline").read_text()]
                srun = shells[0]
                for pid in _descendants(srun):
                    try:
                        os.kill(pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
        rc = proc.wait(timeout=900)
    finally:
        for pid in _descendants(proc.pid):  # a failed test leaves nothing running
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
    return rc, "".join(lines)


def test_hybrid_moe_tree_cp_job_on_two_nodes_equals_one_node(tmp_path):
    """MG*E (Mamba-2, GDN, attention, MoE), tree CP 2, EP 2, DP 2: the 2-node x 2-rank job trains the
    same losses as the same job on 1 node x 4 ranks."""
    # the legacy torch checkpoint format saves in ~30 ms here, torch_dist in ~10 s (the same for the signal path)
    variables = dict(HYBRID, TP=1, PP=1, CP=2, EP=2, ETP=1, TRAIN_ITERS=3, EXTRA_ARGS="--ckpt-format torch")
    out2, two = _job(tmp_path, "train_tree_hybrid.sbatch", "hybrid2x2", 2, 2, **variables)
    assert "TP=1 PP=1 CP=2 EP=2 DP=2" in out2
    assert sorted(two) == [1, 2, 3] and all(np.isfinite(v) for v in two.values()), out2[-4000:]
    _, one = _job(tmp_path, "train_tree_hybrid.sbatch", "hybrid1x4", 1, 4, **variables)
    assert sorted(one) == [1, 2, 3]
    for it in (1, 2, 3):  # the same ranks, groups and data: equal to the printed digits
        assert two[it] == pytest.approx(one[it], rel=1e-6), (it, two, one)
    print(f"\nhybrid MG*E CP2 EP2: 2 nodes x 2 {two}, 1 node x 4 {one}")
    assert (tmp_path / "hybrid2x2" / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


def test_gpt_tree_cp_job_on_two_nodes_saves_and_requeues_on_sigterm(tmp_path):
    """The GPT script as 2 nodes x 1 rank, tree CP 2 across the nodes, 50 iterations; SIGTERM to the job
    step after iteration 2 (as SLURM's --signal before the time limit): the ranks finish their
    iteration, save, exit; the script exits 0 after `scontrol requeue` of its job."""
    out, losses = _job(tmp_path, "train_tree_gpt.sbatch", "gpt2x1", 2, 1, sigterm_after=2, TP=1, PP=1, CP=2,
                       NUM_LAYERS=2, TRAIN_ITERS=50, TREE_LOSS="sft", SHUTDOWN_TIMEOUT=300,
                       EXTRA_ARGS="--ckpt-format torch")
    assert "TP=1 PP=1 CP=2 EP=1 DP=1" in out
    assert "exiting program after receiving SIGTERM" in out, out[-4000:]
    saved = int((tmp_path / "gpt2x1" / "ckpt" / "latest_checkpointed_iteration.txt").read_text())
    assert 2 <= saved < 50 and sorted(losses) == list(range(1, saved + 1)), (saved, losses)
    assert all(np.isfinite(v) and v > 0 for v in losses.values())
    assert (tmp_path / "scontrol.log").read_text() == f"requeue {4200 + 2}\n"
