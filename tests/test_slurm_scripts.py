"""The SLURM scripts as a user runs them: ``DRY_RUN=1`` prints the per-node ``megatron-tree launch``
command (tests/test_slurm_job.py runs the job for real).

Defaults keep today's GPU flags, tree CP 2 and the preemption setup (``#SBATCH --signal`` and
``--exit-signal-handler``); every GPU-only flag and every Mamba / GDN / MoE size is a variable; the
parallel layout is checked against the world size (TP*PP*CP, and PP*ETP*EP for the experts);
``MEGATRON_LM`` is needed only where ``megatron.training`` does not import.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

SLURM = Path(__file__).resolve().parents[1] / "examples" / "slurm"
BASH = shutil.which("bash")


def _dry_run(script: str, tmp_path, **env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    full.update(DRY_RUN="1", MEGATRON_LM="/opt/Megatron-LM", DATA="/data/rollouts", MASTER_ADDR="node0",
                GPUS_PER_NODE="8", CKPT_DIR=str(tmp_path / "ckpt"), LOG_DIR=str(tmp_path / "logs"), PYTHON="python3")
    full.update({k: str(v) for k, v in env.items()})
    return subprocess.run([BASH, str(SLURM / script)], env=full, capture_output=True, text=True)


def _command(proc) -> list[str]:
    assert proc.returncode == 0, proc.stderr
    return shlex.split(proc.stdout.strip().splitlines()[-1])


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


@pytest.mark.parametrize("script", ["train_tree_gpt.sbatch", "train_tree_hybrid.sbatch"])
def test_defaults_keep_the_gpu_flags_and_variables_turn_them_off(script, tmp_path):
    cmd = _command(_dry_run(script, tmp_path))
    assert cmd[:4] == ["python3", "-m", "megatron_tree", "launch"] and "torchrun" not in cmd
    assert "--bf16" in cmd and "--use-distributed-optimizer" in cmd
    assert _flag(cmd, "--tensor-model-parallel-size") == "2"
    assert _flag(cmd, "--context-parallel-size") == "2"  # tree CP by default
    cpu_flags = "--transformer-impl local --no-rope-fusion --use-cpu-initialization"
    cmd = _command(_dry_run(script, tmp_path, PRECISION="", DIST_OPT=0, MOE_GROUPED_GEMM=0, EXTRA_ARGS=cpu_flags))
    for gpu_only in ("--bf16", "--fp16", "--use-distributed-optimizer", "--moe-grouped-gemm"):
        assert gpu_only not in cmd, gpu_only
    assert cmd[-len(cpu_flags.split()):] == cpu_flags.split()
    assert "--fp16" in _command(_dry_run(script, tmp_path, PRECISION="--fp16"))


@pytest.mark.parametrize("script", ["train_tree_gpt.sbatch", "train_tree_hybrid.sbatch"])
def test_in_place_restart_budget_and_load_always(script, tmp_path):
    """torchrun's restart budget (MAX_RESTARTS, default 3) reaches `megatron-tree launch`, and --load is
    passed even before the first checkpoint exists, so a restarted rank resumes from what this job saved."""
    cmd = _command(_dry_run(script, tmp_path))
    assert _flag(cmd, "--max-restarts") == "3" and cmd.index("--max-restarts") < cmd.index("--rdzv-endpoint")
    assert _flag(cmd, "--load") == _flag(cmd, "--save")
    assert _flag(_command(_dry_run(script, tmp_path, MAX_RESTARTS=0)), "--max-restarts") == "0"


def test_launch_passes_the_restart_budget_to_torchrun():
    from megatron_tree.training.launch_lm import build_command

    cmd = build_command("x.py", ["--a"], nproc=2, max_restarts=3, cuda=True)
    assert cmd[cmd.index("--max-restarts") + 1] == "3" and cmd.index("--max-restarts") < cmd.index("x.py")
    assert "--max-restarts" not in build_command("x.py", [], nproc=2, cuda=True)
    with pytest.raises(ValueError, match="--max-restarts must be >= 0"):
        build_command("x.py", [], max_restarts=-1, cuda=True)


def test_hybrid_sizes_are_variables(tmp_path):
    cmd = _command(_dry_run("train_tree_hybrid.sbatch", tmp_path))
    assert "--moe-grouped-gemm" in cmd and _flag(cmd, "--num-experts") == "8"
    assert [_flag(cmd, f) for f in ("--mamba-state-dim", "--mamba-head-dim", "--linear-num-value-heads")] == [
        "128", "64", "32"]
    sizes = dict(MAMBA_STATE_DIM=16, MAMBA_HEAD_DIM=8, MAMBA_GROUPS=2, GDN_KEY_HEADS=2, GDN_VALUE_HEADS=4,
                 GDN_KEY_DIM=8, GDN_VALUE_DIM=16, GDN_CONV_KERNEL=3, NUM_EXPERTS=4, MOE_TOPK=1, MOE_FFN=64)
    cmd = _command(_dry_run("train_tree_hybrid.sbatch", tmp_path, **sizes))
    got = {f: _flag(cmd, f) for f in ("--mamba-state-dim", "--mamba-head-dim", "--mamba-num-groups",
                                      "--linear-num-key-heads", "--linear-num-value-heads", "--linear-key-head-dim",
                                      "--linear-value-head-dim", "--linear-conv-kernel-dim", "--num-experts",
                                      "--moe-router-topk", "--moe-ffn-hidden-size")}
    assert list(got.values()) == [str(v) for v in sizes.values()]


def test_gpt_moe_is_opt_in(tmp_path):
    assert "--num-experts" not in _command(_dry_run("train_tree_gpt.sbatch", tmp_path))
    cmd = _command(_dry_run("train_tree_gpt.sbatch", tmp_path, NUM_EXPERTS=8, EP=4, TP=1, PP=1))
    assert _flag(cmd, "--num-experts") == "8" and _flag(cmd, "--expert-model-parallel-size") == "4"


@pytest.mark.parametrize("script, env, reason", [
    ("train_tree_hybrid.sbatch", dict(TP=3), "TP*PP*CP=6"),
    ("train_tree_hybrid.sbatch", dict(EP=8), "PP*ETP*EP=16"),          # 8 GPUs: TP2 x EP8 does not fit
    ("train_tree_hybrid.sbatch", dict(TP=1, EP=8, ETP=2), "PP*ETP*EP=16"),
    ("train_tree_hybrid.sbatch", dict(EP=4, NUM_EXPERTS=6), "NUM_EXPERTS=6"),
    ("train_tree_gpt.sbatch", dict(EP=2, PP=1), "needs an MoE model"),
])
def test_layout_checked_against_world_size(script, env, reason, tmp_path):
    proc = _dry_run(script, tmp_path, **env)
    assert proc.returncode == 1 and reason in proc.stderr, proc.stderr
    assert "megatron_tree launch" not in proc.stdout


def test_expert_layout_that_fits_is_accepted(tmp_path):
    # 16 GPUs, TP2 PP2: the 4 TP x DP ranks of a stage hold ETP1 x EP4 experts
    cmd = _command(_dry_run("train_tree_hybrid.sbatch", tmp_path, GPUS_PER_NODE=16, TP=2, PP=2, EP=4, ETP=1))
    assert _flag(cmd, "--expert-tensor-parallel-size") == "1" and _flag(cmd, "--nproc-per-node") == "16"


@pytest.mark.parametrize("script", ["train_tree_gpt.sbatch", "train_tree_hybrid.sbatch"])
def test_multi_node_launch_and_preemption_setup(script, tmp_path):
    """One `megatron-tree launch` per node with torchrun's multi-node flags and this node's rank; SLURM
    signals SIGTERM ahead of the time limit; Megatron-LM saves and exits on it (and the agent waits)."""
    cmd = _command(_dry_run(script, tmp_path, SLURM_JOB_NUM_NODES=4, SLURM_JOB_ID=777, SLURM_NODEID=3,
                            MASTER_PORT=29555, CP=4))
    launcher = cmd[:cmd.index(str(SLURM.parent / script.replace("train_", "pretrain_").replace(".sbatch", ".py")))]
    assert _flag(launcher, "--nnodes") == "4" and _flag(launcher, "--nproc-per-node") == "8"
    assert _flag(launcher, "--node-rank") == "3" and _flag(launcher, "--rdzv-id") == "777"
    assert _flag(launcher, "--rdzv-backend") == "c10d" and _flag(launcher, "--rdzv-endpoint") == "node0:29555"
    assert _flag(cmd, "--context-parallel-size") == "4" and "--exit-signal-handler" in cmd
    text = (SLURM / script).read_text()
    assert re.search(r"^#SBATCH --signal=TERM@\d+$", text, re.M)  # SIGTERM: what Megatron-LM's handler catches
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" in text and "keep 1" not in text and "not wired" not in text
    # the launch line the job runs (not the dry run's): each task execs the launcher with its SLURM_NODEID
    assert 'exec "$0" -m megatron_tree launch --node-rank "$SLURM_NODEID" "$@"' in text


@pytest.mark.parametrize("script", ["train_tree_gpt.sbatch", "train_tree_hybrid.sbatch"])
def test_megatron_lm_checkout_needed_only_without_megatron_training(script, tmp_path):
    """A python without megatron.training and no MEGATRON_LM: stop naming both ways out."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "MEGATRON_LM"}
    full.update(DRY_RUN="1", DATA="/data", MASTER_ADDR="node0", CKPT_DIR=str(tmp_path / "c"), LOG_DIR=str(tmp_path / "l"),
                PYTHON=shutil.which("false"))  # stands in for a python whose `import megatron.training` check fails
    proc = subprocess.run([BASH, str(SLURM / script)], env=full, capture_output=True, text=True)
    assert proc.returncode == 1 and "MEGATRON_LM" in proc.stderr and "0.19" in proc.stderr, proc.stderr
    proc = subprocess.run([BASH, str(SLURM / script)], env=dict(full, MEGATRON_LM="/opt/Megatron-LM"),
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
