"""Megatron-Core's stock DSA module on a CPU host: the torch Hadamard rotation
(`compat.dsa.use_torch_hadamard`: stock asserts bfloat16 and needs the CUDA kernel) and an
indexer-loss tracker whose buffer lives on the loss's device (stock's
``DSAIndexerLossLoggingHelper.save_loss_to_tracker`` allocates on ``torch.cuda.current_device()``).
Nothing happens on import: call `enable()`.
"""
from __future__ import annotations

import torch

from ..compat.dsa import dsa_module, use_torch_hadamard

__all__ = ["enable"]


def _save_loss_to_tracker(loss, layer_number, num_layers, reduce_group=None, avg_group=None):
    """Stock ``DSAIndexerLossLoggingHelper.save_loss_to_tracker`` with its buffer on ``loss.device``."""
    if layer_number is None:
        return
    helper = dsa_module().DSAIndexerLossLoggingHelper
    tracker = helper.tracker
    if "values" not in tracker or tracker["values"].device != loss.device or tracker["values"].numel() != num_layers:
        tracker["values"] = torch.zeros(num_layers, device=loss.device, dtype=torch.float64)
    tracker["values"][layer_number - 1] += loss.detach().to(tracker["values"].dtype)
    tracker["reduce_group"] = reduce_group
    tracker["avg_group"] = avg_group


_ENABLED = False


def enable() -> None:
    """Install the CPU shims on the stock DSA module (idempotent): the torch Hadamard rotation and a
    device-agnostic indexer-loss tracker. Tests, verify and CPU runs call it explicitly."""
    global _ENABLED
    if _ENABLED:
        return
    use_torch_hadamard()
    dsa_module().DSAIndexerLossLoggingHelper.save_loss_to_tracker = staticmethod(_save_loss_to_tracker)
    _ENABLED = True
