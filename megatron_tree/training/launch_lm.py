"""`megatron-tree launch [TORCHRUN FLAGS] SCRIPT [SCRIPT ARGS...]`: run a Megatron-LM entry point.

``SCRIPT`` is any Megatron-LM entry point (``examples/pretrain_tree_gpt.py``,
``examples/pretrain_tree_hybrid.py`` or a user's ``pretrain_*.py``). The launcher is torchrun:

* **With CUDA** it is plain torchrun: ``torchrun FLAGS SCRIPT ARGS``.
* **Without CUDA** torchrun starts this module as each rank's program (``--module``): it applies
  the CPU compatibility layer for ``megatron.training`` (`megatron_tree.cpu.megatron_training`: gloo, the
  CUDA assertion and device placement bypassed, the model-parallel RNG on the CPU generator, the
  JIT warm-up kept off the weights' generator, the GPU kernels of the stock Mamba/GDN modules
  replaced by torch stand-ins) and then runs ``SCRIPT`` as ``__main__``; the non-TE CPU flags
  (`megatron_tree.cpu.megatron_training.CPU_FLAGS`) are appended unless the command line sets them (or
  their opposites) itself.

Flags (torchrun's names and meanings): ``--nproc N`` / ``--nproc-per-node N`` ranks on this machine
(default 1). One machine: nothing else (``--standalone``: a private rendezvous on a free port).
Several machines: ``--nnodes N`` (or ``MIN:MAX``), ``--rdzv-endpoint HOST:PORT`` (required),
``--rdzv-backend`` (default ``c10d``), ``--rdzv-id`` (a job id, the same on every machine) and
``--node-rank R``, which torchrun uses with ``--rdzv-backend static`` only (c10d numbers the
machines in the order they join). One launcher per machine, e.g. one SLURM task per node
(``examples/slurm/*.sbatch``). ``--max-restarts N``: torchrun's in-place restart (when a rank dies,
the agent restarts every rank of the machine, up to N times; with ``--load`` the entry point resumes
from the newest checkpoint and the tree data stream right after it).

Signals (preemption, time limits). The launcher does not stay in between: after its checks it
*becomes* torchrun, running torchrun's own entry point (``torch.distributed.run.main``) in its own
process, so the process a scheduler or ``kill`` signals is torchrun's agent, exactly as with plain
torchrun, on GPUs and on CPUs alike; there is no second process to forward from, nor a second copy
of the signal. (It used to ``exec`` a new interpreter for that, which only imported torch again.) On SIGTERM, SIGINT, SIGHUP or SIGQUIT the
agent sends the same signal to every rank (each rank runs in its own session, so this also reaches
them where a scheduler signals only the launcher's process group), waits up to
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds for them to exit (default 30; read by recent torchrun,
2.13 tested, older ones wait a fixed 30 s), SIGKILLs those left and exits non-zero. With
Megatron-LM's ``--exit-signal-handler`` the ranks catch the signal (``--exit-signal``, default
SIGTERM; one rank receiving it stops all), finish the current iteration, save a checkpoint
(``--save``) and exit: set ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` above one iteration plus one save, and
have the scheduler signal that long before it kills (the sbatch scripts: ``#SBATCH --signal``). A
signal torchrun does not handle (SIGUSR1 unless listed in ``--signals-to-handle`` /
``TORCHELASTIC_SIGNALS_TO_HANDLE``) kills the agent and leaves the ranks running unsupervised.

Where ``megatron.training`` comes from: the megatron-core 0.19.x wheel ships it; with 0.16.1 a
Megatron-LM checkout at tag core_v0.16.1 must be on ``PYTHONPATH``. Without it the launcher stops
before starting any process and says so.

The worker side is this module run as ``python -m megatron_tree.training.launch_lm SCRIPT ARGS``.
"""
from __future__ import annotations

import os
import re
import runpy
import shlex
import sys
from typing import Optional, Sequence

import torch

__all__ = ["build_command", "launch", "worker_main"]

WORKER_MODULE = "megatron_tree.training.launch_lm"
_NNODES = re.compile(r"^[1-9][0-9]*(:[1-9][0-9]*)?$")


