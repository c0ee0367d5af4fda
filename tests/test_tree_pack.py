"""Packing and layout properties over random forests that really branch (hypothesis)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from megatron_tree.tree import Sample, pack, summarize
from megatron_tree.tree.packing import PrefixPlan

# Small alphabet + built-in extensions/duplicates: forks at several depths, single-token segments,
# samples that are prefixes of others, duplicates, several trees per microbatch.
EOS = 9


@st.composite
def forests(draw):
    base = draw(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=10), min_size=1, max_size=14))
    out = [list(b) for b in base]
    for _ in range(draw(st.integers(0, 6))):
        src = out[draw(st.integers(0, len(out) - 1))]
        op = draw(st.sampled_from(["prefix", "extend", "dup", "eos"]))
        if op == "prefix":
            out.append(src[: draw(st.integers(1, len(src)))])
        elif op == "extend":
            out.append(src + draw(st.lists(st.integers(0, 3), min_size=1, max_size=5)))
        elif op == "dup":
            out.append(list(src))
        else:
            out.append(src + [EOS])
    masks = [[False] + draw(st.lists(st.booleans(), min_size=len(s) - 1, max_size=len(s) - 1)) for s in out]
    return out, masks


def _ancestors_or_self(path_prev: list[int], q: int) -> set[int]:
    out = set()
    while q >= 0:
        out.add(q)
        q = path_prev[q]
    return out


def check_microbatches(samples, masks, mbs, budget, pad):
    seen = []
    for mb in mbs:
        L = mb.layout
        L.validate()
        assert L.num_rows <= budget and L.num_rows % pad == 0
        ids = L.input_ids.tolist()
        pp = L.path_prev.tolist()
        prefixes = set()
        truth = []
        for sid in mb.sample_ids:
            rows = mb.sample_rows(sid)
            toks = samples[sid]
            assert ids_at(ids, rows) == toks
            assert L.position_ids[rows].tolist() == list(range(len(toks)))
            assert [pp[r] for r in rows.tolist()] == [-1] + rows[:-1].tolist()
            prefixes.update(tuple(toks[: t + 1]) for t in range(len(toks)))
            for t in range(1, len(toks)):
                if masks[sid][t]:
                    truth.append((sid, t, int(rows[t - 1]), toks[t]))
        # per-row sample statistics: samples through each row, sum of 1/len over them (loop oracle)
        count, inv = np.zeros(L.num_rows), np.zeros(L.num_rows)
        for sid in mb.sample_ids:
            for r in mb.sample_rows(sid).tolist():
                count[r] += 1
                inv[r] += 1.0 / len(samples[sid])
        got_count, got_inv = mb.row_sample_stats()
        assert got_count.dtype == got_inv.dtype == torch.float64
        assert got_count.tolist() == count.tolist() and np.allclose(got_inv.numpy(), inv, rtol=1e-15, atol=0)
        # maximal sharing: one real row per distinct prefix
        assert L.num_real_rows == len(prefixes)
        # visibility predicate == ancestor-or-self along path_prev, for every row
        dense = L.dense_mask()
        for q in range(L.num_rows):
            vis = set(torch.nonzero(dense[q]).flatten().tolist())
            assert vis == _ancestors_or_self(pp, q)
        # padding rows see only themselves and are not seen
        assert (L.path_prev[L.num_real_rows:] == -1).all()
        # segments are maximal: every non-root segment's parent has at least two children
        par = L.segment_parent.numpy()
        child_count = np.bincount(par[par >= 0], minlength=len(par))
        assert (child_count[par[par >= 0]] >= 2).all()
        # loss map == per-occurrence truth
        lm = mb.loss_map
        got = sorted(zip(lm.sample_index.tolist(), lm.positions.tolist(), lm.source_rows.tolist(), lm.targets.tolist()))
        assert got == sorted(truth)
        assert mb.stats.tree_tokens == L.num_real_rows
        assert mb.stats.flat_tokens == sum(len(samples[s]) for s in mb.sample_ids)
        seen.extend(mb.sample_ids)
    assert sorted(seen) == list(range(len(samples)))  # exactly once


def ids_at(ids, rows):
    return [ids[r] for r in rows.tolist()]


@settings(max_examples=60, deadline=None)
@given(forests(), st.sampled_from([16, 24, 64]), st.sampled_from([1, 4, 8]))
def test_pack_properties(forest, budget, pad):
    samples, masks = forest
    # a sample longer than the budget is refused by design (tested elsewhere): keep the budget feasible
    budget = -(-max(budget, max(len(s) for s in samples)) // pad) * pad
    sm = [Sample(tokens=s, loss_mask=m) for s, m in zip(samples, masks)]
    mbs = pack(sm, budget, pad_to_multiple_of=pad)
    check_microbatches(samples, masks, mbs, budget, pad)
    # determinism
    again = pack(sm, budget, pad_to_multiple_of=pad)
    assert [m.sample_ids for m in again] == [m.sample_ids for m in mbs]
    assert all(torch.equal(a.layout.input_ids, b.layout.input_ids) for a, b in zip(again, mbs))


_LAYOUT_FIELDS = ("input_ids", "position_ids", "segment_offsets", "segment_parent", "subtree_end", "visible_until",
                  "path_prev")


def _loss_entries(mb, to_original=lambda i: i):
    """The loss map as a sorted list of per-occurrence tuples, sample ids mapped by ``to_original``."""
    lm = mb.loss_map
    return sorted(zip([to_original(i) for i in lm.sample_index.tolist()], lm.positions.tolist(),
                      lm.source_rows.tolist(), lm.targets.tolist(), lm.weights.tolist()))


@settings(max_examples=30, deadline=None)
@given(forests(), st.randoms(use_true_random=False), st.sampled_from([16, 24, 64]))
def test_pack_is_order_independent(forest, rnd, budget):
    """The same microbatches, in the same order, whatever order the samples arrive in: identical
    layouts, identical loss maps and the same samples (ids mapped back through the permutation).
    Small budgets split trees, so the cuts and the bins must not depend on the input order either."""
    samples, masks = forest
    budget = max(budget, max(len(s) for s in samples))  # longer samples are refused by design
    perm = list(range(len(samples)))
    rnd.shuffle(perm)
    a = pack([Sample(s, m) for s, m in zip(samples, masks)], budget)
    b = pack([Sample(samples[i], masks[i]) for i in perm], budget)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert tuple(sorted(perm[i] for i in y.sample_ids)) == x.sample_ids
        for f in _LAYOUT_FIELDS:
            assert torch.equal(getattr(x.layout, f), getattr(y.layout, f)), f
        assert x.layout.num_padding == y.layout.num_padding
        assert _loss_entries(y, lambda i: perm[i]) == _loss_entries(x)
        assert x.stats == y.stats


def _trie_size(token_lists) -> int:
    """Brute-force oracle: the number of distinct non-empty prefixes of the given sequences."""
    return len({tuple(t[:k]) for t in token_lists for k in range(1, len(t) + 1)})


def _check_against_trie(samples, mbs, budget, pad=1):
    """Every microbatch: within budget, one real row per distinct prefix of its samples, each sample's
    rows reproduce its tokens at positions 0..L-1; every sample exactly once. Returns real rows."""
    seen, real = [], []
    for mb in mbs:
        toks = [list(samples[i]) for i in mb.sample_ids]
        assert mb.num_rows <= budget and mb.num_rows % pad == 0
        assert mb.layout.num_real_rows == _trie_size(toks), (mb.sample_ids, mb.layout.num_real_rows)
        for i, t in zip(mb.sample_ids, toks):
            rows = mb.sample_rows(i)
            assert mb.layout.input_ids[rows].tolist() == t
            assert mb.layout.position_ids[rows].tolist() == list(range(len(t)))
        seen += mb.sample_ids
        real.append(mb.layout.num_real_rows)
    assert sorted(seen) == list(range(len(samples)))
    return real


def test_split_tree_parts_in_one_microbatch_share_their_prefix():
    # One tree of 2 + 30 + 30 + 5 + 5 = 72 rows, budget 40: it must be cut. Whatever the cuts, the
    # parts holding d1 (the 7-row part) and a (32 rows) fit one microbatch together; there they
    # must share the root path [1, 2] instead of repeating it (37 rows, not 39).
    P = [1, 2]
    samples = [P + [3] * 30, P + [4] * 30, P + [5] * 5, P + [6] * 5]
    mbs = pack(samples, 40)
    real = _check_against_trie(samples, mbs, 40)
    assert len(mbs) == 2 and sum(real) == 74  # 72 distinct prefixes + the root path once more


def test_split_tree_cut_repeats_the_shortest_ancestor_path():
    # Root [1, 2]; y (10 more tokens) sorts first, then subtree X: a 15-token path and three
    # 5-token leaves. 2 + 10 + 15 + 15 = 42 rows > 40. Cutting before x3 (greedy: as late as fits)
    # repeats the 17-row path [1, 2, X...]; cutting before x1 repeats only [1, 2]: 12 + 32 rows.
    P, X = [1, 2], [7] * 15
    samples = [P + [3] * 10] + [P + X + [10 + k] * 5 for k in range(3)]
    mbs = pack(samples, 40)
    real = _check_against_trie(samples, mbs, 40)
    assert sorted(real) == [12, 32]


@pytest.mark.parametrize("seed", range(40))
def test_pack_split_trees_match_the_trie_of_each_microbatch(seed):
    """Random deep trees (forks at several depths, duplicates, prefixes) larger than the budget:
    each microbatch's real rows are the trie of its samples, never more (parts of one tree that
    share a microbatch share their ancestor rows)."""
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(rng.integers(1, 4)):  # trees
        paths = [rng.integers(0, 3, rng.integers(1, 8)).tolist()]
        for _ in range(rng.integers(3, 30)):
            base = paths[rng.integers(len(paths))]
            cut = int(rng.integers(1, len(base) + 1))
            paths.append(base[:cut] + rng.integers(0, 4, rng.integers(0, 14)).tolist())
        samples += paths
    budget = int(rng.choice([16, 24, 32]))
    samples = [s[:budget] for s in samples]
    pad = int(rng.choice([1, 4, 8]))
    mbs = pack(samples, budget, pad_to_multiple_of=pad)
    _check_against_trie(samples, mbs, budget, pad)
    # the planner the pipeline prices budgets with sees the same microbatches
    plan = PrefixPlan([np.asarray(s, dtype=np.int64) for s in samples])
    assert plan.microbatch_rows(budget, pad) == [mb.num_rows for mb in mbs]


def test_family_shares_prompt_and_stays_together_in_any_order():
    rng = np.random.default_rng(0)
    fams = []
    for f in range(6):
        p = rng.integers(1, 1000, 40)
        fams += [np.concatenate([p, rng.integers(1, 1000, 10)]) for _ in range(4)]
    perm = rng.permutation(len(fams))
    mbs = pack([fams[i] for i in perm], 200)
    for mb in mbs:
        groups = {int(perm[s]) // 4 for s in mb.sample_ids}
        for g in groups:  # every member of a family that is present is present with all its siblings
            assert sum(int(perm[s]) // 4 == g for s in mb.sample_ids) == 4
    tot = summarize(mbs)
    assert tot["tree_tokens"] == 6 * (40 + 4 * 10)  # optimum: distinct prefixes
    assert len(mbs) == 3  # 6 trees of 80 rows, two per 200-row microbatch


def test_large_tree_split_at_branch_points_repeats_only_ancestor_path():
    prompt = list(range(1, 31))
    samples = [prompt + [100 + i] * 10 for i in range(8)]  # tree = 30 + 80 = 110 rows
    mbs = pack(samples, 60)
    check_microbatches(samples, [[False] + [True] * 39] * 8, mbs, 60, 1)
    # 3 completions per part (30 + 3*10 = 60): parts of 3, 3, 2 completions, prompt repeated 3 times
    assert sorted(m.layout.num_real_rows for m in mbs) == [50, 60, 60]
    assert len(mbs) == 3


def test_pack_errors_name_the_sample():
    with pytest.raises(ValueError, match="sample 1: empty"):
        pack([[1, 2], []], 8)
    with pytest.raises(ValueError, match="sample 0: 9 tokens exceed max_tokens_per_mb=8"):
        pack([list(range(9))], 8)
    with pytest.raises(ValueError, match="sample 0: loss_mask has shape"):
        pack([Sample([1, 2, 3], loss_mask=[0, 1])], 8)
    with pytest.raises(ValueError, match=r"sample 0: loss_mask\[0\] is set"):
        pack([Sample([1, 2], loss_mask=[1, 1])], 8)
    with pytest.raises(ValueError, match="sample 2: token ids must lie"):
        pack([[1], [2], [-1, 3]], 8)
    with pytest.raises(ValueError, match="sample 0: token id 70 >= vocab size 64"):
        pack([[70]], 8, vocab_size=64)
    with pytest.raises(ValueError, match="sample 1: advantage has a non-finite"):
        pack([Sample([1, 2], advantage=1.0), Sample([1, 3], advantage=float("nan"))], 8)
    with pytest.raises(ValueError, match="multiple of pad_to_multiple_of"):
        pack([[1]], 10, pad_to_multiple_of=4)


def test_rl_fields_reach_loss_map_per_occurrence():
    # Shared prompt row 2 precedes different first completion tokens with different advantages.
    a = Sample([5, 6, 7, 1, 2], loss_mask=[0, 0, 0, 1, 1], advantage=0.5, old_logprobs=[0, 0, 0, -1.0, -2.0])
    b = Sample([5, 6, 7, 3], loss_mask=[0, 0, 0, 1], advantage=[0, 0, 0, -1.5], old_logprobs=[0, 0, 0, -0.25],
               weight=2.0)
    (mb,) = pack([a, b], 16)
    lm = mb.loss_map
    assert lm.sample_index.tolist() == [0, 0, 1]
    assert lm.source_rows.tolist() == [2, 3, 2]  # row 2 (token 7) predicts twice
    assert lm.targets.tolist() == [1, 2, 3]
    assert lm.advantages.tolist() == [0.5, 0.5, -1.5]
    assert lm.old_logprobs.tolist() == [-1.0, -2.0, -0.25]
    assert lm.weights.tolist() == [1.0, 1.0, 2.0]


def test_stats_definitions():
    (mb,) = pack([[1, 2, 3], [1, 2, 4], [7]], 16, pad_to_multiple_of=8)
    s = mb.stats
    assert (s.flat_tokens, s.tree_tokens, s.padding_tokens, s.num_trees) == (7, 5, 3, 2)
    assert s.tree_token_ratio == pytest.approx(7 / 5)
    assert s.flat_attention_pairs == 6 + 6 + 1
    assert s.tree_attention_pairs == 1 + 2 + 3 + 3 + 1  # rows: 1,2 | 3 | 4 | 7
    assert s.fill == pytest.approx(5 / 16)


@settings(max_examples=40, deadline=None)
@given(forests(), st.sampled_from([1, 2, 3]), st.sampled_from([24, 64]), st.sampled_from([1, 8]))
def test_mtp_tail_rows_follow_each_sample_and_change_nothing_else(forest, K, budget, pad):
    """``pack(..., mtp_tail=K)``: every sample's path, loss map and sample statistics are those of the
    packing without tails (same rows up to renumbering), and after its last row come K rows of token 0
    that only it has (a chain, each one the previous one's child), seeing exactly the sample's path and
    the earlier tail rows; the tails count against the budget and `PrefixPlan` prices them."""
    samples, masks = forest
    budget = -(-max(budget, max(len(s) for s in samples) + K) // pad) * pad
    sm = [Sample(tokens=s, loss_mask=m) for s, m in zip(samples, masks)]
    mbs = pack(sm, budget, pad_to_multiple_of=pad, mtp_tail=K)
    plan = PrefixPlan([np.asarray(s, np.int64) for s in samples], mtp_tail=K)
    assert [mb.num_rows for mb in mbs] == plan.microbatch_rows(budget, pad)
    seen = []
    for mb in mbs:
        L = mb.layout
        L.validate()
        assert mb.num_rows <= budget and mb.num_rows % pad == 0 and mb.mtp_tail == K
        dense = L.dense_mask()
        index, inv = mb.mtp_tail_stats()
        tails = []
        for sid in mb.sample_ids:
            rows, tail = mb.sample_rows(sid), mb.tail_rows(sid)
            assert ids_at(L.input_ids.tolist(), rows) == list(samples[sid])
            assert tail.shape == (K,) and (L.input_ids[tail] == 0).all()
            chain = torch.cat([rows, tail])
            assert (L.path_prev[chain[1:]] == chain[:-1]).all()
            assert (L.position_ids[tail] == torch.arange(len(rows), len(rows) + K)).all()
            for j in range(K):  # a tail row sees the path and the tail rows before it, nothing else
                assert set(torch.nonzero(dense[tail[j]]).flatten().tolist()) == set(chain[: len(rows) + j + 1].tolist())
            assert index[tail].tolist() == list(range(1, K + 1))
            assert torch.allclose(inv[tail], torch.full((K,), 1.0 / len(rows), dtype=torch.float64))
            tails += tail.tolist()
        assert len(set(tails)) == len(tails)  # never shared, not even by identical samples
        assert int((index > 0).sum()) == len(tails) and (inv[index == 0] == 0).all()
        assert mb.stats.tree_tokens == L.num_real_rows
        assert mb.stats.flat_tokens == sum(len(samples[s]) for s in mb.sample_ids)
        # without the tail rows: the same loss map (rows renumbered), sample statistics and sharing
        (alone,) = pack([sm[s] for s in mb.sample_ids], budget)
        to_alone = {}
        for j, sid in enumerate(mb.sample_ids):
            to_alone.update(zip(mb.sample_rows(sid).tolist(), alone.sample_rows(j).tolist()))
        back = dict(zip(range(len(mb.sample_ids)), mb.sample_ids))
        got = [(s, p, to_alone[r], t, w) for s, p, r, t, w in _loss_entries(mb)]
        assert sorted(got) == _loss_entries(alone, back.__getitem__)
        count, row_inv = mb.row_sample_stats()
        a_count, a_inv = alone.row_sample_stats()
        real = [r for r in range(L.num_real_rows) if r not in set(tails)]
        assert len(real) == alone.layout.num_real_rows
        assert [count[r].item() for r in real] == [a_count[to_alone[r]].item() for r in real]
        assert all(count[r] == 0 for r in tails)
        seen += mb.sample_ids
    assert sorted(seen) == list(range(len(samples)))


def test_mtp_tail_that_does_not_fit_names_the_sample():
    with pytest.raises(ValueError, match=r"sample 1: 6 tokens and its 3 MTP tail rows \(mtp_tail\) exceed "
                                         r"max_tokens_per_mb=8"):
        pack([[1, 2], [1, 2, 3, 4, 5, 6]], 8, mtp_tail=3)
    with pytest.raises(ValueError, match="mtp_tail must be >= 0"):
        pack([[1, 2]], 8, mtp_tail=-1)
