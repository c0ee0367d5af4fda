"""Preference-pair losses (DPO, IPO, SimPO) as per-occurrence surrogates with exact gradients.

A preference pair is a chosen and a rejected completion of one prompt (a two-leaf tree). The loss of a
pair is a function of each completion's summed target log-probs ``pi`` (and, DPO / IPO, the reference
model's ``ref``)::

    h = (pi_c - ref_c) - (pi_r - ref_r)
    dpo     -log sigmoid(beta h)
    ipo     (h - 1 / (2 beta))^2
    simpo   -log sigmoid(beta (pi_c / T_c - pi_r / T_r) - gamma)       T: the completion's targets

and the step's loss is the mean over its pairs. A completion's occurrences are cut over microbatches
and ranks, so its ``pi`` is known only after a forward-only stats pass; the graded pass then trains, per
occurrence of sample i, ``share_i + coef_i (logp - sg(logp))``: the gradient is ``coef_i dlogp`` with
``coef_i = N dL/dpi_i`` (exact: ``dL/dlogp_it = dL/dpi_i``), and the values add up to ``N L`` (each pair's
loss spread over its occurrences). ``N`` is the step's target count, by which Megatron's per-token
normalisation divides. Used by the `rl` API and the trainer.
"""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["PAIR_LOSSES", "check_pairs", "check_ranked_groups", "pair_loss_factors", "pair_surrogate", "pair_members", "ranked_pairs"]

PAIR_LOSSES = ("dpo", "ipo", "simpo")


def check_pairs(pair_ids, chosen, names=None) -> None:
    """Raise a ValueError unless every pair id of ``pair_ids`` [B] is held by exactly one chosen and one rejected
    entry of ``chosen`` [B]; it names the pair and its members (``names[i]``, default ``rollout i``)."""
    ids, ch = np.asarray(pair_ids, dtype=np.int64), np.asarray(chosen, dtype=bool)
    uniq, inverse, count = np.unique(ids, return_inverse=True, return_counts=True)
    n_chosen = np.bincount(inverse, weights=ch, minlength=len(uniq))
    bad = np.flatnonzero((count != 2) | (n_chosen != 1))
    if len(bad):
        members = np.flatnonzero(inverse == bad[0]).tolist()
        who = ", ".join(names[i] if names is not None else f"rollout {i}" for i in members)
        raise ValueError(f"pair {int(uniq[bad[0]])}: {who} (chosen: {ch[members].tolist()}); a preference pair is "
                         "exactly one chosen and one rejected entry")


def check_ranked_groups(group_ids, scores, size: int, *, has_pairs: bool = False, names=None):
    """``(group_ids [B], scores [B] float64)`` checked (or ``(None, None)``): both or neither, not with pairs, one
    entry per rollout, finite scores, and two different scores in every group (a group makes no pair otherwise).
    A ValueError names the entry (``names[i]``, default ``rollout i``) or the group and its members."""
    if group_ids is None and scores is None:
        return None, None
    if group_ids is None or scores is None:
        raise ValueError("group_ids and scores go together: each rollout's ranked group and its score")
    if has_pairs:
        raise ValueError("give preference pairs (pair_ids / chosen) or ranked groups (group_ids / scores), not both")
    as_np = lambda x: x.detach().cpu().numpy() if torch.is_tensor(x) else np.asarray(x)
    gid, sc = as_np(group_ids).reshape(-1), as_np(scores).astype(np.float64).reshape(-1)
    if len(gid) != size or len(sc) != size:
        raise ValueError(f"group_ids / scores need one entry per rollout ({size}), got {len(gid)} / {len(sc)}")
    name = lambda i: names[i] if names is not None else f"rollout {i}"
    if not np.isfinite(sc).all():
        raise ValueError(f"{name(int(np.flatnonzero(~np.isfinite(sc))[0]))}: its score is not finite")
    uniq, inverse = np.unique(gid, return_inverse=True)
    lo, hi = np.full(len(uniq), np.inf), np.full(len(uniq), -np.inf)
    np.minimum.at(lo, inverse, sc)
    np.maximum.at(hi, inverse, sc)
    flat = np.flatnonzero(lo == hi)
    if len(flat):
        members = np.flatnonzero(inverse == flat[0]).tolist()
        group = uniq[flat[0]].item()  # (a plain int / str in the message, not numpy's repr)
        who = f"rollouts {members}" if names is None else ", ".join(names[i] for i in members)
        raise ValueError(f"group {group!r}: {who} all score {lo[flat[0]]}; a ranked group needs "
                         "two different scores (it makes no pair otherwise)")
    return gid, sc


