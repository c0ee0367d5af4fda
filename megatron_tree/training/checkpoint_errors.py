"""Why a ``megatron-tree train`` checkpoint was not written, told the same way on every rank.

`trainer._save_checkpoint` exchanges each rank's outcome of a save (all-reduced failure flag, then
the failing ranks' descriptions gathered); when any rank failed, every rank raises a
`CheckpointSaveError` built here by `save_failure_message`: it names the checkpoint directory, the
failing rank(s) and their errors (the OS error's errno name and text, e.g. ``ENOSPC`` "No space
left on device"), the bytes the checkpoint needs against the bytes free when the save started, what
``latest`` still names and what the user does next.

Everything here is plain data (dicts of str / int) so that it travels through
``all_gather_object`` and the local launcher's pickled exceptions, and imports only the standard
library, torch and `files`.

Under torchrun (``--max-restarts``) a failed save is not retried either: rank 0 leaves
`FAILED_SAVE_MARKER` in the ``--save`` directory (`record_failed_save`), and a restarted attempt of
the same job (``TORCHELASTIC_RESTART_COUNT`` > 0, the same rendezvous run id and SLURM requeue
count) that finds it raises the same error before it trains (`refuse_restart_after_failed_save`);
the next successful save removes it (`clear_failed_save`). The local launcher (``--nproc``) needs no
file: it sees the rank's exception itself (`trainer.run`). A save that failed only because another
rank was lost meanwhile (`lost_peer`: killed by the OOM killer or a crash mid-save; the surviving
ranks' collectives break) leaves no marker: the storage is fine, and the restart is what
``--max-restarts`` is for (the local launcher restarts then too: the killed rank is what it reports).
"""
from __future__ import annotations

import errno as errno_codes
import json
import logging
import os
import re
from typing import Optional

from .files import write_atomically

__all__ = ["CheckpointSaveError", "FAILED_SAVE_MARKER", "capture_logged_errors", "clear_failed_save", "describe_failure",
           "dir_bytes", "failing_ranks", "format_bytes", "iteration_dir", "lost_peer", "record_failed_save",
           "refuse_restart_after_failed_save", "save_failure_message"]

#: Left in the ``--save`` directory by a save that failed under torchrun (`record_failed_save`).
FAILED_SAVE_MARKER = "save_failed.json"

# "[Errno 28] No space left on device": how an OSError reads once it lost its type, which
# dist_checkpointing's collective error report does (the writer's OSError is re-raised as a
# RuntimeError and pickled to the coordinator without its __cause__)
_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\]")

# what a rank's error reads when its collective broke because a peer process went away (gloo's TCP
# pair, NCCL's abort, torch's DistBackendError), as opposed to an error of the storage
_LOST_PEER_TEXT = re.compile(r"Connection (?:reset|closed) by peer|NCCL communicator was aborted|DistBackendError")


def iteration_dir(directory: str, step: int) -> str:
    """The checkpoint directory of ``step`` in ``directory`` (``iter_0000012``: Megatron-LM's naming, ours too)."""
    return os.path.join(directory, f"iter_{step:07d}")


def dir_bytes(path: str) -> int:
    """Bytes of the files under ``path`` (a checkpoint's size on disk)."""
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


class CheckpointSaveError(RuntimeError):
    """A checkpoint was not saved. Raised on every rank of the run (the same account of the failing
    ranks on each), never for a checkpoint that ``latest`` names: the marker is written only after
    every rank reported success. Attributes: ``directory`` (the ``--save`` directory), ``step``,
    ``failures`` ({rank: {"error", "errno", "logged"}} of the ranks that failed: `failing_ranks`).
    Picklable (the local
    launcher carries it from the rank to the caller: `launch.DistributedError.exception`)."""

    def __init__(self, message: str, *, directory: Optional[str] = None, step: Optional[int] = None,
                 failures: Optional[dict] = None):
        super().__init__(message)
        self.directory, self.step, self.failures = directory, step, dict(failures or {})


