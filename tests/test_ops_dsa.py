"""Tree DSA ops against per-sample stock Megatron DSA (each sample alone), float64.

Oracle: for every sample (a root-to-row path of a random forest), stock Megatron's free functions
`unfused_dsa_fn` and `compute_dsa_indexer_loss` run on the sample alone, with a causal dense index
score (`dsa_index_scores`) and a tie-stable top-k (sort by -score, stable, over positions). Stock
computes in float32 internally, so it is compared at float32 tolerance; a float64 per-sample mirror
of the same formulas (written here) is compared at 1e-10. Tree results: the selected ids (canonical
rows), outputs, the indexer loss (rows weighted by loss_coeff / len(sample) summed over samples) and
every gradient (query, key, value, index_q, weights, index_k) equal the sums over the samples.
"""
from __future__ import annotations

import inspect
import math
from types import SimpleNamespace

import pytest
import torch

import megatron_tree.ops.dsa as dsa_mod
from megatron_tree.ops.dsa import (NO_ROW, dsa_index_scores, dsa_indexer_loss_partial_stats,
                                   dsa_indexer_loss_partial_terms, merge_topk, sparse_attention, tree_dsa,
                                   tree_dsa_indexer_loss, tree_dsa_topk, tree_dsa_topk_partial)
from megatron_tree.tree.layout import TreeLayout
from tests.forests import flat_copy_weights, random_forest

from megatron.core.transformer.experimental_attention_variant.dsa import (compute_dsa_indexer_loss,
                                                                          unfused_dsa_fn)

F64 = torch.float64
TOL = dict(rtol=1e-10, atol=1e-10)
STOCK_REL = 1e-5  # stock computes scores / softmax in float32 (relative to the largest gradient)
PG1 = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))  # tensor-parallel size 1
COEFF = 0.7
try:  # megatron-core >= 0.19 writes the KL term with a log-softmax (see ops.dsa.KL_FORMS)
    import megatron.core.transformer.experimental_attention_variant.dsa_indexer_loss  # noqa: F401
    KL_FORM = "log_softmax"
except ImportError:
    KL_FORM = "eps"


