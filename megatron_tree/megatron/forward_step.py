"""The tree ``forward_step_func`` for Megatron-Core's pipeline schedules.

``get_forward_backward_func()(forward_step_func=partial(tree_forward_step, loss_type=...), ...)``
over an iterator of `TreeMicrobatch`es trains a `TreeGPTModel` on trees with any schedule (no
pipelining, 1F1B, interleaved): every stage reads the microbatch, because attention visibility,
recurrences and RoPE depths are needed in every layer.

Under context parallelism (``config.context_parallel_size > 1``) an item may be ``(mb, plan)``
with a `CPPlan` made ahead (the data pipeline's ``plan_fn``), or a bare microbatch, planned here
with ``cp_strategy``. Every CP rank then runs on its owned rows; the plan's hash is compared over
the CP group first, so ranks holding different plans stop with an error instead of hanging.

GDN layout islands: for a model whose layers include Gated DeltaNet layers (and islands are on, the
default; ``model.gdn_islands = False`` turns them off), a second, GDN-friendly plan of the same
microbatch (`gdn_island_plan`) rides in the same `TreePackedSeqParams`; the model moves the hidden
states to it at each island's entry and back at its exit (`megatron_tree.megatron.model`). An item may
carry it too: ``(mb, (plan, gdn_plan))`` (what `island_plan_fn` makes for the data pipeline).
"""
from __future__ import annotations

from collections import OrderedDict
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from ..cp import PlanCache
from ..cp.planning.gdn_layout import plan_gdn_layout
from ..cp.planning.lru import lru_get
from ..cp.planning.planner import layout_key
from .carry import CARRY_EP_REFUSAL, CarryItem, carry_view, fill_loss, fill_output
from .loss import tree_loss_func
from .model import unwrap_model as _unwrap
from .moe_balance import refuse_aux_losses_under_carry
from .packed_seq import context_parallel_view, tree_packed_seq_params

__all__ = ["tree_forward_step", "carry_forward", "begin_carry_item", "carry_cp", "pending_backwards", "planned",
           "dsa_work", "context_parallel_params",
           "check_same_plan", "gdn_island_plan", "uses_gdn_islands", "island_plan_fn"]

# Plans made here (microbatches that arrive without one), shared by the pipeline stages of a process.
_PLANS = PlanCache(maxsize=16)


_GDN_PLANS: OrderedDict = OrderedDict()


def gdn_island_plan(layout, cp_size: int, attention_plan=None, **geometry):
    """The island (GDN-friendly) `CPPlan` of a microbatch: ``plan_gdn_layout(layout, cp_size,
    attention_plan=attention_plan, **geometry)``, cached per (layout, CP size, attention plan,
    geometry). ``geometry``: the model's ``gdn_island_geometry`` (``heads`` `megatron_tree.cp.GDNHeads`
    of one TP rank, ``hidden_size``, ``act_bytes``, ``gdn_layers`` per island; the planner's defaults
    for any left out). Deterministic: every rank makes the same plan from the same inputs."""
    layout = layout if layout.device.type == "cpu" else layout.to("cpu")
    key = (layout_key(layout), int(cp_size), None if attention_plan is None else attention_plan.hash,
           tuple(sorted(geometry.items())))
    return lru_get(_GDN_PLANS, key, lambda: plan_gdn_layout(layout, cp_size, attention_plan=attention_plan, **geometry))


def uses_gdn_islands(model) -> bool:
    """True when ``model`` (this pipeline stage, possibly wrapped) has GDN layout islands and they are on
    (`megatron_tree.megatron.model.TreeLanguageModelMixin.gdn_island_spans`)."""
    m = _unwrap(model)
    spans = getattr(m, "gdn_island_spans", None)
    return bool(spans) and bool(getattr(m, "gdn_islands", False))


def island_plan_fn(plan_fn, cp_size: int, geometry=None):
    """Wrap a data pipeline ``plan_fn(mb) -> CPPlan`` so it returns ``(plan, gdn_island_plan)``:
    both plans are then made ahead, off the training thread, and `tree_forward_step` takes the pair.
    ``geometry``: the model's ``gdn_island_geometry`` (what `context_parallel_params` would plan with)."""
    geometry = dict(geometry or {})

    def fn(mb):
        plan = plan_fn(mb)
        return plan, gdn_island_plan(getattr(mb, "layout", mb), cp_size, plan, **geometry)

    fn.cache = getattr(plan_fn, "cache", None)  # type: ignore[attr-defined]
    return fn


