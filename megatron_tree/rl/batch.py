"""Rollout batches in, per-rollout tensors out: the pieces of `megatron_tree.rl`.

Conventions (the same as `tree.Sample`'s): a per-token value at index t belongs to token t *as a
target*, predicted from token t-1; ``loss_mask[t]`` marks token t as a target (index 0 never is).
In the padded layout every per-token tensor is ``[B, T]`` and aligned with ``input_ids``: column j
of row b is token j of that row, real tokens are the one contiguous run ``attention_mask[b]``
marks (left and/or right padding), and outputs come back in the same columns.

Loss normalisation is Megatron's per-token convention: the loss function returns the sum of the
per-occurrence losses and their count, and with ``calculate_per_token_loss=True`` Megatron-Core
divides the gradients by the target count summed over microbatches and DP ranks (exactly the mean
over every target of the global batch, as unpacked per-rollout training computes it).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ..tree.loss import LOSS_TYPES as LOSSES, tree_loss
from ..tree.sample import Sample, validate_sample
from ..tree.token_fields import TokenTable
from .fields import as_numpy as _np, check_ranked_groups, check_teacher_topk, check_token_values, validate_pairs

__all__ = ["RolloutBatch", "RankMicrobatches", "RolloutOutputs", "build_microbatches", "forward_backward",
           "per_occurrence_loss"]

# Test-only fault switch (None in normal use): "column_shift" puts every value one column to the
# right in `RolloutOutputs.to_padded`, which tests/test_rl.py must catch.
_FAULT = None
_FLOAT_FIELDS = {"advantage": "advantages", "old_logprobs": "old_logprobs", "ref_logprobs": "ref_logprobs"}




def _row(x, i):
    """Rollout i's entry of a per-rollout field (a sequence of scalars / arrays, an array, a tensor)."""
    if x is None:
        return None
    v = x[i]
    return _np(v)


