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

__all__ = ["carry_phases", "PHASES"]

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
