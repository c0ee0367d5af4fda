"""Where a model chunk's MoE layers are, and when Megatron re-runs their routing: what every per-router
extension (routing replay, MoE balancing) hooks into."""
from __future__ import annotations

import functools
import inspect

__all__ = ["moe_layers_of", "mtp_moe_layers_of", "recompute_needs_training"]


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


@functools.lru_cache(maxsize=None)
def recompute_needs_training() -> bool:
    """True where MoELayer recomputes only in training mode (0.19: ``moe_layer_recompute and
    self.training``; 0.16.1 recomputes whenever ``moe_layer_recompute``). Feature check on the source."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    try:
        return "moe_layer_recompute and self.training" in inspect.getsource(MoELayer.forward)
    except (OSError, TypeError):  # pragma: no cover - no source: assume the stricter rule
        return True
