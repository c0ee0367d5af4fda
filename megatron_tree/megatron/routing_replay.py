"""Rollout routing replay (R3) on trees: each MoE layer routes the rows it holds with the experts the
rollout engine chose, keeping the router's gradient through the gathered scores.

Megatron-Core (0.16.1 and 0.19) builds a ``RouterReplay`` per router when
``config.moe_enable_routing_replay`` is set; ``topk_routing_with_score_function`` then asks it for
the top-k instead of computing one, and in replay it returns ``scores.gather(1, indices)`` with the
given indices (the probabilities stay differentiable in the router's logits). Stock drives it with
global, per-process state (``RouterReplay.set_replay_data`` for "the" current batch, a FIFO for the
backward's recomputation). On a tree the indices must follow the rows: `install_routing_replay`
replaces each router's instance by a `TreeRouterReplay` that reads them from the microbatch itself.

* **Where the routes come from.** ``TreeMicrobatch.routes`` ``[N, moe_layers, topk]`` (route-aware
  packing: every physical row has exactly one route) rides in ``TreePackedSeqParams.routes``. A
  forward pre-hook on every decoder layer that holds an MoE layer reads the ``packed_seq_params``
  the layer is called with (Megatron hands them to every layer, on every pipeline stage, and again
  when full recomputation re-runs the layer) and gives the layer's router this rank's rows: all
  rows, or under tree CP the owned rows (``local_rows``, the GDN island view's inside an island)
  plus padding rows with a valid route, and under sequence parallelism this TP rank's slice of them.
  The routes' MoE-layer axis is global: a pipeline stage reads its own layers' columns (the layers
  before it on earlier stages counted once, at install).
* **Recomputation.** Full recomputation calls the layer module again, so the hook sets the same
  routes again. Selective MoE recomputation (``recompute_modules`` with "moe") re-runs the MoE
  layer's routing from inside the backward, without a module call: each such MoE forward pushes its
  routes on a per-layer FIFO, and a router call outside an MoE module call pops the oldest (Megatron
  runs a stage's backwards in the order of its forwards under every schedule), after checking the
  row count.
* **Missing routes are an error**, never a silent re-route: a layer called without tree params that
  carry routes, or a router called with no routes set, raises.
"""
from __future__ import annotations

from typing import Optional

import torch

from .model import unwrap_model as _unwrap
from .moe_layers import PerForward, moe_layers_of, tensor_parallel_of
from .packed_seq import TreePackedSeqParams

__all__ = ["TreeRouterReplay", "install_routing_replay", "reset_routing_replay", "local_routes", "moe_layers_of",
           "routing_replay_installed"]

# Test-only fault switch (None in normal use; also per replay object, ``TreeRouterReplay.fault``):
# "route_row_shift" replays, at every row, the routes of the row before it; "route_recompute_stale"
# replays, in a selective MoE recomputation, the routes last set by any forward instead of the FIFO's
# (the planted faults of ``megatron-tree verify --routing-replay``).
_FAULT = None


def local_routes(psp: TreePackedSeqParams) -> torch.Tensor:
    """``[n, moe_layers, topk]`` routes of the rows this rank's modules see for ``psp``: every row, or
    under tree CP the view's ``local_rows`` then ``num_local_padding`` padding rows (experts 0..k-1)."""
    r = psp.routes
    if psp.local_rows is None:
        return r
    pad = torch.arange(r.shape[2], device=r.device, dtype=r.dtype).expand(psp.num_local_padding, r.shape[1], -1)
    return torch.cat([r[psp.local_rows], pad])


class TreeRouterReplay(PerForward):
    """The replay of one router (set in place of its stock ``RouterReplay``): ``get_replay_topk`` has
    stock's signature and, as stock's replay, returns ``(scores.gather(1, indices), indices)``."""

    def __init__(self, moe_ordinal: int, tp_rank: int, tp_size: int, sequence_parallel: bool):
        # current: [n_local, topk] routes set by the layer's pre-hook (`PerForward`)
        super().__init__(tp_rank, tp_size, sequence_parallel)
        self.moe_ordinal = moe_ordinal
        self.layer_number = None
        self.fault = None

    # stock RouterReplay API parts Megatron may touch
    def clear_indices(self):
        self.current = None
        self.fifo.clear()

    def set_layer_number(self, n):
        self.layer_number = n

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        recomputation = not self.in_call  # selective MoE recomputation: the oldest pending forward's routes
        idx = self.pending()
        if recomputation and idx is not None and (self.fault or _FAULT) == "route_recompute_stale":
            idx = self.current
        if idx is None:
            raise RuntimeError(f"routing replay (MoE layer {self.moe_ordinal}): no routes for this forward. Routing "
                               "replay never re-routes: feed the model TreePackedSeqParams whose microbatch carries "
                               "routes (pack(..., route_aware=True))")
        idx = idx[self.router_rows(idx.shape[0], scores.shape[0], f"routing replay (MoE layer {self.moe_ordinal}), "
                                   "routed rows")].to(scores.device)
        if idx.shape[1] != topk:
            raise RuntimeError(f"routing replay (MoE layer {self.moe_ordinal}): routes hold top-{idx.shape[1]} but the "
                               f"router is top-{topk}")
        if (self.fault or _FAULT) == "route_row_shift":
            idx = torch.roll(idx, 1, 0)
        return scores.gather(1, idx), idx


