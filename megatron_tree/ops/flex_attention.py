"""FlexAttention backend of tree attention (CUDA, compiled Triton kernels).

The BlockMask is built directly from the segment ranges: ``block_pairs`` (closed form in
``visible_until``, O(blocks) work, no row-level pair) says which (query block, key block) tiles
are empty, partial or full; partial tiles go to ``kv_num_blocks`` / ``kv_indices`` and are masked
per element by the visibility predicate as ``mask_mod``, full tiles go to ``full_kv_num_blocks`` /
``full_kv_indices`` and skip the mask. No dense N x N (or even row x block) mask is ever formed.

``build_flex_block_tensors`` is a pure tensor function (testable on CPU); the kernel call needs
CUDA and Triton. Sinks are not handled here: the caller merges them exactly through the returned
lse (``attention.apply_sinks``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .blocks import BIG_ROW, block_pairs

__all__ = ["FLEX_BLOCK_SIZE", "FlexBlockTensors", "build_flex_block_tensors", "build_flex_block_mask",
           "flex_tree_attention_partial"]

#: Sparse block size of the BlockMask (FlexAttention's default tile granularity).
FLEX_BLOCK_SIZE = 128


@dataclass(frozen=True)
class FlexBlockTensors:
    """BlockMask metadata for a (query set, key set) pair, in FlexAttention's conventions.

    kv_num_blocks      [1,1,nbq] int32  partial (masked) tiles per query block
    kv_indices         [1,1,nbq,nbk] int32  their key blocks, ascending, first kv_num_blocks valid
    full_kv_num_blocks [1,1,nbq] int32  fully visible tiles per query block
    full_kv_indices    [1,1,nbq,nbk] int32
    block_size         (block_q, block_k)
    seq_lengths        (nbq*block_q, nbk*block_k): the padded lengths the kernel runs on
    Unused index slots hold 0 (a valid block) so that no prefetch can read out of range.
    """

    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    full_kv_num_blocks: torch.Tensor
    full_kv_indices: torch.Tensor
    block_size: tuple[int, int]
    seq_lengths: tuple[int, int]


def _index_rows(qb: torch.Tensor, kb: torch.Tensor, nbq: int, nbk: int):
    """Tiles sorted by (qb, kb) -> per-query-block counts [1,1,nbq] and index rows [1,1,nbq,nbk]."""
    counts = torch.bincount(qb, minlength=nbq)
    first = torch.cumsum(counts, 0) - counts
    col = torch.arange(qb.shape[0], device=qb.device) - first[qb]
    idx = torch.zeros(nbq, nbk, dtype=torch.int32, device=qb.device)
    idx[qb, col] = kb.to(torch.int32)
    return counts.to(torch.int32)[None, None], idx[None, None]


def build_flex_block_tensors(q_rows: torch.Tensor, k_rows: torch.Tensor, k_visible_until: torch.Tensor, *,
                             block_q: int = FLEX_BLOCK_SIZE, block_k: int = FLEX_BLOCK_SIZE,
                             q_positions: torch.Tensor | None = None, k_positions: torch.Tensor | None = None,
                             window: int | None = None) -> FlexBlockTensors:
    """Block metadata of the tree predicate for sorted ``q_rows`` [Nq] against ``k_rows`` [Nk]
    (with ``k_visible_until`` [Nk]; positions [Nq]/[Nk] when ``window``). Pure function, any device."""
    pairs = block_pairs(q_rows, k_rows, k_visible_until, block_q=block_q, block_k=block_k,
                        q_positions=q_positions, k_positions=k_positions, window=window)
    nbq, nbk = pairs.num_q_blocks, pairs.num_k_blocks
    part = ~pairs.full
    kv_num, kv_idx = _index_rows(pairs.q_block[part], pairs.k_block[part], nbq, nbk)
    full_num, full_idx = _index_rows(pairs.q_block[pairs.full], pairs.k_block[pairs.full], nbq, nbk)
    return FlexBlockTensors(kv_num, kv_idx, full_num, full_idx, (block_q, block_k), (nbq * block_q, nbk * block_k))


def _pad_rows(x: torch.Tensor, n: int, fill) -> torch.Tensor:
    if x.shape[0] == n:
        return x
    return torch.cat([x, x.new_full((n - x.shape[0],) + tuple(x.shape[1:]), fill)])


def build_flex_block_mask(q_rows: torch.Tensor, k_rows: torch.Tensor, k_visible_until: torch.Tensor, *,
                          block_q: int = FLEX_BLOCK_SIZE, block_k: int = FLEX_BLOCK_SIZE,
                          q_positions: torch.Tensor | None = None, k_positions: torch.Tensor | None = None,
                          window: int | None = None):
    """A ``BlockMask`` over the padded lengths (see ``FlexBlockTensors.seq_lengths``).

    ``mask_mod`` is the visibility predicate on captured per-row tensors; padding query rows carry
    row -1 and padding key rows a huge row id, so nothing is visible across padding.
    """
    from torch.nn.attention.flex_attention import BlockMask

    t = build_flex_block_tensors(q_rows, k_rows, k_visible_until, block_q=block_q, block_k=block_k,
                                 q_positions=q_positions, k_positions=k_positions, window=window)
    lq, lk = t.seq_lengths
    qr = _pad_rows(q_rows.long(), lq, -1)
    kr = _pad_rows(k_rows.long(), lk, BIG_ROW)
    kv = _pad_rows(k_visible_until.long(), lk, -1)
    if window is None:
        def mask_mod(b, h, q_idx, kv_idx):
            q = qr[q_idx]
            return (kr[kv_idx] <= q) & (q < kv[kv_idx])
    else:
        qp = _pad_rows(q_positions.long(), lq, 0)
        kp = _pad_rows(k_positions.long(), lk, 0)
        w = int(window)

        def mask_mod(b, h, q_idx, kv_idx):
            q = qr[q_idx]
            return (kr[kv_idx] <= q) & (q < kv[kv_idx]) & (qp[q_idx] - kp[kv_idx] < w)
    return BlockMask.from_kv_blocks(t.kv_num_blocks, t.kv_indices, t.full_kv_num_blocks, t.full_kv_indices,
                                    BLOCK_SIZE=t.block_size, mask_mod=mask_mod, seq_lengths=t.seq_lengths)


_COMPILED = None


def _flex_fn(compiled: bool):
    global _COMPILED
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return flex_attention
    if _COMPILED is None:
        _COMPILED = torch.compile(flex_attention)
    return _COMPILED


def flex_tree_attention_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_rows: torch.Tensor,
                                k_rows: torch.Tensor, k_visible_until: torch.Tensor, *,
                                q_positions: torch.Tensor | None = None, k_positions: torch.Tensor | None = None,
                                softmax_scale: float | None = None, window: int | None = None,
                                block_size: int = FLEX_BLOCK_SIZE, compiled: bool = True):
    """FlexAttention form of ``tree_attention_partial`` for sorted ``q_rows``.

    q [Nq,Hq,D], k [Nk,Hkv,D], v [Nk,Hkv,Dv] -> (o [Nq,Hq,Dv] in q's dtype, lse [Nq,Hq] float32,
    natural log, -inf where no key is visible). Differentiable in q, k, v through o and lse.
    ``compiled=False`` runs flex's eager reference (materialises scores: for CPU tests only).
    """
    from torch.nn.attention.flex_attention import AuxRequest

    nq, hq, d = q.shape
    nk, hkv, _ = k.shape
    mask = build_flex_block_mask(q_rows, k_rows, k_visible_until, block_q=block_size, block_k=block_size,
                                 q_positions=q_positions, k_positions=k_positions, window=window)
    lq, lk = mask.seq_lengths
    qf = _pad_rows(q, lq, 0).transpose(0, 1).unsqueeze(0).contiguous()  # [1,Hq,Lq,D]
    kf = _pad_rows(k, lk, 0).transpose(0, 1).unsqueeze(0).contiguous()
    vf = _pad_rows(v, lk, 0).transpose(0, 1).unsqueeze(0).contiguous()
    scale = softmax_scale if softmax_scale is not None else d ** -0.5
    out, aux = _flex_fn(compiled)(qf, kf, vf, block_mask=mask, scale=scale, enable_gqa=hq != hkv,
                                  return_aux=AuxRequest(lse=True))
    o = out[0].transpose(0, 1)[:nq]
    lse = aux.lse[0].transpose(0, 1)[:nq].to(torch.float64 if q.dtype == torch.float64 else torch.float32)
    return o, lse
