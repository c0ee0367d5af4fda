"""Tree attention against per-sample plain causal attention (the oracle is written here, not imported).

Every check compares the tree op, indexed at a sample's rows, with ordinary causal softmax attention
run on that sample alone (gathered with ``x[rows]``), in float64 at ~1e-10: outputs, lse and the
gradients of q, k, v and sinks (shared rows receive the sum over the samples through them).
"""
from __future__ import annotations

import math

import pytest
import torch

import megatron_tree.ops.attention as attn_mod
from megatron_tree.ops.attention import (apply_sinks, block_pairs, merge_attention, tree_attention,
                                         tree_attention_partial)
from megatron_tree.ops.flex_attention import (build_flex_block_mask, build_flex_block_tensors,
                                              flex_tree_attention_partial)
from megatron_tree.tree.layout import TreeLayout
from tests.forests import random_forest

F64 = torch.float64
TOL = dict(rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------ oracle
def sample_attention(q, k, v, scale, *, window=None, sinks=None, softcap=None):
    """Plain causal attention of ONE sample: q [L,Hq,D], k [L,Hkv,D], v [L,Hkv,Dv] -> (o, lse).

    The window is measured in the sample's own token index (position 0 at its first token); ``softcap``
    c: scores ``c tanh(s / c)`` (as transformers' Gemma 2 caps its attention logits).
    """
    L, hq, _ = q.shape
    g = hq // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(L)
    allowed = i[None, :] <= i[:, None]
    if window is not None:
        allowed &= (i[:, None] - i[None, :]) < window
    s = s.masked_fill(~allowed, -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.view(hq, 1, 1).expand(hq, L, 1).to(s.dtype)], -1)
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1)[..., :L]
    o = torch.einsum("hqk,khd->qhd", p, vv)
    return o, lse.T


def leaf(*shape, dtype=F64, gen=None):
    return torch.randn(*shape, dtype=dtype, generator=gen).requires_grad_(True)


