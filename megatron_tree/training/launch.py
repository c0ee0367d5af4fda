"""Run a function on W local ranks: gloo on CPU, NCCL with one GPU per rank when there are enough.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` fresh processes (one torch/OpenMP
thread each), initialises the default process group (`rendezvous`, below), calls ``fn(*args)``
on every rank and returns the per-rank results in rank order. An exception on any rank is re-raised
as ``DistributedError`` with the first failing rank's traceback (and, where it pickles, the
exception object itself: ``DistributedError.exception``); a run past ``timeout`` seconds
raises ``TimeoutError``. Used by ``megatron-tree verify``, the CPU demo, ``megatron-tree train
--nproc`` and the tests (multi-node jobs use torchrun/srun instead).

On a CPU host ranks start through a *forkserver* that imported torch and Megatron-Core once
(:data:`PRELOAD`): importing them costs about 4 s of CPU per process, which a fresh interpreter per
rank (the spawn method) paid on every call. With CUDA they are spawned, since an import such as
Transformer Engine's may touch the CUDA driver, which a forked process cannot reuse. A forked rank is still a clean process as far as the caller can tell:
nothing has run in the server but imports (no threads, no process group, no RNG use), the caller's
``sys.path`` and main module are prepared as with spawn, and the caller's environment and standard
output / error *at the time of the call* are installed in each rank (the server's own were captured
when it started: a caller that redirected fd 2 since, as pytest's ``capfd`` does, would otherwise
not see its ranks' messages).

Rendezvous: no port is ever chosen before it is bound. The launcher binds the ranks' TCP store itself
(port 0: the kernel picks a free port and the store holds it from then on), reads the port from it and
hands it to the ranks, which join as clients (`rank_store`); nothing else on the machine can take the
port in between. A world of one rank needs no TCP store at all: it gets an in-process ``HashStore``.
``MASTER_ADDR`` / ``MASTER_PORT`` are not exported to the ranks (a stale value from the caller's
environment would point at nothing of theirs).

Signals: a batch system signals every process of a job at once (SLURM at a time limit, ``kill -TERM
-- -PGID``, a terminal's Ctrl-C), the forkserver included. The forkserver ignores SIGINT on its own;
it also ignores the preemption signals (SIGTERM, SIGUSR1: `_shield_forkserver`, its first preload),
since a forkserver that dies takes its ranks' exit statuses with it (multiprocessing then reports every
rank as exit code 255 and this launcher would end ranks that were saving a checkpoint). Each rank
starts with the default actions restored; the trainer installs its own handlers around its loop.
"""
from __future__ import annotations

import datetime
import os
import signal
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from .files import write_atomically
from .forkserver_shield import die_with_parent
import torch.multiprocessing as mp

__all__ = ["run_distributed", "DistributedError", "PRELOAD", "launcher_store", "rank_store"]

#: Modules the forkserver imports once, before it forks any rank. Only imports: a module that
#: fails to import is skipped by the server (the rank then imports or fails as usual).
PRELOAD = ("megatron_tree.training.forkserver_shield", "numpy", "torch", "torch.distributed", "megatron.core",
           "megatron.core.parallel_state", "megatron.core.models.gpt", "megatron_tree.megatron")

#: The signals a batch system sends ahead of a time limit or preemption (the trainer's own list).
SHIELDED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class DistributedError(RuntimeError):
    """A rank failed; the message holds its rank and traceback. ``signal`` is the number of the signal
    that ended the first failing rank when it was killed outright (no traceback of its own), else
    None: a caller that forwarded that signal itself can tell the two apart. ``exception`` is the
    exception object the first failing rank raised, carried over by pickle (None when it was killed,
    or its exception does not pickle: the traceback text in the message is always there), so that a
    caller can show an error that explains itself as it is (`trainer.run`: `CheckpointSaveError`)."""

    def __init__(self, message: str, signal: int | None = None, exception: BaseException | None = None):
        super().__init__(message)
        self.signal = signal
        self.exception = exception


#: Marker file of a rank whose process group could not form for a reason of the machine, not of ``fn``
#: (see `run_distributed`).
RENDEZVOUS_LOST = "rendezvous_lost"
#: Attempts of `run_distributed` when its process group could not form (a connection lost while forming).
RENDEZVOUS_ATTEMPTS = 3


def _rendezvous_lost(exc: BaseException) -> bool:
    """The process group failed to form because gloo's full mesh lost a connection while the ranks
    connected (seen under load, with pytest's other worker running gloo jobs of its own): nothing of
    ``fn`` ran, so the launcher may start the ranks again. (A port taken between choosing and binding
    it cannot happen: the launcher's store binds before any rank learns the port.)"""
    text = str(exc)
    return "connectFullMesh" in text and "Connection closed by peer" in text


