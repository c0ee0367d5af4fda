"""Carry microbatches through Megatron's schedules: the items, the views and the fill step.

``carry_items(microbatches)`` turns one data-parallel rank's ``pack(..., carry=True)`` microbatches
into the items of one optimizer step, in the order `cp.planning.carry.carry_phases` gives (fill or
run in step order, then the restores in reverse), sharing one `CarryStore`; hand them to
``get_forward_backward_func()`` with ``num_microbatches=len(items)`` and `tree_forward_step` does the
rest. Each item's forward first lets the store release what earlier items no longer need
(`CarryStore.advance`: an owner's state after its last reader's backward, its accumulators after its
restore's); make new items (a new store) for every step.

A carry view is the CP-style local view of the microbatch: the modules run on its own rows
(``local_rows``; input ids and depths gathered there), the loss map indexes them, and the whole
layout (carried rows included) stays visible, so the mixers place carried state by the layout's
predicate. Every tree layer kind reads carried state (attention, MLA, DSA, Gated DeltaNet, Mamba-2;
MLPs and MoE hold none; MTP depths scope their layers' keys). Under 1F1B pipelining every stage
runs the same items (its own store of its own layers' state) and releases state only once the
items 1F1B may still owe a backward (`forward_step.pending_backwards`) are past it. Under tree CP
the view is this CP rank's share of the own rows (``carry_view(..., cp=)``, `CarryCP`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ..cp.execution.carry import CarryStore, CarryView
from ..cp.planning.carry import carry_lifetimes, carry_phases
from .packed_seq import _padding, local_loss_map

__all__ = ["CARRY_EP_REFUSAL", "CarryItem", "carry_items", "carry_rank_items", "step_carry_items", "carry_view", "fill_output",
           "carry_geometry", "kept_exporters",
           "kept_graph_bytes", "default_carry_memory_gib"]


#: Why carry refuses expert parallelism (`train`, the hooks, `verify`, `rl` and `forward_step.carry_forward` say it)
CARRY_EP_REFUSAL = ("--tree-carry with expert parallelism (--expert-model-parallel-size > 1) is refused: data-parallel "
                    "ranks run different carry items at one schedule position (a fill, which runs the MoE layers "
                    "forward only, beside a reader or a padding microbatch, which also run their backward), so the "
                    "expert-parallel ranks' token all-to-alls would not pair (the step hangs); use "
                    "--expert-model-parallel-size 1 with --tree-carry")


@dataclass(frozen=True, eq=False)
class CarryItem:
    """One schedule item of a carry step: a microbatch, its phase and the step's store."""

    mb: object
    phase: str
    store: CarryStore
    position: int = -1  # in the step's schedule (`carry_phases` order)

    @property
    def num_rows(self) -> int:
        return self.mb.owned_rows


def carry_items(microbatches: list, store: CarryStore | None = None, keep=None) -> list[CarryItem]:
    """The schedule items of one rank's carry microbatches (step order) for one optimizer step. ``keep``: the
    exporters (`CarryInfo.index`, or True: all) that run once with their graph kept until their release
    (`cp.planning.carry`; no pipelining, no recomputation: `kept_exporters` chooses)."""
    store = CarryStore() if store is None else store
    microbatches = list(microbatches)
    store.microbatches = microbatches  # the step's (a tensor-parallel source hands them to its peers)
    store.keep = keep
    phases = carry_phases(microbatches, keep=keep)
    store.set_lifetimes(carry_lifetimes(microbatches, phases))  # state released after its last reader's backward
    return [CarryItem(microbatches[i], p, store, k) for k, (i, p) in enumerate(phases)]


