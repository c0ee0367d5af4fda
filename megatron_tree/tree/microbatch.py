"""`TreeMicrobatch` (layout + loss map + sample paths) and its sharing statistics."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from .layout import TreeLayout
from .loss_map import LossMap


@dataclass(frozen=True)
class MicrobatchStats:
    """Sharing statistics of one microbatch.

    tree_token_ratio = flat_tokens / tree_tokens: how many rows per-sample packing would run per
    row the tree runs (>= 1; padding excluded from both).
    attention pairs: visible (query, key) pairs of causal attention, per-sample
    (sum L(L+1)/2) vs tree (sum over real rows of ``visible_until[k] - k``).
    fill = tree_tokens / max_tokens_per_mb.
    """

    num_samples: int
    num_trees: int
    num_segments: int
    num_targets: int
    flat_tokens: int
    tree_tokens: int
    padding_tokens: int
    flat_attention_pairs: int
    tree_attention_pairs: int
    max_tokens_per_mb: int

    @property
    def tree_token_ratio(self) -> float:
        return self.flat_tokens / max(self.tree_tokens, 1)

    @property
    def attention_pair_ratio(self) -> float:
        return self.flat_attention_pairs / max(self.tree_attention_pairs, 1)

    @property
    def fill(self) -> float:
        return self.tree_tokens / self.max_tokens_per_mb

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(tree_token_ratio=self.tree_token_ratio, attention_pair_ratio=self.attention_pair_ratio,
                 fill=self.fill)
        return d


@dataclass(frozen=True, eq=False)
class TreeMicrobatch:
    """One packed microbatch.

    layout      the `TreeLayout` of its rows
    loss_map    per-occurrence targets (`LossMap`)
    sample_ids  [n] indices (into the list given to `pack`) of the samples it holds, ascending
    stats       `MicrobatchStats`
    sample_rows(sample_id) -> [L] int64 physical rows of that sample in path order; gathering any
    token-wise op output at these rows equals running the op on the sample alone (the test oracle).
    """

    layout: TreeLayout
    loss_map: LossMap
    sample_ids: tuple[int, ...]
    stats: MicrobatchStats
    _path_rows: np.ndarray  # concatenated sample paths, in ``sample_ids`` order
    _path_offsets: np.ndarray  # [n+1]

    def sample_rows(self, sample_id: int) -> torch.Tensor:
        i = self._slot(sample_id)
        return torch.from_numpy(self._path_rows[self._path_offsets[i]: self._path_offsets[i + 1]])

    def _slot(self, sample_id: int) -> int:
        i = int(np.searchsorted(self.sample_ids, sample_id))
        if i >= len(self.sample_ids) or self.sample_ids[i] != sample_id:
            raise KeyError(f"sample {sample_id} is not in this microbatch (it holds {len(self.sample_ids)} samples)")
        return i

    @property
    def num_rows(self) -> int:
        return self.layout.num_rows

    def to(self, device) -> "TreeMicrobatch":
        return TreeMicrobatch(self.layout.to(device), self.loss_map.to(device), self.sample_ids, self.stats,
                              self._path_rows, self._path_offsets)

    def __repr__(self) -> str:
        s = self.stats
        return (f"TreeMicrobatch(samples={s.num_samples}, rows={self.num_rows}, tree_tokens={s.tree_tokens}, "
                f"flat_tokens={s.flat_tokens}, ratio={s.tree_token_ratio:.2f})")


def summarize(microbatches) -> dict:
    """Totals over microbatches (ratios recomputed from totals, not averaged)."""
    keys = ("num_samples", "num_trees", "num_segments", "num_targets", "flat_tokens", "tree_tokens",
            "padding_tokens", "flat_attention_pairs", "tree_attention_pairs")
    tot = {k: int(sum(getattr(mb.stats, k) for mb in microbatches)) for k in keys}
    budget = sum(mb.stats.max_tokens_per_mb for mb in microbatches)
    tot["num_microbatches"] = len(microbatches)
    tot["tree_token_ratio"] = tot["flat_tokens"] / max(tot["tree_tokens"], 1)
    tot["attention_pair_ratio"] = tot["flat_attention_pairs"] / max(tot["tree_attention_pairs"], 1)
    tot["fill"] = tot["tree_tokens"] / max(budget, 1)
    return tot
