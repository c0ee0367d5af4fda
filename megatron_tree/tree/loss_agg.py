"""Loss aggregations as RL frameworks name them, as exact per-sample weights under the per-token convention.

Every entry point trains with Megatron's per-token convention: a microbatch returns the sum of its
per-occurrence losses and their count, and Megatron divides the gradients by the count summed over
microbatches and DP ranks, N (every target of the global batch once). A sample's normaliser in the
other aggregations depends on the whole sample and the whole batch, which carry and tree CP spread
over microbatches and ranks; but it is known before the step, from the samples' target counts alone.
So each aggregation is a per-sample factor ``f_i`` on every loss occurrence of sample i (its weights,
KL and entropy terms included), with ``sum_i f_i sum_t l_it / N`` the aggregated loss:

=========================  =====================================  ====================
``loss_agg``               loss of the global batch               ``f_i``
=========================  =====================================  ====================
token-mean (default)       sum_i sum_t l_it / N                   1
seq-mean-token-sum         mean_i sum_t l_it                      N / B
seq-mean-token-mean        mean_i (sum_t l_it / T_i)              N / (B T_i)
seq-mean-token-sum-norm    sum_i sum_t l_it / (B L)  (Dr. GRPO)   N / (B L)
=========================  =====================================  ====================

``T_i`` is sample i's target count, ``N = sum_i T_i``, ``B`` the number of samples with a target (a sample
with none contributes nothing, as verl's masked means), ``L`` the constant ``norm`` (Dr. GRPO's; default:
the longest sample's target count in the batch). Unweighted counts, as the frameworks count them.
"""
from __future__ import annotations

import numpy as np

__all__ = ["LOSS_AGGS", "loss_agg_factors", "batch_totals", "with_loss_agg"]

LOSS_AGGS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def batch_totals(target_counts) -> tuple:
    """(N, B, longest) of samples with ``target_counts`` targets: what `loss_agg_factors` needs of the
    whole global batch (sum N and B, max the longest, over the parts a batch is split into)."""
    t = np.asarray(target_counts, dtype=np.float64)
    return float(t.sum()), float((t > 0).sum()), float(t.max(initial=0.0))


def loss_agg_factors(target_counts, mode: str = "token-mean", norm: float | None = None, *,
                     totals: tuple | None = None) -> np.ndarray:
    """``[B]`` float64 factors ``f_i`` (module table) for samples with ``target_counts[i]`` targets each:
    the whole global batch, or a part of it with the whole batch's ``totals`` (`batch_totals`)."""
    if mode not in LOSS_AGGS:
        raise ValueError(f"loss_agg must be one of {', '.join(LOSS_AGGS)}, got {mode!r}")
    t = np.asarray(target_counts, dtype=np.float64)
    if mode == "token-mean":
        return np.ones_like(t)
    n, b, longest = batch_totals(t) if totals is None else totals
    if b == 0:
        return np.zeros_like(t)
    if mode == "seq-mean-token-sum":
        return np.full_like(t, n / b)
    if mode == "seq-mean-token-mean":
        return np.where(t > 0, n / (b * np.maximum(t, 1.0)), 0.0)
    length = longest if norm is None else float(norm)
    if not length > 0:
        raise ValueError(f"loss_agg_norm must be > 0, got {norm!r}")
    return np.full_like(t, n / (b * length))


def with_loss_agg(samples, mode: str = "token-mean", norm: float | None = None) -> list:
    """The samples of one global batch with their loss weights multiplied by `loss_agg_factors` (copies;
    the same objects for token-mean). What a packer sees: every occurrence of sample i carries ``f_i``."""
    import dataclasses

    samples = list(samples)
    if mode == "token-mean" and norm is None:
        return samples
    factors = loss_agg_factors([int(s.target_mask().sum()) for s in samples], mode, norm)
    return [dataclasses.replace(s, weight=f * (1.0 if s.weight is None else np.asarray(s.weight, dtype=np.float64)))
            for s, f in zip(samples, factors.tolist())]
