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

from ..tree.pair_loss import check_pairs, check_ranked_groups
from ..tree.token_fields import check_teacher_topk, check_token_values

__all__ = ["validate_pairs", "check_ranked_groups", "check_token_values", "check_teacher_topk", "as_numpy"]
# (the checks of ranked groups and per-token fields live in `tree.pair_loss` / `tree.token_fields`: the trainer
# runs them on its records too, naming file:line)


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