def make_qkv(n, hq, hkv, d, dv, seed, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    return leaf(n, hq, d, dtype=dtype, gen=gen), leaf(n, hkv, d, dtype=dtype, gen=gen), leaf(n, hkv, dv, dtype=dtype, gen=gen)


def check_against_oracle(layout, samples, *, hq=4, hkv=2, d=8, dv=6, window=None, with_sinks=False, seed=0,
                         dtype=F64, tol=TOL, **kw):
    """Forward (o, lse at sample rows) and gradients (q, k, v, sinks) of the tree op vs per-sample oracle."""
    n = layout.num_rows
    q, k, v = make_qkv(n, hq, hkv, d, dv, seed, dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    sinks = leaf(hq, dtype=dtype, gen=gen) if with_sinks else None
    scale = kw.pop("softmax_scale", None)
    eff_scale = scale if scale is not None else d ** -0.5
    params = [q, k, v] + ([sinks] if with_sinks else [])
    cot = [(torch.randn(len(r), hq, dv, dtype=dtype, generator=gen), torch.randn(len(r), hq, dtype=dtype, generator=gen))
           for r in samples]

    softcap = kw.get("softcap")
    o, lse = tree_attention(q, k, v, layout, softmax_scale=scale, window=window, sinks=sinks, return_lse=True,
                            backend="torch", **kw)
    assert o.shape == (n, hq, dv) and lse.shape == (n, hq)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()  # padding rows see themselves
    loss_tree = 0
    loss_ref = 0
    for rows, (go, gl) in zip(samples, cot):
        ro, rl = sample_attention(q[rows], k[rows], v[rows], eff_scale, window=window, sinks=sinks, softcap=softcap)
        torch.testing.assert_close(o[rows], ro, **tol)
        torch.testing.assert_close(lse[rows], rl, **tol)
        loss_tree = loss_tree + (o[rows] * go).sum() + (lse[rows] * gl).sum()
        loss_ref = loss_ref + (ro * go).sum() + (rl * gl).sum()
    g_tree = torch.autograd.grad(loss_tree, params)
    g_ref = torch.autograd.grad(loss_ref, params)
    for a, b in zip(g_tree, g_ref):
        torch.testing.assert_close(a, b, **tol)
    return o, lse


# ------------------------------------------------------------------ equivalence
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("heads", [(2, 2), (4, 2), (3, 1)])
def test_matches_per_sample(seed, heads):
    layout, samples = random_forest(seed)
    check_against_oracle(layout, samples, hq=heads[0], hkv=heads[1], seed=seed, block_size=8)


@pytest.mark.parametrize("block_size", [1, 5, 16, 128])
def test_block_sizes_and_scale(block_size):
    layout, samples = random_forest(7)
    check_against_oracle(layout, samples, block_size=block_size, softmax_scale=0.3, with_sinks=True, seed=7)


@pytest.mark.parametrize("seed,window", [(0, 1), (1, 3), (2, 4), (4, 2)])
def test_window_matches_per_sample(seed, window):
    layout, samples = random_forest(seed)
    check_against_oracle(layout, samples, window=window, with_sinks=seed % 2 == 0, seed=seed, block_size=4)


@pytest.mark.parametrize("seed,window,cap", [(0, None, 0.5), (1, 3, 1.0), (2, None, 2.0)])
def test_softcap_matches_per_sample(seed, window, cap):
    """Gemma 2's attention logit soft-cap: forward and gradients (through the cap's 1 - tanh^2) equal
    per-sample attention on capped scores; a small cap changes the result (scores of q, k ~ N(0, 1) at
    d = 8 reach several units)."""
    layout, samples = random_forest(seed)
    o, _ = check_against_oracle(layout, samples, window=window, with_sinks=seed == 1, seed=seed, block_size=4,
                                softcap=cap)
    q, k, v = make_qkv(layout.num_rows, 4, 2, 8, 6, seed)
    plain = tree_attention(q, k, v, layout, window=window, backend="torch")
    assert float((plain - o).abs().max()) > 1e-2


def test_window_never_leaks_sibling():
    # Root 0..3 (positions 0..3); sibling A rows 4..6 (positions 4..6); sibling B rows 7..9
    # (positions 4..6). Row 7 is B's first row: its physical neighbours 4..6 are in A, at positions
    # within any window, and must still be invisible.
    layout = TreeLayout.from_segments([4, 3, 3], [-1, 0, 0])
    q, k, v = make_qkv(layout.num_rows, 2, 1, 4, 3, seed=3)
    b_rows = torch.tensor([0, 1, 2, 3, 7, 8, 9])
    for window in (None, 2, 3, 10):
        o = tree_attention(q, k, v, layout, window=window, backend="torch", block_size=4)
        ref, _ = sample_attention(q[b_rows], k[b_rows], v[b_rows], 4 ** -0.5, window=window)
        torch.testing.assert_close(o[b_rows], ref, **TOL)
        # perturbing sibling A's keys and values changes nothing in B, and gives B no gradient path
        k2, v2 = k.detach().clone(), v.detach().clone()
        k2[4:7] += 5.0
        v2[4:7] -= 7.0
        o2 = tree_attention(q, k2, v2, layout, window=window, backend="torch", block_size=4)
        assert torch.equal(o2[7:10], o[7:10].detach())
        gk, gv = torch.autograd.grad(o[7:10].sum(), (k, v))
        assert gk[4:7].abs().max() == 0 and gv[4:7].abs().max() == 0
    # a window of 1 sees only the row itself
    o = tree_attention(q, k, v, layout, window=1, backend="torch")
    torch.testing.assert_close(o, v.repeat_interleave(2, 1), **TOL)


def test_sinks_counted_once():
    layout, samples = random_forest(5)
    o, lse = check_against_oracle(layout, samples, hq=4, hkv=1, with_sinks=True, seed=5)
    # With a very negative sink the result approaches sink-free attention; with a very positive one
    # the output vanishes: the sink sits in the denominator exactly once per query.
    q, k, v = make_qkv(layout.num_rows, 4, 1, 8, 6, seed=5)
    o0, lse0 = tree_attention(q, k, v, layout, return_lse=True, backend="torch")
    s = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=F64)
    o1, lse1 = tree_attention(q, k, v, layout, sinks=s, return_lse=True, backend="torch")
    torch.testing.assert_close(lse1, torch.logaddexp(lse0, s), **TOL)
    torch.testing.assert_close(o1, o0 * torch.exp(lse0 - lse1).unsqueeze(-1), **TOL)


def test_larger_forest_multiple_blocks_and_skipping():
    layout, samples = random_forest(11, num_trees=4, max_len=24, max_depth=4, num_padding=5)
    n = layout.num_rows
    assert n >= 250
    bs = 16
    rows = torch.arange(n)
    pairs = block_pairs(rows, rows, layout.visible_until, block_q=bs, block_k=bs)
    nb = -(-n // bs)
    assert nb >= 16
    # skipping is real: far fewer tiles than the causal lower triangle, and some are full
    assert pairs.num_pairs < 0.6 * nb * (nb + 1) / 2
    assert pairs.full.any() and (~pairs.full).any()
    check_against_oracle(layout, samples, hq=4, hkv=2, d=8, dv=8, seed=11, block_size=bs, with_sinks=True)


@pytest.mark.parametrize("use", ["o", "lse"])
def test_gradient_through_one_output(use):
    # backward receives a cotangent for only one of (o, lse); the other arrives as None
    layout, samples = random_forest(8)
    q, k, v = make_qkv(layout.num_rows, 4, 2, 8, 5, seed=8)
    o, lse = tree_attention(q, k, v, layout, return_lse=True, backend="torch", block_size=4)
    out, ref = (o, 0) if use == "o" else (lse, 1)
    loss = sum((out[r] * torch.cos(out[r])).sum() for r in samples)
    loss_ref = sum((x * torch.cos(x)).sum() for x in
                   (sample_attention(q[r], k[r], v[r], 8 ** -0.5)[ref] for r in samples))
    g_ref = torch.autograd.grad(loss_ref, (q, k, v), allow_unused=True)  # lse does not depend on v
    for a, b, x in zip(torch.autograd.grad(loss, (q, k, v)), g_ref, (q, k, v)):
        torch.testing.assert_close(a, torch.zeros_like(x) if b is None else b, **TOL)


def test_batch_splitting_is_exact(monkeypatch):
    layout, samples = random_forest(12, num_trees=3, max_len=20, max_depth=3)
    q, k, v = make_qkv(layout.num_rows, 4, 2, 8, 5, seed=12)
    o_ref, lse_ref = tree_attention(q, k, v, layout, return_lse=True, backend="torch", block_size=8)
    g_ref = torch.autograd.grad(o_ref.square().sum() + lse_ref.sum(), (q, k, v))
    monkeypatch.setattr(attn_mod, "DEFAULT_BATCH_ELEMENTS", 1)  # one tile per batch
    o, lse = tree_attention(q, k, v, layout, return_lse=True, backend="torch", block_size=8)
    g = torch.autograd.grad(o.square().sum() + lse.sum(), (q, k, v))
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(lse, lse_ref, **TOL)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, **TOL)


def test_float32_sanity_and_dtypes():
    layout, samples = random_forest(2)
    check_against_oracle(layout, samples, dtype=torch.float32, tol=dict(rtol=1e-4, atol=1e-5), seed=2,
                         with_sinks=True, block_size=8)
    q, k, v = make_qkv(layout.num_rows, 2, 2, 8, 8, seed=2, dtype=torch.float32)
    o, lse = tree_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), layout, return_lse=True, backend="torch")
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    o32 = tree_attention(q, k, v, layout, backend="torch")
    assert (o.float() - o32).abs().max() < 5e-2


