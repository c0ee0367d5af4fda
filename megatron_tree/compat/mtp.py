"""Multi-token prediction (MTP): what differs between the Megatron-Core versions we serve (0.16.1, 0.19.x).

Feature checks, never version numbers:

* **Inner layer name.** The transformer layer inside a ``MultiTokenPredictionLayer`` is
  ``transformer_layer`` (0.16) or ``mtp_model_layer`` (0.19): `mtp_inner_layer`.
* **Loss scaling under ``calculate_per_token_loss``.** 0.19's ``process_mtp_loss`` multiplies each
  depth's loss by ``original_num_tokens / num_tokens`` (the microbatch's loss-mask sum before and
  after rolling) so that the main loss's token count, by which ``finalize_model_grads`` divides every
  gradient, does not shrink the MTP gradients; 0.16's ``GPTModel._postprocess`` adds the depth's
  loss unscaled. `rescales_per_token_mtp_loss` says which the installed version does (it reads the
  source of ``process_mtp_loss``: there is no flag for it).
* **The depth's token count as a divisor.** 0.19 divides by ``max(num_tokens, 1)`` (``num_tokens``: the
  rolled loss-mask sum), in that rescaling and in the logged mean; 0.16 logs ``sum / num_tokens``. With
  0/1 masks the two agree wherever ``num_tokens > 0``; with loss weights (SFT sample weights, RL weights,
  which reach stock as the loss mask) a sum in (0, 1) tells them apart: `mtp_num_tokens_floor` (read from
  the source of stock's MTP loss code).
* **Hybrid (Mamba) models.** 0.19's ``MambaModel`` is a ``HybridModel`` whose stack spec takes an
  ``mtp_block_spec`` (MTP depths from a ``main/mtp/...`` pattern, each MTP layer's inner stack built
  from the stack's own layer specs); 0.16's has no MTP: `hybrid_has_mtp`.
* **Loss logging.** 0.16's ``MTPLossLoggingHelper.save_loss_to_tracker(loss, layer, num_layers, ...)``
  vs 0.19's ``save_metrics_to_tracker(loss, correct, total, layer, num_layers, ...)`` (acceptance
  counts beside the loss): `save_mtp_metrics`.
"""
from __future__ import annotations

import inspect
import re
from functools import lru_cache

__all__ = ["mtp_inner_layer", "rescales_per_token_mtp_loss", "mtp_num_tokens_floor", "save_mtp_metrics",
           "tracks_acceptance", "hybrid_has_mtp"]


def hybrid_has_mtp() -> bool:
    """True when the installed Megatron-Core's ``MambaModel`` (0.19: a ``HybridModel``) builds MTP layers
    (its stack spec takes an ``mtp_block_spec``; depths come from a ``main/mtp/...`` pattern)."""
    import dataclasses

    from megatron.core.ssm.mamba_block import MambaStackSubmodules

    return "mtp_block_spec" in {f.name for f in dataclasses.fields(MambaStackSubmodules)}


def mtp_inner_layer(layer):
    """The transformer layer inside a stock ``MultiTokenPredictionLayer``."""
    inner = getattr(layer, "mtp_model_layer", None)
    return inner if inner is not None else layer.transformer_layer


@lru_cache(maxsize=None)
def rescales_per_token_mtp_loss() -> bool:
    """True when the installed Megatron-Core scales each depth's per-token MTP loss by the
    microbatch's ``original_num_tokens / num_tokens`` (0.19's ``process_mtp_loss``)."""
    from megatron.core.transformer import multi_token_prediction as mtp

    fn = getattr(mtp, "process_mtp_loss", None)
    if fn is None:
        return False
    try:
        return "original_num_tokens" in inspect.getsource(fn)
    except (OSError, TypeError):  # no source shipped: the newer behaviour
        return True


_CLAMPED_COUNT = re.compile(r"clamp\(\s*num_tokens\s*,\s*min\s*=\s*1\s*\)|num_tokens\.clamp\(\s*min\s*=\s*1\s*\)")


@lru_cache(maxsize=None)
def mtp_num_tokens_floor() -> float:
    """The least value stock's MTP loss lets a depth's token count (``num_tokens``, the rolled loss-mask sum)
    take where it divides by it: 1.0 where it clamps it (0.19's ``process_mtp_loss``:
    ``original_num_tokens / torch.clamp(num_tokens, min=1)`` under ``calculate_per_token_loss``, the logged
    ``sum / num_tokens.clamp(min=1)``), 0.0 where it divides by the exact sum (0.16's
    ``GPTModel._postprocess`` logs ``sum / num_tokens``). Read from the source of stock's MTP loss code."""
    from megatron.core.transformer import multi_token_prediction as mtp

    fn = getattr(mtp, "process_mtp_loss", None)
    if fn is None:
        from megatron.core.models.gpt.gpt_model import GPTModel

        fn = getattr(GPTModel, "_postprocess", None)
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):  # no source shipped: the newer behaviour
        return 1.0
    return 1.0 if _CLAMPED_COUNT.search(src) else 0.0


def tracks_acceptance() -> bool:
    """True when the stock tracker also records MTP acceptance counts (0.19)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    return hasattr(MTPLossLoggingHelper, "save_metrics_to_tracker")


def save_mtp_metrics(loss, correct, total, layer_number: int, num_layers: int, avg_group=None) -> None:
    """Record one depth's logged loss (and, where stock tracks them, its acceptance counts) in
    Megatron's ``MTPLossLoggingHelper`` tracker, as stock ``GPTModel`` does in training."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper as H

    held = H.tracker.get("loss_values", H.tracker.get("values"))
    if held is not None and held.shape[0] != num_layers:  # a model with another depth count logged before
        H.tracker.clear()  # (stock sizes the tracker once, by the first model's depth count)
    if hasattr(H, "save_metrics_to_tracker"):
        H.save_metrics_to_tracker(loss, correct, total, layer_number, num_layers, avg_group=avg_group)
    else:
        H.save_loss_to_tracker(loss, layer_number, num_layers, avg_group=avg_group)