def launcher_store(world_size: int, timeout: float) -> "dist.Store | None":
    """The ranks' rendezvous store, bound by the launcher before any rank starts: a TCP store on
    127.0.0.1 port 0 (its ``port`` is the one the kernel gave it, held from then on), None for a world of
    one rank (`rank_store` gives it an in-process store)."""
    if world_size == 1:
        return None
    return dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=max(timeout, 1.0)),
                         wait_for_workers=False)


def rank_store(port: int | None, world_size: int, timeout: float) -> "dist.Store":
    """A rank's handle on the launcher's store (`launcher_store`): a client of the TCP store on ``port``,
    or an in-process ``HashStore`` for a world of one (``port`` None)."""
    if port is None:
        return dist.HashStore()
    return dist.TCPStore("127.0.0.1", port, world_size, False, timeout=datetime.timedelta(seconds=max(timeout, 1.0)))


def _same_object(obj: Any) -> Any:
    return obj


class _CallerFd:
    """The caller's file descriptor ``fd``, handed to a rank as it starts: pickled while the rank is
    launched, it becomes multiprocessing's ``DupFd`` (the descriptor travels with the launch); the
    rank's `_adopt_stdio` duplicates it onto the same number."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return _same_object, (reduction.DupFd(self.fd),)


def _adopt_stdio(stdio: tuple) -> None:
    import sys

    for target, dup in zip((1, 2), stdio):
        fd = dup.detach()
        if fd == target:  # spawn passes the caller's descriptors under their own numbers
            continue
        getattr(sys, "stdout" if target == 1 else "stderr").flush()
        os.dup2(fd, target)
        os.close(fd)


def _rank_main(rank: int, fn: Callable, world_size: int, port: int | None, outdir: str, timeout: float, args: tuple,
               environ: dict, stdio: tuple) -> None:
    die_with_parent()  # the kernel kills this rank with its parent (the forkserver, or the launcher under spawn)
    for sig in SHIELDED_SIGNALS:  # a forked rank inherits the forkserver's SIG_IGN: back to the default
        signal.signal(sig, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(environ)  # the caller's, as spawn would have inherited it
    _adopt_stdio(stdio)  # and its stdout / stderr
    for name in ("MASTER_ADDR", "MASTER_PORT"):  # the store is the launcher's (`rank_store`), not the caller's
        os.environ.pop(name, None)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1",
                      MKL_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        backend = "gloo"
        if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
            torch.cuda.set_device(rank)
            backend = "nccl"
        try:
            dist.init_process_group(backend, store=rank_store(port, world_size, timeout), rank=rank,
                                    world_size=world_size, timeout=datetime.timedelta(seconds=max(timeout, 1.0)))
        except Exception as exc:
            if _rendezvous_lost(exc):  # fn has not run: the caller may start the ranks again
                open(os.path.join(outdir, RENDEZVOUS_LOST), "w").close()
            raise
        result = fn(*args)
        torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    except BaseException as exc:
        # Written here because the parent prefers the first failing rank's own traceback over the
        # secondary errors of ranks that were waiting for it in a collective.
        # whole or absent (`write_atomically`): the parent reads it while start_processes SIGTERMs the
        # ranks still alive, which may be writing theirs (a torn .err failed the launcher's own parse)
        write_atomically(os.path.join(outdir, f"rank{rank}.err"), f"{time.time()!r}\n{traceback.format_exc()}".encode())
        _write_exception(os.path.join(outdir, f"rank{rank}.exc"), exc)
        raise
    finally:
        _teardown()


def _teardown() -> None:
    try:
        import sys

        if "megatron.core.parallel_state" in sys.modules:
            sys.modules["megatron.core.parallel_state"].destroy_model_parallel()
    except Exception:
        pass
    if dist.is_initialized():
        dist.destroy_process_group()


def _write_exception(path: str, exc: BaseException) -> None:
    """The rank's exception object for `DistributedError.exception` (pickle keeps its arguments and
    attributes, not its traceback or causes: the .err file has those as text). One that does not
    pickle is not written: the caller then has the text alone."""
    import pickle

    try:
        data = pickle.dumps(exc)
    except Exception:  # noqa: BLE001 - an unpicklable exception (a lock or a module among its args)
        return
    write_atomically(path, data)


def _read_exception(outdir: str, rank: int) -> BaseException | None:
    """``rank``'s exception object written by `_write_exception`, None when there is none (killed,
    unpicklable, or not yet written when another rank's failure ended the run)."""
    import pickle

    path = os.path.join(outdir, f"rank{rank}.exc")
    if not os.path.exists(path):
        return None
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except Exception:  # noqa: BLE001 - its class is not importable here: the message has the text
        return None


