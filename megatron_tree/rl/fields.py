"""The per-objective fields of a `RolloutBatch`, checked when the batch is made: a bad entry is a ValueError naming
the rollout (``rollout i``), the pair or the group, and the rule it breaks.

* preference pairs (dpo / ipo / simpo / rm): ``pair_ids`` / ``chosen`` ``[B]`` (`validate_pairs`);
* ranked groups (rm and the pair losses, in place of pairs): ``group_ids`` / ``scores`` ``[B]``
  (`check_ranked_groups`);
* value models: ``returns`` / ``old_values``, one value per token (`check_token_values`);
* distillation: ``teacher_topk_ids`` / ``teacher_topk_logprobs``, ``[L, k]`` per rollout (`check_teacher_topk`).
"""
from __future__ import annotations

import numpy as np
import torch

from ..tree.pair_loss import check_pairs

__all__ = ["validate_pairs", "check_ranked_groups", "check_token_values", "check_teacher_topk", "as_numpy"]


def as_numpy(x):
    """``x`` (a tensor, array, list or None) as a numpy array (None stays None)."""
    if x is None:
        return None
    return x.detach().cpu().numpy() if torch.is_tensor(x) else np.asarray(x)


_np = as_numpy


def validate_pairs(pair_ids, chosen, size: int):
    """``(pair_ids [B] int64, chosen [B] bool)`` checked: both or neither, one entry per rollout, and every
    pair id held by exactly one chosen and one rejected rollout. A ValueError names the rule and the pair."""
    if pair_ids is None and chosen is None:
        return None, None
    if pair_ids is None or chosen is None:
        raise ValueError("pair_ids and chosen go together: the pair each rollout belongs to, and whether it is the "
                         "chosen one")
    ids, ch = np.asarray(pair_ids).reshape(-1), np.asarray(chosen).reshape(-1)
    if len(ids) != size or len(ch) != size:
        raise ValueError(f"pair_ids / chosen need one entry per rollout ({size}), got {len(ids)} / {len(ch)}")
    ids, ch = ids.astype(np.int64), ch.astype(bool)
    check_pairs(ids, ch)
    return ids, ch


def check_ranked_groups(group_ids, scores, size: int, *, has_pairs: bool = False):
    """``(group_ids [B], scores [B] float64)`` checked (or ``(None, None)``): both or neither, not with pairs, one
    entry per rollout, finite scores, and two different scores in every group (a group makes no pair otherwise)."""
    if group_ids is None and scores is None:
        return None, None
    if group_ids is None or scores is None:
        raise ValueError("group_ids and scores go together: each rollout's ranked group and its score")
    if has_pairs:
        raise ValueError("give preference pairs (pair_ids / chosen) or ranked groups (group_ids / scores), not both")
    gid, sc = _np(group_ids).reshape(-1), _np(scores).astype(np.float64).reshape(-1)
    if len(gid) != size or len(sc) != size:
        raise ValueError(f"group_ids / scores need one entry per rollout ({size}), got {len(gid)} / {len(sc)}")
    if not np.isfinite(sc).all():
        raise ValueError(f"rollout {int(np.flatnonzero(~np.isfinite(sc))[0])}: its score is not finite")
    uniq, inverse = np.unique(gid, return_inverse=True)
    lo, hi = np.full(len(uniq), np.inf), np.full(len(uniq), -np.inf)
    np.minimum.at(lo, inverse, sc)
    np.maximum.at(hi, inverse, sc)
    flat = np.flatnonzero(lo == hi)
    if len(flat):
        members = np.flatnonzero(inverse == flat[0]).tolist()
        group = uniq[flat[0]].item()  # (a plain int / str in the message, not numpy's repr)
        raise ValueError(f"group {group!r}: rollouts {members} all score {lo[flat[0]]}; a ranked group needs "
                         "two different scores (it makes no pair otherwise)")
    return gid, sc


def check_token_values(name: str, rows, samples) -> list | None:
    """``rows`` (one per rollout) as float64 arrays of one value per token, finite at every target (or None)."""
    if rows is None:
        return None
    if len(rows) != len(samples):
        raise ValueError(f"{name} needs one entry per rollout ({len(samples)}), got {len(rows)}")
    rows = [_np(r).astype(np.float64) for r in rows]
    for i, (r, s) in enumerate(zip(rows, samples)):
        if r.shape != (len(s),):
            raise ValueError(f"rollout {i}: {name} needs one value per token ({len(s)}), got shape {r.shape}")
        if not np.isfinite(r[s.target_mask()]).all():
            raise ValueError(f"rollout {i}: {name} is not finite at a target")
    return rows


def check_teacher_topk(ids, logprobs, samples):
    """``(ids, logprobs)``: per rollout ``[L, k]`` int64 token ids and float64 log-probs (the same k for every
    rollout, finite and <= 0 at every target), or ``(None, None)``."""
    if ids is None and logprobs is None:
        return None, None
    if ids is None or logprobs is None or len(ids) != len(samples) or len(logprobs) != len(samples):
        raise ValueError("teacher_topk_ids and teacher_topk_logprobs go together, one [L, k] entry per rollout")
    ids = [_np(x) for x in ids]
    logprobs = [_np(x).astype(np.float64) for x in logprobs]
    k = ids[0].shape[-1] if ids and ids[0].ndim == 2 else None
    for i, (a, b, s) in enumerate(zip(ids, logprobs, samples)):
        if a.shape != (len(s), k) or b.shape != a.shape:
            raise ValueError(f"rollout {i}: teacher_topk_ids / teacher_topk_logprobs must be [tokens, k] = "
                             f"[{len(s)}, {k}] (k as rollout 0's), got {a.shape} / {b.shape}")
        if a.dtype.kind not in "iu" or (a < 0).any():
            raise ValueError(f"rollout {i}: teacher_topk_ids must be non-negative integer token ids")
        t = s.target_mask()
        if not (np.isfinite(b[t]).all() and (b[t] <= 0).all()):
            raise ValueError(f"rollout {i}: teacher_topk_logprobs must be finite log-probs (<= 0) at every target")
    return [a.astype(np.int64) for a in ids], logprobs
