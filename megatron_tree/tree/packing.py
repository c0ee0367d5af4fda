"""Sharing-aware packing: samples -> compressed prefix tries -> microbatches under a row budget.

How it works (vectorised; the only Python loops run once per sample or per tree, never per token):

1. Sort the samples lexicographically (token ids as big-endian bytes, so ``bytes`` comparison is
   token-order comparison and a prefix sorts before its extensions). In that order, the rows a
   sample adds to the trie are exactly its tokens after the longest common prefix (LCP) with the
   previous sample, and concatenating those tails gives the trie in DFS preorder.
2. A tree is a maximal run of consecutive sorted samples with LCP > 0. A tree that fits the budget
   is kept whole; a larger one is cut into consecutive runs of samples, each part repeating only
   the ancestor path of its first sample.
3. Trees (and parts) go to microbatches first-fit-decreasing by rows.
4. Segment boundaries are the tail starts (except where a sample merely extends the previous one)
   and the rows where a later sample forks off an earlier path.

Samples arriving in any order give the same microbatches: the result depends only on the multiset
of samples and their indices (ties between identical samples are broken by index).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from .layout import TreeLayout
from .loss_map import LossMap
from .microbatch import MicrobatchStats, TreeMicrobatch
from .sample import Sample, as_sample, validate_sample


def pack(samples: Sequence, max_tokens_per_mb: int, *, pad_to_multiple_of: int = 1, pad_id: int = 0,
         pad_to_budget: bool = False, vocab_size: int | None = None,
         share_prefixes: bool = True) -> list[TreeMicrobatch]:
    """Pack ``samples`` into prefix-shared microbatches of at most ``max_tokens_per_mb`` rows.

    samples            `Sample`s, dicts with Sample's fields, or bare token sequences
    max_tokens_per_mb  row budget per microbatch (padding included)
    pad_to_multiple_of each microbatch's row count is padded up to a multiple of this
    pad_to_budget      pad every microbatch to exactly ``max_tokens_per_mb`` rows (fixed shapes)
    vocab_size         if given, token ids must be below it
    share_prefixes     False gives flat packing (every sample its own unbranched chain, same bins):
                       the baseline tree packing is measured against

    Every sample lands in exactly one microbatch. Raises ValueError naming the sample for an empty
    sample, a sample longer than the budget, or malformed fields.
    """
    if max_tokens_per_mb <= 0:
        raise ValueError(f"max_tokens_per_mb must be positive, got {max_tokens_per_mb}")
    if pad_to_multiple_of <= 0 or max_tokens_per_mb % pad_to_multiple_of:
        raise ValueError(f"max_tokens_per_mb={max_tokens_per_mb} must be a positive multiple of "
                         f"pad_to_multiple_of={pad_to_multiple_of}")
    samples = [as_sample(s) for s in samples]
    for i, s in enumerate(samples):
        validate_sample(i, s, max_tokens=max_tokens_per_mb, vocab_size=vocab_size)
    if not samples:
        return []
    toks = [s.tokens.astype(np.int64, copy=False) for s in samples]
    order, lcp = sort_and_lcp(toks)
    if not share_prefixes:
        lcp[:] = 0
    lens = np.array([len(t) for t in toks], dtype=np.int64)[order]
    units = _split_into_units(lens, lcp, max_tokens_per_mb)
    bins = _first_fit_decreasing([u[2] for u in units], max_tokens_per_mb)
    out = []
    for unit_ids in bins:
        pos = np.concatenate([np.arange(units[u][0], units[u][1]) for u in sorted(unit_ids)])
        mb_lcp = lcp[pos].copy()
        mb_lcp[np.isin(pos, [units[u][0] for u in unit_ids])] = 0  # each part starts a new root path
        out.append(_build_microbatch(samples, toks, order[pos], mb_lcp, max_tokens_per_mb, pad_to_multiple_of,
                                     pad_id, pad_to_budget))
    return out


def sort_and_lcp(toks: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Lexicographic order of token sequences and the LCP of each with its predecessor (0 first)."""
    keys = [t.astype(">u4").tobytes() for t in toks]
    order = np.array(sorted(range(len(toks)), key=lambda i: (keys[i], i)), dtype=np.int64)
    lcp = np.zeros(len(order), dtype=np.int64)
    for j in range(1, len(order)):
        a, b = toks[order[j - 1]], toks[order[j]]
        m = min(len(a), len(b))
        diff = np.flatnonzero(a[:m] != b[:m])
        lcp[j] = diff[0] if diff.size else m
    return order, lcp