def pair_members(pair_ids, chosen) -> tuple:
    """(chosen positions [P], rejected positions [P]) of validated ``pair_ids`` / ``chosen`` ([B] each: every
    pair id held by one chosen and one rejected entry), pairs in ascending id order."""
    ids, ch = np.asarray(pair_ids), np.asarray(chosen, dtype=bool)
    order = np.lexsort((~ch, ids))  # per pair: chosen first
    return order[0::2], order[1::2]


def ranked_pairs(group_ids, scores) -> tuple:
    """(better positions [P], worse positions [P]): every ordered pair of one group whose scores differ (a group
    of K responses with distinct scores gives K (K - 1) / 2 pairs; ties give none), groups in ascending id order.
    Bradley-Terry over a ranked group trains on all of them."""
    gid, sc = np.asarray(group_ids), np.asarray(scores, dtype=np.float64)
    better, worse = [], []
    order = np.argsort(gid, kind="stable")
    bounds = np.flatnonzero(gid[order][1:] != gid[order][:-1]) + 1  # (string group ids too)
    for members in np.split(order, bounds):  # one group at a time: K x K, never B x B
        i, j = np.nonzero(sc[members][:, None] > sc[members][None, :])
        better.append(members[i])
        worse.append(members[j])
    cat = lambda parts: np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
    return cat(better), cat(worse)


def pair_loss_factors(loss: str, pi, ref, counts, chosen_pos, rejected_pos, *, n_targets: float, n_pairs: float,
                      beta: float, gamma: float = 0.0) -> tuple:
    """Per sample ([B] float64 each): ``coef_i = N dL/dpi_i`` and ``share_i = N L_p / n_p`` (its pair's loss
    over the pair's occurrences), 0 for a sample in no pair. ``pi`` / ``ref`` / ``counts`` [B]: summed target
    log-probs, summed reference log-probs, targets; ``chosen_pos`` / ``rejected_pos`` [P]: the pairs here;
    ``n_targets`` N and ``n_pairs``: the whole step's (a pair set may be part of it). A sample may be in several
    pairs (`ranked_pairs`): its factors are the sums over them."""
    if loss not in PAIR_LOSSES:
        raise ValueError(f"a pair loss is one of {PAIR_LOSSES}, got {loss!r}")
    pi, ref = np.asarray(pi, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    counts = np.asarray(counts, dtype=np.float64)
    c, r = np.asarray(chosen_pos, dtype=np.int64), np.asarray(rejected_pos, dtype=np.int64)
    if loss == "simpo":
        tc, tr = np.maximum(counts[c], 1.0), np.maximum(counts[r], 1.0)
        z = beta * (pi[c] / tc - pi[r] / tr) - gamma
        value, dz = np.logaddexp(0.0, -z), -_sigmoid(-z)
        d_c, d_r = dz * beta / tc, -dz * beta / tr
    else:
        h = (pi[c] - ref[c]) - (pi[r] - ref[r])
        if loss == "dpo":
            value, dh = np.logaddexp(0.0, -beta * h), -beta * _sigmoid(-beta * h)
        else:  # ipo
            value, dh = (h - 1.0 / (2.0 * beta)) ** 2, 2.0 * (h - 1.0 / (2.0 * beta))
        d_c, d_r = dh, -dh
    # a sample may be in several pairs (ranked groups): its factors add up over them
    coef, share = np.zeros(len(pi)), np.zeros(len(pi))
    np.add.at(coef, c, n_targets * d_c / n_pairs)
    np.add.at(coef, r, n_targets * d_r / n_pairs)
    spread = n_targets * value / (n_pairs * np.maximum(counts[c] + counts[r], 1.0))
    np.add.at(share, c, spread)
    np.add.at(share, r, spread)
    return coef, share


def pair_surrogate(logprobs: torch.Tensor, coef: torch.Tensor, share: torch.Tensor) -> torch.Tensor:
    """[M] per-occurrence surrogate ``share + coef (logp - sg(logp))`` (``coef`` / ``share`` [M]: each occurrence's
    sample's factors, `pair_loss_factors`): value ``share``, gradient ``coef``."""
    return share.to(logprobs) + coef.to(logprobs) * (logprobs - logprobs.detach())


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))