def _rank_errors(outdir: str, world_size: int, exclude: int | None = None) -> list[tuple[float, int, str]]:
    """``(time, rank, traceback)`` of every rank (but ``exclude``) that wrote a .err file."""
    errors = []
    for rank in range(world_size):
        path = os.path.join(outdir, f"rank{rank}.err")
        if rank != exclude and os.path.exists(path):
            with open(path) as f:
                stamp, _, text = f.read().partition("\n")
            errors.append((float(stamp), rank, text))
    return errors


def _first_failing_rank(outdir: str, world_size: int, exclude: int | None = None) -> int | None:
    """The rank whose .err file is the oldest (the first to fail), None without one."""
    errors = _rank_errors(outdir, world_size, exclude)
    return min(errors)[1] if errors else None


def _first_error(outdir: str, world_size: int, exclude: int | None = None) -> str | None:
    errors = _rank_errors(outdir, world_size, exclude)
    if not errors:
        return None
    stamp, rank, text = min(errors)
    others = [r for _, r, _ in errors if r != rank]
    tail = f"\n(ranks {others} failed afterwards)" if others else ""
    return f"rank {rank} of {world_size} raised:\n{text}{tail}"


def _ensure_preload() -> None:
    """Name :data:`PRELOAD` to the forkserver before it starts (later calls change nothing)."""
    import multiprocessing.forkserver as forkserver

    if getattr(forkserver._forkserver, "_forkserver_pid", None) is None:
        mp.set_forkserver_preload(list(PRELOAD))


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0) -> list[Any]:
    """Call ``fn(*args)`` on ``world_size`` gloo ranks; return the per-rank results in rank order.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function). Inside ``fn`` the
    default process group is initialised; ``dist.get_rank()`` tells the rank. Results travel
    back through ``torch.save``. Raises ``DistributedError`` (first failing rank's traceback) or
    ``TimeoutError``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1; got {world_size}")
    for attempt in range(RENDEZVOUS_ATTEMPTS):
        with tempfile.TemporaryDirectory(prefix="mtree_dist_") as outdir:
            try:
                return _run_once(fn, world_size, args, timeout, outdir)
            except DistributedError:
                # gloo's mesh lost a connection while it formed (nothing of fn ran): a new store, again
                if not os.path.exists(os.path.join(outdir, RENDEZVOUS_LOST)) or attempt == RENDEZVOUS_ATTEMPTS - 1:
                    raise
    raise AssertionError("unreachable")  # pragma: no cover


def _run_once(fn: Callable, world_size: int, args: tuple, timeout: float, outdir: str) -> list:
    method = "spawn" if torch.cuda.is_available() else "forkserver"
    if method == "forkserver":
        _ensure_preload()
    store = launcher_store(world_size, timeout)  # bound before any rank learns its port; held until they end
    port = None if store is None else store.port
    ctx = mp.start_processes(_rank_main, args=(fn, world_size, port, outdir, timeout, args,
                                               dict(os.environ), (_CallerFd(1), _CallerFd(2))),
                             nprocs=world_size, join=False, start_method=method)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                if ctx.join(timeout=0.2):
                    break
            except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:  # a rank failed; start_processes ended the rest
                killed = getattr(exc, "signal_name", None)
                if killed is None:
                    first = _first_failing_rank(outdir, world_size)
                    carried = None if first is None else _read_exception(outdir, first)
                    raise DistributedError(_first_error(outdir, world_size) or str(exc), exception=carried) from None
                # the first rank to go was killed outright (the OOM killer, a segfault, a kill): it wrote
                # no traceback; what the others raised afterwards (a broken connection) comes second
                rank = exc.error_index
                after = _first_error(outdir, world_size, exclude=rank)
                raise DistributedError(
                    f"rank {rank} of {world_size} was killed by {killed} (no traceback: out of memory, a crash or "
                    f"a kill)" + (f"; afterwards {after}" if after else ""), signal=signal.Signals[killed]) from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"distributed run of {getattr(fn, '__name__', fn)!r} on {world_size} ranks "
                                   f"exceeded {timeout:.0f} s"
                                   + (f"\n{_first_error(outdir, world_size)}" if _first_error(outdir, world_size) else ""))
    finally:
        for p in ctx.processes:  # only our own children, by handle
            if p.is_alive():
                p.terminate()
        for p in ctx.processes:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