def test_strided_inputs():
    # q, k, v as strided views (e.g. [s, b, h, d][:, 0] or head-major storage), rows a multiple of the block
    layout = TreeLayout.from_segments([8, 4, 4], [-1, 0, 0])
    q, k, v = make_qkv(16, 4, 2, 8, 8, seed=1)
    o_ref = tree_attention(q, k, v, layout, backend="torch", block_size=8)
    qs = q.detach().transpose(0, 1).contiguous().transpose(0, 1)
    ks = torch.cat([k.detach(), k.detach()], 1)[:, 2:]
    vs = torch.stack([v.detach(), v.detach()], 1)[:, 0]
    assert not qs.is_contiguous() and not ks.is_contiguous() and not vs.is_contiguous()
    torch.testing.assert_close(tree_attention(qs, ks, vs, layout, backend="torch", block_size=8), o_ref, **TOL)


def test_padding_rows_finite():
    layout, _ = random_forest(3, num_padding=4)
    q, k, v = make_qkv(layout.num_rows, 2, 1, 4, 4, seed=3)
    o, lse = tree_attention(q, k, v, layout, return_lse=True, backend="torch", block_size=4)
    pad = layout.is_padding
    assert torch.isfinite(o[pad]).all() and torch.isfinite(lse[pad]).all()
    g = torch.autograd.grad(o.sum() + lse.sum(), (q, k, v))
    assert all(torch.isfinite(x).all() for x in g)