# --------------------------------------------------------------------------------------------- batch
@dataclass
class RolloutBatch:
    """The rollouts of one actor step, one `tree.Sample` each (index = the caller's rollout index).

    ``starts`` / ``width``: for a batch made by `from_padded`, the column of each rollout's first
    token and the padded width T, so outputs can go back to the same columns; None for lists.
    """

    samples: list
    starts: Optional[np.ndarray] = None
    width: Optional[int] = None
    #: preference pairs (``loss="dpo" / "ipo" / "simpo"``): each rollout's pair id, and whether it is the chosen one
    pair_ids: Optional[np.ndarray] = None
    chosen: Optional[np.ndarray] = None
    #: ranked groups (``loss="rm"`` and the pair losses, in place of pairs): each rollout's group and score; every
    #: two rollouts of a group with different scores are a pair (`tree.pair_loss.ranked_pairs`)
    group_ids: Optional[np.ndarray] = None
    scores: Optional[np.ndarray] = None
    #: value models (``loss="value"``): per rollout, one return (and old value) per token, aligned with its tokens
    returns: Optional[list] = None
    old_values: Optional[list] = None
    #: distillation (``loss="distill"``): per rollout, a teacher's top-k next-token ids and log-probs per token,
    #: ``[L, k]`` each (row t: the teacher's distribution for target t, predicted from token t-1)
    teacher_topk_ids: Optional[list] = None
    teacher_topk_logprobs: Optional[list] = None
    #: vision-language rollouts: the `data.images.VisionInput` holding their images' pixels (each rollout's
    #: ``Sample.images`` name them by content); `build_microbatches` attaches each microbatch's image slots
    vision: Optional[object] = None

    def __post_init__(self):

        self.pair_ids, self.chosen = validate_pairs(self.pair_ids, self.chosen, len(self.samples))
        self.group_ids, self.scores = check_ranked_groups(self.group_ids, self.scores, len(self.samples),
                                                          has_pairs=self.pair_ids is not None)
        self.returns = check_token_values("returns", self.returns, self.samples)
        self.old_values = check_token_values("old_values", self.old_values, self.samples)
        self.teacher_topk_ids, self.teacher_topk_logprobs = check_teacher_topk(
            self.teacher_topk_ids, self.teacher_topk_logprobs, self.samples)

    def reward_positions(self, pad_token: int = 0) -> "RolloutBatch":
        """The batch a reward model scores (``loss="rm"``): each rollout followed by ``pad_token`` as its one target,
        so its one occurrence's source row is the rollout's last row (the state a reward model reads); pairs and
        ranked groups kept, per-token fields dropped. The extra token is a leaf row per rollout: it changes no other row."""
        samples = []
        for s in self.samples:
            mask = np.zeros(len(s) + 1, dtype=bool)
            mask[-1] = True
            samples.append(Sample(tokens=np.append(s.tokens, pad_token), loss_mask=mask, images=s.images))
        return RolloutBatch(samples, pair_ids=self.pair_ids, chosen=self.chosen, group_ids=self.group_ids,
                            scores=self.scores, vision=self.vision)

    def per_occurrence(self, name: str, loss_map) -> torch.Tensor:
        """[M] (``returns`` / ``old_values``) or [M, k] (``teacher_topk_ids`` / ``teacher_topk_logprobs``) of
        ``loss_map``'s occurrences (rollout ``sample_index``, token ``positions``; `tree.token_fields.TokenTable`)."""
        cache = self.__dict__.setdefault("_token_tables", {})
        if name not in cache:
            rows = getattr(self, name)
            if rows is None:
                raise ValueError(f"this RolloutBatch has no {name}: give {name}= to RolloutBatch.from_lists / "
                                 "from_padded")
            cache[name] = TokenTable(name, rows)
        return cache[name].at(loss_map)

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def lengths(self) -> np.ndarray:
        return np.array([len(s) for s in self.samples], dtype=np.int64)

    @functools.cached_property
    def target_counts(self) -> np.ndarray:
        """[B] int64 targets (loss-masked positions) of each rollout, counted once per batch: the sequence
        objectives and aggregations read it several times a step (a batch's samples are not changed after)."""
        return np.array([int(s.target_mask().sum()) for s in self.samples], dtype=np.int64)

    def float_fields(self) -> tuple:
        """The optional loss-map fields some rollout carries ("advantages", "old_logprobs", "ref_logprobs")."""
        return tuple(lm for f, lm in _FLOAT_FIELDS.items() if any(getattr(s, f) is not None for s in self.samples))

    @classmethod
    def from_lists(cls, tokens: Sequence, *, loss_mask=None, advantages=None, old_logprobs=None, ref_logprobs=None,
                   weights=None, routed_experts=None, pair_ids=None, chosen=None, returns=None,
                   old_values=None, teacher_topk_ids=None, teacher_topk_logprobs=None, group_ids=None,
                   scores=None, images=None, vision=None) -> "RolloutBatch":
        """Per-rollout token lists (lists, arrays or tensors); every other field is per rollout too:
        ``loss_mask`` / ``old_logprobs`` / ``ref_logprobs`` one value per token, ``advantages`` /
        ``weights`` a scalar or one value per token (or a ``[B]`` array of scalars),
        ``routed_experts`` ``[L, moe_layers, topk]`` expert ids per token (routing replay: what the
        rollout engine returned), ``pair_ids`` / ``chosen`` ``[B]`` (preference pairs: one chosen and one
        rejected rollout per pair id), ``returns`` / ``old_values`` one value per token (value models:
        ``loss="value"``), ``teacher_topk_ids`` / ``teacher_topk_logprobs`` ``[L, k]`` per rollout (``loss="distill"``),
        ``group_ids`` / ``scores`` ``[B]`` (ranked groups: every two rollouts of a group with different scores a pair),
        ``images`` per rollout a list of its images in order of appearance (``(pixel_values, grid_thw)`` as the rollout
        engine processed them, encoded bytes, or paths) read by ``vision`` (`data.images.VisionInput`: the model's
        placeholder token, merge size and image processor), which matches them with the rollout's placeholder runs.
        A bad rollout is a ValueError naming it (``rollout i``) and the rule it breaks."""
        samples = []
        for i in range(len(tokens)):
            s = Sample(tokens=_np(tokens[i]), loss_mask=_row(loss_mask, i), advantage=_row(advantages, i),
                       old_logprobs=_row(old_logprobs, i), ref_logprobs=_row(ref_logprobs, i), weight=_row(weights, i),
                       routed_experts=_row(routed_experts, i), images=_image_refs(vision, images, i, tokens[i]))
            validate_sample(i, s, where=f"rollout {i}")
            samples.append(s)
        return cls(samples, pair_ids=_np(pair_ids), chosen=_np(chosen), group_ids=_np(group_ids), scores=_np(scores),
                   vision=vision,
                   returns=None if returns is None else [_row(returns, i) for i in range(len(tokens))],
                   old_values=None if old_values is None else [_row(old_values, i) for i in range(len(tokens))],
                   teacher_topk_ids=None if teacher_topk_ids is None else [_row(teacher_topk_ids, i)
                                                                           for i in range(len(tokens))],
                   teacher_topk_logprobs=None if teacher_topk_logprobs is None else [
                       _row(teacher_topk_logprobs, i) for i in range(len(tokens))])

    @classmethod
    def from_padded(cls, input_ids, attention_mask, *, loss_mask=None, advantages=None, old_logprobs=None,
                    ref_logprobs=None, weights=None, routed_experts=None, pair_ids=None,
                    chosen=None, returns=None, old_values=None, teacher_topk_ids=None, teacher_topk_logprobs=None,
                    group_ids=None, scores=None, images=None, vision=None) -> "RolloutBatch":
        """Padded ``[B, T]`` tensors: ``attention_mask`` marks each row's real tokens (one contiguous
        run: left and/or right padding); ``loss_mask``, ``old_logprobs``, ``ref_logprobs`` are
        ``[B, T]`` aligned with ``input_ids`` (a response-only tensor is padded on the left by the
        prompt columns first); ``advantages`` / ``weights`` ``[B]`` or ``[B, T]``; ``routed_experts``
        ``[B, T, moe_layers, topk]``; ``pair_ids`` / ``chosen`` / ``group_ids`` / ``scores`` ``[B]``; ``returns`` /
        ``old_values`` ``[B, T]``; ``teacher_topk_ids`` / ``teacher_topk_logprobs`` ``[B, T, k]``; ``images`` /
        ``vision`` as `from_lists` (positions are the rollout's own, padding removed)."""
        ids, am = _np(input_ids), _np(attention_mask).astype(bool)
        if ids.ndim != 2 or am.shape != ids.shape:
            raise ValueError(f"input_ids and attention_mask must both be [B, T], got {ids.shape} and {am.shape}")
        B, T = ids.shape
        n = am.sum(1)
        start = am.argmax(1)
        cols = np.arange(T)
        inside = (cols >= start[:, None]) & (cols < (start + n)[:, None])
        bad = np.flatnonzero(((inside != am).any(1)) | (n == 0))
        if len(bad):
            b = int(bad[0])
            raise ValueError(f"rollout {b}: attention_mask must mark one non-empty contiguous run of tokens "
                             f"(left and/or right padding), got {am[b].astype(int).tolist()}")
        lm = None if loss_mask is None else _np(loss_mask).astype(bool)
        if lm is not None:
            outside = np.flatnonzero((lm & ~am).any(1))
            if len(outside):
                raise ValueError(f"rollout {int(outside[0])}: loss_mask marks a padding column (attention_mask 0)")

        def cut(x, b):
            if x is None:
                return None
            x = _np(x)
            return x[b] if x.ndim == 1 else x[b, start[b]:start[b] + n[b]]

        samples = []
        for b in range(B):
            toks = ids[b, start[b]:start[b] + n[b]]
            s = Sample(tokens=toks, loss_mask=cut(lm, b), advantage=cut(advantages, b),
                       old_logprobs=cut(old_logprobs, b), ref_logprobs=cut(ref_logprobs, b), weight=cut(weights, b),
                       routed_experts=cut(routed_experts, b), images=_image_refs(vision, images, b, toks))
            validate_sample(b, s, where=f"rollout {b}")
            samples.append(s)
        return cls(samples, starts=start.astype(np.int64), width=int(T), pair_ids=_np(pair_ids), chosen=_np(chosen),
                   vision=vision,
                   group_ids=_np(group_ids), scores=_np(scores),
                   returns=None if returns is None else [cut(returns, b) for b in range(B)],
                   old_values=None if old_values is None else [cut(old_values, b) for b in range(B)],
                   teacher_topk_ids=None if teacher_topk_ids is None else [cut(teacher_topk_ids, b) for b in range(B)],
                   teacher_topk_logprobs=None if teacher_topk_logprobs is None else [
                       cut(teacher_topk_logprobs, b) for b in range(B)])


