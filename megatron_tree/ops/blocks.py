"""Block-level sparsity of tree attention, shared by the torch and FlexAttention backends.

Rows are cut into blocks; which (query block, key block) tiles hold a visible pair, and which are
fully visible, follows in closed form from ``visible_until`` (a key block is relevant to a query
block iff its smallest row is <= the query block's largest row and its largest ``visible_until``
exceeds the query block's smallest row). No row-level pair is ever formed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BIG_ROW", "BlockPairs", "block_pairs", "pad_blocks"]

BIG_ROW = 1 << 62  # row / position sentinel for padding rows in block reductions


@dataclass(frozen=True)
class BlockPairs:
    """Relevant (query block, key block) tiles, sorted by ``(q_block, k_block)``.

    q_block [P], k_block [P]  int64 block indices (query block b holds query positions
                              ``b*block_q : (b+1)*block_q`` of the query set, likewise keys)
    full    [P] bool          every (query, key) pair of the tile is visible (no mask needed);
                              a tile with padding (the last, incomplete block) is never full
    num_q_blocks, num_k_blocks, block_q, block_k: grid shape.

    Every tile holding at least one visible pair is listed (no false negatives); ``full`` is exact.
    For self-attention (same rows and grid for queries and keys) without a window every listed tile
    holds at least one visible pair; otherwise a listed partial tile may be empty.
    """

    q_block: torch.Tensor
    k_block: torch.Tensor
    full: torch.Tensor
    num_q_blocks: int
    num_k_blocks: int
    block_q: int
    block_k: int

    @property
    def num_pairs(self) -> int:
        return int(self.q_block.shape[0])


def pad_blocks(x: torch.Tensor, block: int, fill: int) -> torch.Tensor:
    """[n] -> [ceil(n/block), block], the tail padded with ``fill``."""
    n = x.shape[0]
    nb = -(-n // block)
    if nb * block != n:
        x = torch.cat([x, x.new_full((nb * block - n,), fill)])
    return x.view(nb, block)


def block_pairs(q_rows: torch.Tensor, k_rows: torch.Tensor, k_visible_until: torch.Tensor, *, block_q: int,
                block_k: int, q_positions: torch.Tensor | None = None, k_positions: torch.Tensor | None = None,
                window: int | None = None) -> BlockPairs:
    """Block sparsity of ``q_rows`` x ``k_rows`` under the tree predicate, in closed form.

    q_rows [Nq] global row ids, non-decreasing (queries sorted by row); k_rows [Nk] and
    k_visible_until [Nk] in any order (sorted keys give tighter tiles). With ``window``, the
    positions [Nq] / [Nk] are required. Cost O(num blocks * log + P): no row-level pair is formed.
    """
    dev = q_rows.device
    nq, nk = q_rows.shape[0], k_rows.shape[0]
    q_rows = q_rows.long()
    if nq > 1 and bool((q_rows[1:] < q_rows[:-1]).any()):
        raise ValueError("block_pairs: q_rows must be sorted (non-decreasing)")
    nbq, nbk = -(-nq // block_q), -(-nk // block_k)
    empty = torch.zeros(0, dtype=torch.long, device=dev)
    if nbq == 0 or nbk == 0:
        return BlockPairs(empty, empty, empty.bool(), nbq, nbk, block_q, block_k)

    starts = torch.arange(nbq, device=dev) * block_q
    ends = torch.clamp(starts + block_q, max=nq)
    qmin, qmax = q_rows[starts].contiguous(), q_rows[ends - 1].contiguous()
    q_complete = (ends - starts) == block_q

    kr = pad_blocks(k_rows.long(), block_k, BIG_ROW)  # padding keys: after every query, never seen
    kv = pad_blocks(k_visible_until.long(), block_k, -BIG_ROW)
    kmin, kmax = kr.amin(1), kr.amax(1)
    kvis_max, kvis_min = kv.amax(1), kv.amin(1)

    # Queries are sorted, so for key block j the relevant query blocks are one contiguous range:
    # those whose largest row reaches kmin[j] and whose smallest row is below kvis_max[j].
    lo = torch.searchsorted(qmax, kmin)
    hi = torch.searchsorted(qmin, kvis_max)
    counts = (hi - lo).clamp_min(0)
    k_block = torch.repeat_interleave(torch.arange(nbk, device=dev), counts)
    first = torch.cumsum(counts, 0) - counts
    q_block = lo[k_block] + (torch.arange(k_block.shape[0], device=dev) - first[k_block])

    full = (kmax[k_block] <= qmin[q_block]) & (kvis_min[k_block] > qmax[q_block]) & q_complete[q_block]
    if window is not None:
        if q_positions is None or k_positions is None:
            raise ValueError("block_pairs: window needs q_positions and k_positions")
        qp = pad_blocks(q_positions.long(), block_q, BIG_ROW)
        qp_min = qp.amin(1)
        qp_max = torch.where(qp == BIG_ROW, -BIG_ROW, qp).amax(1)
        kp = pad_blocks(k_positions.long(), block_k, BIG_ROW)
        kp_min = kp.amin(1)
        kp_max = torch.where(kp == BIG_ROW, -BIG_ROW, kp).amax(1)
        keep = (qp_min[q_block] - kp_max[k_block]) < window
        full = full & ((qp_max[q_block] - kp_min[k_block]) < window)
        q_block, k_block, full = q_block[keep], k_block[keep], full[keep]

    order = torch.argsort(q_block * nbk + k_block)
    return BlockPairs(q_block[order], k_block[order], full[order], nbq, nbk, block_q, block_k)