def carry_rank_items(microbatches: list, schedule, rank: int, pad_mb, group, store: CarryStore | None = None,
                     keep=None) -> list[CarryItem]:
    """The schedule items of data-parallel rank ``rank`` when carry groups are cut over ranks: ``microbatches``
    are the whole step's (pack order), ``schedule`` their `cp.planning.carry_ranks.RankSchedule` (the same on every
    rank), ``pad_mb`` the zero-loss microbatch of its padding items, ``group`` the data-parallel process group the
    syncs run over (`CarryStore.exchange`, at the start of their item: `tree_forward_step`). ``keep``: this rank's
    exporters that keep their graph (`kept_exporters`)."""
    from ..cp.planning.carry_ranks import rank_lifetimes

    store = CarryStore() if store is None else store
    store.rank_args = (microbatches, schedule, rank, pad_mb, keep)  # what a tensor-parallel peer rebuilds them from
    schedule = schedule.with_keep(rank, keep)
    mine = [microbatches[i] for i, _ in schedule.items[rank] if i >= 0]
    store.microbatches = mine
    store.keep = {microbatches[i].carry.index for i, p in schedule.items[rank] if p == "keep"}
    store.syncs, store.dp_group, store.dp_rank = schedule.syncs, group, rank
    store.set_lifetimes(rank_lifetimes(microbatches, schedule, rank))
    return [CarryItem(microbatches[i] if i >= 0 else pad_mb, p if i >= 0 else "run", store, k)
            for k, (i, p) in enumerate(schedule.items[rank])]


def step_carry_items(step, group, keep=None, store: CarryStore | None = None) -> list[CarryItem]:
    """A `data.pipeline.TreeStep`'s carry schedule items on its rank: its groups whole (`carry_items` of
    ``step.microbatches``) or, when the pipeline cut groups over the DP ranks (``step.carry_schedule``), the rank's
    items of the common schedule, whose syncs run over the data-parallel ``group`` (`carry_rank_items`). Any
    object with ``microbatches`` (and, for cuts, the `TreeStep` carry fields) will do."""
    if getattr(step, "carry_schedule", None) is None:
        return carry_items(step.microbatches, keep=keep, store=store)
    return carry_rank_items(list(step.carry_microbatches), step.carry_schedule, step.dp_rank, step.carry_pad, group,
                            keep=keep, store=store)