def routing_replay_installed(model) -> bool:
    return bool(getattr(_unwrap(model), "_tree_routing_replay", None))


def _moe_layer_offset(local_count: int) -> tuple:
    """(MoE layers on earlier pipeline stages, MoE layers of the whole model or None when unknown):
    one all-gather over the PP group under pipeline parallelism, ``(0, None)`` without it."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not (dist.is_initialized() and ps.model_parallel_is_initialized()):
        return 0, None
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return 0, local_count
    if ps.get_virtual_pipeline_model_parallel_world_size() not in (None, 1):
        raise ValueError("routing replay: virtual (interleaved) pipeline stages are not supported; pass "
                         "first_moe_layer= to install_routing_replay for each model chunk")
    group = ps.get_pipeline_model_parallel_group()
    counts = [None] * dist.get_world_size(group)
    dist.all_gather_object(counts, local_count, group=group)
    return int(sum(counts[: dist.get_rank(group)])), int(sum(counts))


def install_routing_replay(model, *, first_moe_layer: Optional[int] = None) -> list:
    """Make every MoE layer of ``model`` (this pipeline stage / chunk, possibly DDP-wrapped) replay the
    routes of the rows it holds; returns the `TreeRouterReplay` objects in layer order.

    ``model`` must be built with ``config.moe_enable_routing_replay = True`` (Megatron then gives each
    router a replay hook; its stock instance is replaced and dropped from
    ``RouterReplay.global_router_replay_instances``). ``first_moe_layer``: index, in the routes'
    MoE-layer axis, of this chunk's first MoE layer (default: the MoE layers of earlier pipeline
    stages, gathered once over the PP group). Idempotent."""
    m = _unwrap(model)
    if getattr(m, "_tree_routing_replay", None):
        return m._tree_routing_replay
    if not getattr(m.config, "moe_enable_routing_replay", False):
        raise ValueError("routing replay needs the model built with config.moe_enable_routing_replay=True "
                         "(megatron-tree train --routing-replay / --tree-routing-replay set it)")
    from megatron.core.transformer.moe.router_replay import RouterReplay

    pairs = moe_layers_of(m)
    total = None
    if first_moe_layer is None:
        first_moe_layer, total = _moe_layer_offset(len(pairs))
    tp_rank, tp_size, sp = tensor_parallel_of(m)
    replays = []
    for k, (layer, moe) in enumerate(pairs):
        router = moe.router
        stock = getattr(router, "router_replay", None)
        if stock is None:
            raise ValueError(f"MoE layer {k}: its router has no router_replay (moe_enable_routing_replay was off when "
                             "it was built)")
        if stock in RouterReplay.global_router_replay_instances:
            RouterReplay.global_router_replay_instances.remove(stock)
        rep = TreeRouterReplay(first_moe_layer + k, tp_rank, tp_size, sp)
        rep.layer_number = getattr(stock, "layer_number", None)
        router.router_replay = rep
        layer.register_forward_pre_hook(_layer_pre_hook(rep, total), with_kwargs=True)
        rep.attach(moe)
        replays.append(rep)
    m._tree_routing_replay = replays
    # MoE layers of the whole model (the routes' middle axis): counted over the PP group, or from
    # first_moe_layer when the caller gave it (then this chunk is taken to be the last one)
    m.routing_replay_moe_layers = total if total is not None else first_moe_layer + len(pairs)
    return replays


def reset_routing_replay(model) -> None:
    """Drop every pending route (call before a training step: a forward whose backward never ran, e.g.
    an interrupted step, must not leave routes for the next one's recomputation)."""
    for rep in getattr(_unwrap(model), "_tree_routing_replay", None) or []:
        rep.clear_indices()


def _layer_pre_hook(rep: TreeRouterReplay, total: Optional[int]):
    def hook(module, args, kwargs):
        psp = kwargs.get("packed_seq_params")
        if not isinstance(psp, TreePackedSeqParams) or getattr(psp, "routes", None) is None:
            raise ValueError(f"routing replay (MoE layer {rep.moe_ordinal}): this forward's packed_seq_params carry no "
                             "routes. Replay never re-routes: pack with route_aware=True (records with routed_experts) "
                             "and pass tree_packed_seq_params(mb) (it carries mb.routes)")
        r = psp.routes
        if r.shape[1] <= rep.moe_ordinal or (total is not None and r.shape[1] != total):
            raise ValueError(f"routing replay: the routes hold {r.shape[1]} MoE layers but the model has "
                             f"{total if total is not None else f'at least {rep.moe_ordinal + 1}'}")
        rep.current = local_routes(psp)[:, rep.moe_ordinal]
        return None

    return hook