# ------------------------------------------------------------------ oracle (per sample)
def stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[L,L] -> [L,k] positions by (score desc, position asc): a stable sort of -score."""
    return torch.sort(-scores, dim=-1, stable=True).indices[:, :k]


def sample_dsa(rows, t, *, topk, scale, sparse_loss):
    """Stock DSA on one sample (rows of the tree, in path order). t: dict of leaf tensors.

    Returns (o_stock [L,H,Dv], loss_stock, o64, loss64, ids [L,topk] canonical, NO_ROW-padded)."""
    L = rows.shape[0]
    q, k, v = t["query"][rows], t["key"][rows], t["value"][rows]
    h, hk = q.shape[1], k.shape[1]
    kk, vv = k.repeat_interleave(h // hk, 1), v.repeat_interleave(h // hk, 1)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    s = dsa_index_scores(t["index_q"][rows], t["weights"][rows], t["index_k"][rows])
    s = s.masked_fill(~causal, -math.inf)  # what stock's indexer returns with its causal mask
    kk_ = min(topk, L)
    pos = stable_topk(s.detach(), kk_)  # future positions (score -inf) fill the short rows, as stock
    sel = torch.zeros(L, L, dtype=torch.bool).scatter_(1, pos, True) & causal

    o_stock = unfused_dsa_fn(q[:, None], kk[:, None], vv[:, None], pos[None], scale).view(L, h, -1)
    loss_stock = compute_dsa_indexer_loss(s[None].clone(), pos[None], q.detach()[:, None], kk.detach()[:, None],
                                          scale, COEFF, sparse_loss, PG1)

    # float64 mirror of the same formulas
    a = torch.einsum("qhd,khd->hqk", q, kk) * scale
    o64 = torch.einsum("hqk,khd->qhd", torch.softmax(a.masked_fill(~sel, -math.inf), -1), vv)
    S = sel if sparse_loss else causal
    ad = torch.einsum("qhd,khd->hqk", q.detach(), kk.detach()) * scale
    p = torch.softmax(ad.masked_fill(~S, -math.inf), -1).sum(0)
    p = p / p.sum(-1, keepdim=True)
    if KL_FORM == "eps":
        qi = torch.softmax(s.masked_fill(~S, -math.inf), -1)
        kl = p * (torch.log(p + 1e-10) - torch.log(qi + 1e-10))
    else:
        logq = torch.log_softmax(s.masked_fill(~S, -math.inf), -1)
        kl = (p * (torch.log(p.clamp_min(1e-10)) - logq)).masked_fill(~S, 0.0)
    loss64 = kl.sum(-1).mean() * COEFF

    ok = torch.gather(s.detach(), 1, pos) > -math.inf
    ids = torch.where(ok, rows[pos], NO_ROW)
    ids = torch.cat([ids, ids.new_full((L, topk - kk_), NO_ROW)], 1)
    return o_stock, loss_stock, o64, loss64, ids


def make_inputs(n, *, h=4, hk=2, d=8, dv=6, hi=3, di=5, seed=0, ties=False):
    g = torch.Generator().manual_seed(seed)

    def leaf(*shape):
        return torch.randn(*shape, dtype=F64, generator=g)

    t = dict(query=leaf(n, h, d), key=leaf(n, hk, d), value=leaf(n, hk, dv), index_q=leaf(n, hi, di),
             weights=leaf(n, hi), index_k=leaf(n, di))
    if ties:
        # positive weights, ~half of the relu terms exactly 0, some all-zero keys and some all-zero
        # weight rows: many scores are exactly 0 and the tie rule decides the selection
        t["weights"] = t["weights"].abs()
        t["weights"][::3] = 0.0
        t["index_k"][1::4] = 0.0
    return {k_: v_.requires_grad_(True) for k_, v_ in t.items()}


def row_weights(layout, samples, coeff=COEFF):
    rw = torch.zeros(layout.num_rows, dtype=F64)
    for rows in samples:
        rw[rows] += coeff / rows.shape[0]
    return rw


def grads(out, t):
    gs = torch.autograd.grad(out, list(t.values()), allow_unused=True, retain_graph=True)
    return {k_: (torch.zeros_like(v_) if g_ is None else g_) for (k_, v_), g_ in zip(t.items(), gs)}


def family(prompt=7, branches=5, branch_len=3):
    """One prompt and several branches (GRPO-like), plus one padding row."""
    layout = TreeLayout.from_segments([prompt] + [branch_len] * branches, [-1] + [0] * branches, num_padding=1)
    off = layout.segment_offsets.tolist()
    return layout, [torch.cat([torch.arange(off[0], off[1]), torch.arange(off[s], off[s + 1])])
                    for s in range(1, branches + 1)]


def run_case(seed, *, topk, sparse_loss=False, ties=False, index_share=False, block_size=4, rw=None, forest=None,
             prefix_boost=0.0, **shape):
    """Tree vs per-sample: returns a dict of max abs errors (ids as a mismatch count)."""
    layout, samples = random_forest(seed) if forest is None else forest
    n = layout.num_rows
    t = make_inputs(n, seed=seed, ties=ties, **shape)
    if prefix_boost:  # the prompt keys score highest for every query: every branch selects them
        with torch.no_grad():
            t["weights"].abs_()
            t["index_q"].abs_()
            t["index_k"][samples[0][:-3]] = t["index_k"][samples[0][:-3]].abs() + prefix_boost
    scale = t["query"].shape[2] ** -0.5
    go = torch.randn(n, t["query"].shape[1], t["value"].shape[2], dtype=F64, generator=torch.Generator().manual_seed(7))
    count = flat_copy_weights(layout, samples)

    # ---- per-sample oracles
    tot_stock, tot64, loss_stock_sum, loss64_sum = 0.0, 0.0, 0.0, 0.0
    ids_ref = torch.full((n, topk), -2, dtype=torch.long)
    o_ref = torch.zeros(n, t["query"].shape[1], t["value"].shape[2], dtype=F64)
    for rows in samples:
        o_s, l_s, o64, l64, ids = sample_dsa(rows, t, topk=topk, scale=scale, sparse_loss=sparse_loss)
        tot_stock = tot_stock + (o_s * go[rows]).sum() + (0 if index_share else l_s)
        tot64 = tot64 + (o64 * go[rows]).sum() + (0 if index_share else l64)
        ids_ref[rows], o_ref[rows] = ids, o64.detach()
        loss_stock_sum, loss64_sum = loss_stock_sum + l_s, loss64_sum + l64
    g_stock, g64 = grads(tot_stock, t), grads(tot64, t)

    # ---- tree
    covered = count > 0
    selected = None
    if index_share:  # reuse the per-sample selection of a previous layer, as canonical ids
        selected = torch.where(covered[:, None], ids_ref, torch.full_like(ids_ref, NO_ROW))
        selected[~covered, 0] = torch.nonzero(~covered).flatten()  # padding rows: themselves
    rw = row_weights(layout, samples) if rw is None else rw
    o, ids, loss = tree_dsa(t["query"], t["key"], t["value"], t["index_q"], t["weights"], t["index_k"], layout,
                            topk=topk, softmax_scale=scale, selected=selected, loss_row_weight=rw,
                            sparse_loss=sparse_loss, kl_form=KL_FORM, block_size=block_size)
    tot = (o * go * count[:, None, None]).sum() + (0 if loss is None else loss)
    g_tree = grads(tot, t)

    err = {"ids": int((ids[covered] != ids_ref[covered]).sum()),
           "o": (o[covered] - o_ref[covered]).abs().max().item()}
    if not index_share:
        err["loss"] = abs(loss.item() - loss64_sum.item())
        err["loss_stock"] = abs(loss.item() - loss_stock_sum.item()) / max(1.0, abs(loss64_sum.item()))
    for k_ in t:
        err["d" + k_] = (g_tree[k_] - g64[k_]).abs().max().item()
        err["stock_d" + k_] = ((g_tree[k_] - g_stock[k_]).abs().max() / g64[k_].abs().max().clamp_min(1)).item()
    return err


def assert_close(err):
    assert err["ids"] == 0, err
    for k_, v_ in err.items():
        lim = STOCK_REL if ("stock" in k_) else 1e-10
        assert v_ <= lim, (k_, v_, err)


# ------------------------------------------------------------------ tree vs per-sample stock
@pytest.mark.parametrize("case", [
    dict(seed=0, topk=4),                                        # shared-prefix keys chosen by many branches
    dict(seed=1, topk=64),                                       # every query has fewer than topk keys
    dict(seed=2, topk=5, ties=True),                             # exact ties broken by canonical id
    dict(seed=3, topk=3, sparse_loss=True, ties=True),
    dict(seed=4, topk=6, h=3, hk=1, d=4, dv=9, hi=1, di=3),      # MQA (Hk=1), Dv != D, one index head
    dict(seed=5, topk=4, index_share=True),                      # IndexShare: selected given
    dict(seed=6, topk=7, sparse_loss=True, block_size=8, h=2, hk=2),
    dict(seed=7, topk=5, forest=family(), prefix_boost=3.0),     # all branches select the same prompt keys
])
def test_tree_dsa_vs_per_sample_stock(case):
    assert_close(run_case(**case))


def test_small_batches(monkeypatch):
    """Batches of one or two tiles (the chunking paths: a query block split over several batches)."""
    monkeypatch.setattr(dsa_mod, "DEFAULT_BATCH_ELEMENTS", 4 * 4 * 4 * 2)
    assert_close(run_case(seed=8, topk=5, ties=True))
    assert_close(run_case(seed=9, topk=4, sparse_loss=True))


# ------------------------------------------------------------------ sensitivity (planted faults)
def test_sensitivity_tie_rule_larger_id(monkeypatch):
    good = dsa_mod.merge_topk

    def larger_id_wins(sa, ia, sb, ib, k):  # negate ids so that larger ids sort first on ties
        s, i = good(sa, torch.where(ia >= 0, -ia - 2, ia), sb, torch.where(ib >= 0, -ib - 2, ib), k)
        return s, torch.where(i >= 0, i, torch.where(i == NO_ROW, i, -i - 2))

    monkeypatch.setattr(dsa_mod, "merge_topk", larger_id_wins)
    assert run_case(seed=2, topk=5, ties=True)["ids"] > 0


def test_sensitivity_tie_rule_arrival_order(monkeypatch):
    """Ties kept in arrival order with the blocks scanned in reverse: a block-order-dependent rule."""
    def arrival(sa, ia, sb, ib, k):
        s = torch.cat([sa, sb], -1)
        i = torch.cat([ia, ib], -1)
        s = s.masked_fill(i == NO_ROW, -math.inf)
        o = torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :k]
        s, i = s.gather(-1, o), i.gather(-1, o)
        if s.shape[-1] < k:
            s = torch.cat([s, s.new_full((*s.shape[:-1], k - s.shape[-1]), -math.inf)], -1)
            i = torch.cat([i, i.new_full((*i.shape[:-1], k - i.shape[-1]), NO_ROW)], -1)
        return s, i.masked_fill(s == -math.inf, NO_ROW)

    good_plan = dsa_mod._dense_batches

    def reversed_plan(*a, **kw):
        p = good_plan(*a, **kw)
        return dsa_mod._Batches(**{**p.__dict__, "batches": tuple(reversed(p.batches))})

    monkeypatch.setattr(dsa_mod, "merge_topk", arrival)
    monkeypatch.setattr(dsa_mod, "_dense_batches", reversed_plan)
    monkeypatch.setattr(dsa_mod, "DEFAULT_BATCH_ELEMENTS", 4 * 4 * 3)  # one tile per batch
    assert run_case(seed=2, topk=5, ties=True)["ids"] > 0


def test_sensitivity_dkv_assignment(monkeypatch):
    def assign(dst, rows, src):
        dst[:, rows] = src  # last write wins instead of summing over the queries selecting a row

    monkeypatch.setattr(dsa_mod, "_accumulate_rows", assign)
    # both batch forms (per-query gather; batch union, where a row repeats across query batches)
    monkeypatch.setattr(dsa_mod, "DEFAULT_BATCH_ELEMENTS", 2048)  # sparse attention: a few query batches
    for factor in (0, 10 ** 9):
        monkeypatch.setattr(dsa_mod, "UNION_MAX_FACTOR", factor)
        for case in (dict(seed=0, topk=4), dict(seed=7, topk=5, forest=family(), prefix_boost=3.0)):
            err = run_case(**case)
            assert err["dkey"] > 1e-3 and err["dvalue"] > 1e-3, (factor, case)


def test_sensitivity_loss_weight_per_physical_row():
    layout, samples = random_forest(0)
    rw = torch.zeros(layout.num_rows, dtype=F64)
    for rows in samples:
        rw[rows] = COEFF / rows.shape[0]  # one sample's weight per row, not the sum over samples
    err = run_case(seed=0, topk=4, rw=rw)
    assert err["loss"] > 1e-3 and err["dindex_q"] > 1e-4


# ------------------------------------------------------------------ building blocks
def _random_candidates(g, shape, k, ids_pool):
    """Scores with many exact ties (small integers) and distinct ids drawn from ids_pool."""
    s = torch.randint(0, 3, (*shape, k), generator=g).to(F64)
    perm = torch.argsort(torch.rand(*shape, ids_pool.shape[0], generator=g), -1)[..., :k]
    i = ids_pool[perm]
    empty = torch.rand(*shape, k, generator=g) < 0.2
    return s.masked_fill(empty, -math.inf), i.masked_fill(empty, NO_ROW)


def test_merge_topk_associative_commutative():
    g = torch.Generator().manual_seed(0)
    pool = torch.randperm(60, generator=g)
    parts = [_random_candidates(g, (5,), 8, pool[20 * j:20 * (j + 1)]) for j in range(3)]
    k = 6
    (a, ia), (b, ib), (c, ic) = parts
    r1 = merge_topk(*merge_topk(a, ia, b, ib, k), c, ic, k)
    r2 = merge_topk(a, ia, *merge_topk(b, ib, c, ic, k), k)
    r3 = merge_topk(c, ic, *merge_topk(b, ib, a, ia, k), k)
    # brute force: the union sorted by (score desc, id asc), python sort per query
    s_all, i_all = torch.cat([a, b, c], -1), torch.cat([ia, ib, ic], -1)
    for q in range(5):
        cand = sorted((-s_all[q, j].item(), i_all[q, j].item()) for j in range(s_all.shape[1]) if i_all[q, j] >= 0)[:k]
        want = [c_[1] for c_ in cand] + [NO_ROW] * (k - len(cand))
        for r in (r1, r2, r3):
            assert r[1][q].tolist() == want
            assert torch.equal(r[0][q][:len(cand)], torch.tensor([-c_[0] for c_ in cand], dtype=F64))


def test_topk_partial_split_equals_whole():
    layout, _ = random_forest(3)
    n = layout.num_rows
    t = make_inputs(n, seed=3, ties=True)
    iq, w, ik = (t[x].detach() for x in ("index_q", "weights", "index_k"))
    whole = tree_dsa_topk(iq, w, ik, layout, 5, block_size=4)
    owner = torch.randint(0, 3, (n,), generator=torch.Generator().manual_seed(1))
    qsel = torch.nonzero(owner == 0).flatten()  # a subset of queries too
    rows = torch.arange(n)
    res = None
    for r in (2, 0, 1):  # stages in an arbitrary order
        ks = torch.nonzero(owner == r).flatten()
        part = tree_dsa_topk_partial(iq[qsel], w[qsel], ik[ks], rows[qsel], ks, layout.visible_until[ks], 5,
                                     block_size=4)
        res = part if res is None else merge_topk(*res, *part, 5)
    assert torch.equal(res[1], whole[1][qsel])
    torch.testing.assert_close(res[0], whole[0][qsel], **TOL)  # matmul shapes differ: rounding only


@pytest.mark.parametrize("sparse,kl_form", [(False, "eps"), (True, "eps"), (False, "log_softmax"),
                                            (True, "log_softmax")])
def test_staged_loss_equals_whole(sparse, kl_form):
    """Two-pass partial loss over a split of the keys (merged LSEs, summed terms) == one device."""
    layout, samples = random_forest(4)
    n = layout.num_rows
    t = make_inputs(n, seed=4)
    q, k = t["query"].detach(), t["key"].detach()
    scale = 0.4
    rw = row_weights(layout, samples)
    _, sel = tree_dsa_topk(t["index_q"].detach(), t["weights"].detach(), t["index_k"].detach(), layout, 4)
    sel_arg = sel if sparse else None
    whole = tree_dsa_indexer_loss(t["index_q"], t["weights"], t["index_k"], q, k, layout, sel, rw,
                                  softmax_scale=scale, sparse_loss=sparse, kl_form=kl_form, block_size=4)
    g_whole = grads(whole, {x: t[x] for x in ("index_q", "weights", "index_k")})
    owner = torch.randint(0, 3, (n,), generator=torch.Generator().manual_seed(2))
    rows, vis = torch.arange(n), layout.visible_until
    stages = [torch.nonzero(owner == r).flatten() for r in range(3)]
    z = la = None
    for ks in stages:
        zi, li = dsa_indexer_loss_partial_stats(t["index_q"], t["weights"], t["index_k"][ks], q, k[ks], rows, ks,
                                                vis[ks], softmax_scale=scale, selected_ids=sel_arg, block_size=4)
        z, la = (zi, li) if z is None else (torch.logaddexp(z, zi), torch.logaddexp(la, li))
    staged = sum(dsa_indexer_loss_partial_terms(t["index_q"], t["weights"], t["index_k"][ks], q, k[ks], rows, ks,
                                                vis[ks], z, la, rw, softmax_scale=scale, selected_ids=sel_arg,
                                                kl_form=kl_form, block_size=4) for ks in stages)
    g_staged = grads(staged, {x: t[x] for x in ("index_q", "weights", "index_k")})
    torch.testing.assert_close(staged, whole, **TOL)
    for x in g_whole:
        torch.testing.assert_close(g_staged[x], g_whole[x], **TOL)


def test_sparse_attention_empty_slots_and_dense_oracle():
    g = torch.Generator().manual_seed(5)
    nq, m, h, hk, d, dv, T = 7, 11, 4, 2, 5, 3, 6
    q = torch.randn(nq, h, d, dtype=F64, generator=g).requires_grad_(True)
    k = torch.randn(m, hk, d, dtype=F64, generator=g).requires_grad_(True)
    v = torch.randn(m, hk, dv, dtype=F64, generator=g).requires_grad_(True)
    index = torch.stack([torch.randperm(m, generator=g)[:T] for _ in range(nq)])
    index[index % 3 == 0] = NO_ROW
    index[2] = NO_ROW  # a query with no valid slot
    o, lse = sparse_attention(q, k, v, index, softmax_scale=0.3)
    go, gl = torch.randn_like(o), torch.randn_like(lse)
    gl[2] = 0.0
    (o * go).sum().backward(retain_graph=True)
    lse_ok = torch.where(torch.isfinite(lse), lse, 0.0)
    (lse_ok * gl).sum().backward()
    got = [x.grad.clone() for x in (q, k, v)]
    # dense oracle: a [Nq,M] mask
    for x in (q, k, v):
        x.grad = None
    mask = torch.zeros(nq, m, dtype=torch.bool)
    for i in range(nq):
        mask[i, index[i][index[i] >= 0]] = True
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = (torch.einsum("qhd,khd->hqk", q, kk) * 0.3).masked_fill(~mask, -math.inf)
    lse_ref = torch.logsumexp(s, -1).T
    p = torch.nan_to_num(torch.softmax(s, -1))
    o_ref = torch.einsum("hqk,khd->qhd", p, vv)
    ((o_ref * go).sum() + (torch.where(torch.isfinite(lse_ref), lse_ref, 0.0) * gl).sum()).backward()
    torch.testing.assert_close(o, o_ref, **TOL)
    assert torch.equal(o[2], torch.zeros_like(o[2])) and bool((lse[2] == -math.inf).all())
    torch.testing.assert_close(lse, lse_ref, **TOL)
    for a, x in zip(got, (q, k, v)):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, x.grad, **TOL)


def test_errors_name_the_rule():
    layout, _ = random_forest(0)
    n = layout.num_rows
    t = make_inputs(n)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        sparse_attention(t["query"], t["key"][:, :1].expand(n, 3, -1), t["value"][:, :1].expand(n, 3, -1),
                         torch.zeros(n, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="ascending"):
        rows = torch.arange(n).flip(0)
        tree_dsa_topk_partial(t["index_q"], t["weights"], t["index_k"], rows, rows, layout.visible_until, 3)
    with pytest.raises(ValueError, match="does not see on the tree"):
        sel = torch.full((n, 2), NO_ROW)
        sel[0, 0] = 1  # a later row
        tree_dsa(t["query"], t["key"], t["value"], None, None, None, layout, topk=2, softmax_scale=0.3, selected=sel)
    with pytest.raises(ValueError, match="rows of the k/v buffer"):
        sparse_attention(t["query"], t["key"], t["value"], torch.full((n, 2), n))


def test_stock_signature_compat():
    """The oracle calls stock positionally; fail loudly if a Megatron version changes that."""
    assert list(inspect.signature(unfused_dsa_fn).parameters)[:5] == ["query", "key", "value", "topk_indices",
                                                                        "softmax_scale"]


def test_empty_stages():
    """A stage without keys (or without queries): empty candidates, -inf LSEs, a zero loss term."""
    layout, samples = random_forest(0)
    n = layout.num_rows
    t = make_inputs(n)
    rows, none = torch.arange(n), torch.zeros(0, dtype=torch.long)
    s, i = tree_dsa_topk_partial(t["index_q"], t["weights"], t["index_k"][:0], rows, none, none, 3)
    assert bool((i == NO_ROW).all()) and bool((s == -math.inf).all())
    s, i = tree_dsa_topk_partial(t["index_q"][:0], t["weights"][:0], t["index_k"], none, rows, layout.visible_until, 3)
    assert s.shape == (0, 3) and i.shape == (0, 3)
    q, k = t["query"].detach(), t["key"].detach()
    for sel in (None, torch.zeros(n, 2, dtype=torch.long)):
        z, la = dsa_indexer_loss_partial_stats(t["index_q"], t["weights"], t["index_k"][:0], q, k[:0], rows, none,
                                               none, softmax_scale=0.3, selected_ids=sel)
        assert bool((z == -math.inf).all()) and bool((la == -math.inf).all())
        zf = torch.zeros(n, dtype=F64, requires_grad=True)
        term = dsa_indexer_loss_partial_terms(t["index_q"], t["weights"], t["index_k"][:0], q, k[:0], rows, none,
                                              none, zf, torch.zeros(n, q.shape[1], dtype=F64),
                                              row_weights(layout, samples), softmax_scale=0.3, selected_ids=sel)
        g = torch.autograd.grad(term + z.clamp_min(0).sum(), [t["index_q"], zf], allow_unused=True)
        assert term.item() == 0.0 and all(x is None or bool((x == 0).all()) for x in g)
    o, lse = sparse_attention(t["query"][:0], t["key"], t["value"], torch.zeros(0, 4, dtype=torch.long))
    assert o.shape == (0, t["query"].shape[1], t["value"].shape[2]) and lse.shape == (0, t["query"].shape[1])


def _tp_body(seed):
    """Rank r of a 2-way head split (TP): the loss with head_group = both ranks."""
    import torch.distributed as dist

    layout, samples = random_forest(seed)
    t = make_inputs(layout.num_rows, seed=seed, h=4, hk=4)
    r = dist.get_rank()
    q, k = t["query"].detach()[:, 2 * r:2 * r + 2], t["key"].detach()[:, 2 * r:2 * r + 2]
    _, sel = tree_dsa_topk(t["index_q"].detach(), t["weights"].detach(), t["index_k"].detach(), layout, 4)
    out = []
    for sparse, form in ((False, "eps"), (True, "log_softmax")):
        loss = tree_dsa_indexer_loss(t["index_q"], t["weights"], t["index_k"], q, k, layout, sel,
                                     row_weights(layout, samples), softmax_scale=0.35, sparse_loss=sparse,
                                     kl_form=form, head_group=dist.group.WORLD, block_size=4)
        g = grads(loss, {x: t[x] for x in ("index_q", "weights", "index_k")})
        out.append((loss.detach(), g))
    return out


def test_head_group_all_reduce_matches_all_heads():
    from tests.dist import run_distributed

    results = run_distributed(_tp_body, 2, 6)
    layout, samples = random_forest(6)
    t = make_inputs(layout.num_rows, seed=6, h=4, hk=4)
    _, sel = tree_dsa_topk(t["index_q"].detach(), t["weights"].detach(), t["index_k"].detach(), layout, 4)
    for j, (sparse, form) in enumerate(((False, "eps"), (True, "log_softmax"))):
        loss = tree_dsa_indexer_loss(t["index_q"], t["weights"], t["index_k"], t["query"].detach(),
                                     t["key"].detach(), layout, sel, row_weights(layout, samples), softmax_scale=0.35,
                                     sparse_loss=sparse, kl_form=form, block_size=4)
        g = grads(loss, {x: t[x] for x in ("index_q", "weights", "index_k")})
        for rank_out in results:
            torch.testing.assert_close(rank_out[j][0], loss.detach(), **TOL)
            for x in g:
                torch.testing.assert_close(rank_out[j][1][x], g[x], **TOL)


def test_packed_float32_selection_equals_sorted():
    """The float32 fast path (one topk over packed (score, id) keys) == the two-sort rule, with
    negative scores, -0.0 / +0.0, many exact ties and empty slots."""
    g = torch.Generator().manual_seed(3)
    s = torch.randint(-3, 3, (50, 40), generator=g).float() * 0.5
    s[s == 0] = torch.where(torch.rand(int((s == 0).sum()), generator=g) < 0.5, -0.0, 0.0)
    ids = torch.argsort(torch.rand(50, 40, generator=g), -1) * 37 + 5
    ids[torch.rand(50, 40, generator=g) < 0.2] = NO_ROW
    for k in (1, 7, 40, 45):
        got = dsa_mod._select_topk(s, ids, k)
        want = dsa_mod._select_topk(s.double(), ids, k)
        assert torch.equal(got[1], want[1]), k
        assert torch.equal(got[0].double(), want[0]), k


def test_tree_topk_float32_exact_ties_vs_per_sample():
    """float32 tree top-k (packed path) on integer-valued inputs (every score exact, many ties) ==
    per-sample stable sort of the dense scores."""
    layout, samples = random_forest(2)
    n = layout.num_rows
    g = torch.Generator().manual_seed(0)
    iq = torch.randint(-2, 3, (n, 2, 3), generator=g).float()
    w = torch.randint(0, 3, (n, 2), generator=g).float()
    ik = torch.randint(-2, 3, (n, 3), generator=g).float()
    _, ids = tree_dsa_topk(iq, w, ik, layout, 5, block_size=4)
    for rows in samples:
        s = dsa_index_scores(iq[rows], w[rows], ik[rows])
        s = s.masked_fill(~torch.ones_like(s, dtype=torch.bool).tril(), -math.inf)
        pos = stable_topk(s, min(5, rows.shape[0]))
        want = torch.where(torch.gather(s, 1, pos) > -math.inf, rows[pos], NO_ROW)
        assert torch.equal(ids[rows, :pos.shape[1]], want)
        assert bool((ids[rows, pos.shape[1]:] == NO_ROW).all())


def test_bfloat16_inputs_run_in_float32():
    """Low-precision inputs compute in float32 and return the input dtype (o) / float32 (loss)."""
    layout, samples = random_forest(1)
    t64 = make_inputs(layout.num_rows, seed=1)
    tb = {k_: v_.detach().to(torch.bfloat16).requires_grad_(True) for k_, v_ in t64.items()}
    tf = {k_: v_.detach().float().requires_grad_(True) for k_, v_ in tb.items()}  # the same numbers
    out = {}
    for name, t in (("bf16", tb), ("f32", tf)):
        o, ids, loss = tree_dsa(t["query"], t["key"], t["value"], t["index_q"], t["weights"], t["index_k"], layout,
                                topk=4, softmax_scale=0.3, loss_row_weight=row_weights(layout, samples).float())
        g = grads(o.float().sum() + loss, t)
        out[name] = (o, ids, loss, g)
    o, ids, loss, g = out["bf16"]
    assert o.dtype == torch.bfloat16 and loss.dtype == torch.float32
    assert torch.equal(ids, out["f32"][1])  # same scores in float32 -> same selection
    torch.testing.assert_close(o.float(), out["f32"][0], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(loss, out["f32"][2])
    for k_ in g:
        assert g[k_].dtype == torch.bfloat16
        torch.testing.assert_close(g[k_].float(), out["f32"][3][k_], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("factor", [0, 10 ** 9])
def test_sparse_attention_both_batch_forms(monkeypatch, factor):
    """Per-query gather (factor 0) and batch-union (huge factor) forms, each forced, vs the oracles."""
    monkeypatch.setattr(dsa_mod, "UNION_MAX_FACTOR", factor)
    assert_close(run_case(seed=0, topk=4))
    assert_close(run_case(seed=7, topk=5, forest=family(), prefix_boost=3.0))
    test_sparse_attention_empty_slots_and_dense_oracle()
