"""Sharing-aware packing: samples -> compressed prefix tries -> microbatches under a row budget.

How it works (vectorised; the only Python loops run once per sample or per tree, never per token):

1. Sort the samples lexicographically (token ids as big-endian bytes, so ``bytes`` comparison is
   token-order comparison and a prefix sorts before its extensions). In that order, the rows a
   sample adds to the trie are exactly its tokens after the longest common prefix (LCP) with the
   previous sample, and concatenating those tails gives the trie in DFS preorder.
2. A tree is a maximal run of consecutive sorted samples with LCP > 0. A tree that fits the budget
   is kept whole; a larger one is cut into consecutive runs of samples (parts), each part repeating
   the ancestor path of its first sample (a cut before sample j costs ``lcp[j]`` repeated rows). Two
   cuttings are planned: dynamic programming for the fewest parts, then the fewest rows (shallow
   forks over deep ones), and greedy full parts; the one packing into fewer microbatches, then
   fewer rows, wins. A duplicate is never cut off its twin.
3. Trees (and parts) go to microbatches first-fit-decreasing by rows. A part joins a bin that
   already holds parts of its tree at its *marginal* cost: the rows it adds to the bin's trie.
4. A microbatch holds an ascending subset of the sorted samples; the LCP of two of them that are
   not neighbours in the full order is the minimum LCP between them (range minimum), 0 across
   trees. So parts of one tree that share a microbatch share their ancestor rows again: in every
   microbatch the real rows are exactly the distinct prefixes (trie nodes) of its samples.
5. Segment boundaries are the tail starts (except where a sample merely extends the previous one)
   and the rows where a later sample forks off an earlier path.

Samples arriving in any order give the same microbatches (same layouts and loss maps, holding the
same samples): every decision depends only on the sorted token sequences, and with prefix sharing
identical samples are never cut apart, so the index tie-break between them changes nothing.

Route-aware packing (``route_aware=True``, routing replay): steps 1-5 run on symbol sequences
(`routes.route_symbols`: one symbol per (token, routes) position), so two samples share a row only
where their tokens and their MoE routes agree; the layout keeps the tokens and the microbatch
carries each row's routes (``TreeMicrobatch.routes``).

Vision-language records (``Sample.images``) are shared the same way on (token, image content key)
symbols (`images.image_identity`), so two screenshots behind identical placeholder tokens never share a
row; every microbatch then carries the multimodal RoPE position of each row
(``TreeMicrobatch.rope_positions``) and the image occurrences its own rows hold
(``TreeMicrobatch.image_slots``: each distinct occurrence encoded once).
"""
from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np
import torch

from .layout import TreeLayout
from .loss_map import LossMap
from .microbatch import MicrobatchStats, TreeMicrobatch
from .prefix import sort_and_lcp
from .images import image_identity, image_slots, row_rope_positions
from .routes import route_symbols, routes_shape, row_routes
from .sample import Sample, as_sample, validate_sample


