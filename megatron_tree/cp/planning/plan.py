"""`CPPlan`: which CP rank owns which rows of one microbatch, and in how many KV waves it fetches.

A plan is a pure host-side object (numpy), made from a `TreeLayout` alone, identical on every rank.
It keeps the three things of tree context parallelism apart:

* **visibility** is the layout's (``visible_until``, ``position_ids``), copied into the plan so the
  schedule can be derived without the device tensors;
* **ownership** is ``owner[N]``: the CP rank that holds each row's residual stream, its token-local
  work (projections, norms, MLP / MoE), its queries and outputs, and the master copy of its K / V.
  A rank's rows need not be contiguous; its *local order* is ascending global row;
* **schedule**: remote K / V a rank's queries need arrive in ``num_waves`` waves
  (`megatron_tree.cp.planning.schedule.build_schedule`): wave ``w`` of rank ``r`` holds the ``w``-th of
  ``num_waves`` contiguous, near-equal parts of ``r``'s needed remote rows sorted by global row.

``predicted_ms`` / ``imbalance`` are the planner's cost-model prediction for the executed plan
(forward + backward of the attention layers plus token-local work, per rank).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

__all__ = ["CPPlan"]


@dataclass(frozen=True, eq=False)
class CPPlan:
    """Ownership and wave count of one microbatch under context parallelism.

    cp_size        number of CP ranks
    strategy       "balanced" | "zigzag" | "contiguous" (how ``owner`` was chosen)
    owner          [N] int32, rank owning each physical row (every rank in ``range(cp_size)``;
                   a rank may own nothing)
    visible_until  [N] int64, the layout's visibility bound (a copy: the plan is self-contained)
    position_ids   [N] int64, the layout's depths (sliding windows are measured in depth)
    num_waves      remote KV waves per attention layer (>= 1)
    chunk_size     rows per planning chunk (ownership is constant on chunks, except that the
                   last chunk may be short); with ``chunk_starts`` set, the chunks' nominal size
    predicted_ms   [cp_size] float64, predicted time per rank (cost model), or all zeros
    stats          free-form planner figures (search steps, planning time, model-neutral balance)
    chunk_starts   optional [M] int64 first row of each planning chunk when the chunks are not
                   uniform (the balanced planner cuts near-equal chunks of whole 128-row tiles, or
                   for small microbatches sub-tile chunks snapped to tree starts): ownership is
                   constant on ``[chunk_starts[c], chunk_starts[c+1])``
    """

    cp_size: int
    strategy: str
    owner: np.ndarray
    visible_until: np.ndarray
    position_ids: np.ndarray
    num_waves: int = 1
    chunk_size: int = 1
    predicted_ms: np.ndarray | None = None
    stats: dict = field(default_factory=dict)
    chunk_starts: np.ndarray | None = None

    def __post_init__(self):
        n = self.owner.shape[0]
        if self.owner.ndim != 1 or self.visible_until.shape != (n,) or self.position_ids.shape != (n,):
            raise ValueError("CPPlan: owner, visible_until and position_ids must be [N] arrays of one length")
        if self.cp_size < 1 or self.num_waves < 1:
            raise ValueError(f"CPPlan: cp_size ({self.cp_size}) and num_waves ({self.num_waves}) must be >= 1")
        if n and (int(self.owner.min()) < 0 or int(self.owner.max()) >= self.cp_size):
            raise ValueError(f"CPPlan: owner ranks must lie in [0, {self.cp_size})")
        if self.predicted_ms is None:
            object.__setattr__(self, "predicted_ms", np.zeros(self.cp_size))

    @property
    def num_rows(self) -> int:
        return int(self.owner.shape[0])

    def owner_rows(self, rank: int) -> np.ndarray:
        """[n_rank] int64 global rows owned by ``rank``, in its local order (ascending)."""
        if not 0 <= rank < self.cp_size:
            raise ValueError(f"rank {rank} is outside the CP group of size {self.cp_size}")
        return self._owned[rank]

    def rows_per_rank(self) -> np.ndarray:
        """[cp_size] int64 number of rows each rank owns."""
        return np.bincount(self.owner, minlength=self.cp_size).astype(np.int64)

    @property
    def imbalance(self) -> float:
        """max / mean of ``predicted_ms`` (1.0 is perfect; 1.0 when nothing is predicted)."""
        mean = float(np.mean(self.predicted_ms))
        return float(np.max(self.predicted_ms)) / mean if mean > 0 else 1.0

    @property
    def hash(self) -> str:
        """Stable digest of everything the executors read: equal on every rank for the same plan."""
        return self._hash

    # ------------------------------------------------------------------ cached derived state
    # (cached_property writes the instance __dict__ directly, which a frozen dataclass allows)
    @cached_property
    def _owned(self) -> tuple:
        order = np.argsort(self.owner, kind="stable")
        bounds = np.searchsorted(self.owner[order], np.arange(self.cp_size + 1))
        return tuple(order[bounds[r]:bounds[r + 1]].astype(np.int64) for r in range(self.cp_size))

    @cached_property
    def _hash(self) -> str:
        h = hashlib.sha256()
        h.update(np.array([self.cp_size, self.num_waves, self.chunk_size, self.num_rows], np.int64).tobytes())
        for a in (self.owner.astype(np.int32), self.visible_until.astype(np.int64), self.position_ids.astype(np.int64)):
            h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()[:16]

    def __repr__(self) -> str:
        rows = self.rows_per_rank().tolist()
        return (f"CPPlan(cp={self.cp_size}, strategy={self.strategy!r}, rows/rank={rows}, waves={self.num_waves}, "
                f"imbalance={self.imbalance:.3f}, hash={self.hash})")
