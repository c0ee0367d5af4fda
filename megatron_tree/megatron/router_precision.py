"""Stock's MoE route scoring at the model's precision when that is wider than float32.

Megatron-Core scores routes in float32 whatever the model's dtype: ``topk_routing_with_score_function``
and ``compute_routing_scores_for_aux_loss`` (``moe_utils``) call ``torch.softmax(..., dtype=torch.float32)``
and ``torch.sigmoid(logits.float())`` (0.19 also ``softplus(logits.float())`` and ``expert_bias.float()``).
In a float64 run this rounds every routing probability to float32, in the forward and the backward, so
two float64 computations of the same routes that differ in the last bit of a logit (a tree row against
the flat token it stands for, whose logits are summed in another order) can differ by float32's unit
roundoff: ~1e-7 in the router gradients, 1e-10..1e-9 after the model's other terms. That is float32
noise, not a property of either side, and it hides every real difference below it.

Stock's router gating (``router_gating_linear``) likewise computes the logits in float32 when a config
sets ``moe_router_dtype="fp32"`` (Megatron-Bridge's DeepSeek-V3 provider does).

`widen_router_scores` runs stock's own functions (its code, unchanged) at float64 for float64 input:
while a scoring function runs on float64 logits, ``moe_utils``' ``torch.float32`` reads float64 and
``Tensor.float()`` keeps a float64 tensor as it is; the gating's float32 ``router_dtype`` reads float64.
Float32 or narrower input, and the fused TE kernels, run stock's functions exactly as they are
(bitwise: the wrappers only call through). `megatron-tree verify` and the tests turn it on in float64
for both sides (the stock reference and the tree), which makes their MoE checks exact to float64
rounding; training never turns it on.
"""
from __future__ import annotations

import contextlib
import functools

import torch

__all__ = ["widen_router_scores"]

_NAMES = ("topk_routing_with_score_function", "compute_routing_scores_for_aux_loss")
_STATE = {"on": False, "active": False}


class _Float32IsFloat64:
    """Stands for the ``torch`` module inside ``moe_utils`` while a widened call runs."""

    def __getattr__(self, name):
        return torch.float64 if name == "float32" else getattr(torch, name)


_ORIGINAL_FLOAT = torch.Tensor.float


def _float_keeping_float64(self, *args, **kwargs):
    if self.dtype == torch.float64:
        return self
    return _ORIGINAL_FLOAT(self, *args, **kwargs)


@contextlib.contextmanager
def _float32_means_float64():
    """Not reentrant by design: a widened call inside another (wrappers stacked around one function) runs
    in the outer one's context (`_widening` checks ``active``)."""
    from megatron.core.transformer.moe import moe_utils

    saved_torch = moe_utils.torch
    had_float = "float" in torch.Tensor.__dict__
    saved_float = torch.Tensor.__dict__.get("float")
    moe_utils.torch = _Float32IsFloat64()
    torch.Tensor.float = _float_keeping_float64
    _STATE["active"] = True
    try:
        yield
    finally:
        _STATE["active"] = False
        moe_utils.torch = saved_torch
        if had_float:
            torch.Tensor.float = saved_float
        else:
            del torch.Tensor.float


def _widening(original):
    @functools.wraps(original)
    def wrapper(logits, *args, **kwargs):
        if (_STATE["active"] or not _STATE["on"] or logits.dtype != torch.float64
                or kwargs.get("fused", False)):
            return original(logits, *args, **kwargs)
        with _float32_means_float64():
            return original(logits, *args, **kwargs)

    wrapper._tree_widened = True
    return wrapper


def _widened_gating(original):
    """``router_gating_linear(inp, weight, bias, router_dtype)``: a float32 ``router_dtype``
    (``moe_router_dtype="fp32"``, which Bridge providers set) computes float64 logits from float64 input."""
    @functools.wraps(original)
    def wrapper(inp, weight, bias, router_dtype):
        if _STATE["on"] and inp.dtype == torch.float64 and router_dtype == torch.float32:
            router_dtype = torch.float64
        return original(inp, weight, bias, router_dtype)

    wrapper._tree_widened = True
    return wrapper


def _install() -> None:
    """Wrap the functions where the router calls them (idempotent; ``functools.wraps`` keeps the markers
    of wrappers already there, e.g. MoE balancing's weighted aux scores)."""
    from megatron.core.transformer.moe import router as router_module

    for name, wrap in [(n, _widening) for n in _NAMES] + [("router_gating_linear", _widened_gating)]:
        fn = getattr(router_module, name)
        if not getattr(fn, "_tree_widened", False):
            setattr(router_module, name, wrap(fn))


def widen_router_scores(on: bool = True) -> None:
    """Score routes at float64 when the logits are float64 (``on``), or as stock does (``off``)."""
    if on:
        _install()
    _STATE["on"] = bool(on)