def pack(samples: Sequence, max_tokens_per_mb: int, *, pad_to_multiple_of: int = 1, pad_id: int = 0,
         pad_to_budget: bool = False, vocab_size: int | None = None,
         share_prefixes: bool = True, route_aware: bool = False, route_spec=None,
         mtp_tail: int = 0, carry: bool = False) -> list[TreeMicrobatch]:
    """Pack ``samples`` into prefix-shared microbatches of at most ``max_tokens_per_mb`` rows.

    samples            `Sample`s, dicts with Sample's fields, or bare token sequences
    max_tokens_per_mb  row budget per microbatch (padding included)
    pad_to_multiple_of each microbatch's row count is padded up to a multiple of this
    pad_to_budget      pad every microbatch to exactly ``max_tokens_per_mb`` rows (fixed shapes)
    vocab_size         if given, token ids must be below it
    share_prefixes     False gives flat packing (every sample its own unbranched chain, same bins):
                       the baseline tree packing is measured against
    route_aware        share a row only where tokens and ``routed_experts`` agree, and give every
                       microbatch its rows' routes (``TreeMicrobatch.routes``); every sample must carry
                       routes of one ``[moe_layers, topk]`` shape
    route_spec         `routes.RouteSpec` the routes must match (the model's MoE layers, top-k, experts)
    mtp_tail           K: append K rows (token 0, never shared) after every sample's last token, the
                       trailing positions stock multi-token prediction runs depth k <= K on (it rolls
                       token 0 in); needed where an MTP layer has a loss over every position (DeepSeek
                       sparse attention's indexer loss). They count against the budget; they are in
                       no loss map and no ``sample_rows`` (`TreeMicrobatch.tail_rows`)
    carry              every row of the step computed by exactly one microbatch at any budget (`tree.carry`):
                       a tree over the budget is cut into microbatches that read their ancestors' state from
                       earlier ones (``mb.carry``, ``mb.owned_rows``); a sample may be longer than the budget.
                       Needs ``share_prefixes``; not with ``mtp_tail`` (refused). With ``route_aware`` the
                       forest is the (token, route) trie's and each microbatch's ``routes`` cover its
                       layout's rows, carried ones included

    Every sample lands in exactly one microbatch. Raises ValueError naming the sample for an empty
    sample, a sample longer than the budget (without ``carry``), malformed fields, or (route_aware)
    missing routes.
    """
    if max_tokens_per_mb <= 0:
        raise ValueError(f"max_tokens_per_mb must be positive, got {max_tokens_per_mb}")
    if pad_to_multiple_of <= 0 or max_tokens_per_mb % pad_to_multiple_of:
        raise ValueError(f"max_tokens_per_mb={max_tokens_per_mb} must be a positive multiple of "
                         f"pad_to_multiple_of={pad_to_multiple_of}")
    if mtp_tail < 0:
        raise ValueError(f"mtp_tail must be >= 0, got {mtp_tail}")
    if carry and (mtp_tail or not share_prefixes):
        what = "mtp_tail" if mtp_tail else "share_prefixes=False"
        raise ValueError(f"pack(carry=True) does not support {what} yet: carried rows hold one state per row of "
                         "the shared prefix forest")
    samples = [as_sample(s) for s in samples]
    for i, s in enumerate(samples):
        validate_sample(i, s, max_tokens=None if carry else max_tokens_per_mb, vocab_size=vocab_size,
                        route_spec=route_spec, mtp_tail=mtp_tail)
    if not samples:
        return []
    toks = [s.tokens.astype(np.int64, copy=False) for s in samples]
    routes = None
    if route_aware:
        missing = [i for i, s in enumerate(samples) if s.routed_experts is None]
        if missing:
            raise ValueError(f"sample {missing[0]}: route_aware packing (routing replay) needs routed_experts on every "
                             f"sample; {len(missing)} of {len(samples)} have none (a sample without routes would be "
                             "re-routed, not replayed)")
        routes_shape(samples)
        routes = [s.routed_experts for s in samples]
    images = [s.images for s in samples] if any(s.images for s in samples) else None
    order, lcp = sort_and_lcp(share_keys(toks, routes, images))
    if not share_prefixes:
        lcp[:] = 0
    if carry:
        from .carry import pack_carry

        out = pack_carry(samples, toks, order, lcp, max_tokens_per_mb, pad_multiple=pad_to_multiple_of,
                         pad_id=pad_id, pad_to_budget=pad_to_budget, routes=routes)
        return [with_images(mb, samples) for mb in out] if images else out
    lens = np.array([len(t) for t in toks], dtype=np.int64)[order] + mtp_tail  # a tail is never shared
    units, bins, bin_rows = _plan_bins(lens, lcp, max_tokens_per_mb)
    out = []
    for unit_ids, rows in zip(bins, bin_rows):
        pos = np.concatenate([np.arange(units[u][0], units[u][1]) for u in sorted(unit_ids)])
        mb_lcp = _subset_lcp(lcp, pos)
        assert int((lens[pos] - mb_lcp).sum()) == rows  # the bin's trie is what first-fit priced
        out.append(_build_microbatch(samples, toks, order[pos], mb_lcp, max_tokens_per_mb, pad_to_multiple_of,
                                     pad_id, pad_to_budget, routes, mtp_tail))
    return [with_images(mb, samples) for mb in out] if images else out


