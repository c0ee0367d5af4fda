"""Tree attention: softmax attention over a packed prefix forest, single device.

Visibility is the layout's one predicate: query row ``q`` sees key row ``k`` iff
``k <= q < visible_until[k]`` (and, with a sliding window ``w``,
``position_ids[q] - position_ids[k] < w``: positions are depths on the root path, so a sibling
branch can never leak in). Every output row therefore equals plain causal attention over its own
root-to-row path, which is what per-sample training computes.

Public API (token-major, no batch dimension; the tree is the batch):

* ``tree_attention(q, k, v, layout, ...)``: the whole forest at once.
* ``tree_attention_partial(q, k, v, q_rows, k_rows, k_visible_until, ...) -> (o, lse)``: one stage
  of a staged computation (context parallelism): queries against one disjoint subset of keys.
* ``merge_attention(o_a, lse_a, o_b, lse_b) -> (o, lse)``: exact, differentiable combination of
  two stages over disjoint key sets.
* ``apply_sinks(o, lse, sinks) -> (o, lse)``: adds one learned zero-value logit per head to the
  softmax denominator; call it once, after all stages are merged.
* ``block_pairs(...)``: the block-level sparsity pattern (re-exported from `ops.blocks`, which both
  the torch and the FlexAttention backends import).

The torch backend never materialises an N x N matrix. Rows are cut into blocks; the relevant
(query block, key block) tiles are found in closed form from ``visible_until`` (a key block is
relevant to a query block iff its smallest row is <= the query block's largest row and its largest
``visible_until`` exceeds the query block's smallest row), and processed in bounded-size batches
of tiles with an online-softmax merge (flash-attention style). Backward recomputes the scores from
the saved q, k, v, o, lse, so peak memory is O(N*H*D + batch budget).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..tree.layout import TreeLayout
from .backend import select_backend
from .blocks import BIG_ROW, BlockPairs, block_pairs, pad_blocks

__all__ = [
    "tree_attention",
    "tree_attention_partial",
    "merge_attention",
    "apply_sinks",
    "block_pairs",
    "BlockPairs",
    "DEFAULT_BLOCK_SIZE",
]

#: Rows per query/key block of the torch backend (tuned on CPU: tools/bench_ops_attention.py).
DEFAULT_BLOCK_SIZE = 128
#: Score elements (tiles x heads x block x block) processed per batch by the torch backend. On CPU:
#: small enough for a batch of score tiles to stay in cache, large enough to amortise Python
#: overhead. On CUDA the reference backend needs large batches to fill the device.
DEFAULT_BATCH_ELEMENTS = 1 << 20
DEFAULT_BATCH_ELEMENTS_CUDA = 1 << 25

# Flex needs a Triton build (it compiles Triton kernels); without it "flex" cannot run.
_GPU_BACKENDS = {"flex": "triton"}


# ====================================================================== torch backend
# Layout of the kernel loops. Tensors are kept head-major in blocks: q as [Hkv, nbq, G*bq, D] (each
# query block holds its G grouped query heads x bq rows), k / v as [Hkv, nbk, bk, D]. Because the
# queries are sorted, the query blocks relevant to one key block form a contiguous range, so a batch
# is (key block, query-block range): its queries, outputs and gradients are plain slices and the
# key block is one [Hkv, bk, D] view. Every step is then one batched matmul over the kv heads, with
# no gather or scatter; the online-softmax state of the range is updated in place.
@dataclass(frozen=True)
class _Plan:
    """Everything the kernel loops need besides the tensors (built once, reused by backward)."""

    q_rows: torch.Tensor  # [nbq, bq] (padding -1: sees nothing)
    k_rows: torch.Tensor  # [nbk, bk] (padding BIG: seen by nothing)
    k_vis: torch.Tensor  # [nbk, bk]
    q_pos: torch.Tensor | None  # [nbq, bq]
    k_pos: torch.Tensor | None  # [nbk, bk]
    window: int | None
    batches: tuple  # ((k_block, q_lo, q_hi, ((mask_lo, mask_hi), ...)), ...) in query blocks
    block_q: int
    block_k: int
    num_q: int
    num_k: int


def _make_plan(q_rows, k_rows, k_vis, q_pos, k_pos, window, block_q, block_k, max_tiles) -> _Plan:
    pairs = block_pairs(q_rows, k_rows, k_vis, block_q=block_q, block_k=block_k, q_positions=q_pos,
                        k_positions=k_pos, window=window)
    qb, kb, full = pairs.q_block, pairs.k_block, pairs.full
    if qb.numel():
        order = torch.argsort(kb * pairs.num_q_blocks + qb)
        qb, kb, full = qb[order], kb[order], full[order]
        # Runs of consecutive query blocks of one key block with the same full/partial kind, cut
        # every max_tiles tiles to bound the batch's score memory ...
        brk = torch.ones_like(full)
        brk[1:] = (kb[1:] != kb[:-1]) | (qb[1:] != qb[:-1] + 1) | (full[1:] != full[:-1])
        run = torch.cumsum(brk.long(), 0) - 1
        run_start = torch.nonzero(brk).flatten()
        brk = brk | ((torch.arange(qb.numel(), device=qb.device) - run_start[run]) % max_tiles == 0)
        starts = torch.nonzero(brk).flatten()
        stops = torch.cat([starts[1:], starts.new_tensor([qb.numel()])])
        table = torch.stack([kb[starts], qb[starts], qb[stops - 1] + 1, (~full[starts]).long()], 1).tolist()
        # ... then adjacent runs of a key block are joined again up to max_tiles: a batch is one
        # contiguous query range whose partial sub-ranges alone get masked. Fewer, larger batches
        # mean fewer kernel launches (a loop over runs, not rows).
        batches = []
        cur = None
        for kb_, lo, hi, m in table:
            if cur is not None and cur[0] == kb_ and cur[2] == lo and hi - cur[1] <= max_tiles:
                cur[2] = hi
            else:
                if cur is not None:
                    batches.append((cur[0], cur[1], cur[2], tuple(cur[3])))
                cur = [kb_, lo, hi, []]
            if m:
                cur[3].append((lo, hi))
        batches.append((cur[0], cur[1], cur[2], tuple(cur[3])))
        batches = tuple(batches)
    else:
        batches = ()
    return _Plan(
        q_rows=pad_blocks(q_rows.long(), block_q, -1),
        k_rows=pad_blocks(k_rows.long(), block_k, BIG_ROW),
        k_vis=pad_blocks(k_vis.long(), block_k, -BIG_ROW),
        q_pos=None if window is None else pad_blocks(q_pos.long(), block_q, 0),
        k_pos=None if window is None else pad_blocks(k_pos.long(), block_k, 0),
        window=window, batches=batches, block_q=block_q, block_k=block_k,
        num_q=q_rows.shape[0], num_k=k_rows.shape[0],
    )


def _tile_mask(plan: _Plan, kb: int, lo: int, hi: int) -> torch.Tensor:
    """[1,n,1,bq,bk] bool visibility of query blocks lo:hi against key block kb (broadcasts over the
    kv heads and the GQA group)."""
    qr = plan.q_rows[lo:hi].unsqueeze(2)
    vis = (plan.k_rows[kb] <= qr) & (qr < plan.k_vis[kb])
    if plan.window is not None:
        vis &= (plan.q_pos[lo:hi].unsqueeze(2) - plan.k_pos[kb]) < plan.window
    return vis[None, :, None]


def _apply_masks(s: torch.Tensor, plan: _Plan, kb: int, lo: int, masked: tuple, groups: int) -> None:
    """Set the invisible scores of the batch's partial sub-ranges to -inf, in place."""
    if masked:
        hkv, rows, bk = s.shape
        sv = s.view(hkv, rows // (groups * plan.block_q), groups, plan.block_q, bk)
        for a, b in masked:
            sv[:, a - lo:b - lo].masked_fill_(~_tile_mask(plan, kb, a, b), -math.inf)


def _to_blocks(x: torch.Tensor, block: int, groups: int) -> torch.Tensor:
    """[N, Hkv*G, D] -> [Hkv, nb, G*block, D] (zero-padded rows), head-major."""
    n, h, d = x.shape
    nb = -(-n // block)
    if nb * block != n:
        x = torch.cat([x, x.new_zeros(nb * block - n, h, d)])
    x = x.reshape(nb, block, h // groups, groups, d).permute(2, 0, 3, 1, 4)  # inputs may be strided views
    return x.reshape(h // groups, nb, groups * block, d).contiguous()  # the loops take views of slices


def _from_blocks(xb: torch.Tensor, n: int, groups: int) -> torch.Tensor:
    """Inverse of ``_to_blocks``: [Hkv, nb, G*block, D] -> [n, Hkv*G, D]."""
    hkv, nb, gb, d = xb.shape
    block = gb // groups
    return xb.reshape(hkv, nb, groups, block, d).permute(1, 3, 0, 2, 4).reshape(nb * block, hkv * groups, d)[:n]


def _forward_blocks(qh, kh, vh, plan: _Plan, groups: int, softcap: float | None = None):
    """Online-softmax forward over the plan's batches.

    qh [Hkv,nbq,G*bq,D] (already scaled), kh [Hkv,nbk,bk,D], vh [Hkv,nbk,bk,Dv]; ``softcap`` c: scores
    ``c tanh(s / c)`` (Gemma 2's attention logit soft-cap) before the softmax.
    Returns o [Hkv,nbq,G*bq,Dv] and lse [Hkv,nbq,G*bq] (-inf where no key is visible, o = 0 there).
    """
    hkv, nbq, gb, d = qh.shape
    dv = vh.shape[-1]
    acc = qh.new_zeros(hkv, nbq, gb, dv)
    m = qh.new_full((hkv, nbq, gb), -math.inf)
    den = qh.new_zeros(hkv, nbq, gb)
    for kb, lo, hi, masked in plan.batches:
        n = hi - lo
        s = torch.matmul(qh[:, lo:hi].reshape(hkv, n * gb, d), kh[:, kb].transpose(-1, -2))  # [Hkv,n*G*bq,bk]
        if softcap:
            s = torch.tanh(s.div_(softcap)).mul_(softcap)
        _apply_masks(s, plan, kb, lo, masked, groups)
        mp = s.amax(-1)  # -inf for a row that sees no key of this batch (masked batches only)
        shift = torch.where(mp == -math.inf, 0.0, mp) if masked else mp
        s.sub_(shift.unsqueeze(-1)).exp_()
        lp = s.sum(-1)
        op = torch.matmul(s, vh[:, kb])  # [Hkv,n*G*bq,Dv], relative to exp(shift)
        # The running max stays -inf until a row sees a key (an empty batch must not raise it, which
        # would underflow the real terms); exponents use a finite stand-in, and exp(-inf - finite)
        # = 0 drops empty contributions.
        m_old = m[:, lo:hi].view(hkv, n * gb)
        m_new = torch.maximum(m_old, mp)
        m_fin = torch.where(m_new == -math.inf, 0.0, m_new) if masked else m_new
        a_old = torch.exp(m_old - m_fin)
        a_new = torch.exp(mp - m_fin)
        acc_s = acc[:, lo:hi].view(hkv, n * gb, dv)
        acc_s.mul_(a_old.unsqueeze(-1)).add_(op.mul_(a_new.unsqueeze(-1)))
        den_s = den[:, lo:hi].view(hkv, n * gb)
        den_s.mul_(a_old).add_(lp.mul_(a_new))
        m_old.copy_(m_new)
    pos = den > 0
    den1 = torch.where(pos, den, torch.ones_like(den))
    return acc.div_(den1.unsqueeze(-1)), torch.where(pos, m + torch.log(den1), -math.inf)


def _backward_blocks(qh, kh, vh, oh, lse, doh, dlse, plan: _Plan, groups: int, softcap: float | None = None):
    """Recompute-based backward. Returns dqh (w.r.t. the scaled q), dkh, dvh in block layout."""
    hkv, _, gb, d = qh.shape
    dv = vh.shape[-1]
    # dL/dS = P * (dP - rowsum(dO * O) + dlse): the lse cotangent enters as a shift of delta.
    delta = (doh * oh).sum(-1)
    if dlse is not None:
        delta = delta - dlse
    # Rows with no visible key: lse = -inf; using +inf there makes every recomputed probability
    # exactly 0. Both row shifts enter the matmuls as a broadcast bias (baddbmm): one pass fewer.
    neg_lse = torch.where(lse == -math.inf, -math.inf, -lse).unsqueeze(-1)
    neg_delta = delta.neg_().unsqueeze(-1)
    dq = qh.new_zeros(qh.shape)
    # key-block-major gradients: dk[kb] is one contiguous [Hkv, bk, D] output of a batched matmul
    nbk = kh.shape[1]
    dk = kh.new_zeros(nbk, hkv, kh.shape[2], d)
    dvv = vh.new_zeros(nbk, hkv, vh.shape[2], dv)
    for kb, lo, hi, masked in plan.batches:
        n = hi - lo
        qs = qh[:, lo:hi].reshape(hkv, n * gb, d)
        dos = doh[:, lo:hi].reshape(hkv, n * gb, dv)
        kt = kh[:, kb]
        if softcap:  # P from the capped scores; dS then goes through the cap's derivative 1 - tanh^2
            t = torch.tanh(torch.matmul(qs, kt.transpose(-1, -2)).div_(softcap))
            s = (t * softcap).add_(neg_lse[:, lo:hi].reshape(hkv, n * gb, 1))
        else:
            s = torch.baddbmm(neg_lse[:, lo:hi].reshape(hkv, n * gb, 1), qs, kt.transpose(-1, -2))
        _apply_masks(s, plan, kb, lo, masked, groups)
        s.exp_()  # probabilities P
        dvv[kb].baddbmm_(s.transpose(-1, -2), dos)
        ds = torch.baddbmm(neg_delta[:, lo:hi].reshape(hkv, n * gb, 1), dos, vh[:, kb].transpose(-1, -2))
        ds.mul_(s)
        if softcap:
            ds.mul_(1 - t * t)
        dq[:, lo:hi].view(hkv, n * gb, d).baddbmm_(ds, kt)
        dk[kb].baddbmm_(ds.transpose(-1, -2), qs)
    dk, dvv = dk.transpose(0, 1), dvv.transpose(0, 1)
    return dq, dk, dvv


class _TreeAttentionFn(torch.autograd.Function):
    """(q, k, v) -> (o, lse) for sorted query rows; saves only q, k, v, o, lse (block layout)."""

    @staticmethod
    def forward(ctx, q, k, v, plan: _Plan, scale: float, softcap: float | None = None):
        ctx.set_materialize_grads(False)  # an unused o or lse costs nothing in backward
        groups = q.shape[1] // k.shape[1]
        cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
        qh = _to_blocks(q.to(cdt) * scale, plan.block_q, groups)
        kh = _to_blocks(k.to(cdt), plan.block_k, 1)
        vh = _to_blocks(v.to(cdt), plan.block_k, 1)
        oh, lse = _forward_blocks(qh, kh, vh, plan, groups, softcap)
        ctx.save_for_backward(qh, kh, vh, oh, lse)
        ctx.plan, ctx.scale, ctx.groups, ctx.softcap = plan, scale, groups, softcap
        ctx.dtypes = (q.dtype, k.dtype, v.dtype)
        o = _from_blocks(oh, plan.num_q, groups).to(q.dtype)
        lse_out = _from_blocks(lse.unsqueeze(-1), plan.num_q, groups).squeeze(-1)
        return o, lse_out

    @staticmethod
    def backward(ctx, do, dlse):
        qh, kh, vh, oh, lse = ctx.saved_tensors
        plan, groups = ctx.plan, ctx.groups
        if do is None and dlse is None:
            return None, None, None, None, None, None
        cdt = qh.dtype
        if do is None:
            doh = oh.new_zeros(oh.shape)
        else:
            doh = _to_blocks(do.to(cdt), plan.block_q, groups)
        dlse_h = None if dlse is None else _to_blocks(dlse.to(cdt).unsqueeze(-1), plan.block_q, groups).squeeze(-1)
        dqh, dkh, dvh = _backward_blocks(qh, kh, vh, oh, lse, doh, dlse_h, plan, groups, ctx.softcap)
        dq = (_from_blocks(dqh, plan.num_q, groups) * ctx.scale).to(ctx.dtypes[0])
        dk = _from_blocks(dkh, plan.num_k, 1).to(ctx.dtypes[1])
        dv = _from_blocks(dvh, plan.num_k, 1).to(ctx.dtypes[2])
        return dq, dk, dv, None, None, None


def _torch_partial(q, k, v, q_rows, k_rows, k_vis, q_pos, k_pos, scale, window, block_size, batch_elems,
                   softcap=None):
    tile = q.shape[1] * block_size * block_size
    plan = _make_plan(q_rows, k_rows, k_vis, q_pos, k_pos, window, block_size, block_size,
                      max(1, batch_elems // tile))
    return _TreeAttentionFn.apply(q, k, v, plan, scale, softcap)


# ====================================================================== public API
def _check_qkv(q, k, v):
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [N,H,D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[:2] != v.shape[:2] or q.shape[2] != k.shape[2]:
        raise ValueError(f"incompatible k {tuple(k.shape)} / v {tuple(v.shape)} / q {tuple(q.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})")


def tree_attention_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_rows: torch.Tensor,
                           k_rows: torch.Tensor, k_visible_until: torch.Tensor, *,
                           q_positions: torch.Tensor | None = None, k_positions: torch.Tensor | None = None,
                           softmax_scale: float | None = None, window: int | None = None, backend: str = "auto",
                           block_size: int | None = None, softcap: float | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a query set against one key set (one stage of a staged/CP computation).

    q [Nq,Hq,D] with global row ids q_rows [Nq]; k [Nk,Hkv,D], v [Nk,Hkv,Dv] with global row ids
    k_rows [Nk] and their k_visible_until [Nk]. Query q sees key k iff
    ``k_rows[k] <= q_rows[q] < k_visible_until[k]`` and, with ``window``,
    ``q_positions[q] - k_positions[k] < window``. Rows may come in any order (sorted rows are used
    as given; others are sorted internally).

    Returns ``(o [Nq,Hq,Dv], lse [Nq,Hq])``: softmax-normalised over this key set only; lse is the
    natural-log normaliser (float32, float64 for float64 inputs), -inf with o = 0 for a query that
    sees no key here. Both are differentiable (gradients flow through lse too), so stages over
    disjoint key sets combine exactly with ``merge_attention`` (then ``apply_sinks`` once).
    ``softcap`` c: attention logits ``c tanh(s / c)`` of the scaled scores (Gemma 2), the torch backend
    only ("auto" takes it; "flex" is refused).
    """
    _check_qkv(q, k, v)
    if q_rows.shape != (q.shape[0],) or k_rows.shape != (k.shape[0],) or k_visible_until.shape != k_rows.shape:
        raise ValueError("q_rows must be [Nq]; k_rows and k_visible_until must be [Nk]")
    if window is not None:
        if q_positions is None or k_positions is None:
            raise ValueError("window needs q_positions and k_positions")
        if int(window) < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        window = int(window)
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    name = select_backend("tree_attention", backend, q, _GPU_BACKENDS)
    if name == "flex" and backend == "auto" and q.dtype == torch.float64:
        name = "torch"  # the flex kernels target 16/32-bit floats; float64 takes the exact reference
    if name == "flex" and (q.shape[0] == 0 or k.shape[0] == 0):
        name = "torch"  # nothing to compute; the torch path returns o = 0, lse = -inf, zero grads
    if softcap is not None and name != "torch":
        if backend != "auto":
            raise ValueError(f"softcap (an attention logit soft-cap) runs on the torch backend only, not {name!r}")
        name = "torch"
    dev = q.device
    q_rows, k_rows, k_visible_until = q_rows.to(dev), k_rows.to(dev), k_visible_until.to(dev)
    if window is not None:
        q_positions, k_positions = q_positions.to(dev), k_positions.to(dev)
    else:
        q_positions = k_positions = None

    # Sort queries (block ranges need it) and keys (tighter tiles); undo the query order at the end.
    q_perm = None
    if q_rows.shape[0] > 1 and bool((q_rows[1:] < q_rows[:-1]).any()):
        q_perm = torch.argsort(q_rows, stable=True)
        q, q_rows = q[q_perm], q_rows[q_perm]
        q_positions = None if q_positions is None else q_positions[q_perm]
    if k_rows.shape[0] > 1 and bool((k_rows[1:] < k_rows[:-1]).any()):
        k_perm = torch.argsort(k_rows, stable=True)
        k, v, k_rows, k_visible_until = k[k_perm], v[k_perm], k_rows[k_perm], k_visible_until[k_perm]
        k_positions = None if k_positions is None else k_positions[k_perm]

    if name == "flex":
        from .flex_attention import flex_tree_attention_partial

        # compiled on CUDA; on CPU tensors (the kernel tier's switch only) flex's eager path, the one
        # that returns the LSE there (compiled CPU flex has neither LSE nor a backward)
        o, lse = flex_tree_attention_partial(q, k, v, q_rows, k_rows, k_visible_until, q_positions=q_positions,
                                             k_positions=k_positions, softmax_scale=scale, window=window,
                                             compiled=q.is_cuda)
    else:
        o, lse = _torch_partial(q, k, v, q_rows, k_rows, k_visible_until, q_positions, k_positions, scale, window,
                                int(block_size or DEFAULT_BLOCK_SIZE),
                                DEFAULT_BATCH_ELEMENTS_CUDA if q.is_cuda else DEFAULT_BATCH_ELEMENTS, softcap)
    if q_perm is not None:
        inv = torch.empty_like(q_perm)
        inv[q_perm] = torch.arange(q_perm.shape[0], device=dev)
        o, lse = o[inv], lse[inv]
    return o, lse


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: TreeLayout, *,
                   softmax_scale: float | None = None, window: int | None = None, sinks: torch.Tensor | None = None,
                   return_lse: bool = False, backend: str = "auto", block_size: int | None = None,
                   softcap: float | None = None):
    """Softmax attention over a packed prefix forest.

    q [N,Hq,D], k [N,Hkv,D], v [N,Hkv,Dv] token-major (N = ``layout.num_rows``); Hq a multiple of
    Hkv (query head h uses kv head ``h // (Hq // Hkv)``). Row q attends to the rows k with
    ``k <= q < layout.visible_until[k]`` (its root path), restricted by ``window`` w to
    ``position_ids[q] - position_ids[k] < w``. ``softmax_scale`` defaults to D**-0.5.
    ``sinks`` [Hq]: one learned logit per head joins each query's softmax denominator (zero value),
    once; it receives a gradient.

    Returns o [N,Hq,Dv] (input dtype), plus lse [N,Hq] (natural log, float32, float64 for float64
    inputs, including the sink term) when ``return_lse``. ``backend``: "torch" (any device, exact
    reference, O(N) memory), "flex" (CUDA FlexAttention), or "auto" (flex for CUDA 16/32-bit
    inputs when available, else torch). ``block_size`` sets the torch backend's tile size.
    ``softcap`` c: attention logits ``c tanh(s / c)`` (Gemma 2's soft-cap; torch backend).
    """
    _check_qkv(q, k, v)
    n = layout.num_rows
    if q.shape[0] != n or k.shape[0] != n:
        raise ValueError(f"q and k must have layout.num_rows={n} rows; got {q.shape[0]} and {k.shape[0]}")
    layout = layout if layout.device == q.device else layout.to(q.device)
    rows = torch.arange(n, device=q.device)
    pos = layout.position_ids if window is not None else None
    o, lse = tree_attention_partial(q, k, v, rows, rows, layout.visible_until, q_positions=pos, k_positions=pos,
                                    softmax_scale=softmax_scale, window=window, backend=backend,
                                    block_size=block_size, softcap=softcap)
    if sinks is not None:
        o, lse = apply_sinks(o, lse, sinks)
    return (o, lse) if return_lse else o


# ====================================================================== merging stages
def _merge_weights(lse_a: torch.Tensor, lse_b: torch.Tensor):
    """Exact, NaN-free weights of two normalisers: returns (w_a, w_b, lse) with w = exp(lse_x - lse)."""
    # The shift cancels in the value, so it needs no gradient; it only keeps exp() in range.
    m = torch.maximum(lse_a, lse_b).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    ea, eb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    s = ea + eb
    nonempty = s > 0
    s_safe = torch.where(nonempty, s, torch.ones_like(s))  # both sides empty: no key anywhere
    lse = torch.where(nonempty, m + torch.log(s_safe), torch.full_like(s, -math.inf))
    return ea / s_safe, eb / s_safe, lse


def merge_attention(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor):
    """Combine attention over two disjoint key sets: o [...,Dv], lse [...] -> (o, lse).

    Exact in value and gradient (through both o and lse); a side with lse = -inf contributes nothing
    and two empty sides give o = 0, lse = -inf without NaN in forward or backward.
    """
    wdt = torch.promote_types(lse_a.dtype, lse_b.dtype)
    w_a, w_b, lse = _merge_weights(lse_a.to(wdt), lse_b.to(wdt))
    cdt = torch.promote_types(o_a.dtype, wdt)
    o = o_a.to(cdt) * w_a.unsqueeze(-1) + o_b.to(cdt) * w_b.unsqueeze(-1)
    return o.to(o_a.dtype), lse


def apply_sinks(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor):
    """Add a learned sink logit per head to the softmax denominator: o [N,H,Dv], lse [N,H], sinks [H].

    The sink has zero value, so it only rescales: o' = o * exp(lse - lse'), lse' = logaddexp(lse, sink).
    Apply once per query, after all stages are merged. Differentiable in o, lse and sinks.
    """
    if sinks.shape != (o.shape[1],):
        raise ValueError(f"sinks must be [H={o.shape[1]}], got {tuple(sinks.shape)}")
    wdt = torch.promote_types(lse.dtype, sinks.dtype)
    w, _, lse_new = _merge_weights(lse.to(wdt), sinks.to(wdt).expand_as(lse))
    cdt = torch.promote_types(o.dtype, wdt)
    return (o.to(cdt) * w.unsqueeze(-1)).to(o.dtype), lse_new
