"""Where a model chunk's MoE layers are, and when Megatron re-runs their routing: what every per-router
extension (routing replay, MoE balancing) hooks into."""
from __future__ import annotations

import functools
import inspect
from collections import deque

import torch

__all__ = ["moe_layers_of", "mtp_moe_layers_of", "recompute_needs_training", "PerForward", "tensor_parallel_of"]


def moe_layers_of(model) -> list:
    """[(decoder layer, MoELayer)] of this model chunk (possibly DDP- / Float16Module-wrapped), in
    layer order. A decoder layer holds at most one MoE layer."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    while hasattr(model, "module"):
        model = model.module
    layers = list(getattr(getattr(model, "decoder", None), "layers", None) or [])
    out = []
    for layer in layers:
        moes = [x for x in layer.modules() if isinstance(x, MoELayer)]
        if len(moes) > 1:
            raise ValueError(f"layer {getattr(layer, 'layer_number', '?')} holds {len(moes)} MoE layers; the tree's "
                             "router extensions expect at most one per decoder layer")
        if moes:
            out.append((layer, moes[0]))
    return out


def mtp_moe_layers_of(model) -> list:
    """[(MTP layer, MoELayer)] of this model chunk's multi-token prediction block (empty without one), in
    depth order: the MTP layer module is called with each depth's ``packed_seq_params``."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    while hasattr(model, "module"):
        model = model.module
    mtp = getattr(model, "mtp", None)
    out = []
    for layer in list(getattr(mtp, "layers", None) or []):
        for moe in (x for x in layer.modules() if isinstance(x, MoELayer)):
            out.append((layer, moe))
    return out


def tensor_parallel_of(model) -> tuple:
    """``(TP rank, TP size, sequence parallel)`` of a model chunk's routers: its process groups, else
    Megatron's parallel state, else one rank."""
    while hasattr(model, "module"):
        model = model.module
    tp = getattr(getattr(model, "pg_collection", None), "tp", None)
    if tp is not None:
        rank, size = tp.rank(), tp.size()
    else:
        from megatron.core import parallel_state as ps

        rank, size = ((ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())
                      if ps.model_parallel_is_initialized() else (0, 1))
    return rank, size, bool(model.config.sequence_parallel)


@functools.lru_cache(maxsize=None)
def recompute_needs_training() -> bool:
    """True where MoELayer recomputes only in training mode (0.19: ``moe_layer_recompute and
    self.training``; 0.16.1 recomputes whenever ``moe_layer_recompute``). Feature check on the source."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    try:
        return "moe_layer_recompute and self.training" in inspect.getsource(MoELayer.forward)
    except (OSError, TypeError):  # pragma: no cover - no source: assume the stricter rule
        return True


class PerForward:
    """What one router reads for the forward in flight, under every recomputation Megatron runs.

    A pre-hook on the router's decoder (or MTP) layer sets ``current`` from the ``packed_seq_params`` the
    layer is called with (every pipeline stage; full recomputation calls the layer again). Selective MoE
    recomputation re-runs the router in the backward without an MoE module call: each such forward
    pushes ``current`` on a FIFO that the re-run pops (Megatron runs a stage's backwards in the order of
    its forwards under every schedule). `pending` is the value for a router call: ``current`` inside the
    MoE module's call, else the oldest pushed one, else None. `attach` hangs the MoE module's hooks.
    ``current`` covers this rank's rows; under sequence parallelism the router sees its TP rank's slice
    of them (`router_rows`)."""

    def __init__(self, tp_rank: int = 0, tp_size: int = 1, sequence_parallel: bool = False):
        self.tp_rank, self.tp_size, self.sp = tp_rank, tp_size, sequence_parallel
        self.current = None
        self.in_call = 0  # > 0 while the MoE module's forward runs (a module call)
        self.fifo: deque = deque()

    def router_rows(self, n: int, n_tokens: int, what: str) -> slice:
        """Which of the ``n`` rows this rank holds its router sees (``n_tokens`` of them): all, or under
        sequence parallelism this TP rank's slice. ``what`` names the values in the error."""
        if n == n_tokens:
            return slice(0, n)
        if self.sp and self.tp_size > 1 and n == n_tokens * self.tp_size:
            return slice(self.tp_rank * n_tokens, (self.tp_rank + 1) * n_tokens)
        raise RuntimeError(f"{what}: the router sees {n_tokens} tokens but the microbatch gives this rank {n} rows")

    def pending(self):
        if self.in_call:
            return self.current
        if self.fifo:
            return self.fifo.popleft()
        return None

    def attach(self, moe) -> None:
        needs_training = recompute_needs_training()

        def pre(module, args):
            self.in_call += 1
            recomputes = getattr(moe, "moe_layer_recompute", False) and (moe.training or not needs_training)
            if recomputes and torch.is_grad_enabled() and self.current is not None:
                self.fifo.append(self.current)  # this forward's routing runs again in the backward
            return None

        def post(module, args, output):
            self.in_call -= 1
            return None

        moe.register_forward_pre_hook(pre)
        moe.register_forward_hook(post)
