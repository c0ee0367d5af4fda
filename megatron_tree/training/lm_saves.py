"""Megatron-LM's checkpoint saves under our hooks: a save that fails stops with one clear error, and
torchrun's in-place restart does not retry it.

Megatron-LM's ``save_checkpoint`` raises whatever its writer raised (a traceback deep in
``torch.save`` or ``dist_checkpointing``; an ``ENOSPC`` there may reach the caller as
``CheckpointException`` with only the class name left), and torchrun's ``--max-restarts`` treats it
like a crashed rank: every rank restarts, loads the last checkpoint, retrains the steps since, and
fails the same save again (a full disk stays full). `guard_saves` changes two things, nothing about
what Megatron-LM writes or when:

* ``megatron.training.training.save_checkpoint`` (the name ``pretrain()``'s loop calls) is wrapped:
  when it raises on a rank, that rank raises `checkpoint_errors.CheckpointSaveError` instead, chained
  to the original, naming the checkpoint directory and the iteration, the error with its errno (also
  when only dist_checkpointing's log still holds it), the bytes of this rank's model and optimizer
  tensors against the bytes free when the save started, and the iteration Megatron-LM's tracker
  (``latest_checkpointed_iteration.txt``) still names, the one a ``--load`` resumes from (Megatron-LM
  writes the tracker only after a save succeeded). Under torchrun the failing rank leaves the failed
  save's marker in ``--save`` (`checkpoint_errors.record_failed_save`); a successful save clears it.
* a restarted attempt of the same torchrun job (``TORCHELASTIC_RESTART_COUNT`` > 0) that finds the
  marker raises that error before its first iteration (`checkpoint_errors.refuse_restart_after_failed_save`),
  so the remaining restarts end at once and the job fails with the save's error.

The hooks call `guard_saves`: `megatron_lm.train_valid_test_datasets_provider` (``pretrain()`` calls it
after the model and a ``--load`` are set up, before the first iteration, on tensor-parallel rank 0 only:
Megatron-LM builds the data there) and `megatron_lm.forward_step` (every rank, every microbatch: the
other tensor-parallel ranks' saves are guarded from their first forward on; after the first call it
only checks a flag).
"""
from __future__ import annotations

import functools
import os
import shutil
import sys
from typing import Optional

from .checkpoint_errors import (CheckpointSaveError, capture_logged_errors, clear_failed_save, describe_failure,
                                dir_bytes, failing_ranks, iteration_dir, record_failed_save,
                                refuse_restart_after_failed_save, save_failure_message)

__all__ = ["guard_saves", "TRACKER"]

#: Megatron-LM's marker of the last complete checkpoint in ``--save``.
TRACKER = "latest_checkpointed_iteration.txt"
_checked = False  # this process looked for a failed save's marker (a torchrun restart refuses once)


def _tracker_iteration(directory: str) -> Optional[int]:
    try:
        with open(os.path.join(directory, TRACKER)) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _free_bytes(directory: str) -> Optional[int]:
    path = directory
    while path and not os.path.isdir(path):  # --save may not exist before the first save
        parent = os.path.dirname(path)
        path = parent if parent != path else ""
    try:
        return shutil.disk_usage(path or ".").free
    except OSError:
        return None


def _tensor_bytes(model, optimizer) -> int:
    """This rank's model parameters plus its optimizer's state tensors (the bulk of its share)."""
    seen, total = set(), 0
    chunks = model if isinstance(model, (list, tuple)) else [model]
    tensors = [p for m in chunks for p in m.parameters()]
    for opt in getattr(optimizer, "chained_optimizers", None) or ([optimizer] if optimizer is not None else []):
        inner = getattr(opt, "optimizer", opt)
        for state in getattr(inner, "state", {}).values():
            tensors += [v for v in state.values() if hasattr(v, "element_size")]
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _guarded(original, args):
    @functools.wraps(original)
    def save_checkpoint(iteration, model, optimizer, *rest, **kwargs):
        directory = getattr(args, "save", None)
        if not directory:
            return original(iteration, model, optimizer, *rest, **kwargs)
        free, previous = _free_bytes(directory), _tracker_iteration(directory)
        with capture_logged_errors("megatron.core.dist_checkpointing") as logged:
            try:
                result = original(iteration, model, optimizer, *rest, **kwargs)
            except Exception as exc:  # noqa: BLE001 (any failure of the save; KeyboardInterrupt passes)
                raise _failure(args, iteration, model, optimizer, exc, logged.messages, free, previous) from exc
        if _rank() == 0:
            clear_failed_save(directory)
        return result

    save_checkpoint._megatron_tree_guard = True
    return save_checkpoint


def _failure(args, iteration, model, optimizer, exc, logged, free, previous) -> CheckpointSaveError:
    directory, rank = args.save, _rank()
    try:
        need = _tensor_bytes(model, optimizer)
    except Exception:  # noqa: BLE001 (an estimate for the message only)
        need = None
    records = [None] * rank + [{"failure": describe_failure(exc, logged), "need": need, "free": free}]
    if previous is not None and os.path.isdir(iteration_dir(directory, previous)):
        records[rank]["previous_bytes"] = dir_bytes(iteration_dir(directory, previous))
    failures = failing_ranks(records)
    final = iteration_dir(directory, iteration)
    message = save_failure_message(
        who="megatron-tree (Megatron-LM's save_checkpoint through the hooks)", stage="Megatron-LM's save_checkpoint",
        directory=directory, step=iteration, final=final, failures=failures,
        records=records, previous=previous, previous_complete=previous is not None,
        cleanup=f"Megatron-LM leaves the partial {final} in place; a --load follows "
                f"its tracker ({os.path.join(directory, TRACKER)}), never that directory",
        unreachable="each rank raises with what it saw itself (Megatron-LM exchanges no outcome)", latest=TRACKER)
    error = CheckpointSaveError(message, directory=directory, step=iteration, failures=failures)
    record_failed_save(directory, error)  # torchrun: its restarts of this job refuse to retrain
    return error


def guard_saves(args) -> None:
    """Refuse a torchrun restart attempt of a job whose save failed, then wrap Megatron-LM's
    ``save_checkpoint`` as the module docstring says (idempotent; ``args``: Megatron-LM's parsed args,
    whose ``save`` names the checkpoint directory). Outside ``pretrain()`` (``megatron.training.training``
    not imported: the hooks called on their own) there is nothing to wrap."""
    global _checked
    if not _checked:  # once per process: every microbatch's forward step calls this
        refuse_restart_after_failed_save(getattr(args, "save", None))
        _checked = True
    training = sys.modules.get("megatron.training.training")  # imported by pretrain(), which calls the hooks
    if training is not None and not getattr(training.save_checkpoint, "_megatron_tree_guard", False):
        training.save_checkpoint = _guarded(training.save_checkpoint, args)
