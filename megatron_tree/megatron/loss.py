"""Per-occurrence log-probs under tensor parallelism, and Megatron ``loss_func``s for trees.

The output layer runs only on the distinct source rows U of the loss map (never on M occurrence
rows, never on rows that predict nothing). `vocab_parallel_logprobs` turns the vocab-sharded logits
of those rows into one log-prob per occurrence with two small all-reduces; its backward is the
closed form  d logp_e / d z_u = [e's row is u] (onehot(target_e) - softmax(z_u)), computed locally
on every rank (the per-occurrence gradient is identical on all TP ranks).

Loss normalisation follows Megatron's per-token convention: ``loss_func`` returns
``(loss_sum, num_tokens, report)``; with ``calculate_per_token_loss=True`` Megatron all-reduces
``num_tokens`` over DP x CP and divides gradients by it, which is exactly per-sample token-mean
training over the global batch.

Entropy (`vocab_parallel_logprobs_entropy`): the entropy of the next-token distribution of every
occurrence, ``H(z_u) = lse(z_u) - sum_v p_v z_v``, computed once per distinct source row u with the
same two all-reduces (max, then the sums of ``exp``, ``exp * z`` and the target logits together:
no vocabulary all-gather, no ``[M, vocab]`` tensor) and indexed per occurrence. Its backward is
``dH/dz_u = -p (z_u - lse + H)``, local on every rank, and the gradients of the occurrences of a
shared row are summed per row before that (float32 or wider).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..tree.loss import tree_loss
from ..tree.loss_map import LossMap
from ..tree.pair_loss import PAIR_LOSSES, pair_surrogate


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, inverse, targets, vocab_start, group):
        z = logits if logits.dtype == torch.float64 else logits.float()
        Vl = z.shape[-1]
        m = z.max(dim=-1).values
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        sumexp = torch.exp(z - m.unsqueeze(-1)).sum(-1)
        local_t = targets - vocab_start
        in_range = (local_t >= 0) & (local_t < Vl)
        tz = torch.where(in_range, z[inverse, local_t.clamp(0, Vl - 1)], torch.zeros((), dtype=z.dtype, device=z.device))
        if group is not None and dist.get_world_size(group) > 1:
            buf = torch.cat([sumexp, tz])
            dist.all_reduce(buf, group=group)
            sumexp, tz = buf[: sumexp.numel()], buf[sumexp.numel():]
        lse = m + torch.log(sumexp)
        ctx.save_for_backward(z, lse, inverse, local_t, in_range)
        ctx.in_dtype = logits.dtype
        return tz - lse[inverse]

    @staticmethod
    def backward(ctx, g):
        z, lse, inverse, local_t, in_range = ctx.saved_tensors
        g = g.to(z.dtype)
        gsum = torch.zeros(z.shape[0], dtype=z.dtype, device=z.device).index_add_(0, inverse, g)
        grad = -gsum.unsqueeze(-1) * torch.exp(z - lse.unsqueeze(-1))
        grad.index_put_((inverse[in_range], local_t[in_range]), g[in_range], accumulate=True)
        return grad.to(ctx.in_dtype), None, None, None, None


# Test-only fault switch (None in normal use): "entropy_row_shift" reads each occurrence's entropy
# from the next distinct source row (a row off by one), which the entropy tests must catch;
# "gspo_one_microbatch" takes each sample's GSPO statistic from the first microbatch holding it
# (`gspo_sequence_ratios`), which verify --loss gspo must catch where a sample is cut.
_FAULT = None


class _VocabParallelLogprobsEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, inverse, targets, vocab_start, group):
        z = logits if logits.dtype == torch.float64 else logits.float()
        Vl = z.shape[-1]
        tp = group is not None and dist.get_world_size(group) > 1
        m = z.max(dim=-1).values
        if tp:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        zm = z - m.unsqueeze(-1)
        e = torch.exp(zm)
        sumexp = e.sum(-1)
        sez = e.mul_(zm).sum(-1)  # sum_v exp(z_v - m) (z_v - m): H = log S - sez / S (two [U, V] temporaries)
        del e, zm
        local_t = targets - vocab_start
        in_range = (local_t >= 0) & (local_t < Vl)
        tz = torch.where(in_range, z[inverse, local_t.clamp(0, Vl - 1)], torch.zeros((), dtype=z.dtype, device=z.device))
        if tp:
            U = sumexp.numel()
            buf = torch.cat([sumexp, sez, tz])
            dist.all_reduce(buf, group=group)
            sumexp, sez, tz = buf[:U], buf[U:2 * U], buf[2 * U:]
        log_s = torch.log(sumexp)
        lse = m + log_s
        ent = log_s - sez / sumexp  # [U]
        ctx.save_for_backward(z, lse, ent, inverse, local_t, in_range)
        ctx.in_dtype = logits.dtype
        ctx.set_materialize_grads(False)  # an entropy only logged (detached) costs no backward work
        rows = inverse
        if _FAULT == "entropy_row_shift":
            rows = (inverse + 1) % max(ent.numel(), 1)
        return tz - lse[inverse], ent[rows]

    @staticmethod
    def backward(ctx, g, g_ent):
        z, lse, ent, inverse, local_t, in_range = ctx.saved_tensors
        U = z.shape[0]
        zeros = lambda: torch.zeros(U, dtype=z.dtype, device=z.device)  # noqa: E731
        gsum = zeros() if g is None else zeros().index_add_(0, inverse, g.to(z.dtype))
        # d logp_e / dz = onehot - p ;  d H_u / dz = -p (log p + H_u)   (two [U, V] temporaries)
        logp = z - lse.unsqueeze(-1)
        p = torch.exp(logp)
        if g_ent is None:
            coef = gsum.unsqueeze(-1)
        else:
            hsum = zeros().index_add_(0, inverse, g_ent.to(z.dtype))
            coef = logp.add_(ent.unsqueeze(-1)).mul_(hsum.unsqueeze(-1)).add_(gsum.unsqueeze(-1))
        grad = p.mul_(coef).neg_()
        if g is not None:
            grad.index_put_((inverse[in_range], local_t[in_range]), g.to(z.dtype)[in_range], accumulate=True)
        return grad.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_logprobs_entropy(logits: torch.Tensor, inverse: torch.Tensor, targets: torch.Tensor, *,
                                    vocab_start: int = 0, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp [M], entropy [M])``: `vocab_parallel_logprobs` and, per occurrence e, the entropy
    ``-sum_v p_v log p_v`` of ``softmax(full-vocab logits[inverse[e]])`` (in nats), both differentiable.

    Computed on the ``U`` distinct rows of ``logits`` (this rank's vocab shard ``[U, V_local]``) with
    two all-reduces over ``group`` (the TP group, or None), then indexed by ``inverse``; float64 for
    float64 logits, float32 for any other dtype. Identical on every TP rank.
    """
    return _VocabParallelLogprobsEntropy.apply(logits, inverse, targets, vocab_start, group)