def _config_and_cp_group(model):
    m = _unwrap(model)
    cp_group = getattr(getattr(m, "pg_collection", None), "cp", None)
    if cp_group is None and m.config.context_parallel_size > 1:
        from megatron.core import parallel_state

        cp_group = parallel_state.get_context_parallel_group()
    return m.config, cp_group


def check_same_plan(plan, group) -> None:
    """Stop with a clear error unless every rank of ``group`` holds a plan with the same hash."""
    if group is None or dist.get_world_size(group) == 1:
        return
    h = torch.tensor([int(plan.hash, 16) & ((1 << 62) - 1)], dtype=torch.int64)
    lo, hi = h.clone(), h.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    if int(lo) != int(hi):
        raise RuntimeError(f"CP rank {dist.get_rank(group)} holds CP plan {plan.hash} but another rank of its CP "
                           "group holds a different plan: every CP rank must plan the same microbatch with the same "
                           "strategy, cost model and chunk size")


def dsa_work(config):
    """The DSA terms the CP planner prices for a model whose attention is DSA (`cp.DSAWork` with the
    model's top-k), None for any other model. Every plan made for a model takes them from here: the
    data pipeline's ahead of time (`train`) and those made as a microbatch runs (`planned`)."""
    if getattr(config, "experimental_attention_variant", None) != "dsa":
        return None
    from ..cp import DSAWork

    return DSAWork(topk=int(config.dsa_indexer_topk))


def planned(layout, cp: int, strategy: str = "balanced", dsa=None):
    """The `CPPlan` ``strategy`` makes on the host for ``layout`` and ``cp`` ranks (pricing ``dsa``, a
    `dsa_work`), from the plans this process made (`context_parallel_params` and `carry_cp` plan
    through it: made once per layout)."""
    return _PLANS.get_or_plan(layout if layout.device.type == "cpu" else layout.to("cpu"), cp, strategy=strategy,
                              dsa=dsa)


def _checked_plan(layout, config, cp_group, strategy: str, plan=None):
    """``plan`` (or, when None, `planned` for ``config``'s CP size and DSA work: every rank makes the
    same), checked to be for that CP size and the same on every rank of ``cp_group``."""
    cp = config.context_parallel_size
    if plan is None:
        plan = planned(layout, cp, strategy, dsa_work(config))
    if plan.cp_size != cp:
        raise ValueError(f"the CP plan is for {plan.cp_size} ranks but context_parallel_size is {cp}")
    check_same_plan(plan, cp_group)
    return plan


def context_parallel_params(psp, model, *, plan=None, strategy: str = "balanced", gdn_plan=None):
    """This rank's view of a whole-microbatch `TreePackedSeqParams` under ``model``'s CP size.

    Without CP, ``psp`` itself. Otherwise ``plan`` (or, when None, the plan ``strategy`` makes on the
    host from the layout, pricing the model's `dsa_work`; every rank makes the same one), checked to
    be the same on every CP rank, then `packed_seq.context_parallel_view` padded to the TP size under
    sequence parallelism.
    ``plan`` may be a pair ``(plan, gdn_plan)``. When the model has GDN layout islands
    (`uses_gdn_islands`), the view also carries the island plan: ``gdn_plan`` or `gdn_island_plan`
    (left out when it has the attention plan's ownership: nothing would move).
    """
    config, cp_group = _config_and_cp_group(model)
    cp = config.context_parallel_size
    if isinstance(plan, tuple):
        plan, gdn_plan = plan
    if cp == 1:
        return psp
    plan = _checked_plan(psp.layout, config, cp_group, strategy, plan)
    if uses_gdn_islands(model):
        if gdn_plan is None:
            layout = psp.layout if psp.layout.device.type == "cpu" else psp.layout.to("cpu")
            gdn_plan = gdn_island_plan(layout, cp, plan, **getattr(_unwrap(model), "gdn_island_geometry", {}))
        if gdn_plan.cp_size != cp:
            raise ValueError(f"the GDN island plan is for {gdn_plan.cp_size} ranks but context_parallel_size is {cp}")
        check_same_plan(gdn_plan, cp_group)
        if np.array_equal(gdn_plan.owner, plan.owner):
            gdn_plan = None  # the same ownership: a move would send every row to itself
    else:
        gdn_plan = None  # no islands in this stage (or turned off): GDN layers run on the attention plan
    tp = config.tensor_model_parallel_size if config.sequence_parallel else 1
    return context_parallel_view(psp, plan, cp_group.rank(), pad_to_multiple_of=tp, gdn_plan=gdn_plan)