def _collective_report(exc: BaseException) -> Optional[dict]:
    """The per-rank failures of torch.distributed.checkpoint's `CheckpointException` (a
    BaseException: dist_checkpointing raises it on every rank when some rank's write failed; only the
    coordinator's copy lists them), None for any other exception."""
    from torch.distributed.checkpoint.api import CheckpointException

    if not isinstance(exc, CheckpointException):
        return None
    return {int(rank): pair[0] if isinstance(pair, tuple) else pair for rank, pair in exc.failures.items()}


def _errno_of(exc: BaseException) -> Optional[int]:
    """The errno of the first OSError in ``exc``'s cause / context chain, else one written in its
    text as ``[Errno N]`` (an OSError that crossed a process as text), else None."""
    seen, cur = set(), exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno is not None:
            return int(cur.errno)
        cur = cur.__cause__ or cur.__context__
    found = _ERRNO_TEXT.search(str(exc))
    return int(found.group(1)) if found else None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class capture_logged_errors(logging.Handler):
    """Context manager: the ERROR records of logger ``name`` and its children while active, as
    one-line messages (``.messages``). dist_checkpointing logs a writer's own error there ("Local
    worker 0 encountered an error: [Errno 28] No space left on device") while the exception it
    raises may keep only the class (0.19: ``error: <class 'OSError'>``): this is where the errno of
    such a failure is still written."""

    def __init__(self, name: str, keep: int = 3):
        super().__init__(level=logging.ERROR)
        self.name_, self.keep, self.messages = name, keep, []

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.messages) < self.keep:
            self.messages.append(" ".join(record.getMessage().split())[:300])

    def __enter__(self):
        logging.getLogger(self.name_).addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger(self.name_).removeHandler(self)


def describe_failure(exc: BaseException, logged=()) -> dict:
    """This rank's failure as plain data: ``error`` (type and text on one line), ``errno`` (int or
    None: from the exception, else from ``logged``, the errors dist_checkpointing logged on this
    rank meanwhile), ``logged``, ``reported`` ({rank: {"error", "errno"}} from a collective
    `CheckpointException`, empty for other errors) and ``echo`` (True for such a collective report:
    the rank raised because some rank's write failed, which may be its own)."""
    logged = list(logged)
    from_log = next((int(m.group(1)) for m in map(_ERRNO_TEXT.search, logged) if m), None)
    report = _collective_report(exc)
    if report is not None:
        return {"error": "CheckpointException (dist_checkpointing's report that a rank's write failed)",
                "errno": from_log, "echo": True, "logged": logged,
                "reported": {rank: {"error": _one_line(e), "errno": _errno_of(e)} for rank, e in report.items()}}
    own = _errno_of(exc)
    return {"error": _one_line(exc), "errno": own if own is not None else from_log, "echo": False,
            "logged": logged, "reported": {}}


def failing_ranks(records: list) -> dict:
    """{rank: {"error", "errno", "logged"}} of the ranks whose own part failed, from every rank's
    record (a dict with ``failure``: a `describe_failure` dict or None). A rank counts when it raised
    an error of its own, or when dist_checkpointing's collective report names it (completed with
    what that rank logged itself: the report crossed processes as text and may have lost the
    errno); a rank that only echoed the report is not listed. When only echoes are known (the
    report's details reach the coordinator alone), the echoing ranks are listed as they are."""
    def own(rank):
        rec = records[rank] if 0 <= rank < len(records) else None
        return (rec or {}).get("failure")

    out: dict = {}
    for rec in records:
        failure = (rec or {}).get("failure")
        if failure:
            for rank, desc in failure["reported"].items():
                mine = own(rank) or {}
                out[rank] = {"error": desc["error"], "logged": mine.get("logged", []),
                             "errno": desc["errno"] if desc["errno"] is not None else mine.get("errno")}
    only_echoes = not out and all((rec or {}).get("failure") is None or rec["failure"]["echo"] for rec in records)
    for rank, rec in enumerate(records):
        failure = (rec or {}).get("failure")
        if failure and (not failure["echo"] or only_echoes) and rank not in out:
            out[rank] = {k: failure[k] for k in ("error", "errno", "logged")}
    return dict(sorted(out.items()))