class PrefixPlan:
    """What packing decides from, without building any layout: the lexicographic order of a set of
    token sequences, each one's LCP with its predecessor, and the rows each tree needs.

    ``tree_rows()`` rows per prefix tree; ``microbatch_rows(budget)`` rows of each microbatch `pack`
    would build at that budget (padding included). Planning a budget costs O(samples).
    """

    def __init__(self, toks: Sequence[np.ndarray]):
        self.order, self.lcp = sort_and_lcp(toks)
        self.lens = np.array([len(t) for t in toks], dtype=np.int64)[self.order]

    def tree_rows(self) -> np.ndarray:
        return np.add.reduceat(self.lens - self.lcp, np.flatnonzero(self.lcp == 0))

    def microbatch_rows(self, budget: int, pad_to_multiple_of: int = 1) -> list[int]:
        units = _split_into_units(self.lens, self.lcp, budget)
        bins = _first_fit_decreasing([u[2] for u in units], budget)
        m = pad_to_multiple_of
        return [-(-sum(units[u][2] for u in b) // m) * m for b in bins]


def _split_into_units(lens: np.ndarray, lcp: np.ndarray, budget: int) -> list[tuple[int, int, int]]:
    """Cut the sorted samples into (start, stop, rows) units: whole trees, or parts of big trees."""
    tails = lens - lcp
    tree_start = np.flatnonzero(lcp == 0)
    tree_stop = np.append(tree_start[1:], len(lens))
    tree_rows = np.add.reduceat(tails, tree_start)
    units = []
    for a, b, rows in zip(tree_start.tolist(), tree_stop.tolist(), tree_rows.tolist()):
        if rows <= budget:
            units.append((a, b, rows))
            continue
        # Greedy consecutive parts: a part's first sample repeats its whole ancestor path.
        start, used = a, int(lens[a])
        for j in range(a + 1, b):
            if used + tails[j] > budget:
                units.append((start, j, used))
                start, used = j, int(lens[j])
            else:
                used += int(tails[j])
        units.append((start, b, used))
    return units


def _first_fit_decreasing(sizes: Sequence[int], budget: int) -> list[list[int]]:
    """Bins of unit ids; units sorted by size descending (ties by id), each into the first bin it fits."""
    sizes = np.asarray(sizes, dtype=np.int64)
    order = np.lexsort((np.arange(len(sizes)), -sizes))
    remaining = np.empty(0, dtype=np.int64)
    bins: list[list[int]] = []
    for u in order.tolist():
        fits = np.flatnonzero(remaining >= sizes[u])
        if fits.size:
            b = int(fits[0])
            remaining[b] -= sizes[u]
            bins[b].append(u)
        else:
            remaining = np.append(remaining, budget - sizes[u])
            bins.append([u])
    return bins


def _build_microbatch(samples: list[Sample], toks: list[np.ndarray], ids: np.ndarray, lcp: np.ndarray, budget: int,
                      pad_multiple: int, pad_id: int, pad_to_budget: bool) -> TreeMicrobatch:
    """Lay out the samples ``ids`` (in sorted order, ``lcp`` relative to the previous one, 0 = new root)."""
    lens = np.array([len(toks[i]) for i in ids], dtype=np.int64)
    tails = lens - lcp
    start = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum(tails, out=start[1:])
    n_real = int(start[-1])
    input_ids = np.concatenate([toks[i][l:] for i, l in zip(ids.tolist(), lcp.tolist())])

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
    path_rows = np.concatenate([paths[k] for k in by_id.tolist()])
    path_offsets = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum(lens[by_id], out=path_offsets[1:])
    stats = MicrobatchStats(
        num_samples=len(ids), num_trees=int((lcp == 0).sum()), num_segments=len(cuts),
        num_targets=len(loss_map), flat_tokens=int(lens.sum()), tree_tokens=n_real,
        padding_tokens=n_rows - n_real, flat_attention_pairs=int((lens * (lens + 1) // 2).sum()),
        tree_attention_pairs=layout.visible_pairs(), max_tokens_per_mb=budget)
    return TreeMicrobatch(layout=layout, loss_map=loss_map, sample_ids=tuple(sample_ids.tolist()), stats=stats,
                          _path_rows=path_rows, _path_offsets=path_offsets)