def tree_forward_step(data_iterator, model, *, loss_type: str = "sft", clip_eps: float = 0.2, clip_eps_high=None,
                      kl_coef: float = 0.0, device=None, cp_strategy: str = "balanced", return_entropy: bool = False,
                      entropy_coef: float = 0.0, occurrence_ids=None, **loss_extras):
    """Megatron ``forward_step_func`` for `TreeMicrobatch` iterators (every stage reads the batch).

    ``return_entropy`` (implied by a nonzero ``entropy_coef``): the model also returns per-occurrence
    entropies; the loss then reports their mean (``report["entropy"]``) and adds the bonus
    ``-entropy_coef * H`` per target (`tree_loss_func`). ``loss_extras`` go to `tree_loss_func`
    (``sequence_ratios``, ``report_occurrences``: GSPO's two passes). ``occurrence_ids``: see `TreePackedSeqParams`
    (a distillation step's teacher top-k ids)."""
    item = next(data_iterator)
    if isinstance(item, CarryItem) and item.mb.carry is None:
        begin_carry_item(item, model)
        item = item.mb  # a padding microbatch of a carry step runs as usual
    if isinstance(item, CarryItem):
        return _carry_forward_step(item, model, device=device, loss_type=loss_type, clip_eps=clip_eps,
                                   clip_eps_high=clip_eps_high, kl_coef=kl_coef, return_entropy=return_entropy,
                                   entropy_coef=entropy_coef, cp_strategy=cp_strategy, occurrence_ids=occurrence_ids,
                                   **loss_extras)
    # (mb, plan), (mb, (plan, gdn_plan)), (mb, plan, gdn_plan) or a bare microbatch
    mb, plan = (item[0], item[1] if len(item) == 2 else tuple(item[1:])) if isinstance(item, tuple) else (item, None)
    dev = device if device is not None else next(model.parameters()).device
    psp = tree_packed_seq_params(mb, dev, return_entropy=bool(return_entropy or entropy_coef),
                                 occurrence_ids=occurrence_ids)
    psp = context_parallel_params(psp, model, plan=plan, strategy=cp_strategy)
    out = model(psp.input_ids.unsqueeze(0), psp.position_ids.unsqueeze(0), None, packed_seq_params=psp)
    loss_func = partial(tree_loss_func, psp.loss_map, loss_type=loss_type, clip_eps=clip_eps,
                        clip_eps_high=clip_eps_high, kl_coef=kl_coef, entropy_coef=entropy_coef, **loss_extras)
    if getattr(_unwrap(model).config, "mtp_num_layers", None):  # report each MTP depth's loss too
        from .mtp import with_mtp_report

        loss_func = partial(with_mtp_report, loss_func, psp)
    return out, loss_func


def _carry_forward_step(item, model, *, device, loss_type, clip_eps, clip_eps_high, kl_coef, return_entropy,
                        entropy_coef, cp_strategy, occurrence_ids=None, **loss_extras):
    make_loss = lambda loss_map: partial(tree_loss_func, loss_map, loss_type=loss_type, clip_eps=clip_eps,
                                         clip_eps_high=clip_eps_high, kl_coef=kl_coef, entropy_coef=entropy_coef,
                                         **loss_extras)
    return carry_forward(item, model, make_loss, device=device, return_entropy=bool(return_entropy or entropy_coef),
                         cp_strategy=cp_strategy, occurrence_ids=occurrence_ids)


def pending_backwards(model) -> int:
    """How many schedule items before the one starting now may still await their backward on this
    pipeline stage: none without pipelining; under 1F1B (Megatron's ``forward_backward_pipelining_
    without_interleaving``) stage ``r`` of ``p`` runs ``p - r - 1`` warmup forwards, then item
    ``k``'s forward follows the backward of item ``k - (p - r) ``. Interleaved (virtual) stages are
    refused: a chunk's backward order then mixes the items of two model chunks."""
    config = _unwrap(model).config
    pp = config.pipeline_model_parallel_size
    if pp == 1:
        return 0
    if getattr(config, "virtual_pipeline_model_parallel_size", None):
        raise ValueError("carry (--tree-carry) does not run with interleaved (virtual) pipeline stages: use "
                         "1F1B (no --num-layers-per-virtual-pipeline-stage)")
    group = getattr(getattr(_unwrap(model), "pg_collection", None), "pp", None)
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_pipeline_model_parallel_group()
    return pp - dist.get_rank(group) - 1