def build_command(script: str, script_args: Sequence[str], *, nproc: int = 1, nnodes: str = "1",
                  node_rank: Optional[int] = None, rdzv_backend: Optional[str] = None,
                  rdzv_endpoint: Optional[str] = None, rdzv_id: Optional[str] = None,
                  max_restarts: int = 0, cuda: Optional[bool] = None) -> list[str]:
    """The torchrun command line ``launch`` runs (``cuda`` defaults to ``torch.cuda.is_available()``).

    ``nnodes`` "1" with no ``rdzv_endpoint``: ``--standalone``. Otherwise the rendezvous flags are
    passed as given (``rdzv_backend`` default c10d); more than one node needs ``rdzv_endpoint``.
    ``max_restarts``: torchrun's ``--max-restarts`` (every rank restarted when one dies)."""
    if nproc < 1:
        raise ValueError(f"--nproc / --nproc-per-node must be >= 1; got {nproc}")
    if max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0; got {max_restarts}")
    nnodes = str(nnodes)
    if not _NNODES.match(nnodes):
        raise ValueError(f"--nnodes must be N or MIN:MAX (positive integers); got {nnodes!r}")
    if node_rank is not None and node_rank < 0:
        raise ValueError(f"--node-rank must be >= 0; got {node_rank}")
    if cuda is None:
        cuda = torch.cuda.is_available()
    run = [sys.executable, "-m", "torch.distributed.run"]
    if nnodes == "1" and rdzv_endpoint is None:
        run += ["--standalone"]
        if rdzv_backend is not None or rdzv_id is not None or node_rank not in (None, 0):
            raise ValueError("--rdzv-backend / --rdzv-id / --node-rank need a rendezvous: give --rdzv-endpoint "
                             "HOST:PORT (and --nnodes for several machines)")
    else:
        if rdzv_endpoint is None:
            raise ValueError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (the machine the ranks meet on)")
        run += ["--nnodes", nnodes, "--rdzv-backend", rdzv_backend or "c10d", "--rdzv-endpoint", rdzv_endpoint]
        if rdzv_id is not None:
            run += ["--rdzv-id", str(rdzv_id)]
        if node_rank is not None:
            run += ["--node-rank", str(node_rank)]
    run += ["--nproc-per-node", str(nproc)]
    if max_restarts:
        run += ["--max-restarts", str(max_restarts)]
    if cuda:
        return run + [script, *script_args]
    from ..cpu.megatron_training import add_cpu_flags

    return run + ["--module", WORKER_MODULE, script, *add_cpu_flags(script_args)]


def _check_script(script: str) -> None:
    if not os.path.isfile(script):
        raise FileNotFoundError(f"no such Megatron-LM entry point: {script}")


def launch(script: str, script_args: Sequence[str], *, nproc: int = 1, nnodes: str = "1",
           node_rank: Optional[int] = None, rdzv_backend: Optional[str] = None, rdzv_endpoint: Optional[str] = None,
           rdzv_id: Optional[str] = None, max_restarts: int = 0, env: Optional[dict] = None,
           dry_run: bool = False) -> int:
    """Check, print and run the torchrun command of :func:`build_command`.

    Before starting anything: the script must exist and ``megatron.training`` must be importable
    (else FileNotFoundError / RuntimeError with what to install). With CUDA the launcher imports it
    (the ranks run the script directly); on a CPU host it only locates it, and each rank's worker
    (:func:`worker_main`) imports it and stops with the same message if that fails: the import
    costs ~7 s of CPU, which a launcher that becomes torchrun would pay for nothing. ``dry_run``
    returns 0 after printing.
    Otherwise this process **becomes** torchrun: it runs ``torch.distributed.run.main`` with the
    command's arguments and environment, so signals sent to it are torchrun's agent's to handle
    (module docstring), and returns torchrun's exit status (0, or 1 when a rank failed or a signal
    ended the job, as plain torchrun exits)."""
    from ..compat.lm_api import (MISSING_MEGATRON_TRAINING, megatron_training_import_error,
                                 megatron_training_location_error)

    _check_script(script)
    cmd = build_command(script, script_args, nproc=nproc, nnodes=nnodes, node_rank=node_rank,
                        rdzv_backend=rdzv_backend, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id,
                        max_restarts=max_restarts)
    print("megatron-tree launch: " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    if dry_run:
        return 0
    error = (megatron_training_import_error if torch.cuda.is_available() else megatron_training_location_error)()
    if error is not None:
        raise RuntimeError(f"{MISSING_MEGATRON_TRAINING}\n  ({error})")
    run_env = dict(os.environ if env is None else env)
    run_env.setdefault("OMP_NUM_THREADS", "1")
    if not torch.cuda.is_available():
        from ..cpu.megatron_training import CPU_ENV

        for key, value in CPU_ENV.items():
            run_env.setdefault(key, value)
    assert cmd[1:3] == ["-m", "torch.distributed.run"], cmd
    sys.stdout.flush()
    sys.stderr.flush()
    os.environ.clear()
    os.environ.update(run_env)  # what the agent and, through it, every rank inherits
    from torch.distributed.run import main as torchrun

    try:
        torchrun(cmd[3:])
    except Exception as exc:  # noqa: BLE001 (ChildFailedError, SignalException: torchrun's own exit status 1)
        print(f"megatron-tree launch: torchrun: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


def worker_main(argv: Sequence[str]) -> None:
    """One rank on a CPU-only host: CPU layer for megatron.training, then ``SCRIPT`` as ``__main__``."""
    if not argv:
        raise SystemExit(f"usage: python -m {WORKER_MODULE} SCRIPT [ARGS...]")
    script, args = argv[0], list(argv[1:])
    _check_script(script)
    if not torch.cuda.is_available():
        from ..cpu import megatron_training as lm_cpu
        from ..compat.lm_api import MISSING_MEGATRON_TRAINING, megatron_training_import_error

        error = megatron_training_import_error()  # the launcher only located it
        if error is not None:
            raise SystemExit(f"megatron-tree launch: {MISSING_MEGATRON_TRAINING}\n  ({error})")
        lm_cpu.enable()
    sys.argv = [script] + args
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    worker_main(sys.argv[1:])
