"""`LossMap`: one entry per original prediction occurrence of a packed microbatch."""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True, eq=False)
class LossMap:
    """Per-occurrence loss metadata (M = number of targets over all samples of the microbatch).

    source_rows   [M] int64  physical row whose logits predict the target
    targets       [M] int64  target token id
    sample_index  [M] int64  index of the sample in the caller's input list (as in ``sample_ids``)
    positions     [M] int64  position t of the target inside its sample (1 <= t < L)
    weights       [M] float  loss weight (1 unless the sample gave one)
    advantages    [M] float or None
    old_logprobs  [M] float or None
    ref_logprobs  [M] float or None

    A shared row that precedes several different next tokens appears once per occurrence; two
    identical samples contribute two occurrences each. Occurrences are ordered by sample index,
    then position.
    """

    source_rows: torch.Tensor
    targets: torch.Tensor
    sample_index: torch.Tensor
    positions: torch.Tensor
    weights: torch.Tensor
    advantages: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.source_rows.shape[0])

    @property
    def num_occurrences(self) -> int:
        return len(self)

    def to(self, device) -> "LossMap":
        return LossMap(**{f.name: (None if getattr(self, f.name) is None else getattr(self, f.name).to(device))
                          for f in fields(self)})

    def sample_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(unique sample ids with >=1 occurrence [U], slot of each occurrence in them [M])."""
        return torch.unique(self.sample_index, return_inverse=True)
