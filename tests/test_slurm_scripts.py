"""The SLURM scripts as a user runs them: ``DRY_RUN=1`` prints the per-node torchrun command.

Defaults keep today's GPU flags; every GPU-only flag and every Mamba / GDN / MoE size is a variable;
the parallel layout is checked against the world size (TP*PP*CP, and PP*ETP*EP for the experts).
"""
from __future__ import annotations

import os
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
                GPUS_PER_NODE="8", CKPT_DIR=str(tmp_path / "ckpt"), LOG_DIR=str(tmp_path / "logs"))
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
    assert cmd[0] == "torchrun" and "--bf16" in cmd and "--use-distributed-optimizer" in cmd
    assert _flag(cmd, "--tensor-model-parallel-size") == "2"
    cpu_flags = "--transformer-impl local --no-rope-fusion --use-cpu-initialization"
    cmd = _command(_dry_run(script, tmp_path, PRECISION="", DIST_OPT=0, MOE_GROUPED_GEMM=0, EXTRA_ARGS=cpu_flags))
    for gpu_only in ("--bf16", "--fp16", "--use-distributed-optimizer", "--moe-grouped-gemm"):
        assert gpu_only not in cmd, gpu_only
    assert cmd[-len(cpu_flags.split()):] == cpu_flags.split()
    assert "--fp16" in _command(_dry_run(script, tmp_path, PRECISION="--fp16"))


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
    ("train_tree_hybrid.sbatch", dict(TP=3), "TP*PP*CP=3"),
    ("train_tree_hybrid.sbatch", dict(EP=8), "PP*ETP*EP=16"),          # 8 GPUs: TP2 x EP8 does not fit
    ("train_tree_hybrid.sbatch", dict(TP=1, EP=8, ETP=2), "PP*ETP*EP=16"),
    ("train_tree_hybrid.sbatch", dict(EP=4, NUM_EXPERTS=6), "NUM_EXPERTS=6"),
    ("train_tree_gpt.sbatch", dict(EP=2, PP=1), "needs an MoE model"),
])
def test_layout_checked_against_world_size(script, env, reason, tmp_path):
    proc = _dry_run(script, tmp_path, **env)
    assert proc.returncode == 1 and reason in proc.stderr, proc.stderr
    assert "torchrun" not in proc.stdout


def test_expert_layout_that_fits_is_accepted(tmp_path):
    # 16 GPUs, TP2 PP2: the 4 TP x DP ranks of a stage hold ETP1 x EP4 experts
    cmd = _command(_dry_run("train_tree_hybrid.sbatch", tmp_path, GPUS_PER_NODE=16, TP=2, PP=2, EP=4, ETP=1))
    assert _flag(cmd, "--expert-tensor-parallel-size") == "1" and _flag(cmd, "--nproc-per-node") == "16"