# ------------------------------------------------------------------ staged form
def _random_split(n, parts, gen):
    owner = torch.randint(0, parts, (n,), generator=gen)
    owner[torch.randperm(n, generator=gen)[:parts]] = torch.arange(parts)  # no empty part
    return [torch.nonzero(owner == p).flatten()[torch.randperm(int((owner == p).sum()), generator=gen)]
            for p in range(parts)]


@pytest.mark.parametrize("seed,parts,window", [(0, 2, None), (1, 3, None), (6, 3, 3)])
def test_staged_split_merge_exact(seed, parts, window):
    layout, _ = random_forest(seed)
    n, hq, hkv = layout.num_rows, 4, 2
    q, k, v = make_qkv(n, hq, hkv, 8, 6, seed=seed)
    gen = torch.Generator().manual_seed(100 + seed)
    sinks = leaf(hq, gen=gen)
    go, gl = torch.randn(n, hq, 6, dtype=F64, generator=gen), torch.randn(n, hq, dtype=F64, generator=gen)
    params = (q, k, v, sinks)

    o_ref, lse_ref = tree_attention(q, k, v, layout, window=window, sinks=sinks, return_lse=True, backend="torch",
                                    block_size=4)
    g_ref = torch.autograd.grad((o_ref * go).sum() + (lse_ref * gl).sum(), params)

    vis, pos = layout.visible_until, layout.position_ids
    q_sets = _random_split(n, 2, gen)  # queries also split and unsorted: rows are global ids
    o = torch.zeros(n, hq, 6, dtype=F64)
    lse = torch.zeros(n, hq, dtype=F64)
    for qr in q_sets:
        o_acc = lse_acc = None
        for kr in _random_split(n, parts, gen):
            o_p, lse_p = tree_attention_partial(q[qr], k[kr], v[kr], qr, kr, vis[kr], q_positions=pos[qr],
                                                k_positions=pos[kr], window=window, backend="torch", block_size=4)
            if o_acc is None:
                o_acc, lse_acc = o_p, lse_p
            else:
                o_acc, lse_acc = merge_attention(o_acc, lse_acc, o_p, lse_p)
        o_acc, lse_acc = apply_sinks(o_acc, lse_acc, sinks)
        o = o.index_put((qr,), o_acc)
        lse = lse.index_put((qr,), lse_acc)
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(lse, lse_ref, **TOL)
    g = torch.autograd.grad((o * go).sum() + (lse * gl).sum(), params)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, **TOL)