def format_bytes(n: Optional[int]) -> str:
    """``1,234,567 bytes (1.2 MiB)``; "unknown" for None."""
    if n is None:
        return "unknown"
    size, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{n:,} bytes" + (f" ({size:.1f} {unit})" if unit != "B" else "")


def _errno_name(code: Optional[int]) -> str:
    if code is None:
        return ""
    return f"[{errno_codes.errorcode.get(code, f'errno {code}')}: {os.strerror(code)}] "


def save_failure_message(*, stage: str, directory: str, step: int, final: str, failures: dict, records: list,
                         previous: Optional[int], previous_complete: bool, cleanup: str, unreachable: str = "",
                         who: str = "megatron-tree train", latest: str = "latest") -> str:
    """The one message every rank raises. ``stage``: where the save failed ("preparing ...",
    "writing ...", "committing ..."); ``failures``: `failing_ranks`; ``records``: every rank's
    record (``need`` bytes of this rank's share of the checkpoint, ``free`` bytes in ``directory``
    when the save started, on rank 0 ``previous_bytes``: the size of the checkpoint ``latest``
    names; None where a rank's record is missing); ``previous``: the step ``latest`` still names
    (None: none), ``previous_complete``: whether its directory holds metadata.json; ``cleanup``: what became of the partial directory;
    ``unreachable``: why some ranks' outcome is unknown (empty when every rank reported); ``who``: the
    message's prefix; ``latest``: the file in ``directory`` naming the last complete checkpoint."""
    # what dist_checkpointing logged is shown where the error's own text lost the errno it holds
    parts = [f"rank {rank}: {_errno_name(f['errno'])}{f['error']}"
             + (f" (dist_checkpointing logged: {' | '.join(f['logged'])})"
                if f.get("logged") and not _ERRNO_TEXT.search(f["error"]) else "")
             for rank, f in failures.items()]
    msg = (f"{who}: the checkpoint of step {step} was NOT saved to {final}: {stage} failed on "
           f"rank{'s' * (len(failures) > 1)} {', '.join(map(str, failures))} ({'; '.join(parts)})")
    if unreachable:
        msg += f"; {unreachable}"
    needs = [rec.get("need") for rec in records if rec is not None]
    frees = [rec.get("free") for rec in records if rec is not None and rec.get("free") is not None]
    if needs:
        total = sum(n for n in needs if n is not None)
        share = ", ".join(f"rank {r} {'?' if rec.get('need') is None else format(rec['need'], ',')}"
                          for r, rec in enumerate(records) if rec)
        msg += (f". Space: the checkpoint needs about {format_bytes(total)} of model and optimizer tensors ({share}"
                f"), plus some bytes per tensor")
        before = [rec["previous_bytes"] for rec in records if rec is not None and rec.get("previous_bytes") is not None]
        if before and previous is not None:
            msg += f"; the checkpoint of step {previous} takes {format_bytes(before[0])} on disk"
        free = format_bytes(min(frees)) if frees else "an unknown amount"
        msg += f"; {directory} had {free} free when the save started"
    if any(f["errno"] == errno_codes.ENOSPC for f in failures.values()):
        msg += " (the filesystem ran out of space: make room for one more checkpoint, or choose another --save)"
    marker = os.path.join(directory, latest)
    if previous is None:
        msg += f". {marker} was not written (no earlier checkpoint there)"
    else:
        where = iteration_dir(directory, previous)
        msg += (f". {marker} still names step {previous} ({where}), " + (
            "a complete checkpoint" if previous_complete else
            "which is NOT a complete checkpoint (no metadata.json): a load refuses it"))
    msg += f"; {cleanup}. Training stopped: a run never goes on without a checkpoint it was asked to write"
    if previous is not None and previous_complete:
        msg += f"; rerun with --load {directory} to resume from step {previous}"
    return msg


