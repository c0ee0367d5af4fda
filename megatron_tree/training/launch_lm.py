"""`megatron-tree launch [--nproc N] SCRIPT [SCRIPT ARGS...]`: run a Megatron-LM entry point.

``SCRIPT`` is any Megatron-LM entry point (``examples/pretrain_tree_gpt.py``,
``examples/pretrain_tree_hybrid.py`` or a user's ``pretrain_*.py``). It runs on ``N`` local
processes started the way ``torchrun --standalone --nproc-per-node N`` starts them.

* **With CUDA** it is plain torchrun: ``torchrun --standalone --nproc-per-node N SCRIPT ARGS``.
* **Without CUDA** each process first applies the CPU compatibility layer for
  ``megatron.training`` (`megatron_tree.compat.lm_cpu`: gloo, the CUDA assertion and device
  placement bypassed, the model-parallel RNG on the CPU generator, the GPU kernels of the stock
  Mamba/GDN modules replaced by torch stand-ins) and then runs ``SCRIPT`` as ``__main__``; the
  non-TE CPU flags (`megatron_tree.compat.lm_cpu.CPU_FLAGS`) are appended unless the command
  line sets them (or their opposites) itself.

Where ``megatron.training`` comes from: the megatron-core 0.19.x wheel ships it; with 0.16.1 a
Megatron-LM checkout at tag core_v0.16.1 must be on ``PYTHONPATH``. Without it the launcher stops
before starting any process and says so.

The worker side is this module run as ``python -m megatron_tree.training.launch_lm SCRIPT ARGS``.
"""
from __future__ import annotations

import os
import runpy
import shlex
import subprocess
import sys
from typing import Optional, Sequence

import torch

__all__ = ["build_command", "launch", "worker_main"]

WORKER_MODULE = "megatron_tree.training.launch_lm"


def build_command(script: str, script_args: Sequence[str], *, nproc: int = 1,
                  cuda: Optional[bool] = None) -> list[str]:
    """The torchrun command line ``launch`` runs (``cuda`` defaults to ``torch.cuda.is_available()``)."""
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1; got {nproc}")
    if cuda is None:
        cuda = torch.cuda.is_available()
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    if cuda:
        return run + [script, *script_args]
    from ..compat.lm_cpu import add_cpu_flags

    return run + ["--module", WORKER_MODULE, script, *add_cpu_flags(script_args)]


def _check_script(script: str) -> None:
    if not os.path.isfile(script):
        raise FileNotFoundError(f"no such Megatron-LM entry point: {script}")


def launch(script: str, script_args: Sequence[str], *, nproc: int = 1, env: Optional[dict] = None,
           dry_run: bool = False) -> int:
    """Run ``script`` on ``nproc`` local processes; returns the exit status (0 on success).

    Before starting anything: the script must exist and ``megatron.training`` must import (else
    FileNotFoundError / RuntimeError with what to install)."""
    from ..compat.lm_api import MISSING_MEGATRON_TRAINING, megatron_training_import_error

    _check_script(script)
    cmd = build_command(script, script_args, nproc=nproc)
    print("megatron-tree launch: " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    if dry_run:
        return 0
    error = megatron_training_import_error()
    if error is not None:
        raise RuntimeError(f"{MISSING_MEGATRON_TRAINING}\n  ({error})")
    run_env = dict(os.environ if env is None else env)
    run_env.setdefault("OMP_NUM_THREADS", "1")
    if not torch.cuda.is_available():
        from ..compat.lm_cpu import CPU_ENV

        for key, value in CPU_ENV.items():
            run_env.setdefault(key, value)
    return subprocess.run(cmd, env=run_env).returncode


def worker_main(argv: Sequence[str]) -> None:
    """One rank on a CPU-only host: CPU layer for megatron.training, then ``SCRIPT`` as ``__main__``."""
    if not argv:
        raise SystemExit(f"usage: python -m {WORKER_MODULE} SCRIPT [ARGS...]")
    script, args = argv[0], list(argv[1:])
    _check_script(script)
    if not torch.cuda.is_available():
        from ..compat import lm_cpu

        lm_cpu.enable()
    sys.argv = [script] + args
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    worker_main(sys.argv[1:])
