"""Model-agnostic loss helpers over a `LossMap` (pure torch).

Log-probs are gathered only at ``loss_map.source_rows``: the normaliser is computed once per
distinct source row (never M full vocabulary rows), the target logit is a scalar gather. Every
reduction uses the denominator per-sample training would use, so tree and flat losses agree.

Reductions:
  "token"  sum_e w_e * l_e / denominator, denominator defaults to M (the number of target tokens)
  "sample" mean over samples with at least one target of (sum of the sample's w_e * l_e / its count)
  "sum"    sum_e w_e * l_e
  "none"   the per-occurrence values w_e * l_e, [M] (what a caller maps back to its own layout)
Pass ``denominator`` to normalise across microbatches / DP ranks (e.g. the global token count).
"""
from __future__ import annotations

from typing import Optional

import torch

from .loss_map import LossMap

_REDUCTIONS = ("token", "sample", "sum", "none")


def gather_logprobs(logits: torch.Tensor, source_rows: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits[source_rows])[targets] -> [M], computed in float32 or wider.

    logits [N, V] (row-major per physical row); source_rows, targets [M] int64.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    rows, inverse = torch.unique(source_rows, return_inverse=True)
    work = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    lse = torch.logsumexp(work[rows], dim=-1)  # [U], U <= N distinct source rows
    return work[source_rows, targets] - lse[inverse]


def _reduce(per_occ: torch.Tensor, loss_map: LossMap, reduction: str, denominator) -> torch.Tensor:
    w = loss_map.weights.to(per_occ)
    val = per_occ * w
    if reduction == "none":
        return val
    if reduction == "sum":
        return val.sum()
    if reduction == "token":
        den = len(loss_map) if denominator is None else denominator
        return val.sum() / max(den, 1) if not torch.is_tensor(den) else val.sum() / den.clamp(min=1)
    if reduction == "sample":
        uniq, slot = loss_map.sample_slots()
        per_sample = torch.zeros(len(uniq), dtype=val.dtype, device=val.device).index_add(0, slot, val)
        counts = torch.bincount(slot, minlength=len(uniq)).to(val)
        den = len(uniq) if denominator is None else denominator
        return (per_sample / counts).sum() / (max(den, 1) if not torch.is_tensor(den) else den.clamp(min=1))
    raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")


def _require_finite(loss_map: LossMap, name: str) -> None:
    v = getattr(loss_map, name)
    bad = ~torch.isfinite(v)
    if bad.any():
        sid = int(loss_map.sample_index[bad.nonzero()[0, 0]])
        raise ValueError(f"sample {sid}: has no {name} (or a non-finite one), which policy_loss needs")


def sft_loss(logprobs: torch.Tensor, loss_map: LossMap, *, reduction: str = "token", denominator=None) -> torch.Tensor:
    """Negative log-likelihood of the targets. ``logprobs`` [M] from `gather_logprobs`."""
    return _reduce(-logprobs, loss_map, reduction, denominator)


def entropy_loss(entropy: torch.Tensor, loss_map: LossMap, *, coef: float, reduction: str = "token",
                 denominator=None) -> torch.Tensor:
    """The entropy-bonus term to add to a loss: ``-coef * reduce(w_e H_e)`` with the same weights,
    reduction and ``denominator`` as `sft_loss` / `policy_loss`. ``entropy`` [M] per occurrence
    (`megatron_tree.megatron.loss.vocab_parallel_logprobs_entropy`). Sign convention: a positive
    ``coef`` rewards entropy (the total loss is ``main - coef * mean H``)."""
    return -coef * _reduce(entropy, loss_map, reduction, denominator)


def policy_loss(logprobs: torch.Tensor, loss_map: LossMap, *, clip_eps: float | torch.Tensor = 0.2,
                clip_eps_high: float | torch.Tensor | None = None, kl_coef: float = 0.0, reduction: str = "token",
                denominator=None, sequence_ratio: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict]:
    """PPO/GRPO clipped surrogate, applied per occurrence with its own advantage and old log-prob.

    per occurrence e: r = exp(logp_e - old_e);  l_e = -min(r A_e, clip(r, 1-eps_lo, 1+eps_hi) A_e)
                      (+ kl_coef * (exp(ref_e - logp_e) - (ref_e - logp_e) - 1), the k3 estimator)
    ``clip_eps`` / ``clip_eps_high`` may be scalars or [M] tensors (per-occurrence clip ranges);
    ``clip_eps_high`` defaults to ``clip_eps``. Without old log-probs the update is on-policy
    (old = logp detached). Returns (loss, metrics) with float metrics.

    GSPO: ``sequence_ratio`` [M], each occurrence's sample's ``s_i = exp(mean_t (logp_it - old_it))`` computed
    beforehand over the whole sample (a stats pass: `rl.objectives`, the trainer), gives
    ``r = s_i exp(logp_e - sg(logp_e))``: the sample's one ratio as value, ``s_i dlogp_e`` as gradient.
    """
    if loss_map.advantages is None:
        raise ValueError("policy_loss needs advantages in the loss map (give samples an advantage)")
    _require_finite(loss_map, "advantages")
    adv = loss_map.advantages.to(logprobs)
    if loss_map.old_logprobs is not None:
        _require_finite(loss_map, "old_logprobs")
    old = logprobs.detach() if loss_map.old_logprobs is None else loss_map.old_logprobs.to(logprobs)
    lo = torch.as_tensor(clip_eps, dtype=logprobs.dtype, device=logprobs.device)
    hi = lo if clip_eps_high is None else torch.as_tensor(clip_eps_high, dtype=logprobs.dtype, device=logprobs.device)
    if sequence_ratio is None:
        log_ratio = logprobs - old
        ratio = torch.exp(log_ratio)
    else:
        seq = sequence_ratio.to(logprobs)
        ratio, log_ratio = seq * torch.exp(logprobs - logprobs.detach()), torch.log(seq)
    unclipped = ratio * adv
    clipped = torch.minimum(torch.maximum(ratio, 1 - lo), 1 + hi) * adv
    per = -torch.minimum(unclipped, clipped)
    metrics = {}
    if kl_coef:
        if loss_map.ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs in the loss map")
        _require_finite(loss_map, "ref_logprobs")
        d = loss_map.ref_logprobs.to(logprobs) - logprobs
        kl = torch.exp(d) - d - 1
        per = per + kl_coef * kl
        metrics["kl_ref"] = float(kl.detach().mean()) if len(kl) else 0.0
    loss = _reduce(per, loss_map, reduction, denominator)
    with torch.no_grad():
        n = max(len(per), 1)
        metrics.update(
            clip_fraction=float((clipped < unclipped).sum()) / n,
            approx_kl=float((0.5 * log_ratio.pow(2)).sum()) / n,
            ratio_mean=float(ratio.sum()) / n,
            num_tokens=len(per),
        )
    return loss, metrics


