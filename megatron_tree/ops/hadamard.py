"""Walsh-Hadamard rotation: the torch reference of ``fast_hadamard_transform.hadamard_transform``
(DeepSeek sparse attention's indexer rotates its queries and keys with it). Runs everywhere, any
float dtype, exact in float64."""
from __future__ import annotations

import torch

__all__ = ["hadamard_rotate"]


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """``x @ H / sqrt(d)`` over the last dim (H the Sylvester Hadamard matrix of order d): what
    ``fast_hadamard_transform.hadamard_transform(x, scale=d ** -0.5)`` computes, in x's dtype.

    d must be a power of two (the kernel pads otherwise; DSA's indexer head dims are powers of two,
    so anything else is refused rather than guessed). Differentiable (linear butterflies)."""
    if not x.is_floating_point():
        raise TypeError(f"hadamard_rotate needs a floating point tensor, got {x.dtype}")
    d = x.shape[-1]
    if d < 1 or d & (d - 1):
        raise ValueError(f"hadamard_rotate: the last dimension must be a power of two (DSA indexer head dim), got {d}")
    lead = x.shape[:-1]
    y = x.reshape(-1, d)
    h = 1
    while h < d:  # log2(d) butterfly stages, each over the whole tensor
        y = y.view(-1, d // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return (y.reshape(*lead, d) * d ** -0.5).to(x.dtype)