@dataclass
class RankMicrobatches:
    """This rank's tree microbatches (`TreeMicrobatch`es whose ``loss_map.sample_index`` /
    ``sample_ids`` are rollout indices of ``batch``), and which rollouts they hold."""

    batch: RolloutBatch
    microbatches: list
    rollout_ids: np.ndarray
    max_tokens_per_mb: int
    carry: bool = False  # ``build_microbatches(..., carry=True)``: `forward_backward` runs carry items
    dp_size: int = 1  # > 1: ``batch`` is the global batch, sharded over DP ranks by `build_microbatches`
    # carry groups cut over the DP ranks (``carry_cut``): every rank's schedule (`cp.planning.carry_ranks`), the
    # whole batch's microbatches it indexes, the padding microbatch of its padding items, this rank; else None
    carry_schedule: object = None
    carry_microbatches: tuple = ()
    carry_pad: object = None
    dp_rank: int = 0

    def __len__(self) -> int:
        return len(self.microbatches)


def _image_refs(vision, images, i: int, tokens):
    """Rollout ``i``'s `tree.images.ImageRef`s (None without ``vision``): its images matched with its placeholders."""
    if vision is None:
        if images is not None:
            raise ValueError("images need vision= (a megatron_tree.data.images.VisionInput: the model's image token, "
                             "merge size and processor)")
        return None
    return vision.refs(f"rollout {i}", _np(tokens), [] if images is None else list(images[i] or []), None)


def _with_pixels(batch, mbs: list) -> list:
    """``mbs`` with their image slots' pixels (vision-language rollouts), else unchanged."""
    return mbs if batch.vision is None else [batch.vision.attach(mb) for mb in mbs]


def _renumber(mb, ids: np.ndarray):
    """``mb`` (packed from a sub-list) with its sample indices mapped to rollout indices ``ids``
    (ascending, so the loss map's order and ``sample_ids``' order are kept)."""
    lm = mb.loss_map
    idx = torch.as_tensor(ids, dtype=torch.int64)
    extra = {}
    if getattr(mb, "carry", None) is not None:
        paths = tuple(int(ids[i]) for i in mb._path_ids)
        extra = dict(_path_ids=paths, carry=dataclasses.replace(mb.carry, path_sample_ids=paths))
    return dataclasses.replace(mb, loss_map=dataclasses.replace(lm, sample_index=idx[lm.sample_index]),
                               sample_ids=tuple(int(ids[i]) for i in mb.sample_ids), **extra)


def _dp_group():
    try:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            return ps.get_data_parallel_group()
    except ImportError:
        pass
    return None