def vocab_parallel_logprobs(logits: torch.Tensor, inverse: torch.Tensor, targets: torch.Tensor, *,
                            vocab_start: int = 0, group=None) -> torch.Tensor:
    """logp[e] = log softmax(full-vocab logits[inverse[e]])[targets[e]] -> [M].

    The result is float64 for float64 logits and float32 for any other dtype (upcast first).

    logits [U, V_local] (this rank's vocab shard starting at ``vocab_start``), inverse [M] row of
    each occurrence in ``logits``, targets [M] global token ids, group the TP group (or None).
    """
    return _VocabParallelLogprobs.apply(logits, inverse, targets, vocab_start, group)


@torch.no_grad()
def vocab_parallel_topk(logits: torch.Tensor, k: int, *, vocab_start: int = 0,
                        group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [U, k] int64, logp [U, k])``: the ``k`` most likely next tokens of each row of the
    vocab-sharded ``logits [U, V_local]`` (this rank's shard, starting at ``vocab_start``) and their
    log-probs under the full-vocabulary softmax, in descending order, identical on every TP rank.

    No ``[U, vocab]`` tensor is gathered: each rank takes its shard's top ``min(k, V_local)`` and the
    shard's max and sum of ``exp``; one all-gather of the ``U x k`` candidates per rank and two small
    all-reduces (max, then the sum) over ``group`` (the TP group, or None) give the global top ``k`` and
    the log-normaliser. float64 for float64 logits, float32 otherwise. Forward only (scoring)."""
    z = logits.double() if logits.dtype == torch.float64 else logits.float()
    n, v_local = z.shape
    world = 1 if group is None else dist.get_world_size(group)
    if not 0 < k <= v_local * world:
        raise ValueError(f"top-k {k} must be between 1 and the vocabulary size {v_local * world}")
    m = z.max(dim=-1).values if n else z.new_zeros(0)
    if world > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    s = torch.exp(z - m[:, None]).sum(dim=-1)
    if world > 1:
        dist.all_reduce(s, group=group)
    lse = m + torch.log(s)
    kk = min(k, v_local)
    vals, idx = z.topk(kk, dim=-1)
    idx = idx + vocab_start
    if world > 1:
        all_vals = [torch.empty_like(vals) for _ in range(world)]
        all_idx = [torch.empty_like(idx) for _ in range(world)]
        dist.all_gather(all_vals, vals.contiguous(), group=group)
        dist.all_gather(all_idx, idx.contiguous(), group=group)
        vals, idx = torch.cat(all_vals, dim=-1), torch.cat(all_idx, dim=-1)
        vals, pick = vals.topk(k, dim=-1)
        idx = idx.gather(-1, pick)
    return idx, vals - lse[:, None]


def tree_loss_func(loss_map: LossMap, logprobs, *, loss_type: str = "sft", clip_eps: float = 0.2,
                   clip_eps_high=None, kl_coef: float = 0.0, entropy_coef: float = 0.0, sequence_ratios=None,
                   pair_factors=None, token_fields=None, value_clip=None, distill_kl: str = "forward",
                   report_occurrences: bool = False):
    """Megatron ``loss_func`` body: returns ``(loss_sum, num_tokens, report)``.

    ``logprobs``: the model's output, ``[M]`` per-occurrence log-probs or ``(logprobs, entropy)``
    (a model run with ``TreePackedSeqParams.return_entropy``). ``loss_sum`` is the sum over this
    microbatch's occurrences (weighted); Megatron divides by the global token count when
    ``calculate_per_token_loss=True``.

    ``entropy_coef`` (needs the entropy): an entropy bonus. Sign convention: ``loss -= entropy_coef *
    sum_e w_e H_e``, reduced like the main loss (the same weights and the same global per-token
    denominator), so a positive coefficient raises the entropy and a negative one lowers it.
    ``report["entropy"]`` is ``[sum_e H_e, M]`` whenever the entropy is there (Megatron-LM logs the
    ratio, the mean entropy per target token).

    ``loss_type="gspo"`` takes ``sequence_ratios`` (`tree.loss.SampleValues`: each sample's ratio from a stats
    pass, `gspo_sequence_ratios`). A pair loss (``"dpo"``, ``"ipo"``, ``"simpo"``) takes ``pair_factors``, the
    (coef, share) `tree.loss.SampleValues` of `tree.pair_loss.pair_loss_factors` from a stats pass, and
    trains `tree.pair_loss.pair_surrogate` (unweighted: a pair's loss is a function of its sums).
    A value model (`megatron.value_head`: its output is each occurrence's value where a policy's is its log-prob):
    ``loss_type="value"`` trains `tree.loss.value_loss` against ``token_fields["returns"]`` (clipped around
    ``token_fields["old_values"]`` with ``value_clip``), weighted; ``"rm"`` (a reward model, one occurrence per sample at
    its last row) trains Bradley-Terry through ``pair_factors`` as the pair losses do. ``loss_type="distill"``: the
    output's third entry is the student's log-probs at the teacher's top-k ids (`TreePackedSeqParams.occurrence_ids`),
    trained by `tree.loss.distill_loss` (``distill_kl``) against ``token_fields["teacher_topk_logprobs"]``, weighted.
    ``token_fields``: name -> `tree.token_fields.TokenTable` of the step's samples.
    ``report_occurrences``: ``report["occurrences"]`` holds every occurrence's ``sample_index``, ``logprobs``
    and, where the data has old log-probs, ``logprobs - old_logprobs`` (``log_ratio``): what a stats pass reads.
    """
    entropy, at_ids = None, None
    if isinstance(logprobs, (tuple, list)):
        logprobs, entropy, *rest = logprobs
        at_ids = rest[0] if rest else None
    if entropy_coef and entropy is None:
        raise ValueError("entropy_coef needs the per-occurrence entropy: run the model with "
                         "TreePackedSeqParams(return_entropy=True) (tree_forward_step(..., return_entropy=True))")
    if loss_type in PAIR_LOSSES + ("rm",):
        if pair_factors is None or kl_coef or entropy_coef:
            raise ValueError(f"loss_type {loss_type!r} needs the pair factors of a stats pass and takes no KL or "
                             "entropy term")
        coef, share = (v.at(loss_map.sample_index).to(logprobs.device) for v in pair_factors)
        loss_sum, metrics = pair_surrogate(logprobs, coef, share).sum(), {}
    elif loss_type in TOKEN_FIELD_LOSSES:
        loss_sum, metrics = (_token_field_loss(loss_type, loss_map, logprobs, at_ids, token_fields, value_clip,
                                               distill_kl) * loss_map.weights.to(logprobs)).sum(), {}
    else:
        seq = None if sequence_ratios is None else sequence_ratios.at(loss_map.sample_index).to(logprobs.device)
        loss_sum, metrics = tree_loss(logprobs, loss_map, loss_type=loss_type, clip_eps=clip_eps,
                                      clip_eps_high=clip_eps_high, kl_coef=kl_coef, entropy=entropy,
                                      entropy_coef=entropy_coef, reduction="sum", sequence_ratio=seq)
    num_tokens = torch.tensor(len(loss_map), dtype=torch.int, device=logprobs.device)
    acc = torch.float64 if loss_sum.dtype == torch.float64 else torch.float32
    report = {"lm loss": torch.stack([loss_sum.detach().clone().to(acc), num_tokens.to(acc)])}
    if entropy is not None:
        report["entropy"] = torch.stack([entropy.detach().sum().to(acc), num_tokens.to(acc)])
    for k, v in metrics.items():
        if k != "num_tokens":
            report[k] = torch.tensor([v * len(loss_map), float(len(loss_map))], device=logprobs.device)
    if report_occurrences:
        occ = {"sample_index": loss_map.sample_index.cpu(), "logprobs": logprobs.detach().double().cpu()}
        if loss_map.old_logprobs is not None:
            occ["log_ratio"] = (logprobs.detach() - loss_map.old_logprobs.to(logprobs)).double().cpu()
        report["occurrences"] = occ
    return loss_sum, num_tokens, report


#: losses of per-token record fields (`tree.token_fields`) rather than of the targets' log-probs
TOKEN_FIELD_LOSSES = ("value", "distill")


def _token_field_loss(loss_type, loss_map, output, at_ids, token_fields, value_clip, distill_kl) -> torch.Tensor:
    """[M] unweighted per-occurrence loss of a value model (``output`` = values) or a distillation step (``at_ids``:
    the student's log-probs at the teacher's ids)."""
    from ..tree.loss import distill_loss, value_loss

    if token_fields is None:
        raise ValueError(f"loss_type {loss_type!r} reads per-token record fields: pass token_fields")
    if loss_type == "value":
        old = token_fields["old_values"].at(loss_map) if value_clip is not None else None
        return value_loss(output, token_fields["returns"].at(loss_map).to(output.device),
                          None if old is None else old.to(output.device), value_clip)
    if at_ids is None:
        raise RuntimeError("loss_type 'distill': the model returned no log-probs at the teacher's ids (run it with "
                           "TreePackedSeqParams.occurrence_ids)")
    return distill_loss(at_ids, token_fields["teacher_topk_logprobs"].at(loss_map).to(at_ids.device), distill_kl)


def sample_sum_groups() -> dict:
    """The groups `gather_sample_sums` (and `gspo_sequence_ratios`) gather a step's per-sample sums over, from
    Megatron's parallel state: ``groups`` (DP x CP), ``src_group`` / ``src_rank`` (the PP group and its last stage,
    or None without PP)."""
    from megatron.core import parallel_state as ps

    pp = ps.get_pipeline_model_parallel_group() if ps.get_pipeline_model_parallel_world_size() > 1 else None
    return dict(groups=[ps.get_data_parallel_group(with_context_parallel=True)], src_group=pp,
                src_rank=ps.get_pipeline_model_parallel_last_rank())


def gather_sample_sums(reports: list, field: str, groups: list, src_group=None, src_rank: int = 0) -> tuple:
    """(ids [S], sums [S] float64, counts [S]) per sample of the step: the stats pass's per-occurrence ``field``
    ("logprobs" or "log_ratio") of this rank's reports (made with ``report_occurrences``), gathered over
    ``groups`` (the DP x CP group: each rank holds part of the step's occurrences, a sample's possibly cut over
    microbatches and CP ranks), then sent from the last pipeline stage over ``src_group`` (the PP group; only
    that stage has reports). The same on every rank."""
    import numpy as np
    import torch.distributed as dist

    occ = [r["occurrences"] for r in reports if "occurrences" in r]
    if occ and field not in occ[0]:
        raise ValueError("a GSPO stats pass needs old_logprobs in the data (each sample's mean log-ratio)"
                         if field == "log_ratio" else f"the stats pass reported no {field!r}")
    if _FAULT == "gspo_one_microbatch":  # planted: a sample's statistic from the first microbatch holding it
        seen, kept = set(), []
        for o in occ:
            keep = torch.tensor([int(i) not in seen for i in o["sample_index"].tolist()], dtype=torch.bool)
            kept.append({k: v[keep] for k, v in o.items()})
            seen.update(o["sample_index"].tolist())
        occ = kept
    sid = torch.cat([o["sample_index"] for o in occ]).numpy() if occ else np.zeros(0, np.int64)
    val = torch.cat([o[field] for o in occ]).numpy() if occ else np.zeros(0)
    part = (sid, val)
    for g in groups:
        if g is not None and dist.get_world_size(g) > 1:
            parts = [None] * dist.get_world_size(g)
            dist.all_gather_object(parts, part, group=g)
            part = (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
    if src_group is not None and dist.get_world_size(src_group) > 1:
        box = [part]
        dist.broadcast_object_list(box, src=src_rank, group=src_group)
        part = box[0]
    ids, inverse = np.unique(part[0], return_inverse=True)
    return ids, np.bincount(inverse, weights=part[1], minlength=len(ids)), np.bincount(inverse, minlength=len(ids))


def gspo_sequence_ratios(reports: list, groups: list, src_group=None, src_rank: int = 0):
    """GSPO's per-sample ratio ``exp(mean_t (logp_t - old_t))`` from a stats pass's reports, gathered as
    `gather_sample_sums` does. Returns `tree.loss.SampleValues` on every rank."""
    import numpy as np

    from ..tree.loss import SampleValues

    ids, sums, counts = gather_sample_sums(reports, "log_ratio", groups, src_group, src_rank)
    return SampleValues(ids, torch.as_tensor(np.exp(sums / np.maximum(counts, 1))))
