"""Random prefix forests for op tests, built directly from segments (independent of `pack`).

`random_forest(seed)` returns a `TreeLayout` whose trees really branch (forks at several depths,
single-row segments, several trees, padding) and the row paths of samples ending at leaves, in the
middle of segments (samples that are prefixes of others) and duplicates.
"""
from __future__ import annotations

import numpy as np
import torch

from megatron_tree.tree import Sample
from megatron_tree.tree.layout import TreeLayout


def _grow(rng, parent, depth, lengths, parents, max_len, max_depth):
    seg = len(lengths)
    lengths.append(int(rng.choice([1, 1, 2, 3]) if rng.random() < 0.4 else rng.integers(1, max_len + 1)))
    parents.append(parent)
    n_children = 0 if depth >= max_depth else int(rng.choice([0, 1, 2, 2, 3]))
    for _ in range(n_children):
        _grow(rng, seg, depth + 1, lengths, parents, max_len, max_depth)


def path_rows(layout: TreeLayout, last_row: int) -> torch.Tensor:
    """Rows from the root to ``last_row`` following ``path_prev`` (test oracle; Python loop)."""
    prev = layout.path_prev.tolist()
    rows = []
    r = last_row
    while r >= 0:
        rows.append(r)
        r = prev[r]
    return torch.tensor(rows[::-1], dtype=torch.long)


def random_forest(seed: int, *, num_trees: int = 2, max_len: int = 9, max_depth: int = 3, num_padding: int = 2,
                  vocab: int = 50):
    """Returns ``(layout, samples)`` with ``samples`` a list of row tensors (root path order)."""
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    parents: list[int] = []
    for _ in range(num_trees):
        _grow(rng, -1, 0, lengths, parents, max_len, max_depth)
    n_real = int(sum(lengths))
    layout = TreeLayout.from_segments(lengths, parents, rng.integers(1, vocab, n_real), num_padding=num_padding)
    offsets = layout.segment_offsets.tolist()
    parents_arr = np.asarray(parents)
    is_leaf = ~np.isin(np.arange(len(lengths)), parents_arr)
    ends = [offsets[s + 1] - 1 for s in np.nonzero(is_leaf)[0]]
    # prefix samples ending inside or at the end of internal segments
    for s in np.nonzero(~is_leaf)[0][:3]:
        ends.append(int(rng.integers(offsets[s], offsets[s + 1])))
    ends.append(ends[0])  # a duplicate sample
    samples = [path_rows(layout, e) for e in ends]
    return layout, samples


def flat_copy_weights(layout: TreeLayout, samples) -> torch.Tensor:
    """[N] number of samples through each row (0 for rows no sample covers)."""
    count = torch.zeros(layout.num_rows, dtype=torch.float64)
    for rows in samples:
        count[rows] += 1
    return count


def ownership(kind: str, n: int, cp: int, seed: int = 0, *, chunk: int = 4) -> np.ndarray:
    """[n] owner rank of every row for CP tests, independent of the planner.

    random      row-level, non-contiguous
    chunks      random owners of ``chunk``-row runs
    runs        random owners of runs of random length (unaligned boundaries)
    cycle       runs of 1-3 rows cycling over the ranks (pieces shorter than a conv window)
    contiguous  equal contiguous blocks
    zigzag      2*cp equal blocks, rank r gets blocks r and 2*cp-1-r (Megatron's fold)
    empty_last  random over every rank but the last, which owns nothing
    all_on_R    every row on rank R
    """
    rng = np.random.default_rng(seed)
    if kind == "random":
        return rng.integers(0, cp, n)
    if kind == "chunks":
        return np.repeat(rng.integers(0, cp, -(-n // chunk)), chunk)[:n]
    if kind == "runs":
        cuts = np.sort(rng.choice(np.arange(1, n), size=min(n - 1, max(1, n // 3)), replace=False))
        runs = np.diff(np.concatenate([[0], cuts, [n]]))
        return np.repeat(rng.integers(0, cp, runs.size), runs)
    if kind == "cycle":
        runs = rng.integers(1, 4, n)
        return np.repeat(np.arange(runs.size) % cp, runs)[:n]
    if kind == "contiguous":
        return (np.arange(n) * cp) // n
    if kind == "zigzag":
        block = (np.arange(n) * 2 * cp) // n
        return np.minimum(block, 2 * cp - 1 - block)
    if kind == "empty_last":
        return rng.integers(0, cp - 1, n)
    if kind.startswith("all_on_"):
        return np.full(n, int(kind[len("all_on_"):]))
    raise ValueError(kind)


def test_plan(layout: TreeLayout, kind: str, cp: int, seed: int = 0, *, waves: int = 1, chunk: int = 4):
    """A `CPPlan` with `ownership` ``kind`` over ``layout`` (no planner involved)."""
    from megatron_tree.cp import CPPlan

    return CPPlan(cp_size=cp, strategy="test", owner=ownership(kind, layout.num_rows, cp, seed, chunk=chunk)
                  .astype(np.int32), visible_until=layout.visible_until.numpy().astype(np.int64),
                  position_ids=layout.position_ids.numpy().astype(np.int64), num_waves=waves)


test_plan.__test__ = False  # a helper, not a pytest test


def branching_samples(seed: int, vocab: int = 128):
    """`Sample`s (for `pack`) of 3 branching families: a shared prompt, completions forking at
    several depths, a prefix sample."""
    rng = np.random.default_rng(seed)
    out = []
    for fam in range(3):
        prompt = rng.integers(1, vocab, int(rng.integers(6, 14)))
        mid = rng.integers(1, vocab, 4)
        for c in range(3):
            tail = rng.integers(1, vocab, int(rng.integers(2, 9)))
            toks = np.concatenate([prompt, mid, tail]) if c < 2 else np.concatenate([prompt, tail])
            mask = np.zeros(len(toks), bool)
            mask[len(prompt):] = True
            out.append(Sample(tokens=toks, loss_mask=mask, group=fam))
        out.append(Sample(tokens=prompt[:5].copy(), group=fam))  # a prefix of its family's prompt
    return out