def test_partial_rows_without_visible_keys():
    # Keys of the second tree only; queries of the first tree see none of them.
    layout = TreeLayout.from_segments([3, 2, 2, 4, 3], [-1, 0, 0, -1, 3])
    n = layout.num_rows
    q, k, v = make_qkv(n, 2, 2, 4, 3, seed=9)
    qr, kr = torch.arange(n), torch.arange(7, n)
    o, lse = tree_attention_partial(q, k[kr], v[kr], qr, kr, layout.visible_until[kr], backend="torch", block_size=4)
    assert torch.equal(o[:7], torch.zeros_like(o[:7])) and torch.isinf(lse[:7]).all() and (lse[:7] < 0).all()
    assert torch.isfinite(o).all()
    gq, gk, gv = torch.autograd.grad((o * torch.randn_like(o)).sum() + (lse[7:] * 2).sum(), (q, k, v))
    assert all(torch.isfinite(x).all() for x in (gq, gk, gv))
    assert gq[:7].abs().max() == 0
    # an empty key set behaves the same and still backpropagates
    e = torch.zeros(0, dtype=torch.long)
    o, lse = tree_attention_partial(q, k[e], v[e], qr, e, e, backend="torch")
    assert torch.equal(o, torch.zeros_like(o)) and torch.isinf(lse).all()
    g = torch.autograd.grad(o.sum(), q, allow_unused=True)[0]
    assert g is None or g.abs().max() == 0


def test_merge_attention_edge_cases():
    gen = torch.Generator().manual_seed(4)
    o_a, o_b = leaf(5, 2, 3, gen=gen), leaf(5, 2, 3, gen=gen)
    lse_a, lse_b = leaf(5, 2, gen=gen), leaf(5, 2, gen=gen)
    with torch.no_grad():
        lse_a[0] = -math.inf  # a empty
        lse_b[1] = -math.inf  # b empty
        lse_a[2] = -math.inf  # both empty
        lse_b[2] = -math.inf
        lse_a[3] = 800.0  # large values stay finite
        lse_b[3] = 799.0
    o, lse = merge_attention(o_a, lse_a, o_b, lse_b)
    torch.testing.assert_close(o[0], o_b[0], **TOL)
    torch.testing.assert_close(lse[0], lse_b[0], **TOL)
    torch.testing.assert_close(o[1], o_a[1], **TOL)
    assert torch.equal(o[2], torch.zeros_like(o[2])) and torch.isinf(lse[2]).all()
    w = torch.sigmoid(torch.tensor(1.0, dtype=F64))
    torch.testing.assert_close(o[3], w * o_a[3] + (1 - w) * o_b[3], **TOL)
    torch.testing.assert_close(lse[3], torch.full((2,), 800.0 + math.log1p(math.exp(-1.0)), dtype=F64), **TOL)
    grads = torch.autograd.grad((o * torch.randn_like(o)).sum() + lse[[0, 1, 3, 4]].sum(), (o_a, lse_a, o_b, lse_b))
    assert all(torch.isfinite(g).all() for g in grads)
    # exact gradient on rows with finite inputs, against the closed form
    ok = torch.tensor([3, 4])
    gcheck = torch.autograd.gradcheck(
        lambda a, la, b, lb: merge_attention(a, la, b, lb), (o_a[ok].detach().requires_grad_(),
                                                            lse_a[ok].detach().requires_grad_(),
                                                            o_b[ok].detach().requires_grad_(),
                                                            lse_b[ok].detach().requires_grad_()))
    assert gcheck