def carry_view(psp, mb, phase: str, store: CarryStore, cp=None):
    """The local view of ``psp`` (the whole microbatch's `TreePackedSeqParams`) for a carry phase.

    ``cp``: ``(plan, group, pad_to_multiple_of, pipelined)`` under tree CP (`forward_step.carry_cp`): the
    plan covers the whole layout (carried rows too); the modules then run on the own rows this CP rank
    owns (padded to the TP size under sequence parallelism), and the view's `CarryCP` holds the rest
    (every rank's exported rows, the view of every own row the recurrent head shards run on)."""
    info = mb.carry
    dev = psp.layout.device
    if cp is not None:  # the view of every own row first: the recurrent layers' head shards run on it
        whole = carry_view(psp, mb, phase, store).carry
    own_np, exported, state_rows = info.own, info.exported, info.state_rows
    carry_cp, pad = None, 0
    if cp is not None:  # this rank's share; `CarryView.state` gathers every rank's exported / state rows
        from ..cp.execution.carry import CarryCP

        plan, group, multiple, pipelined = cp
        rank = dist.get_rank(group)
        carry_cp = CarryCP(plan=plan, group=group, rank=rank, whole=whole, pipelined=pipelined)
        own_np = own_np[plan.owner[own_np] == rank]
        exported, state_rows = exported[plan.owner[exported] == rank], state_rows[plan.owner[state_rows] == rank]
        pad = _padding(len(own_np), multiple)
    own = torch.from_numpy(own_np).to(dev)
    view = CarryView(phase=phase, store=store, index=info.index, own=own,
                     carried=torch.from_numpy(info.carried).to(dev), carried_keys=info.keys[info.carried],
                     carried_owner=np.asarray(info.carried_owner),
                     exported=torch.from_numpy(np.searchsorted(own_np, exported)).to(dev),
                     exported_keys=info.keys[exported],
                     state_rows=torch.from_numpy(np.searchsorted(own_np, state_rows)).to(dev),
                     state_keys=info.keys[state_rows], keys=info.keys, cp=carry_cp)
    lm = psp.loss_map
    if lm is not None:  # every occurrence's source row is owned here (pack routes it to its owner)
        if cp is not None:  # ... and under CP, the occurrences whose source row this CP rank computes
            lm = local_loss_map(lm, torch.from_numpy(plan.owner.astype(np.int64)).to(dev), own, rank)
        else:
            lm = dataclasses.replace(lm, source_rows=torch.searchsorted(own, lm.source_rows))
    extra = {} if cp is None else dict(cp_plan=plan, cp_rank=rank)
    out = dataclasses.replace(psp, loss_map=lm, local_rows=own, num_local_padding=pad, carry=view, **extra)
    out.max_seqlen_q = out.max_seqlen_kv = psp.layout.num_rows
    if cp is not None:  # Megatron's rotary table is zigzag-sliced over CP ranks: a multiple of 2 * cp
        out.max_seqlen_q = out.max_seqlen_kv = -(-psp.layout.num_rows // (2 * plan.cp_size)) * 2 * plan.cp_size
    return out


#: Activation elements a layer keeps for backward per row and hidden unit, no recomputation: Korthikanti et al.
#: count 17 (34 bytes at 2-byte activations) for fused kernels with dropout; our torch reference path keeps 22-25
#: for a GPT layer with a 4h MLP (measured on CPU, float32, saved-tensor bytes of restore items less the logits).
#: The larger figure, so that a budget errs towards a second forward rather than out of memory.
KEPT_ELEMENTS_PER_ROW = 24


def kept_graph_bytes(config):
    """``bytes(mb)``: what a carry microbatch's kept graph holds, estimated from the model's shape (``config``: a
    TransformerConfig or Megatron-LM's arguments; no profile): ``KEPT_ELEMENTS_PER_ROW`` activation elements per
    row and hidden unit per layer in the activation dtype, plus float32 logits of the targets' source rows over the
    TP rank's vocabulary."""
    layers = int(config.num_layers) + int(getattr(config, "mtp_num_layers", None) or 0)
    width = torch.finfo(getattr(config, "params_dtype", None) or torch.float32).bits // 8
    per_row = KEPT_ELEMENTS_PER_ROW * width * int(config.hidden_size) * layers
    tp = int(getattr(config, "tensor_model_parallel_size", 1) or 1)
    vocab = int(getattr(config, "padded_vocab_size", 0) or getattr(config, "vocab_size", 0) or 0)

    def nbytes(mb) -> float:
        sources = len(np.unique(mb.loss_map.source_rows.cpu().numpy())) if mb.loss_map is not None else 0
        return float(per_row * mb.owned_rows + 4 * sources * vocab / tp)

    return nbytes


def default_carry_memory_gib() -> float:
    """``--tree-carry-memory``'s default: 30% of this process's GPU memory, or 20% of the host's RAM on CPU."""
    import os

    if torch.cuda.is_available():
        return 0.3 * torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2 ** 30
    return 0.2 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30


def kept_exporters(microbatches: list, config, memory_gib: float | None) -> set:
    """The exporters of one rank's step (`CarryInfo.index`) whose graphs stay alive from keep to release within
    ``memory_gib`` (`cp.planning.carry.choose_kept` with `kept_graph_bytes`; None: `default_carry_memory_gib`, 0:
    none). None under pipelining or activation recomputation (``config``'s), where a kept graph cannot wait. The
    same on every rank that runs the same microbatches with the same flags."""
    from ..cp.planning.carry import choose_kept

    if int(getattr(config, "pipeline_model_parallel_size", 1) or 1) > 1 or getattr(config, "recompute_granularity",
                                                                                   None):
        return set()
    gib = default_carry_memory_gib() if memory_gib is None else float(memory_gib)
    if gib <= 0:
        return set()
    return choose_kept([mb for mb in microbatches if getattr(mb, "carry", None) is not None],
                       kept_graph_bytes(config), gib * 2 ** 30, remote=True)


def fill_output(model, output=None) -> torch.Tensor:
    """What a fill item hands the schedule: a zero that depends on one parameter, so Megatron's
    backward of it runs (and adds zero) without the fill forward keeping any graph.

    Under pipelining a stage before the last hands on ``output`` (its hidden states, computed without
    autograd: the next stage's fill reads them) plus that zero, and a stage after the first adds zero
    times one element of the tensor it received, so the gradient it sends back is a zero tensor of
    the right shape (every stage's backward of a fill runs and sends, as for any microbatch)."""
    from .model import unwrap_model

    m = unwrap_model(model)
    p = next(model.parameters())
    zero = p.reshape(-1)[:1].sum() * 0.0
    received = getattr(getattr(m, "decoder", None), "input_tensor", None)
    if isinstance(received, torch.Tensor) and received.requires_grad:
        zero = zero + received.reshape(-1)[:1].sum().to(zero.dtype) * 0.0
    if getattr(m, "post_process", True) or output is None:
        return zero
    return output.detach() + zero.to(output.dtype)


def fill_loss(output):
    acc = torch.float64 if output.dtype == torch.float64 else torch.float32
    zero = torch.zeros((), dtype=torch.int, device=output.device)
    return output, zero, {"lm loss": torch.zeros(2, dtype=acc, device=output.device)}


def carry_geometry(model):
    """The `cp.planning.carry.CarryGeometry` of ``model`` (this process's modules: one TP rank's heads,
    one pipeline stage's layers), for predicting the carry store (`carry_store_bytes`).

    Attention stores K and V per head group (MLA: its per-head K and V); DSA MLA's K and V and its
    indexer key; GDN its pre-conv channels and state; Mamba-2 its pre-conv ``x | B | C`` and state. Element sizes follow the parameters' dtype
    (states fp32, float64 in a float64 model)."""
    from ..cp.planning.carry import CarryGeometry
    from .attention import TreeDotProductAttention
    from .gdn import TreeGatedDeltaNet

    pattern, kv, gdn, mamba, dsa_index = [], None, None, None, None
    for m in model.modules():
        if type(m).__name__ == "TreeDSAttention":  # MLA's K / V per head, and the indexer key
            pattern.append("*" if m.skip_topk else "D")  # an IndexShare layer reuses selections: no index key
            heads = m.config.num_attention_heads // m.config.tensor_model_parallel_size
            kv = (heads, (m.k_channels + m.v_channels) / 2)
            dsa_index = m.config.dsa_indexer_head_dim
        elif isinstance(m, TreeDotProductAttention):
            pattern.append("*")
            heads = m.num_query_groups_per_partition
            if getattr(m.config, "multi_latent_attention", False):
                heads = m.num_heads_per_partition  # MLA's core attention gets K / V per head
            if m.k_channels != m.v_channels:  # K and V widths differ (MLA): count their mean width twice
                kv = (heads, (m.k_channels + m.v_channels) / 2)
            else:
                kv = (heads, m.k_channels)
        elif isinstance(m, TreeGatedDeltaNet):
            pattern.append("G")
            tp = m.tp_size
            gdn = (m.num_key_heads // tp, m.num_value_heads // tp, m.key_head_dim, m.value_head_dim)
        elif type(m).__name__ == "TreeMambaMixer":
            pattern.append("M")
            mamba = (m.nheads_local_tp, m.headdim, m.ngroups_local_tp, m.d_state)
    dtype = next(model.parameters()).dtype
    act = torch.finfo(dtype).bits // 8
    kw = {k: v for k, v in (("kv", kv), ("gdn", gdn), ("mamba", mamba), ("dsa_index", dsa_index)) if v is not None}
    return CarryGeometry("".join(pattern), act_bytes=act, state_bytes=8 if dtype == torch.float64 else 4, **kw)