def build_microbatches(batch: RolloutBatch, max_tokens_per_mb: int, *, dp_rank: int = 0, dp_size: int = 1,
                       pad_to_multiple_of: int = 8, share_prefixes: bool = True, vocab_size: Optional[int] = None,
                       equalize: bool = True, route_spec=None, carry: bool = False,
                       carry_cut: str = "auto") -> RankMicrobatches:
    """Pack ``batch`` into prefix-tree microbatches of at most ``max_tokens_per_mb`` rows and keep DP
    rank ``dp_rank``'s share.

    ``dp_size == 1`` (default): the batch is this rank's already (a framework that shards its batch
    over DP itself). ``dp_size > 1``: ``batch`` is the global batch, identical on every DP rank; the
    microbatches are balanced over the DP ranks by predicted cost (`data.sharding.balance`). A
    rollout longer than the budget runs alone in a microbatch of its own length (rounded up to
    ``pad_to_multiple_of``): never dropped, never truncated; tree CP splits such a microbatch's rows
    like any other. With ``equalize`` and Megatron's parallel state initialised, every DP rank ends
    with the same microbatch count (padding microbatches: zero loss, zero gradient), which the MoE
    all-to-all and pipeline schedules need.

    Routing replay: when the rollouts carry ``routed_experts`` (every one must), rows are shared only
    where tokens and routes agree and each microbatch carries its rows' routes (``route_spec``, a
    `tree.routes.RouteSpec`, checks them against the model); the model must be built with
    ``moe_enable_routing_replay=True`` and `megatron.routing_replay.install_routing_replay` applied.

    ``carry``: every row of the batch computed once at this budget (``pack(..., carry=True)``, `tree.carry`):
    a rollout longer than the budget is cut into microbatches that read its earlier rows' layer state
    instead of running alone; the microbatches linked by carry stay on one DP rank unless ``carry_cut`` cuts a
    group over several (`tree.carry.assign_carry_ranks`: "auto" cuts one over a rank's share of the rows, "never",
    "always"; their carried state then crosses ranks at syncs, not under pipelining), and `forward_backward` runs
    them as carry items (fill / run / restore, `megatron.carry`). Equalized by schedule items.
    """
    from ..data.sharding import balance, microbatch_cost
    from ..tree import pack, padding_microbatch

    budget, pad = int(max_tokens_per_mb), int(pad_to_multiple_of)
    if budget < 1 or pad < 1 or budget % pad:
        raise ValueError(f"max_tokens_per_mb ({budget}) must be a positive multiple of pad_to_multiple_of ({pad})")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} is outside 0..{dp_size - 1}")
    from ..tree.routes import routes_shape

    lens = batch.lengths
    shape = routes_shape(batch.samples)
    routed = shape is not None
    if routed:
        missing = [i for i, s in enumerate(batch.samples) if s.routed_experts is None]
        if missing:
            raise ValueError(f"rollout {missing[0]}: has no routed_experts while others do: routing replay needs the "
                             "routes of every rollout (one without would be re-routed, not replayed)")
    kw = dict(pad_to_multiple_of=pad, vocab_size=vocab_size, route_aware=routed, route_spec=route_spec)
    if carry:
        return _build_carry(batch, budget, pad, dp_rank, dp_size, equalize, shape, kw, carry_cut)
    normal, long = np.flatnonzero(lens <= budget), np.flatnonzero(lens > budget)
    mbs = []
    if len(normal):
        mbs += [_renumber(mb, normal) for mb in pack([batch.samples[i] for i in normal], budget,
                                                     share_prefixes=share_prefixes, **kw)]
    for i in long.tolist():  # alone, in a microbatch of its own length
        own = -(-int(lens[i]) // pad) * pad
        mbs += [_renumber(mb, np.array([i])) for mb in pack([batch.samples[i]], own, **kw)]
    per_rank = -(-len(mbs) // dp_size)
    mine = [mbs[j] for j in balance([microbatch_cost(mb) for mb in mbs], dp_size, max(per_rank, 1))[dp_rank]] \
        if mbs else []
    count = _most_over_dp(max(len(mine), 1), equalize)
    mine += [padding_microbatch(budget, num_rows=pad, float_fields=batch.float_fields(), route_shape=shape)
             for _ in range(count - len(mine))]
    ids = np.array(sorted(i for mb in mine for i in mb.sample_ids), dtype=np.int64)
    return RankMicrobatches(batch=batch, microbatches=_with_pixels(batch, mine), rollout_ids=ids,
                            max_tokens_per_mb=budget, dp_size=dp_size)


def _most_over_dp(count: int, equalize: bool) -> int:
    """The largest ``count`` over the DP ranks (with ``equalize`` and Megatron's parallel state), else ``count``."""
    group = _dp_group() if equalize else None
    if group is not None and dist.get_world_size(group) > 1:
        dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        c = torch.tensor([count], dtype=torch.int64, device=dev)
        dist.all_reduce(c, op=dist.ReduceOp.MAX, group=group)
        count = int(c)
    return count


def _build_carry(batch, budget, pad, dp_rank, dp_size, equalize, shape, kw, cut) -> RankMicrobatches:
    from ..cp.planning.carry_ranks import PAD, rank_schedule
    from ..tree import pack, padding_microbatch
    from ..tree.carry import assign_carry_ranks

    ids = np.arange(len(batch.samples))
    mbs = [_renumber(mb, ids) for mb in pack(batch.samples, budget, carry=True, **kw)] if len(ids) else []
    mbs = _with_pixels(batch, mbs)
    ranks = assign_carry_ranks(mbs, dp_size, cut=cut) if mbs else [[] for _ in range(dp_size)]
    mine = [mbs[j] for j in ranks[dp_rank]]
    schedule = rank_schedule(mbs, ranks) if mbs and dp_size > 1 else None
    if schedule is not None and schedule.syncs:  # the same items on every rank by construction (the same batch)
        pad_mb = padding_microbatch(budget, num_rows=pad, float_fields=batch.float_fields(), route_shape=shape)
        mine += [pad_mb] * sum(p == PAD for _, p in schedule.items[dp_rank])
        done = np.array(sorted(i for mb in mine for i in mb.sample_ids), dtype=np.int64)
        return RankMicrobatches(batch=batch, microbatches=mine, rollout_ids=done, max_tokens_per_mb=budget, carry=True,
                                dp_size=dp_size, carry_schedule=schedule, carry_microbatches=tuple(mbs),
                                carry_pad=pad_mb, dp_rank=dp_rank)
    # schedule items (`carry_items`: an exporting microbatch is a fill and a restore)
    count = _most_over_dp(max(sum(1 + (len(mb.carry.exported) > 0) for mb in mine), 1), equalize)
    have = sum(1 + (len(mb.carry.exported) > 0) for mb in mine)
    mine += [padding_microbatch(budget, num_rows=pad, float_fields=batch.float_fields(), route_shape=shape)
             for _ in range(count - have)]
    done = np.array(sorted(i for mb in mine for i in mb.sample_ids), dtype=np.int64)
    return RankMicrobatches(batch=batch, microbatches=mine, rollout_ids=done, max_tokens_per_mb=budget, carry=True,
                            dp_size=dp_size)


# --------------------------------------------------------------------------------------------- loss
def per_occurrence_loss(logprobs: torch.Tensor, entropy: torch.Tensor, loss_map, *, loss: str = "sft",
                        clip_eps: float = 0.2, clip_eps_high=None, kl_coef: float = 0.0,
                        entropy_coef: float = 0.0) -> tuple[torch.Tensor, dict]:
    """Our losses per occurrence, weighted, before normalisation: ``[M]`` whose sum is
    `megatron.loss.tree_loss_func`'s ``loss_sum`` (sft: ``-w logp``; grpo / ppo: the clipped
    surrogate plus ``kl_coef`` x k3 KL; both minus ``entropy_coef`` x ``w H``), and the metrics."""
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES} or a loss_fn, got {loss!r}")
    return tree_loss(logprobs, loss_map, loss_type=loss, clip_eps=clip_eps, clip_eps_high=clip_eps_high,
                     kl_coef=kl_coef, entropy=entropy, entropy_coef=entropy_coef, reduction="none")


def _loss_func(loss_map, output, *, loss, loss_fn, loss_kwargs, agg=None):
    lp, ent, *at_ids = output  # (a distillation step also has the log-probs at the teacher's ids)
    if loss_fn is not None:
        per = loss_fn(lp, ent, loss_map, *at_ids)
        if not torch.is_tensor(per) or per.shape != lp.shape:
            raise ValueError(f"loss_fn must return one loss per occurrence, shape {tuple(lp.shape)}, got "
                             f"{getattr(per, 'shape', type(per))}")
    else:
        per, _ = per_occurrence_loss(lp, ent, loss_map, loss=loss, **loss_kwargs)
    if agg is not None:  # the loss aggregation's per-rollout factor (`rl.objectives.agg_factors`)
        per = per * agg.to(per.device)[loss_map.sample_index.to(per.device)].to(per)
    loss_sum = per.sum()
    num = torch.tensor(len(loss_map), dtype=torch.int, device=lp.device)
    acc = torch.float64 if lp.dtype == torch.float64 else torch.float32
    report = {"lm loss": torch.stack([loss_sum.detach().to(acc), num.to(acc)]),
              "entropy": torch.stack([ent.detach().sum().to(acc), num.to(acc)]),
              "occurrences": {"sample_index": loss_map.sample_index.cpu(), "positions": loss_map.positions.cpu(),
                              "logprobs": lp.detach().double().cpu(), "entropy": ent.detach().double().cpu(),
                              "loss": per.detach().double().cpu()}}
    return loss_sum, num, report


def _forward_step(data_iterator, model, *, cp_strategy: str, loss, loss_fn, loss_kwargs, agg=None,
                  occurrence_ids=None):
    from ..megatron.carry import CarryItem
    from ..megatron.forward_step import begin_carry_item, carry_forward, context_parallel_params
    from ..megatron.packed_seq import tree_packed_seq_params

    mb = next(data_iterator)
    if isinstance(mb, CarryItem):
        if mb.mb.carry is not None:
            return carry_forward(mb, model, lambda lm: partial(_loss_func, lm, loss=loss, loss_fn=loss_fn,
                                                               loss_kwargs=loss_kwargs, agg=agg), return_entropy=True,
                                 cp_strategy=cp_strategy, occurrence_ids=occurrence_ids)
        begin_carry_item(mb, model)  # a sync of carry groups cut over DP ranks may begin here
        mb = mb.mb  # a padding microbatch
    dev = next(model.parameters()).device
    psp = context_parallel_params(tree_packed_seq_params(mb, dev, return_entropy=True, occurrence_ids=occurrence_ids),
                                  model, strategy=cp_strategy)
    out = model(psp.input_ids.unsqueeze(0), psp.position_ids.unsqueeze(0), None, packed_seq_params=psp)
    return out, partial(_loss_func, psp.loss_map, loss=loss, loss_fn=loss_fn, loss_kwargs=loss_kwargs, agg=agg)


def forward_backward(model, microbatches: RankMicrobatches, *, loss="sft", loss_fn: Optional[Callable] = None,
                     forward_only: bool = False, entropy_coef: float = 0.0, clip_eps: float = 0.2, clip_eps_high=None,
                     kl_coef: float = 0.0, cp_strategy: str = "balanced", loss_agg: str = "token-mean",
                     loss_agg_norm: Optional[float] = None, beta: float = 0.1,
                     simpo_gamma: float = 0.5, value_clip: Optional[float] = None,
                     distill_kl: str = "forward", carry_memory_gib: Optional[float] = None) -> "RolloutOutputs":
    """One forward(-backward) of this rank's microbatches through Megatron-Core's schedule.

    ``model``: this rank's model chunk (a `TreeGPTModel` / `TreeMambaModel`, possibly wrapped in DDP /
    Float16Module) or the list of virtual-pipeline chunks; the config needs
    ``calculate_per_token_loss=True`` and ``variable_seq_lengths=True`` to train. ``loss``: "sft",
    "grpo" or "ppo" (`per_occurrence_loss` with ``clip_eps``, ``clip_eps_high``, ``kl_coef``,
    ``entropy_coef``), or ``loss_fn(logprobs [M], entropy [M], loss_map) -> [M]`` per-occurrence
    losses (differentiable; ``loss_map`` carries ``advantages``, ``old_logprobs``, ``ref_logprobs``,
    ``weights``, ``sample_index`` = rollout index, ``positions``). ``forward_only``: no backward, under
    ``torch.no_grad()`` (old / reference log-probs). Gradients are left in the model's grad buffers
    (DDP: call ``finalize_model_grads`` / the optimizer as usual; Megatron's schedule calls the
    config's ``finalize_model_grads_func``). Returns `RolloutOutputs` on every rank of the model-parallel
    group (gathered over CP, sent from the last pipeline stage).

    Sequence-level objectives (`rl.objectives`, exact however carry / CP / DP cut a rollout; one extra
    forward-only pass gives each rollout's sums first): ``"gspo"`` (sequence ratio, ``clip_eps`` /
    ``clip_eps_high``, with the k3 KL and entropy terms), and over preference pairs (``RolloutBatch``
    ``pair_ids`` / ``chosen``) ``"dpo"``, ``"ipo"`` (``beta``) and ``"simpo"`` (``beta``, ``simpo_gamma``),
    the mean over pairs. ``loss_agg`` (`tree.loss_agg`: token-mean, seq-mean-token-sum,
    seq-mean-token-mean, seq-mean-token-sum-norm with ``loss_agg_norm``) weighs every rollout's
    per-occurrence losses (a ``loss_fn``'s too) by its exact factor over the whole step.

    Value models (`megatron.value_head.add_value_head`: the model returns each occurrence's value ``V(s_t)``
    where a policy returns its log-prob): ``loss="value"`` trains PPO's value loss against the batch's
    ``returns`` (`tree.loss.value_loss`; clipped around its ``old_values`` with ``value_clip``), and the
    outputs hold ``"values"`` (``per_rollout("values")``) in place of ``"logprobs"``. ``loss="rm"`` trains a
    reward model (the same head) with Bradley-Terry over the batch's preference pairs, on microbatches built from
    `RolloutBatch.reward_positions` (each rollout's reward is its value at its last row).

    Distillation (``loss="distill"``): the batch's ``teacher_topk_ids`` / ``teacher_topk_logprobs`` per target;
    the model returns its log-probs at those ids (vocab-parallel, `TreePackedSeqParams.occurrence_ids`) and
    trains `tree.loss.distill_loss` (``distill_kl`` "forward" or "reverse", over the teacher's top-k), the mean
    over every target of the step.

    Carry (``build_microbatches(..., carry=True)``): an exporting microbatch whose graph fits ``carry_memory_gib``
    (`megatron.carry.kept_exporters`; None: 30% of the GPU, 20% of RAM on CPU; 0: none) runs one forward and keeps
    its graph until its readers' backward are done; the others fill and restore (two forwards).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from ..megatron.model import unwrap_model

    chunks = model if isinstance(model, (list, tuple)) else [model]
    inner = unwrap_model(chunks[0])
    if not forward_only and not getattr(inner.config, "calculate_per_token_loss", False):
        raise ValueError("rl.forward_backward trains with Megatron's per-token loss: build the model's config with "
                         "calculate_per_token_loss=True")
    if callable(loss) and loss_fn is None:
        loss, loss_fn = None, loss
    kw = dict(clip_eps=clip_eps, clip_eps_high=clip_eps_high, kl_coef=kl_coef, entropy_coef=entropy_coef)
    from .objectives import PAIR_LOSSES, SEQUENCE_LOSSES, agg_factors, sequence_loss_fn

    from ..megatron.value_head import value_head_of

    value_model = value_head_of(chunks[-1]) is not None
    occurrence_ids = None
    if loss == "distill":
        if kl_coef or entropy_coef:
            raise ValueError("loss='distill' trains toward a teacher's top-k: kl_coef / entropy_coef do not apply")
        batch = microbatches.batch
        if batch.teacher_topk_ids is None:
            raise ValueError("loss='distill' needs RolloutBatch teacher_topk_ids and teacher_topk_logprobs")
        occurrence_ids = partial(batch.per_occurrence, "teacher_topk_ids")
        loss, loss_fn = None, _distill_loss_fn(batch, distill_kl)
    elif loss == "value":
        if kl_coef or entropy_coef:
            raise ValueError("loss='value' trains a value model: kl_coef / entropy_coef do not apply")
        if ps.is_pipeline_last_stage() and not value_model:
            raise ValueError("loss='value' needs a value model: megatron_tree.megatron.value_head.add_value_head(model) "
                             "before wrapping it")
        loss, loss_fn = None, _value_loss_fn(microbatches.batch, value_clip)
    elif value_model and loss not in ("sft", "rm") and not forward_only:
        raise ValueError(f"a value model trains with loss='value' (a critic) or 'rm' (a reward model), not {loss!r}")
    elif loss == "rm" and ps.is_pipeline_last_stage() and not value_model:
        raise ValueError("loss='rm' needs a reward model: megatron_tree.megatron.value_head.add_value_head(model) "
                         "before wrapping it")
    if loss in PAIR_LOSSES and loss_agg != "token-mean":
        raise ValueError(f"loss {loss!r} is the mean over preference pairs; loss_agg={loss_agg!r} does not apply")
    agg = None
    if loss_agg != "token-mean" or loss_agg_norm is not None:
        agg = torch.as_tensor(agg_factors(microbatches, loss_agg, loss_agg_norm, _dp_group()))
    if loss in SEQUENCE_LOSSES and loss_fn is None:
        # the stats pass: every rollout's log-probs, then the graded pass with per-rollout factors fixed
        stats = forward_backward(model, microbatches, forward_only=True, cp_strategy=cp_strategy,
                                 carry_memory_gib=carry_memory_gib)
        loss_fn = sequence_loss_fn(loss, microbatches, stats, _dp_group(), beta=beta, simpo_gamma=simpo_gamma, **kw)
        loss = None
    step = partial(_forward_step, cp_strategy=cp_strategy, loss=loss, loss_fn=loss_fn, loss_kwargs=kw, agg=agg,
                   occurrence_ids=occurrence_ids)
    mbs = microbatches.microbatches
    if any(getattr(mb, "routes", None) is not None for mb in mbs):
        from ..megatron.routing_replay import reset_routing_replay

        for c in chunks:  # no route left over from an earlier forward whose backward never ran
            reset_routing_replay(c)
    if getattr(microbatches, "carry", False):  # fill / run, then the restores, one store (`megatron.carry`)
        from ..megatron.carry import carry_items, carry_rank_items, kept_exporters

        keep = kept_exporters(list(mbs), inner.config, carry_memory_gib)
        if microbatches.carry_schedule is None:
            mbs = carry_items(list(mbs), keep=keep)
        elif int(inner.config.pipeline_model_parallel_size) > 1:
            raise ValueError("carry groups cut over DP ranks do not run under pipelining (a sync needs every earlier "
                             "item's backward done): build_microbatches(..., carry_cut='never')")
        else:
            mbs = carry_rank_items(list(microbatches.carry_microbatches), microbatches.carry_schedule,
                                   microbatches.dp_rank, microbatches.carry_pad, _dp_group(), keep=keep)
    data = [iter(list(mbs)) for _ in chunks] if len(chunks) > 1 else iter(list(mbs))
    with torch.no_grad() if forward_only else contextlib.nullcontext():
        reports = get_forward_backward_func()(
            forward_step_func=step, data_iterator=data, model=list(chunks), num_microbatches=len(mbs),
            seq_length=max(mb.num_rows for mb in mbs), micro_batch_size=1, forward_only=forward_only)
    keys = ("sample_index", "positions", "logprobs", "entropy", "loss")
    occ = [r.pop("occurrences") for r in reports if "occurrences" in r]
    part = {k: torch.cat([o[k] for o in occ]).numpy() if occ else np.zeros(0) for k in keys}
    if value_model:  # (the last stage: the values came back where a policy's log-probs do)
        part["values"] = part.pop("logprobs")
    keys = tuple(part)
    if ps.get_context_parallel_world_size() > 1:  # every CP rank computed its own occurrences
        parts = [None] * ps.get_context_parallel_world_size()
        dist.all_gather_object(parts, part, group=ps.get_context_parallel_group())
        part = {k: np.concatenate([p[k] for p in parts]) for k in keys}
    if getattr(microbatches, "carry_schedule", None) is not None:  # a rollout's rows may have been computed on
        parts = [None] * microbatches.dp_size  # several DP ranks: each keeps its own rollouts' occurrences
        dist.all_gather_object(parts, part, group=_dp_group())
        mine = np.isin(np.concatenate([p["sample_index"] for p in parts]).astype(np.int64), microbatches.rollout_ids)
        part = {k: np.concatenate([p[k] for p in parts])[mine] for k in keys}
    if ps.get_pipeline_model_parallel_world_size() > 1:  # only the last stage has them
        box = [part]
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                   group=ps.get_pipeline_model_parallel_group())
        part = box[0]
    return RolloutOutputs(microbatches.batch, microbatches.rollout_ids, part, reports)


def _distill_loss_fn(batch: RolloutBatch, kind: str):
    """``loss_fn`` of ``loss="distill"``: `tree.loss.distill_loss` of the student's log-probs at the teacher's top-k
    ids (the model's third output) against the teacher's."""
    from ..tree.loss import distill_loss

    distill_loss(torch.zeros(1, 1), torch.zeros(1, 1), kind)  # an unknown kind is refused before any forward

    def distill_fn(logprobs, entropy, loss_map, at_ids=None):
        if at_ids is None:
            raise RuntimeError("loss='distill': the model returned no log-probs at the teacher's ids")
        return distill_loss(at_ids, batch.per_occurrence("teacher_topk_logprobs", loss_map).to(at_ids.device), kind)

    return distill_fn


def _value_loss_fn(batch: RolloutBatch, clip: Optional[float]):
    """``loss_fn`` of ``loss="value"``: `tree.loss.value_loss` of each occurrence's value against its return (and
    old value, clipped)."""
    from ..tree.loss import value_loss

    def value_fn(values, entropy, loss_map):
        returns = batch.per_occurrence("returns", loss_map).to(values.device)
        old = None if clip is None else batch.per_occurrence("old_values", loss_map).to(values.device)
        return value_loss(values, returns, old, clip)

    return value_fn


# --------------------------------------------------------------------------------------------- outputs
@dataclass
class RolloutOutputs:
    """Per-occurrence results of this rank's rollouts, in the caller's layouts.

    ``values``: ``sample_index`` (rollout), ``positions`` (target index t), ``logprobs``,
    ``entropy`` (nats) and ``loss`` (the per-occurrence weighted loss, before normalisation), sorted
    by (rollout, position). ``reports``: the schedule's loss reports (``"lm loss"``, ``"entropy"``:
    ``[sum, count]`` per microbatch).
    """

    batch: RolloutBatch
    rollout_ids: np.ndarray
    values: dict
    reports: list = field(default_factory=list)

    def __post_init__(self):
        sidx = self.values["sample_index"].astype(np.int64)
        pos = self.values["positions"].astype(np.int64)
        order = np.lexsort((pos, sidx))
        self.values = {k: (v[order].astype(np.int64) if k in ("sample_index", "positions") else v[order])
                       for k, v in self.values.items()}
        want = [np.flatnonzero(self.batch.samples[i].target_mask()) for i in self.rollout_ids.tolist()]
        counts = np.array([len(w) for w in want], dtype=np.int64)
        exp_pos = np.concatenate(want) if want else np.zeros(0, np.int64)
        exp_sidx = np.repeat(self.rollout_ids, counts)
        if not (np.array_equal(self.values["sample_index"], exp_sidx) and np.array_equal(self.values["positions"],
                                                                                          exp_pos)):
            raise RuntimeError(f"rl: {len(order)} occurrences came back for {len(exp_pos)} targets of this rank's "
                               "rollouts, or not one per (rollout, target)")

    def per_rollout(self, name: str) -> list:
        """``[B]``: for each rollout this rank ran, a float64 array aligned with its target tokens
        (ascending positions); None for the rollouts of other DP ranks."""
        sidx, vals = self.values["sample_index"], self.values[name]
        out = [None] * len(self.batch)
        bounds = np.searchsorted(sidx, self.rollout_ids, side="left"), np.searchsorted(sidx, self.rollout_ids,
                                                                                         side="right")
        for i, a, b in zip(self.rollout_ids.tolist(), *bounds):
            out[i] = vals[a:b]
        return out

    def to_padded(self, name: str, *, fill: float = 0.0, dtype=torch.float32) -> torch.Tensor:
        """``[B, T]`` with the value of target t of rollout b at its column (``starts[b] + t`` for a
        `RolloutBatch.from_padded` batch, ``t`` for lists, T = the longest rollout), ``fill``
        elsewhere (non-targets, padding, rollouts of other DP ranks)."""
        B = len(self.batch)
        starts = self.batch.starts if self.batch.starts is not None else np.zeros(B, dtype=np.int64)
        width = self.batch.width if self.batch.width is not None else int(self.batch.lengths.max(initial=0))
        out = np.full((B, width), fill, dtype=np.float64)
        sidx = self.values["sample_index"]
        cols = starts[sidx] + self.values["positions"]
        if _FAULT == "column_shift":
            cols = np.minimum(cols + 1, width - 1)
        out[sidx, cols] = self.values[name]
        return torch.as_tensor(out, dtype=dtype)

    def padded_mask(self) -> torch.Tensor:
        """``[B, T]`` bool: where `to_padded` put a value."""
        return ~torch.isnan(self.to_padded("logprobs", fill=float("nan"), dtype=torch.float64))