# --------------------------------------------------------------------------------------------- torchrun restarts
def _torchrun_job() -> Optional[dict]:
    """This torchrun job as one attempt after another sees it: the rendezvous run id (a fresh uuid for
    each ``--standalone`` launch; the ``--rdzv-id`` given, the SLURM job id in the sbatch scripts) and
    SLURM's requeue count (a requeued job keeps its id); None outside torchrun."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run_id:
        return None
    return {"run_id": run_id, "slurm_restart_count": os.environ.get("SLURM_RESTART_COUNT")}


def lost_peer(failures: dict) -> bool:
    """True when every failing rank of ``failures`` (`failing_ranks`) failed only because a peer
    process went away: a broken collective, no errno. A rank SIGKILLed mid-save writes no failure of
    its own; the others report it this way."""
    return bool(failures) and all(f.get("errno") is None and _LOST_PEER_TEXT.search(str(f.get("error", "")))
                                  for f in failures.values())


def record_failed_save(directory: str, error: CheckpointSaveError) -> Optional[str]:
    """Rank 0, under torchrun: write ``error`` to ``directory/FAILED_SAVE_MARKER`` (atomically; best
    effort: a marker that cannot be written only means a restart retrains and fails again) so that
    torchrun's in-place restart of this job refuses to train again (`refuse_restart_after_failed_save`).
    Not for a save that failed only because a peer was lost (`lost_peer`): rank 0 would otherwise
    refuse the restart when another rank was killed mid-save and allow it when rank 0 itself was.
    Returns the marker's path, None outside torchrun, after a lost peer, or when it could not be written."""
    job = _torchrun_job()
    if job is None or lost_peer(error.failures):
        return None
    path = os.path.join(directory, FAILED_SAVE_MARKER)
    record = {"message": str(error), "directory": error.directory, "step": error.step, "job": job,
              "attempt": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
              "failures": [[rank, failure] for rank, failure in error.failures.items()]}
    try:
        write_atomically(path, json.dumps(record).encode())
    except (OSError, TypeError, ValueError):
        return None
    return path


def clear_failed_save(directory: str) -> None:
    """Rank 0, once a save of ``directory`` succeeded: a failed save's marker there no longer holds."""
    try:
        os.remove(os.path.join(directory, FAILED_SAVE_MARKER))
    except FileNotFoundError:
        pass


def refuse_restart_after_failed_save(directory: Optional[str]) -> None:
    """Before a torchrun restart attempt (``TORCHELASTIC_RESTART_COUNT`` > 0) trains: raise the
    `CheckpointSaveError` that stopped an earlier attempt of this same job (its marker in
    ``directory``, the ``--save`` directory), so that torchrun's restart budget never retrains the
    steps since the last checkpoint only to fail the same save again (a full disk stays full). Each
    remaining restart then ends the same way at once, and the job fails with the save's error.
    Nothing happens outside a restart, for a marker of another job (another run id or SLURM requeue
    count: a new launch after the cause was fixed trains normally), or without a marker."""
    if not directory:
        return
    try:
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return
    job = _torchrun_job()
    if attempt <= 0 or job is None:
        return
    path = os.path.join(directory, FAILED_SAVE_MARKER)
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return
    if not isinstance(record, dict) or record.get("job") != job or not isinstance(record.get("message"), str):
        return
    raise CheckpointSaveError(
        f"{record['message']}\nmegatron-tree: torchrun restart {attempt} of this job does not train again: the "
        f"save above failed in an earlier attempt ({path}), and retraining the steps since the last checkpoint would "
        "only fail it the same way; fix the cause and launch the job again",
        directory=record.get("directory") or directory, step=record.get("step"),
        failures={int(rank): failure for rank, failure in record.get("failures") or []})
