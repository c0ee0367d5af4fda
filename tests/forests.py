"""Random prefix forests for op tests, built directly from segments (independent of `pack`).

`random_forest(seed)` returns a `TreeLayout` whose trees really branch (forks at several depths,
single-row segments, several trees, padding) and the row paths of samples ending at leaves, in the
middle of segments (samples that are prefixes of others) and duplicates.
"""
from __future__ import annotations

import numpy as np
import torch

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