def share_keys(toks: Sequence[np.ndarray], routes=None, images=None) -> list[np.ndarray]:
    """The sequences packing sorts and shares on: the tokens, or with ``routes`` (``[len, moe_layers, topk]``
    per sequence) and / or ``images`` (a list of `images.ImageRef` per sequence, or None) one int64 symbol
    per position that is equal iff the token, its routes and the image content behind it are."""
    if routes is None and images is None:
        return list(toks)
    cols = [[] for _ in toks]
    if routes is not None:
        cols = [c + [np.asarray(r, np.int64).reshape(len(r), -1)] for c, r in zip(cols, routes)]
    if images is not None:
        cols = [c + [image_identity(len(t), im)] for c, t, im in zip(cols, toks, images)]
    return route_symbols(toks, [np.concatenate(c, 1) for c in cols])


def with_images(mb: TreeMicrobatch, samples: Sequence[Sample]) -> TreeMicrobatch:
    """``mb`` with its rows' multimodal RoPE positions and its own image occurrences (`tree.images`)."""
    from dataclasses import replace

    return replace(mb, rope_positions=row_rope_positions(mb, samples), image_slots=image_slots(mb, samples))


class PrefixPlan:
    """What packing decides from, without building any layout: the lexicographic order of a set of
    token sequences, each one's LCP with its predecessor, and the rows each tree needs.

    ``tree_rows()`` rows per prefix tree; ``microbatch_rows(budget)`` rows of each microbatch `pack`
    would build at that budget (padding included). Planning a budget costs O(samples). With
    ``routes`` (one ``[len, moe_layers, topk]`` array per sequence) it plans route-aware packing, with
    ``mtp_tail`` the tail rows of ``pack(..., mtp_tail=)``.
    """

    def __init__(self, toks: Sequence[np.ndarray], routes=None, mtp_tail: int = 0, images=None):
        self.order, self.lcp = sort_and_lcp(share_keys(toks, routes, images))
        self.lens = np.array([len(t) for t in toks], dtype=np.int64)[self.order] + mtp_tail

    def tree_rows(self) -> np.ndarray:
        return np.add.reduceat(self.lens - self.lcp, np.flatnonzero(self.lcp == 0))

    def microbatch_rows(self, budget: int, pad_to_multiple_of: int = 1) -> list[int]:
        m = pad_to_multiple_of
        return [-(-r // m) * m for r in _plan_bins(self.lens, self.lcp, budget)[2]]


def _subset_lcp(lcp: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """[len(pos)] LCP of each of the sorted samples ``pos`` (ascending positions) with the previous
    one of the subset, 0 for the first: the minimum of ``lcp`` over ``(pos[k-1], pos[k]]`` (the LCP
    of two lexicographically sorted strings is the least adjacent LCP between them; it is 0 as soon
    as the range crosses a tree boundary)."""
    out = np.zeros(len(pos), dtype=np.int64)
    if len(pos) > 1:
        out[1:] = np.minimum.reduceat(lcp[: pos[-1] + 1], pos[:-1] + 1)
    return out


def _range_min(lcp: np.ndarray, a: int, b: int) -> int:
    """LCP of sorted samples a < b: min(lcp[a+1 .. b])."""
    return int(lcp[a + 1: b + 1].min())


def _split_tree(lens: np.ndarray, lcp: np.ndarray, a: int, b: int, budget: int) -> list[tuple[int, int, int]]:
    """Cut the tree of sorted samples [a, b) into consecutive parts of at most ``budget`` rows each.

    A part [i, j) costs ``C[i] + T[j] - T[i]`` rows: the ancestor path ``C[i] = lcp[i]`` its first
    sample repeats (0 for the tree's first sample) plus the tails ``T[j] - T[i]`` of its samples.
    Dynamic programming over the cut positions picks the fewest parts, then the fewest rows, then
    the latest last cut (a small last part packs well). A duplicate (tail 0) never starts a part, so
    identical samples stay together and the result does not depend on how ties between them were
    ordered. Returns (start, stop, rows) in order, tiling [a, b).

    The best start for a cut j minimises ``key[i] + C[i] - T[i]`` over the starts i < j with
    ``T[i] - C[i] >= T[j] - budget``; that bound only rises with j, so a start that fails it once
    fails it forever: a heap with lazy removal gives O(n log n) (one push/pop per sample).
    """
    L, C = lens[a:b].tolist(), lcp[a:b].tolist()
    C[0] = 0
    n = b - a
    T = [0] * (n + 1)
    for k in range(n):
        T[k + 1] = T[k] + L[k] - C[k]
    big = T[n] + n * budget + 1  # key = parts * big + rows orders by parts, then rows
    back = [0] * (n + 1)
    heap = [(C[0] - T[0], 0)]  # (key[i] + C[i] - T[i], -i): ties go to the latest start
    for j in range(1, n + 1):
        if j < n and L[j] == C[j]:
            continue  # a duplicate: no cut before it
        while T[-heap[0][1]] - C[-heap[0][1]] < T[j] - budget:
            heapq.heappop(heap)  # never empty: the latest start alone (with its duplicates) fits
        v, neg_i = heap[0]
        back[j] = -neg_i
        key_j = v + big + T[j]  # one more part, ending at j
        if j < n:
            heapq.heappush(heap, (key_j + C[j] - T[j], -j))
    parts, j = [], n
    while j > 0:
        i = back[j]
        parts.append((a + i, a + j, C[i] + T[j] - T[i]))
        j = i
    return parts[::-1]


def _split_tree_greedy(lens: np.ndarray, lcp: np.ndarray, a: int, b: int, budget: int) -> list[tuple[int, int, int]]:
    """Cut the tree [a, b) into consecutive parts filled as far as the budget allows (every part but
    the last is full, so the small last part packs well). Never cuts before a duplicate (tail 0
    adds no row). Same return as `_split_tree`."""
    tails = lens - lcp
    parts, start, used = [], a, int(lens[a])
    for j in range(a + 1, b):
        if used + tails[j] > budget:
            parts.append((start, j, used))
            start, used = j, int(lens[j])
        else:
            used += int(tails[j])
    parts.append((start, b, used))
    return parts


def _plan_bins(lens: np.ndarray, lcp: np.ndarray, budget: int):
    """Units, bins and the real rows of each bin for the sorted samples (``lens``, ``lcp``).

    units     [(start, stop, rows, tree)]: whole trees, or parts of trees over the budget; ``rows``
              is the unit's cost alone
    bins      lists of unit ids, first-fit-decreasing (`_first_fit`)
    bin_rows  real rows of each bin = the size of the trie of its samples, always <= ``budget``

    Trees over the budget are cut twice, by `_split_tree` (fewest parts, then fewest rows) and by
    `_split_tree_greedy` (full parts, a small remainder: bins pack tighter); the plan with fewer
    bins, then fewer rows, wins (the row-minimal one on ties). Depends only on the sorted samples,
    so not on the order they were given in.
    """
    tails = lens - lcp
    tree_start = np.flatnonzero(lcp == 0)
    tree_stop = np.append(tree_start[1:], len(lens))
    tree_rows = np.add.reduceat(tails, tree_start)
    trees = list(zip(tree_start.tolist(), tree_stop.tolist(), tree_rows.tolist()))
    big = tree_rows > budget
    plans = []
    for split in ((_split_tree, _split_tree_greedy) if big.any() else (None,)):
        units: list[tuple[int, int, int, int]] = []
        for t, (a, b, rows) in enumerate(trees):
            if rows <= budget:
                units.append((a, b, rows, t))
            else:
                units += [(i, j, r, t) for i, j, r in split(lens, lcp, a, b, budget)]
        bins, bin_rows = _first_fit(units, lcp, big, budget)
        plans.append((len(bins), sum(bin_rows), units, bins, bin_rows))
    best = min(plans, key=lambda p: p[:2])  # min keeps the first of equals: the row-minimal cuts
    return best[2:]


def _first_fit(units, lcp: np.ndarray, split_tree: np.ndarray, budget: int) -> tuple[list[list[int]], list[int]]:
    """First-fit-decreasing of ``units`` (see `_plan_bins`) by their rows alone (ties by unit id).

    A part of a split tree (``split_tree[tree]``) goes to the first bin where its *marginal* cost
    fits: the rows it adds to that bin's trie, less than its rows alone when the bin already holds
    parts of its tree (`_marginal_rows`). Returns the bins (unit ids) and their real rows.
    """
    sizes = np.array([u[2] for u in units], dtype=np.int64)
    order = np.lexsort((np.arange(len(sizes)), -sizes))
    remaining = np.empty(0, dtype=np.int64)
    bins: list[list[int]] = []
    placed: dict[int, list[tuple[int, int, int]]] = {}  # tree -> [(bin, start, stop)] of its placed parts
    for u in order.tolist():
        a, b, rows, t = units[u]
        fits = np.flatnonzero(remaining >= rows)
        choice, cost = (int(fits[0]) if fits.size else len(bins)), rows
        for bn in sorted({p[0] for p in placed.get(t, ())}):
            if bn > choice:
                break
            m = _marginal_rows(lcp, [(i, j) for q, i, j in placed[t] if q == bn], a, b, rows)
            if m <= remaining[bn]:
                choice, cost = bn, m
                break
        if choice == len(bins):
            remaining = np.append(remaining, budget)
            bins.append([])
        remaining[choice] -= cost
        bins[choice].append(u)
        if split_tree[t]:  # only parts of a split tree can share rows with another unit
            placed.setdefault(t, []).append((choice, a, b))
    return bins, (budget - remaining).tolist()


def _marginal_rows(lcp: np.ndarray, others: list[tuple[int, int]], a: int, b: int, rows: int) -> int:
    """Rows that part [a, b) (``rows`` alone) adds to a bin already holding the parts ``others`` of
    the same tree: its first sample shares its LCP with the closest earlier sample p of the bin,
    and the closest later sample s now follows b-1 instead of p (its tail shrinks accordingly)."""
    p = max((j - 1 for i, j in others if j <= a), default=None)
    s = min((i for i, j in others if i >= b), default=None)
    lcp_pa = _range_min(lcp, p, a) if p is not None else 0
    cost = rows - lcp_pa
    if s is not None:
        cost -= _range_min(lcp, b - 1, s) - (_range_min(lcp, p, s) if p is not None else 0)
    return cost


def _build_microbatch(samples: list[Sample], toks: list[np.ndarray], ids: np.ndarray, lcp: np.ndarray, budget: int,
                      pad_multiple: int, pad_id: int, pad_to_budget: bool, routes=None, tail: int = 0) -> TreeMicrobatch:
    """Lay out the samples ``ids`` (in sorted order, ``lcp`` relative to the previous one, 0 = new root),
    each followed by ``tail`` MTP tail rows (token 0: laid out as a suffix no other sample shares)."""
    real = np.array([len(toks[i]) for i in ids], dtype=np.int64)
    lens = real + tail
    tails = lens - lcp
    start = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum(tails, out=start[1:])
    n_real = int(start[-1])
    suffix = np.zeros(tail, np.int64)
    input_ids = np.concatenate([np.concatenate([toks[i][l:], suffix]) for i, l in zip(ids.tolist(), lcp.tolist())])

    # Paths: a sample's rows are the previous sample's first lcp rows, then its own tail.
    paths = []
    prev = np.empty(0, dtype=np.int64)
    path_prev = np.arange(n_real, dtype=np.int64) - 1
    fork_rows = []
    for j in range(len(ids)):
        l = int(lcp[j])
        if tails[j]:
            path_prev[start[j]] = prev[l - 1] if l else -1
        if 0 < l < len(prev):
            fork_rows.append(prev[l])  # the previous path's child at the fork starts a segment
        cur = np.concatenate([prev[:l], np.arange(start[j], start[j + 1], dtype=np.int64)])
        paths.append(cur)
        prev = cur
    # A tail starts a segment unless it only extends the previous sample's path (prefix extension).
    prev_len = np.concatenate([[0], lens[:-1]])
    extends = (lcp > 0) & (lcp == prev_len)
    cuts = np.unique(np.concatenate([start[:-1][(tails > 0) & ~extends], np.asarray(fork_rows, dtype=np.int64)]))
    seg_len = np.diff(np.append(cuts, n_real))
    seg_of_row = np.repeat(np.arange(len(cuts)), seg_len)
    pp = path_prev[cuts]
    parent = np.where(pp >= 0, seg_of_row[np.maximum(pp, 0)], -1)

    n_rows = budget if pad_to_budget else -(-n_real // pad_multiple) * pad_multiple
    layout = TreeLayout.from_segments(seg_len, parent, input_ids, num_padding=n_rows - n_real, pad_id=pad_id)

    # Loss map and stored paths, in ascending sample-id order.
    by_id = np.argsort(ids, kind="stable")
    sample_ids = ids[by_id]
    src, tgt, sidx, posn, w, adv, old, ref = [], [], [], [], [], [], [], []
    has = {f: any(getattr(samples[i], f) is not None for i in sample_ids)
           for f in ("advantage", "old_logprobs", "ref_logprobs")}
    for k in by_id.tolist():
        sid = int(ids[k])
        s = samples[sid]
        t = np.flatnonzero(s.target_mask())
        src.append(paths[k][t - 1])
        tgt.append(toks[sid][t])
        sidx.append(np.full(t.shape, sid, dtype=np.int64))
        posn.append(t)
        w.append(s.per_token("weight", 1.0)[t])
        for f, acc in (("advantage", adv), ("old_logprobs", old), ("ref_logprobs", ref)):
            if has[f]:  # NaN where a sample lacks the field: policy_loss names it if it is needed
                acc.append(s.per_token(f, float("nan"))[t])
    cat_l = lambda xs: torch.from_numpy(np.concatenate(xs).astype(np.int64, copy=False))
    cat_f = lambda xs: torch.from_numpy(np.concatenate(xs).astype(np.float64, copy=False)) if xs else None
    loss_map = LossMap(source_rows=cat_l(src), targets=cat_l(tgt), sample_index=cat_l(sidx), positions=cat_l(posn),
                       weights=cat_f(w), advantages=cat_f(adv), old_logprobs=cat_f(old), ref_logprobs=cat_f(ref))
    path_rows = np.concatenate([paths[k][: real[k]] for k in by_id.tolist()])
    tail_rows = np.stack([paths[k][real[k]:] for k in by_id.tolist()]) if tail else None
    path_offsets = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum(real[by_id], out=path_offsets[1:])
    stats = MicrobatchStats(  # tree_tokens counts the MTP tail rows too: the model runs them
        num_samples=len(ids), num_trees=int((lcp == 0).sum()), num_segments=len(cuts),
        num_targets=len(loss_map), flat_tokens=int(real.sum()), tree_tokens=n_real,
        padding_tokens=n_rows - n_real, flat_attention_pairs=int((real * (real + 1) // 2).sum()),
        tree_attention_pairs=layout.visible_pairs(), max_tokens_per_mb=budget)
    mb_routes = None
    if routes is not None:
        mb_routes = torch.from_numpy(row_routes(path_rows, [routes[i] for i in sample_ids.tolist()], n_rows))
    return TreeMicrobatch(layout=layout, loss_map=loss_map, sample_ids=tuple(sample_ids.tolist()), stats=stats,
                          _path_rows=path_rows, _path_offsets=path_offsets, routes=mb_routes, _tail_rows=tail_rows)
