"""The order a step's carry microbatches run in, inside one Megatron schedule (host side, no torch).

A microbatch whose rows later microbatches read (it *exports* rows, `tree.carry.CarryInfo.exported`)
runs twice: a **fill** forward without autograd that writes the exported rows' layer state into the
step's carry store, and, after every reader has run, a **restore** forward + backward that recomputes
the same state with autograd, adds the gradient the readers accumulated on it (the gradient
restoration) and backpropagates its own loss. Every other microbatch runs once (**run**). So the
cost of carry is one extra forward (without saved activations) of each exporting microbatch, and
each row is computed once by forward + backward, as with an unlimited budget.

Order for the microbatches of one data-parallel rank, in step order: each in turn as fill (exports)
or run (does not), then the restores in reverse step order. An owner always precedes its readers
(`pack(..., carry=True)` puts them first), so every read finds its state filled, and a reader that
exports itself restores before the owners it reads: its restore's backward accumulates into theirs.
Megatron runs backward passes in forward order (no pipelining and 1F1B alike), so the order holds for
backward too.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["carry_phases", "PHASES", "CarryGeometry", "carry_store_bytes"]

PHASES = ("fill", "run", "restore")


def carry_phases(microbatches: list) -> list[tuple[int, str]]:
    """``[(position in microbatches, phase)]`` for one rank's microbatches (step order, as
    `tree.carry.assign_carry_groups` gives them). Microbatches without carry info run once."""
    order, restores = [], []
    for i, mb in enumerate(microbatches):
        info = getattr(mb, "carry", None)
        exports = info is not None and len(info.exported) > 0
        order.append((i, "fill" if exports else "run"))
        if exports:
            restores.append((i, "restore"))
    seen = {getattr(mb, "carry", None).index for mb in microbatches if getattr(mb, "carry", None) is not None}
    for mb in microbatches:
        info = getattr(mb, "carry", None)
        if info is not None and not set(info.reads_from) <= seen:
            missing = sorted(set(info.reads_from) - seen)
            raise ValueError(f"carry microbatch {info.index} reads rows of microbatches {missing}, which this rank "
                             "does not run: a carry group must stay on one data-parallel rank "
                             "(megatron_tree.tree.carry.assign_carry_groups)")
    return order + restores[::-1]


@dataclass(frozen=True)
class CarryGeometry:
    """What one process stores per carried row and per state row, by layer kind (one TP rank's heads).

    pattern      one letter per layer: ``*`` attention (K and V of every exported row), ``G`` Gated
                 DeltaNet (pre-conv channels of every exported row, one recurrent state per state row),
                 ``M`` Mamba-2 (the same); other letters (``-`` MLP, ``E`` MoE) store nothing
    kv           (key/value heads, head dim) of attention
    gdn          (key heads, value heads, key dim, value dim) of GDN
    mamba        (heads, head dim, groups, state dim) of Mamba-2
    act_bytes    bytes of an activation element (2 for bf16, 8 for a float64 model)
    state_bytes  bytes of a recurrent-state element (4: states are kept in fp32; 8 in float64)
    """

    pattern: str
    kv: tuple = (8, 128)
    gdn: tuple = (16, 32, 128, 128)
    mamba: tuple = (64, 64, 8, 128)
    act_bytes: int = 2
    state_bytes: int = 4

    def row_bytes(self) -> int:
        """Stored bytes of one exported row over every layer."""
        hk, d = self.kv
        H, HV, K, V = self.gdn
        mh, mp, mg, ms = self.mamba
        per = {"*": 2 * hk * d, "G": 2 * H * K + HV * V, "M": mh * mp + 2 * mg * ms}
        return int(self.act_bytes * sum(per.get(c, 0) for c in self.pattern))

    def state_row_bytes(self) -> int:
        """Stored bytes of one state row over every layer (the recurrent states after it)."""
        H, HV, K, V = self.gdn
        mh, mp, mg, ms = self.mamba
        per = {"G": HV * K * V, "M": mh * mp * ms}
        return self.state_bytes * sum(per.get(c, 0) for c in self.pattern)


def carry_store_bytes(microbatches: list, geometry: CarryGeometry) -> list[int]:
    """Bytes each microbatch writes into the step's carry store (its fill), in order; the store holds
    their sum from the last fill until the step ends."""
    out = []
    for mb in microbatches:
        info = getattr(mb, "carry", None)
        if info is None:
            out.append(0)
            continue
        out.append(len(info.exported) * geometry.row_bytes() + len(info.state_rows) * geometry.state_row_bytes())
    return out