def begin_carry_item(item, model) -> int:
    """A carry schedule item (a padding one too) begins: the sync of carry groups cut over data-parallel ranks
    planned here runs (`CarryStore.exchange`), then the store releases what the items whose backward is done no
    longer need (`CarryStore.advance`). Returns the backward passes 1F1B may still owe (`pending_backwards`)."""
    pending = pending_backwards(model)
    item.store.exchange(item.position)
    item.store.advance(item.position - pending)
    return pending


def carry_cp(model, layout, strategy: str = "balanced"):
    """``(plan, group, pad_to_multiple_of, pipelined)`` of a carry microbatch under tree CP (`carry_view`'s
    ``cp``), or None without CP. The plan covers the whole layout, carried rows included (they hold
    K / V the CP attention exchanges), made here like `context_parallel_params` makes one and checked
    the same on every CP rank. Every layer kind carries under CP (GDN in heads mode), 1F1B too."""
    config, cp_group = _config_and_cp_group(model)
    cp = config.context_parallel_size
    if cp == 1:
        return None
    plan = _checked_plan(layout, config, cp_group, strategy)
    return (plan, cp_group, config.tensor_model_parallel_size if config.sequence_parallel else 1,
            config.pipeline_model_parallel_size > 1)


def carry_forward(item, model, make_loss, *, device=None, return_entropy: bool = False, logits: bool = False,
                  cp_strategy: str = "balanced", occurrence_ids=None):
    """One carry item (`megatron.carry`) through ``model``: fill (forward without autograd, state
    into the store; the schedule backpropagates a zero), or run / restore (forward with autograd and
    ``make_loss(loss_map)`` as the loss function), or keep (the forward of a restore that also fills the
    store; its output and loss function wait in the store, the schedule backpropagates a zero) and release
    (no forward: the kept output and loss function, backpropagated now). ``logits``: the model returns its own rows' logits
    (this CP rank's, under CP; no loss map) and ``make_loss`` gets the view's packed-seq params (its
    rows are ``local_rows``). Under tree CP ``cp_strategy`` plans each microbatch (`carry_cp`).
    ``occurrence_ids``: see `TreePackedSeqParams` (the view's own occurrences).
    Returns ``(output, loss_func)`` for the schedule."""
    config = _unwrap(model).config
    refuse_aux_losses_under_carry(config)
    if int(getattr(config, "expert_model_parallel_size", 1) or 1) > 1:
        raise ValueError(CARRY_EP_REFUSAL)
    pending = begin_carry_item(item, model)
    if item.phase == "release":  # no forward: the keep's output and loss function, its graph kept alive
        return item.store.kept.pop(item.mb.carry.index)
    if item.phase == "keep" and (pending or config.pipeline_model_parallel_size > 1 or config.recompute_granularity):
        raise ValueError("carry: a kept graph (keep / release) needs a schedule without pipelining and no activation "
                         "recomputation (a recomputation would write the store again): keep none there "
                         "(megatron_tree.megatron.carry.carry_items(keep=None))")
    dev = device if device is not None else next(model.parameters()).device
    psp = tree_packed_seq_params(item.mb, dev, return_entropy=return_entropy, occurrence_ids=occurrence_ids)
    psp = carry_view(psp, item.mb, item.phase, item.store, cp=carry_cp(model, item.mb.layout, cp_strategy))
    loss_map = psp.loss_map
    if logits:
        psp.loss_map = None
    if item.phase == "fill":
        with torch.no_grad():
            out = model(psp.input_ids.unsqueeze(0), psp.position_ids.unsqueeze(0), None, packed_seq_params=psp)
        return fill_output(model, out), fill_loss
    out = model(psp.input_ids.unsqueeze(0), psp.position_ids.unsqueeze(0), None, packed_seq_params=psp)
    loss_func = make_loss(psp if logits else loss_map)
    if getattr(config, "mtp_num_layers", None) and not logits:  # report each MTP depth's loss too
        from .mtp import with_mtp_report

        loss_func = partial(with_mtp_report, loss_func, psp)
    if item.phase == "keep":  # the schedule backpropagates a zero now, the kept graph at the release
        item.store.kept[item.mb.carry.index] = (out, loss_func)
        return fill_output(model, out), fill_loss
    return out, loss_func
