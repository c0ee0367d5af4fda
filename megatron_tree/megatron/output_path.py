"""Stock's output path, for the logits of the rows a tree reads log-probs at.

Stock ``GPTModel`` / ``HybridModel`` compute logits as ``output_layer(hidden, weight=...)`` and then
``_scale_logits`` (megatron-core 0.19: MuP's output multiplier, identity without MuP). The tree computes
log-probs only at the rows that have loss occurrences, so it applies the output layer's matmul to those
rows itself (`TreeLanguageModelMixin.tree_logprobs`); everything stock's output layer does beyond the
matmul must be applied here too, or the tree's log-probs are silently another model's.

What an output layer does is read from its class: stock ``ColumnParallelLinear`` is the matmul (plus its
bias); Megatron-Bridge's ``Gemma2OutputLayer`` (Gemma 2 / 3, which the Bridge's provider puts on the
model with ``extend_instance`` after building it) is the matmul then the final logit soft-cap
``c * tanh(logits / c)``, ``c = config.final_logit_softcapping``. Any other class whose ``forward``
differs from ``ColumnParallelLinear.forward`` is refused by name (`TreeOutputError`): the tree cannot
know what it does.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

__all__ = ["TreeOutputError", "check_output_layer", "output_logits"]


class TreeOutputError(ValueError):
    """An output layer whose forward the tree's log-prob path cannot reproduce."""


def _softcapping_forward():
    # a Gemma2OutputLayer exists only once its module is imported: never import the Bridge from here
    module = sys.modules.get("megatron.bridge.models.gemma.gemma2_provider")
    layer = getattr(module, "Gemma2OutputLayer", None)
    return layer.forward if layer is not None else None


def _final_softcap(model):
    """None for a plain matmul output layer, the soft-cap constant for a soft-capping one; raises
    `TreeOutputError` for any other output layer."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    layer = model.output_layer
    forward = type(layer).forward
    if forward is ColumnParallelLinear.forward:
        return None
    softcapping = _softcapping_forward()
    if softcapping is not None and forward is softcapping:
        return getattr(model.config, "final_logit_softcapping", None) or None
    raise TreeOutputError(
        f"{type(model).__name__}.output_layer is {type(layer).__module__}.{type(layer).__qualname__}, whose forward "
        "does more than ColumnParallelLinear's matmul; the tree's per-occurrence log-probs apply the output layer "
        "themselves and know only the plain matmul and Megatron-Bridge's Gemma2OutputLayer (final logit soft-cap)")


def check_output_layer(model) -> None:
    """Raise `TreeOutputError` now (after a model is built) rather than at its first forward."""
    if getattr(model, "post_process", False) and getattr(model, "output_layer", None) is not None:
        _final_softcap(model)


def output_logits(model, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``[n, V/tp]`` logits of ``hidden [n, h]`` as stock's output path computes them: the output layer's
    matmul (its bias too), its soft-cap where it has one, then the model's ``_scale_logits`` where the
    stack has it. Soft-cap and scaling are elementwise, so they act on each TP rank's vocab shard as they
    do on stock's."""
    cap = _final_softcap(model)
    logits = F.linear(hidden, weight, getattr(model.output_layer, "bias", None))
    if cap:
        logits = cap * torch.tanh(logits / cap)
    scale = getattr(model, "_scale_logits", None)
    return scale(logits) if scale is not None else logits
