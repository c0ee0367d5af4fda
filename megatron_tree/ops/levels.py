"""Level-by-level schedule shared by the recurrent tree ops (gated delta rule, SSD).

A recurrent op over a tree runs one segment-tree level at a time: every segment of a level starts
from its parent's final state (or the zero state at a root), so all segments of a level run as one
batch. Segments of a level are padded at the end to a common length; padded steps must leave the
state unchanged (the ops feed zero decay-log / zero input there), so a segment's final state is the
state after its last real row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tree.layout import TreeLayout


@dataclass(frozen=True)
class Level:
    """One level of the segment tree.

    segments [n]   segment ids of this level (ascending)
    parent   [n]   their parent segment ids (-1 at roots)
    lengths  [n]   rows per segment
    rows     [n,T] physical row of step t of each segment; padded steps hold ``pad_row`` (= N, a
                   sentinel one past the last row: gather from a tensor with one extra zero row)
    """

    segments: torch.Tensor
    parent: torch.Tensor
    lengths: torch.Tensor
    rows: torch.Tensor
    pad_row: int

    @property
    def valid(self) -> torch.Tensor:
        """[n,T] bool: real steps."""
        return self.rows != self.pad_row


def level_schedule(layout: TreeLayout, *, pad_to_multiple_of: int = 1, include_padding: bool = True) -> list[Level]:
    """Levels of ``layout``'s segment tree, root level first. Vectorised per level.

    ``pad_to_multiple_of`` rounds each level's common length T up (e.g. to the chunk size).
    ``include_padding=False`` leaves out the padding rows' one-row root segments (ops that give
    them a closed form) and any level left empty.
    """
    dev = layout.device
    level = layout.segment_level
    offsets = layout.segment_offsets
    lengths_all = layout.segment_lengths
    N = layout.num_rows
    out = []
    first_pad = layout.num_segments - layout.num_padding
    for lv in range(layout.num_levels):
        segs = torch.nonzero(level == lv).flatten()
        if not include_padding:
            segs = segs[segs < first_pad]
            if segs.numel() == 0:
                continue
        lengths = lengths_all[segs]
        T = int(lengths.max().item())
        T = -(-T // pad_to_multiple_of) * pad_to_multiple_of
        t = torch.arange(T, device=dev)
        rows = offsets[segs].unsqueeze(1) + t
        rows = torch.where(t < lengths.unsqueeze(1), rows, torch.full_like(rows, N))
        out.append(Level(segments=segs, parent=layout.segment_parent[segs], lengths=lengths, rows=rows, pad_row=N))
    return out