def value_loss(values: torch.Tensor, returns: torch.Tensor, old_values: Optional[torch.Tensor] = None,
               clip: Optional[float] = None) -> torch.Tensor:
    """[M] PPO's value loss per occurrence: ``0.5 (V - R)^2``, or with ``clip`` and ``old_values`` the clipped form
    ``0.5 max((V - R)^2, (V_old + clip(V - V_old, -clip, clip) - R)^2)`` (values kept near the rollout's)."""
    r = returns.to(values)
    loss = (values - r) ** 2
    if clip is not None:
        if old_values is None:
            raise ValueError("a clipped value loss needs the rollout's old values")
        old = old_values.to(values)
        loss = torch.maximum(loss, (old + torch.clamp(values - old, -clip, clip) - r) ** 2)
    return 0.5 * loss


def distill_loss(student: torch.Tensor, teacher: torch.Tensor, kind: str = "forward") -> torch.Tensor:
    """[M] a distillation loss per occurrence over the teacher's top-k ids: ``student`` / ``teacher`` ``[M, k]`` the
    two models' log-probs of those ids (the student's under its full-vocabulary softmax). ``forward``:
    ``KL(teacher || student)`` restricted to the top-k, ``sum_j p_T (log p_T - log p_S)``; ``reverse``:
    ``sum_j p_S (log p_S - log p_T)``. Not renormalised over the k ids: the mass outside them contributes nothing."""
    t = teacher.to(student)
    if kind == "forward":
        return (torch.exp(t) * (t - student)).sum(-1)
    if kind == "reverse":
        return (torch.exp(student) * (student - t)).sum(-1)
    raise ValueError(f"distillation kind must be 'forward' or 'reverse', got {kind!r}")


LOSS_TYPES = ("sft", "grpo", "ppo", "gspo")


class SampleValues:
    """One value per sample id (a stats pass's per-sample result, e.g. GSPO's sequence ratios): ``ids`` [S]
    int64 ascending, ``values`` [S]. ``at(sample_index [M])`` reads each occurrence's sample's value."""

    def __init__(self, ids, values):
        order = torch.argsort(torch.as_tensor(ids, dtype=torch.int64))
        self.ids = torch.as_tensor(ids, dtype=torch.int64)[order]
        self.values = torch.as_tensor(values)[order]

    def at(self, sample_index: torch.Tensor) -> torch.Tensor:
        idx = torch.searchsorted(self.ids, sample_index.cpu()).clamp(max=max(len(self.ids) - 1, 0))
        if len(self.ids) == 0 or not bool((self.ids[idx] == sample_index.cpu()).all()):
            missing = sample_index.cpu()[self.ids[idx] != sample_index.cpu()] if len(self.ids) else sample_index
            raise ValueError(f"sample {int(missing[0])}: no value from the stats pass (it saw {len(self.ids)} samples)")
        return self.values[idx]


def tree_loss(logprobs: torch.Tensor, loss_map: LossMap, *, loss_type: str = "sft", clip_eps=0.2,
              clip_eps_high=None, kl_coef: float = 0.0, entropy: Optional[torch.Tensor] = None,
              entropy_coef: float = 0.0, reduction: str = "token", denominator=None,
              sequence_ratio: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict]:
    """The loss every entry point trains with: ``loss_type`` "sft" (`sft_loss`), "grpo" / "ppo"
    (`policy_loss`: clipped surrogate plus ``kl_coef`` x k3 KL) or "gspo" (the same with each sample's
    ``sequence_ratio`` [M]), minus ``entropy_coef`` x the entropy (`entropy_loss`, needs ``entropy`` [M]),
    all with one ``reduction`` and ``denominator``. Returns (loss, metrics)."""
    if loss_type == "sft":
        loss, metrics = sft_loss(logprobs, loss_map, reduction=reduction, denominator=denominator), {}
    elif loss_type in ("grpo", "ppo", "gspo"):
        if (loss_type == "gspo") != (sequence_ratio is not None):
            raise ValueError("loss_type 'gspo' needs (and only it takes) the per-occurrence sequence_ratio of a "
                             "stats pass")
        loss, metrics = policy_loss(logprobs, loss_map, clip_eps=clip_eps, clip_eps_high=clip_eps_high,
                                    kl_coef=kl_coef, reduction=reduction, denominator=denominator,
                                    sequence_ratio=sequence_ratio)
    else:
        raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
    if entropy_coef:
        if entropy is None:
            raise ValueError("entropy_coef needs the per-occurrence entropy")
        loss = loss + entropy_loss(entropy, loss_map, coef=entropy_coef, reduction=reduction, denominator=denominator)
    return loss, metrics
