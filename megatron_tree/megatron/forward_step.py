"""The tree ``forward_step_func`` for Megatron-Core's pipeline schedules.

``get_forward_backward_func()(forward_step_func=partial(tree_forward_step, loss_type=...), ...)``
over an iterator of `TreeMicrobatch`es trains a `TreeGPTModel` on trees with any schedule (no
pipelining, 1F1B, interleaved): every stage reads the microbatch, because attention visibility,
recurrences and RoPE depths are needed in every layer.
"""
from __future__ import annotations

from functools import partial

from .loss import tree_loss_func
from .packed_seq import tree_packed_seq_params

__all__ = ["tree_forward_step"]


def tree_forward_step(data_iterator, model, *, loss_type: str = "sft", clip_eps: float = 0.2, clip_eps_high=None,
                      kl_coef: float = 0.0, device=None):
    """Megatron ``forward_step_func`` for `TreeMicrobatch` iterators (every stage reads the batch)."""
    mb = next(data_iterator)
    dev = device if device is not None else next(model.parameters()).device
    psp = tree_packed_seq_params(mb, dev)
    layout = psp.layout
    out = model(layout.input_ids.unsqueeze(0), layout.position_ids.unsqueeze(0), None, packed_seq_params=psp)
    return out, partial(tree_loss_func, psp.loss_map, loss_type=loss_type, clip_eps=clip_eps,
                        clip_eps_high=clip_eps_high, kl_coef=kl_coef)
