"""`TreeLayout`: the physical row layout of one packed prefix forest.

Rows are laid out in DFS preorder. A *segment* is a maximal run of rows shared by the same set of
samples (a compressed-trie node); every segment is contiguous, a child segment starts after its
parent's last row, and every subtree is a contiguous row range. Padding rows are one-row root
segments.

Visibility is one predicate: query row ``q`` sees key row ``k`` iff ``k <= q < visible_until[k]``
(``visible_until[k]`` is the end of the subtree of ``k``'s segment). That is exactly "k is an
ancestor-or-self of q on q's root path".
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

_FIELDS = (
    "input_ids",
    "position_ids",
    "segment_offsets",
    "segment_parent",
    "subtree_end",
    "visible_until",
    "path_prev",
)


@dataclass(frozen=True, eq=False)
class TreeLayout:
    """Immutable layout of N physical rows grouped into S segments (all int64 tensors).

    Fields (docs/architecture.md):
      input_ids       [N]   token of each physical row (padding rows hold ``pad_id``)
      position_ids    [N]   depth of the row on its root-to-leaf path (0 at a root row)
      segment_offsets [S+1] segment s owns rows ``segment_offsets[s]:segment_offsets[s+1]``
      segment_parent  [S]   parent segment, -1 for a root (padding rows are roots)
      subtree_end     [S]   one past the last row of the segment's subtree
      visible_until   [N]   ``subtree_end`` of the row's segment
      path_prev       [N]   previous row on the root path, -1 at a root row

    Derived (cached, same device): ``segment_ids`` [N], ``segment_level`` [S] (0 for roots),
    ``is_padding`` [N] bool, ``num_rows``, ``num_segments``, ``num_levels``.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segment_offsets: torch.Tensor
    segment_parent: torch.Tensor
    subtree_end: torch.Tensor
    visible_until: torch.Tensor
    path_prev: torch.Tensor
    num_padding: int = 0  # padding rows are the last ``num_padding`` rows

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_segments(cls, segment_lengths, segment_parent, input_ids=None, *, num_padding: int = 0,
                      pad_id: int = 0) -> "TreeLayout":
        """Build a layout from segments given in DFS preorder.

        ``segment_lengths[s]`` rows each; ``segment_parent[s]`` < s or -1. Segments must be in DFS
        preorder (each segment's subtree is the run of segments that follows it). The last
        ``num_padding`` rows are appended as one-row padding segments. ``input_ids`` (length of the
        real rows) defaults to zeros. Vectorised: no loop over rows.
        """
        lengths = np.asarray(segment_lengths, dtype=np.int64)
        parent = np.asarray(segment_parent, dtype=np.int64)
        if lengths.ndim != 1 or parent.shape != lengths.shape:
            raise ValueError("segment_lengths and segment_parent must be 1-D and of equal length")
        if (lengths <= 0).any():
            raise ValueError(f"segment {int(np.argmax(lengths <= 0))} has no rows")
        S = len(lengths)
        if S and ((parent >= np.arange(S)) | (parent < -1)).any():
            bad = int(np.argmax((parent >= np.arange(S)) | (parent < -1)))
            raise ValueError(f"segment {bad}: parent {parent[bad]} must precede it (DFS preorder) or be -1")
        if num_padding:
            lengths = np.concatenate([lengths, np.ones(num_padding, np.int64)])
            parent = np.concatenate([parent, np.full(num_padding, -1, np.int64)])
        S = len(lengths)
        offsets = np.zeros(S + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        N = int(offsets[-1])
        seg_of_row = np.repeat(np.arange(S), lengths)
        level = _levels(parent)
        # subtree_end: bottom-up max over children, one vectorised step per level.
        subtree_end = offsets[1:].copy()
        for lv in range(int(level.max(initial=0)), 0, -1):
            segs = np.nonzero(level == lv)[0]
            np.maximum.at(subtree_end, parent[segs], subtree_end[segs])
        # path_prev: row-1 inside a segment; parent's last row at a segment start.
        path_prev = np.arange(N, dtype=np.int64) - 1
        starts = offsets[:-1]
        path_prev[starts] = np.where(parent >= 0, offsets[np.maximum(parent, 0) + 1] - 1, -1)
        # depth: parent's last depth + 1 at a segment start, +1 along the segment.
        seg_depth0 = np.zeros(S, np.int64)
        for lv in range(1, int(level.max(initial=0)) + 1):
            segs = np.nonzero(level == lv)[0]
            p = parent[segs]
            seg_depth0[segs] = seg_depth0[p] + lengths[p]
        position = seg_depth0[seg_of_row] + (np.arange(N) - starts[seg_of_row])
        if input_ids is None:
            ids = np.zeros(N, np.int64)
        else:
            ids = np.full(N, pad_id, np.int64)
            ids[: N - num_padding] = np.asarray(input_ids, np.int64)
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
        layout = cls(
            input_ids=t(ids), position_ids=t(position), segment_offsets=t(offsets),
            segment_parent=t(parent), subtree_end=t(subtree_end),
            visible_until=t(subtree_end[seg_of_row]), path_prev=t(path_prev), num_padding=num_padding,
        )
        return layout

    # ------------------------------------------------------------------ derived
    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_segments(self) -> int:
        return int(self.segment_parent.shape[0])

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @cached_property
    def segment_lengths(self) -> torch.Tensor:
        return self.segment_offsets[1:] - self.segment_offsets[:-1]

    @cached_property
    def segment_ids(self) -> torch.Tensor:
        """[N] segment of every row."""
        return torch.repeat_interleave(
            torch.arange(self.num_segments, device=self.device), self.segment_lengths)

    @cached_property
    def segment_level(self) -> torch.Tensor:
        """[S] depth of the segment in the segment tree (roots are level 0)."""
        return torch.from_numpy(_levels(self.segment_parent.cpu().numpy())).to(self.device)

    @property
    def num_levels(self) -> int:
        return int(self.segment_level.max().item()) + 1 if self.num_segments else 0

    @cached_property
    def is_padding(self) -> torch.Tensor:
        pad = torch.zeros(self.num_rows, dtype=torch.bool, device=self.device)
        if self.num_padding:
            pad[-self.num_padding:] = True
        return pad

    @property
    def num_real_rows(self) -> int:
        return self.num_rows - self.num_padding

    def to(self, device) -> "TreeLayout":
        return TreeLayout(**{f: getattr(self, f).to(device) for f in _FIELDS}, num_padding=self.num_padding)

    def visible(self, q_rows: torch.Tensor, k_rows: torch.Tensor) -> torch.Tensor:
        """[Nq, Nk] bool: query rows ``q_rows`` [Nq] x key rows ``k_rows`` [Nk] (tests, small blocks)."""
        q, k = q_rows.unsqueeze(-1), k_rows.unsqueeze(-2)
        return (k <= q) & (q < self.visible_until[k_rows].unsqueeze(-2))

    def dense_mask(self) -> torch.Tensor:
        """[N,N] bool visibility. For tests only: never build this on a hot path."""
        r = torch.arange(self.num_rows, device=self.device)
        return self.visible(r, r)

    def visible_pairs(self) -> int:
        """Number of visible (q, k) pairs over real rows: sum_k (visible_until[k] - k)."""
        n = self.num_real_rows
        return int((self.visible_until[:n] - torch.arange(n, device=self.device)).sum().item())

    def validate(self) -> None:
        """Check the structural invariants; raises ValueError naming the first broken rule."""
        N, S = self.num_rows, self.num_segments
        off = self.segment_offsets
        for name in _FIELDS:
            v = getattr(self, name)
            if v.dtype != torch.int64:
                raise ValueError(f"{name} must be int64, got {v.dtype}")
        if off[0] != 0 or off[-1] != N or (off[1:] <= off[:-1]).any():
            raise ValueError("segment_offsets must start at 0, end at N and strictly increase")
        par = self.segment_parent
        idx = torch.arange(S, device=self.device)
        if ((par >= idx) | (par < -1)).any():
            raise ValueError("segment_parent must point to an earlier segment or be -1")
        has_p = par >= 0
        if (off[:-1][has_p] < off[1:][par[has_p]]).any():
            raise ValueError("a child segment must start after its parent's last row")
        if (self.subtree_end[has_p] > self.subtree_end[par[has_p]]).any():
            raise ValueError("a subtree must lie inside its parent's subtree")
        if (self.visible_until != self.subtree_end[self.segment_ids]).any():
            raise ValueError("visible_until must equal subtree_end of the row's segment")

    def __repr__(self) -> str:
        return (f"TreeLayout(rows={self.num_rows}, segments={self.num_segments}, levels={self.num_levels}, "
                f"padding={self.num_padding}, device={self.device})")


def _levels(parent: np.ndarray) -> np.ndarray:
    """Depth of each node in a forest (roots 0) by synchronous pointer doubling: O(S log depth)."""
    anc = np.asarray(parent, np.int64).copy()
    dist = (anc >= 0).astype(np.int64)  # hops from node to anc[node]
    while True:
        has = np.nonzero(anc >= 0)[0]
        if has.size == 0:
            return dist
        a = anc[has]
        dist[has] = dist[has] + dist[a]
        anc[has] = anc[a]
