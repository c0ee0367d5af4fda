"""Per-token objective fields (a value model's returns, a teacher's top-k), checked and read per occurrence.

A value model trains against one return per token (and, clipped, the rollout's old value), a distillation
step against a teacher's top-k next-token ids and log-probs per token (``[L, k]``). Entry ``t`` describes
token ``t`` as a target, as every per-token field of `Sample` does. They stay beside the packed microbatches,
not in them: a loss reads its occurrences' entries by (sample, position) from a `TokenTable` (the loss map's
``sample_index`` / ``positions``), so packing, carry and CP views need not know them.

The checks name the entry (``names[i]``: "file.jsonl:12" in the trainer, ``rollout i`` in the `rl` API)
and the rule it breaks.
"""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["check_token_values", "check_teacher_topk", "TokenTable"]


def _name(names, i: int) -> str:
    return names[i] if names is not None else f"rollout {i}"


def _array(x):
    return x.detach().cpu().numpy() if torch.is_tensor(x) else np.asarray(x)


def check_token_values(name: str, rows, samples, names=None) -> list | None:
    """``rows`` (one per sample) as float64 arrays of one value per token, finite at every target (or None)."""
    if rows is None:
        return None
    if len(rows) != len(samples):
        raise ValueError(f"{name} needs one entry per rollout ({len(samples)}), got {len(rows)}")
    out = []
    for i, (r, s) in enumerate(zip(rows, samples)):
        try:
            r = _array(r).astype(np.float64)
        except (TypeError, ValueError):
            raise ValueError(f"{_name(names, i)}: {name} must be numbers, one per token") from None
        if r.shape != (len(s),):
            raise ValueError(f"{_name(names, i)}: {name} needs one value per token ({len(s)}), got shape {r.shape}")
        if not np.isfinite(r[s.target_mask()]).all():
            raise ValueError(f"{_name(names, i)}: {name} is not finite at a target")
        out.append(r)
    return out


def check_teacher_topk(ids, logprobs, samples, names=None, vocab_size=None):
    """``(ids, logprobs)``: per sample ``[L, k]`` int64 token ids (below ``vocab_size`` where given) and float64
    log-probs (the same k for every sample, finite and <= 0 at every target), or ``(None, None)``."""
    if ids is None and logprobs is None:
        return None, None
    if ids is None or logprobs is None or len(ids) != len(samples) or len(logprobs) != len(samples):
        raise ValueError("teacher_topk_ids and teacher_topk_logprobs go together, one [L, k] entry per rollout")
    out_ids, out_lp, k = [], [], None
    for i, (a, b, s) in enumerate(zip(ids, logprobs, samples)):
        try:
            a, b = _array(a), _array(b).astype(np.float64)
        except (TypeError, ValueError):
            raise ValueError(f"{_name(names, i)}: teacher_topk_ids / teacher_topk_logprobs must be [tokens, k] "
                             "arrays of numbers") from None
        k = a.shape[-1] if k is None and a.ndim == 2 else k
        if a.shape != (len(s), k) or b.shape != a.shape:
            raise ValueError(f"{_name(names, i)}: teacher_topk_ids / teacher_topk_logprobs must be [tokens, k] = "
                             f"[{len(s)}, {k}] (k as the first entry's), got {a.shape} / {b.shape}")
        if a.dtype.kind not in "iu" or (a < 0).any():
            raise ValueError(f"{_name(names, i)}: teacher_topk_ids must be non-negative integer token ids")
        if vocab_size is not None and a.size and a.max() >= vocab_size:
            raise ValueError(f"{_name(names, i)}: teacher_topk_ids holds id {int(a.max())} >= vocab size {vocab_size}")
        t = s.target_mask()
        if not (np.isfinite(b[t]).all() and (b[t] <= 0).all()):
            raise ValueError(f"{_name(names, i)}: teacher_topk_logprobs must be finite log-probs (<= 0) at every "
                             "target")
        out_ids.append(a.astype(np.int64))
        out_lp.append(b)
    return out_ids, out_lp


class TokenTable:
    """One per-token field of a sample list, flattened: ``rows[i]`` ``[L_i]`` or ``[L_i, k]`` for sample id ``i``
    (None for a sample that has none: reading it is an error). ``at(loss_map)`` gives ``[M]`` / ``[M, k]`` of the
    loss map's occurrences (``sample_index``, ``positions``), one gather, no per-occurrence Python loop."""

    def __init__(self, name: str, rows):
        self.name = name
        lengths = np.array([-1 if r is None else len(r) for r in rows], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(np.maximum(lengths, 0))[:-1]]).astype(np.int64)
        self.lengths = lengths
        have = [np.asarray(r) for r in rows if r is not None]
        self.flat = np.concatenate(have) if have else np.zeros(0)

    def at(self, loss_map) -> torch.Tensor:
        sample = loss_map.sample_index.cpu().numpy()
        pos = loss_map.positions.cpu().numpy()
        if len(sample) and (self.lengths[sample] <= pos).any():
            bad = int(sample[np.flatnonzero(self.lengths[sample] <= pos)[0]])
            raise ValueError(f"sample {bad}: has no {self.name} for its targets")
        return torch.as_tensor(self.flat[self.offsets[sample] + pos])