# ------------------------------------------------------------------ block metadata
def _tile_truth(dense, nq, nk, bq, bk):
    """Tile-level truth from a dense mask: any visible, all visible (incomplete tiles never full)."""
    nbq, nbk = -(-nq // bq), -(-nk // bk)
    pad = torch.zeros(nbq * bq, nbk * bk, dtype=torch.bool)
    pad[:nq, :nk] = dense
    t = pad.view(nbq, bq, nbk, bk).permute(0, 2, 1, 3)
    any_ = t.any(-1).any(-1)
    complete = torch.zeros(nbq * bq, nbk * bk, dtype=torch.bool)
    complete[:nq, :nk] = True
    all_ = t.all(-1).all(-1) & complete.view(nbq, bq, nbk, bk).permute(0, 2, 1, 3).all(-1).all(-1)
    return any_, all_


def _dense(qr, kr, vis, qp=None, kp=None, window=None):
    m = (kr[None, :] <= qr[:, None]) & (qr[:, None] < vis[None, :])
    if window is not None:
        m &= (qp[:, None] - kp[None, :]) < window
    return m


@pytest.mark.parametrize("seed", [0, 1, 3])
@pytest.mark.parametrize("bq,bk", [(3, 3), (4, 8), (8, 4)])
def test_block_pairs_vs_dense_mask(seed, bq, bk):
    layout, _ = random_forest(seed)
    n = layout.num_rows
    rows, vis, pos = torch.arange(n), layout.visible_until, layout.position_ids
    gen = torch.Generator().manual_seed(seed)
    ksub = torch.randperm(n, generator=gen)[: n // 2]  # unsorted key subset (a CP stage)
    qsub = torch.sort(torch.randperm(n, generator=gen)[: n // 2]).values
    cases = [(rows, rows, None), (rows, rows, 3), (qsub, ksub, None), (qsub, ksub, 2)]
    for qr, kr, window in cases:
        p = block_pairs(qr, kr, vis[kr], block_q=bq, block_k=bk, q_positions=pos[qr], k_positions=pos[kr],
                        window=window)
        any_, all_ = _tile_truth(_dense(qr, kr, vis[kr], pos[qr], pos[kr], window), len(qr), len(kr), bq, bk)
        listed = torch.zeros_like(any_)
        listed[p.q_block, p.k_block] = True
        full = torch.zeros_like(any_)
        full[p.q_block[p.full], p.k_block[p.full]] = True
        assert p.num_pairs == int(listed.sum())  # no duplicates
        assert (listed >= any_).all(), "a tile with a visible pair was skipped"
        assert torch.equal(full, all_), "full tiles must be exactly the fully visible ones"
        key = p.q_block * p.num_k_blocks + p.k_block
        assert (key[1:] > key[:-1]).all()  # sorted by (q_block, k_block)
        if qr is rows and window is None and bq == bk:
            assert torch.equal(listed, any_), "self-attention tiles are exact"


def test_block_pairs_rejects_unsorted_queries():
    with pytest.raises(ValueError):
        block_pairs(torch.tensor([2, 1]), torch.tensor([0, 1]), torch.tensor([3, 3]), block_q=1, block_k=1)


@pytest.mark.parametrize("seed,window", [(0, None), (1, None), (2, 3)])
def test_flex_block_tensors_vs_dense_mask(seed, window):
    layout, _ = random_forest(seed, num_trees=3)
    n = layout.num_rows
    rows, vis, pos = torch.arange(n), layout.visible_until, layout.position_ids
    b = 8
    t = build_flex_block_tensors(rows, rows, vis, block_q=b, block_k=b, q_positions=pos, k_positions=pos,
                                 window=window)
    nb = -(-n // b)
    assert t.kv_num_blocks.shape == (1, 1, nb) and t.kv_indices.shape == (1, 1, nb, nb)
    assert t.kv_num_blocks.dtype == torch.int32 and t.full_kv_indices.dtype == torch.int32
    assert t.seq_lengths == (nb * b, nb * b)
    dense = _dense(rows, rows, vis, pos, pos, window)
    any_, all_ = _tile_truth(dense, n, n, b, b)
    part = torch.zeros_like(any_)
    full = torch.zeros_like(any_)
    for i in range(nb):
        kp = t.kv_indices[0, 0, i, : t.kv_num_blocks[0, 0, i]].long()
        kf = t.full_kv_indices[0, 0, i, : t.full_kv_num_blocks[0, 0, i]].long()
        assert (kp[1:] > kp[:-1]).all() and (kf[1:] > kf[:-1]).all()
        part[i, kp] = True
        full[i, kf] = True
    assert not (part & full).any()
    assert torch.equal(full, all_)
    assert (part | full >= any_).all()
    if window is None:
        assert torch.equal(part, any_ & ~all_)  # partial = nonempty but not full

    # What the kernel computes from the BlockMask (full tiles unmasked, partial tiles through
    # mask_mod, every other tile skipped) is exactly the visibility mask, padding included.
    bm = build_flex_block_mask(rows, rows, vis, block_q=b, block_k=b, q_positions=pos, k_positions=pos,
                               window=window)
    L = nb * b
    qi, ki = torch.arange(L)[:, None], torch.arange(L)[None, :]
    mm = bm.mask_mod(0, 0, qi, ki)
    tile_part = part.repeat_interleave(b, 0).repeat_interleave(b, 1)
    tile_full = full.repeat_interleave(b, 0).repeat_interleave(b, 1)
    kernel_mask = tile_full | (tile_part & mm)
    expect = torch.zeros(L, L, dtype=torch.bool)
    expect[:n, :n] = dense
    assert torch.equal(kernel_mask, expect)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_eager_reference_on_cpu():
    # flex's uncompiled reference runs on CPU (forward only): checks the mask_mod and lse plumbing.
    layout, _ = random_forest(1)
    n = layout.num_rows
    q, k, v = make_qkv(n, 4, 2, 16, 8, seed=1)
    rows, vis, pos = torch.arange(n), layout.visible_until, layout.position_ids
    with torch.no_grad():
        o, lse = flex_tree_attention_partial(q, k, v, rows, rows, vis, q_positions=pos, k_positions=pos, window=5,
                                             block_size=16, compiled=False)
        o_ref, lse_ref = tree_attention_partial(q, k, v, rows, rows, vis, q_positions=pos, k_positions=pos,
                                                window=5, backend="torch")
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(lse, lse_ref, **TOL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention kernels need CUDA")
@pytest.mark.parametrize("window,with_sinks", [(None, False), (64, True)])
def test_flex_cuda_matches_torch_backend(window, with_sinks):
    layout, _ = random_forest(13, num_trees=4, max_len=60, max_depth=4)
    layout = layout.to("cuda")
    n = layout.num_rows
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, 64, generator=gen).cuda().requires_grad_() for h in (8, 2, 2))
    sinks = torch.randn(8, generator=gen).cuda().requires_grad_() if with_sinks else None
    params = [q, k, v] + ([sinks] if with_sinks else [])
    go, gl = torch.randn(n, 8, 64, device="cuda"), torch.randn(n, 8, device="cuda")
    res = {}
    for backend in ("flex", "torch"):
        o, lse = tree_attention(q, k, v, layout, window=window, sinks=sinks, return_lse=True, backend=backend)
        res[backend] = (o, lse, torch.autograd.grad((o * go).sum() + (lse * gl).sum(), params))
    (o1, l1, g1), (o2, l2, g2) = res["flex"], res["torch"]
    tol = dict(rtol=5e-3, atol=5e-3)  # fp32 kernels with different summation orders; a mask error is O(0.1)
    torch.testing.assert_close(o1, o2, **tol)
    torch.testing.assert_close(l1, l2, **tol)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, **tol)
    assert tree_attention(q, k, v, layout, backend="auto").shape == (n, 8, 64)


# ------------------------------------------------------------------ errors
def test_backend_errors():
    layout, _ = random_forest(0)
    q, k, v = make_qkv(layout.num_rows, 2, 2, 4, 4, seed=0)
    with pytest.raises(ValueError):
        tree_attention(q, k, v, layout, backend="nope")
    with pytest.raises(RuntimeError):
        tree_attention(q, k, v, layout, backend="flex")  # CPU tensors
    with pytest.raises(ValueError):
        tree_attention(q, k[:, :1].expand(-1, 3, -1), v, layout)  # heads not a multiple
    with pytest.raises(ValueError):
        tree_attention(q[:-1], k[:-1], v[:-1], layout)  # wrong number of rows
    with pytest.raises(ValueError):
        tree_attention_partial(q, k, v, torch.arange(len(q)), torch.arange(len(q)), layout.visible_until, window=2)
    # auto on CPU is the torch backend
    torch.testing.assert_close(tree_attention(q, k, v, layout), tree_attention(q, k, v, layout, backend="torch"),
                               rtol=0, atol=0)
