"""Depthwise causal conv1d on a prefix forest (the short convolution in front of Mamba / GDN).

A row's receptive field is its W-1 predecessors on its root path, found by following
``layout.path_prev``: a child segment's first rows continue its parent's tail and never see a
sibling; steps before a root read zero. Inside a segment the path is the storage order, so a plain
causal conv over all rows (W shifted slices) is right everywhere except the first W-1 rows of each
segment, which are recomputed from gathers along ``path_prev`` (index arithmetic over all rows,
then gathers of only those rows). No loop over rows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..tree.layout import TreeLayout

_ACTIVATIONS = (None, "silu")


def tree_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layout: TreeLayout, *,
                       activation: str | None = None, backend: str = "auto") -> torch.Tensor:
    """Causal depthwise convolution along root paths.

    x [N,C], weight [C,W] (``weight[:, W-1]`` multiplies the row itself, ``weight[:, j]`` the row
    W-1-j steps back on the root path), bias [C] or None, activation None or "silu".
    Returns y [N,C] in the promoted dtype of x and weight. Differentiable in x, weight and bias.

    ``backend``: "auto" or "torch"; one bandwidth-bound implementation serves CPU and GPU.
    """
    if activation not in _ACTIVATIONS:
        raise ValueError(f"tree_causal_conv1d: activation must be one of {_ACTIVATIONS}, got {activation!r}")
    if backend not in ("auto", "torch"):
        raise ValueError(f"tree_causal_conv1d: unknown backend {backend!r}; choose 'auto' or 'torch'")
    if x.dim() != 2:
        raise ValueError(f"x must be [N,C], got {tuple(x.shape)}")
    N, Cn = x.shape
    if N != layout.num_rows:
        raise ValueError(f"x has {N} rows but the layout has {layout.num_rows}")
    if weight.dim() != 2 or weight.shape[0] != Cn or weight.shape[1] < 1:
        raise ValueError(f"weight must be [C,W] with C={Cn}, W>=1; got {tuple(weight.shape)}")
    if bias is not None and bias.shape != (Cn,):
        raise ValueError(f"bias must be [C] = ({Cn},), got {tuple(bias.shape)}")
    W = weight.shape[1]
    dtype = torch.promote_types(x.dtype, weight.dtype)
    x, weight = x.to(dtype), weight.to(dtype)
    bias = None if bias is None else bias.to(dtype)

    # Bulk: a causal depthwise conv over the rows in storage order, token-major (shifted slices of
    # one zero-padded copy). It is right for every row whose W-1 predecessors on its root path are
    # the W-1 rows just above it in storage, i.e. all rows except the first W-1 rows of a segment.
    xp = F.pad(x, (0, 0, W - 1, 0))
    y = xp[:N] * weight[:, 0] if bias is None else torch.addcmul(bias, xp[:N], weight[:, 0])
    for j in range(1, W):
        y = torch.addcmul(y, xp[j:j + N], weight[:, j])
    if W > 1:
        # Halo rows: recompute them with predecessors found through path_prev (index N = none).
        prev = layout.path_prev.to(x.device)
        step = torch.cat([torch.where(prev < 0, N, prev), prev.new_full((1,), N)])
        rows = torch.arange(N, device=x.device)
        src, wrong = rows, torch.zeros(N, dtype=torch.bool, device=x.device)
        taps = []
        for k in range(1, W):
            src = step[src]
            taps.append(src)
            wrong |= src != torch.where(rows >= k, rows - k, N)
        fix = torch.nonzero(wrong).flatten()
        if fix.numel():
            vals = x[fix] * weight[:, W - 1]
            for k, src in enumerate(taps, start=1):
                s = src[fix]
                has = (s < N).unsqueeze(1)
                vals = vals + torch.where(has, x[s.clamp(max=N - 1)], x.new_zeros(())) * weight[:, W - 1 - k]
            if bias is not None:
                vals = vals + bias
            # In place on a fresh sum (its backward does not read it): no full copy.
            y[fix] = vals
    if activation == "silu":
        y = F.silu(y)
    return y
