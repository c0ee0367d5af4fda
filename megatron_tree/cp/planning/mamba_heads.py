"""Mamba-2 under CP, the host side: which heads, B/C groups and ``xBCdt`` channels each CP rank
receives (`mamba_head_shards`) and the elements each rank sends per layer (`mamba_exchange_figures`).
The executor that moves them is `cp.execution.mamba.tree_mamba_cp`; its module docstring describes
the transpose these index maps serve.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .plan import CPPlan

__all__ = ["MambaHeadShards", "mamba_head_shards", "mamba_exchange_figures"]


# --------------------------------------------------------------------------------------- channels
@dataclass(frozen=True, eq=False)
class MambaHeadShards:
    """Which channels of one token row each CP rank receives (numpy int64, per rank ``j``).

    The row layout is ``xBCdt = [x (H*P) | B (G*S) | C (G*S) | dt (H)]`` of one TP rank (``H``
    heads of head dim ``P``, ``G`` groups of state size ``S``); rank ``j`` owns heads
    ``heads[j] = (j*H/cp, (j+1)*H/cp)`` and reads groups ``groups[j] = (g0, g1)`` (half-open).

    channels[j]      [F_j] indices into the row: ``x`` of its heads, ``B`` then ``C`` of its groups,
                     then ``dt`` of its heads; the first ``conv_width[j]`` are the conv channels
                     (also the rows of the conv weight / bias to use)
    head_group[j]    [H/cp] local group (in ``0..g1-g0``) each local head reads
    expand[j]        True when ``head_group[j]`` is not mamba's ``h // (H_local / G_local)``: the
                     shard's ``B`` / ``C`` are expanded to one group per head before `tree_ssd`
    """

    cp_size: int
    num_heads: int
    head_dim: int
    num_groups: int
    d_state: int
    heads: tuple
    groups: tuple
    channels: tuple
    conv_width: tuple
    head_group: tuple
    expand: tuple

    @property
    def heads_per_rank(self) -> int:
        return self.num_heads // self.cp_size

    @property
    def row_width(self) -> int:
        """Channels of one ``xBCdt`` row: ``H*P + 2*G*S + H``."""
        return self.num_heads * self.head_dim + 2 * self.num_groups * self.d_state + self.num_heads


@lru_cache(maxsize=64)
def mamba_head_shards(num_heads: int, head_dim: int, num_groups: int, d_state: int, cp_size: int) -> MambaHeadShards:
    """The head / group / channel split of one TP rank's Mamba heads over ``cp_size`` CP ranks.

    Heads split in contiguous equal blocks (rank ``j`` gets ``H/cp`` heads); a rank reads every
    group one of its heads reads (head ``h`` reads group ``h // (H/G)``), so with ``G < cp`` a
    group is replicated to several ranks. Raises ValueError when ``cp_size`` does not divide the
    head count or the groups do not divide the heads.
    """
    H, P, G, S, cp = int(num_heads), int(head_dim), int(num_groups), int(d_state), int(cp_size)
    if cp < 1 or H < 1 or G < 1 or P < 1 or S < 1:
        raise ValueError(f"Mamba CP: cp_size ({cp}), heads ({H}), head dim ({P}), groups ({G}) and state size ({S}) "
                         "must all be >= 1")
    if H % cp:
        raise ValueError(f"Mamba context parallelism splits heads over the CP ranks: the CP size {cp} must divide the "
                         f"number of Mamba heads on this tensor-parallel rank, {H}")
    if H % G:
        raise ValueError(f"the number of Mamba heads {H} must be a multiple of the number of B/C groups {G}")
    Hc, R = H // cp, H // G
    x0, b0, c0, d0 = 0, H * P, H * P + G * S, H * P + 2 * G * S
    heads, groups, channels, conv_width, head_group, expand = [], [], [], [], [], []
    for j in range(cp):
        h0, h1 = j * Hc, (j + 1) * Hc
        g0, g1 = h0 // R, (h1 - 1) // R + 1
        hg = np.arange(h0, h1) // R - g0
        gl = g1 - g0
        uniform = Hc % gl == 0 and np.array_equal(hg, np.arange(Hc) // (Hc // gl))
        ch = np.concatenate([np.arange(x0 + h0 * P, x0 + h1 * P), np.arange(b0 + g0 * S, b0 + g1 * S),
                             np.arange(c0 + g0 * S, c0 + g1 * S), np.arange(d0 + h0, d0 + h1)]).astype(np.int64)
        heads.append((h0, h1))
        groups.append((g0, g1))
        channels.append(ch)
        conv_width.append(Hc * P + 2 * gl * S)
        head_group.append(hg.astype(np.int64))
        expand.append(not uniform)
    return MambaHeadShards(cp, H, P, G, S, tuple(heads), tuple(groups), tuple(channels), tuple(conv_width),
                           tuple(head_group), tuple(expand))


def mamba_exchange_figures(plan: CPPlan, num_heads: int, head_dim: int, num_groups: int, d_state: int) -> dict:
    """Elements each rank sends to *other* ranks per Mamba layer (analytic, from the plan).

    Returns ``{"forward_sent": [cp], "backward_sent": [cp], "forward_total": int,
    "backward_total": int}`` in elements (multiply by the element size for bytes). Forward: the
    transpose of ``x``/``B``/``C``/``dt`` (rank ``s`` sends ``n_s * F_j`` to each ``j != s``) plus
    the return of ``y`` (rank ``j`` sends ``n_s * H/cp * P`` to each owner ``s != j``). Backward
    moves the same volumes the other way (the gradients), so ``backward_sent[r]`` is what ``r``
    receives in forward. Zero for a single-owner plan (no exchange).
    """
    cp = plan.cp_size
    sh = mamba_head_shards(num_heads, head_dim, num_groups, d_state, cp)
    n = plan.rows_per_rank()
    if cp == 1 or n.max() == plan.num_rows:
        z = np.zeros(cp, np.int64)
        return {"forward_sent": z, "backward_sent": z.copy(), "forward_total": 0, "backward_total": 0}
    width = np.array([c.shape[0] for c in sh.channels], np.int64)     # F_j
    yw = sh.heads_per_rank * head_dim
    # forward: s -> j (j != s): n_s * F_j channels in, then j -> s: n_s * yw of y
    fwd = n * (width.sum() - width) + (n.sum() - n) * yw
    # backward: the transposes of both moves: what each rank received in forward
    bwd = width * (n.sum() - n) + n * (cp - 1) * yw
    return {"forward_sent": fwd, "backward_sent": bwd, "forward_total": int(fwd.sum()),
            "backward_total": int(bwd.sum())}
