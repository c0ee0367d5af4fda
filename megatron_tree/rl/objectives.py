"""Sequence-level objectives and loss aggregations for `forward_backward`, exact across microbatches and ranks.

A sequence-level loss is a function of per-rollout sums of per-token quantities (GSPO: the mean log-ratio
of a rollout; DPO: the summed log-probs of a preference pair's two rollouts). Carry and tree CP cut a
rollout's tokens over microbatches and ranks, and Megatron's schedule runs each microbatch's backward
before later forwards, so a rollout's sum is not known when its first occurrence is differentiated.

Two passes (`sequence_stats`, then the graded pass): a forward-only pass of the same microbatches gives
every rollout's per-token log-probs (gathered over CP and PP by `RolloutOutputs`; per-rollout sums
all-reduced over DP, ``[B]`` floats, when the batch was sharded by `build_microbatches`); the graded pass
then trains a per-occurrence surrogate whose gradient is the sequence-level gradient exactly, because
``dL/dlogp_it = dL/dS_i * dS_i/dlogp_it``: each occurrence gets the factor ``dL/dS_i`` evaluated at the first
pass's sums (the same parameters, the same deterministic forward). Cost: one forward of the step without
backward (about a third of the step's FLOPs); token-level losses and the aggregations need no extra pass.

Normalisation is Megatron's per-token convention (gradients divided by N, the targets of the global
batch): a surrogate's per-occurrence values are scaled by N so that their sum over the step, divided
by N, is the objective.

* ``gspo`` (Qwen3's GSPO, verl's form): ``s_i = exp(mean_t (logp_it - old_it))``; per occurrence
  ``l_it = -min(r_it A, clip(r_it, 1 - eps, 1 + eps_high) A)`` with ``r_it = s_i exp(logp_it - sg(logp_it))``
  (value ``s_i``, gradient ``s_i dlogp_it``), plus the k3 KL and entropy terms, then aggregated by
  ``loss_agg`` (GSPO's paper: ``seq-mean-token-mean``, i.e. the mean over rollouts of
  ``-min(s_i A_i, clip(s_i) A_i)``).
* ``rm`` (a reward model: `megatron.value_head` on the model, the batch's `RolloutBatch.reward_positions`):
  Bradley-Terry over preference pairs, ``-log sigmoid(r_c - r_r)`` with ``r`` a rollout's value at its last row,
  the mean over pairs (DPO's form with ``beta = 1`` and no reference). Pairs are the batch's ``pair_ids`` /
  ``chosen``, or, for ranked groups (``group_ids`` / ``scores``), every two rollouts of a group whose scores
  differ (the better one "chosen"); a rollout in several pairs gets the sum of its factors.
* ``dpo`` / ``ipo`` / ``simpo`` over preference pairs (``RolloutBatch.pair_ids`` and ``chosen``: a prompt
  with two completions is a two-leaf tree): ``h = (pi_c - ref_c) - (pi_r - ref_r)``, ``pi`` a rollout's summed
  target log-probs, ``ref`` its summed ``ref_logprobs``; DPO ``-log sigmoid(beta h)``, IPO
  ``(h - 1 / (2 beta))^2``, SimPO ``-log sigmoid(beta (pi_c / T_c - pi_r / T_r) - gamma)`` (no reference);
  the step's loss is the mean over pairs.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from ..tree.pair_loss import PAIR_LOSSES, pair_loss_factors, pair_members, pair_surrogate, ranked_pairs
from .fields import validate_pairs

__all__ = ["SEQUENCE_LOSSES", "PAIR_LOSSES", "agg_factors", "step_totals", "sequence_loss_fn", "validate_pairs"]

SEQUENCE_LOSSES = ("gspo",) + PAIR_LOSSES + ("rm",)

# Test-only fault switch (None in normal use): "one_microbatch" takes each rollout's statistic from its
# occurrences in the first microbatch holding it only; "wrong_partner" pairs each chosen rollout with the
# rejected rollout of the next pair. tests/test_rl_objectives.py must catch both.
_FAULT = None


def _dp_all_reduce(x: np.ndarray, group, op=dist.ReduceOp.SUM) -> np.ndarray:
    """``x`` reduced over the DP ``group`` (float64 on the wire); ``x`` itself without one."""
    if group is None or dist.get_world_size(group) == 1:
        return np.asarray(x, dtype=np.float64)
    t = torch.as_tensor(np.asarray(x, dtype=np.float64))
    if torch.cuda.is_available():
        t = t.cuda()
    dist.all_reduce(t, op=op, group=group)
    return t.cpu().numpy()


def step_totals(microbatches, group) -> tuple:
    """(N, B, longest) of the whole step: targets, rollouts with a target and the longest rollout's
    targets, over this rank's rollouts and the DP ``group``'s (a framework may shard its batch over DP
    itself, or let `build_microbatches` do it: either way each rank counts its own rollouts)."""
    from ..tree.loss_agg import batch_totals

    n, b, longest = batch_totals(microbatches.batch.target_counts[microbatches.rollout_ids])
    n, b = _dp_all_reduce([n, b], group).tolist()
    return n, b, float(_dp_all_reduce([longest], group, dist.ReduceOp.MAX)[0])


def agg_factors(microbatches, mode: str, norm, group) -> np.ndarray:
    """``[B]`` per-rollout loss-aggregation factors (`tree.loss_agg`) of this rank's batch, with the step's
    totals (`step_totals`)."""
    from ..tree.loss_agg import loss_agg_factors

    return loss_agg_factors(microbatches.batch.target_counts, mode, norm, totals=step_totals(microbatches, group))


def _rollout_sums(microbatches, outputs, group) -> dict:
    """Per rollout of the batch (``[B]`` float64): the summed target log-probs ``pi`` of the stats pass, the
    summed ``logp - old`` ``d`` (where old log-probs exist) and the summed ``ref_logprobs`` ``ref``; reduced
    over DP when `build_microbatches` sharded a global batch (each rollout is on one rank)."""
    batch = microbatches.batch
    B = len(batch)
    pi, d, ref = np.zeros(B), np.zeros(B), np.zeros(B)
    per = outputs.per_rollout("values" if "values" in outputs.values else "logprobs")  # a value model's values
    for i in microbatches.rollout_ids.tolist():
        s = batch.samples[i]
        lp = np.asarray(per[i], dtype=np.float64)
        if _FAULT == "one_microbatch":  # planted: a statistic from part of the rollout's occurrences only
            lp = lp[: max(1, len(lp) // 2)]
        mask = np.flatnonzero(s.target_mask())[: len(lp)]
        pi[i] = lp.sum()
        if s.old_logprobs is not None:
            d[i] = (lp - s.old_logprobs[mask]).sum()
        if s.ref_logprobs is not None:
            ref[i] = s.ref_logprobs[mask].sum()
    if getattr(microbatches, "dp_size", 1) > 1:
        pi, d, ref = _dp_all_reduce(np.stack([pi, d, ref]), group)
    return {"pi": pi, "d": d, "ref": ref}


def sequence_loss_fn(loss: str, microbatches, outputs, group, *, clip_eps=0.2, clip_eps_high=None, kl_coef=0.0,
                     entropy_coef=0.0, beta=0.1, simpo_gamma=0.5):
    """``loss_fn(logprobs [M], entropy [M], loss_map) -> [M]`` of the graded pass of sequence objective
    ``loss``, its per-rollout factors fixed from the stats pass ``outputs`` (module docstring)."""
    if loss not in SEQUENCE_LOSSES:
        raise ValueError(f"sequence loss must be one of {SEQUENCE_LOSSES}, got {loss!r}")
    sums = _rollout_sums(microbatches, outputs, group)
    counts = microbatches.batch.target_counts.astype(np.float64)
    if loss == "gspo":
        missing = [i for i in microbatches.rollout_ids.tolist() if microbatches.batch.samples[i].advantage is None]
        if missing:
            raise ValueError(f"rollout {missing[0]}: has no advantage, which gspo needs")
        seq_ratio = torch.as_tensor(np.exp(np.where(counts > 0, sums["d"] / np.maximum(counts, 1.0), 0.0)))
        return _gspo_fn(seq_ratio, clip_eps, clip_eps_high, kl_coef, entropy_coef)
    if kl_coef or entropy_coef:
        raise ValueError(f"loss {loss!r} is a function of preference pairs: kl_coef / entropy_coef do not apply")
    if loss == "rm":  # Bradley-Terry: -log sigmoid(r_c - r_r), each reward the value at the rollout's last row
        bad = np.flatnonzero(counts[microbatches.rollout_ids] != 1)
        if len(bad):
            raise ValueError(f"rollout {int(microbatches.rollout_ids[bad[0]])}: a reward model scores one position per "
                             "rollout (its last row): build the microbatches from batch.reward_positions()")
        sums = dict(sums, ref=np.zeros_like(sums["pi"]))
        coef, share = _pair_factors("dpo", microbatches, sums, counts, group, beta=1.0, gamma=0.0)
    else:
        coef, share = _pair_factors(loss, microbatches, sums, counts, group, beta=beta, gamma=simpo_gamma)
    coef, share = torch.as_tensor(coef), torch.as_tensor(share)

    def pair_fn(lp, ent, loss_map):
        i = loss_map.sample_index.to(coef.device)
        return pair_surrogate(lp, coef[i], share[i])

    return pair_fn


def _gspo_fn(seq_ratio: torch.Tensor, clip_eps, clip_eps_high, kl_coef, entropy_coef):
    from ..tree.loss import tree_loss

    def gspo_fn(lp, ent, loss_map):
        s = seq_ratio.to(lp.device)[loss_map.sample_index.to(lp.device)]
        per, _ = tree_loss(lp, loss_map, loss_type="gspo", clip_eps=clip_eps, clip_eps_high=clip_eps_high,
                           kl_coef=kl_coef, entropy=ent, entropy_coef=entropy_coef, reduction="none",
                           sequence_ratio=s)
        return per

    return gspo_fn


def _pairs(batch):
    """(chosen rollout, rejected rollout) per pair of ``batch``, [P] each (validated by `RolloutBatch`): its
    preference pairs, or every two rollouts of a ranked group with different scores (better, worse)."""
    if batch.group_ids is not None:
        c, r = ranked_pairs(batch.group_ids, batch.scores)
    elif batch.pair_ids is None or batch.chosen is None:
        raise ValueError("a preference loss needs RolloutBatch pair_ids and chosen (one chosen and one rejected "
                         "rollout per pair id) or ranked groups (group_ids and scores)")
    else:
        c, r = pair_members(batch.pair_ids, batch.chosen)
    if _FAULT == "wrong_partner":  # planted: each chosen rollout against the next pair's rejected one
        r = np.roll(r, 1)
    return c, r


def _pair_factors(loss, microbatches, sums, counts, group, *, beta, gamma):
    """Per rollout: ``coef_i = N dL/dpi_i`` and ``share_i = N L_p / n_p`` (`tree.pair_loss`), with L the mean
    over the step's pairs."""
    c, r = _pairs(microbatches.batch)
    n, _, _ = step_totals(microbatches, group)
    pairs = float(len(c)) if getattr(microbatches, "dp_size", 1) > 1 else float(
        _dp_all_reduce([len(c)], group)[0])  # a framework-sharded batch holds its own pairs only
    return pair_loss_factors(loss, sums["pi"], sums["ref"], counts, c, r, n_targets=n, n_pairs=pairs, beta=beta,
                             gamma=gamma)
