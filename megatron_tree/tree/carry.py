"""Carry packing: every row of a step computed by exactly one microbatch, at any row budget.

``pack(samples, budget, carry=True)`` lays the step's samples out as ONE prefix forest in DFS
preorder (step-global rows ``0..R-1``: the rows per-step sharing would compute with no budget) and
gives every row one *owner* microbatch:

* a tree of at most ``budget`` rows is owned whole by one microbatch (first-fit-decreasing, as
  split packing does);
* a larger tree (or one path longer than the budget) is cut, in preorder, into chunks of at most
  ``budget`` rows (ending at a branch point in the second half of the budget where there is one,
  else after exactly ``budget`` rows), each a microbatch of its own, and a remainder that joins the
  bins of whole trees.

A chunk ``[a, b)`` of the preorder *reads* the ancestors of its first row ``a`` that earlier chunks
own: in a preorder every row of ``[a, b)`` whose ancestor lies before ``a`` is a descendant of that
ancestor, so the rows a microbatch reads but does not compute ("carried rows") are always ONE root
path, the ancestors of ``a``. Its layout holds ``carried path + owned rows`` in global preorder,
which is again a preorder: visibility, depths and recurrences are the layout's unchanged, and the
executors (`megatron_tree.cp.execution.carry`) fill the carried rows' layer state (K / V, recurrent
states, conv tails) from the owners' forward instead of computing it.

Order and groups: the full chunks come first (in preorder, so every owner precedes its readers), then
the bins of whole trees and remainders (at most one remainder per bin). Microbatches linked by carry
form a *group* (``CarryInfo.group``; -1: reads nothing and is read by nobody) that must run on one
data-parallel rank, in order, within one optimizer step (`assign_carry_groups`).

What each microbatch holds:

* ``owned_rows``: rows it computes (its own real rows + padding; carried rows excluded);
* its loss map: exactly the occurrences whose source row it owns (a sample's targets may be spread
  over the microbatches that own its rows; with a step-wide token denominator the sum is per-sample
  training's);
* ``sample_ids``: the samples whose LAST row it owns, so every sample is in exactly one microbatch's
  ``sample_ids`` (what consumed-sample counting reads); ``carry.path_sample_ids`` lists every sample
  whose path crosses one of its owned rows, and ``sample_rows(i)`` is sample ``i``'s path prefix
  inside this layout (carried rows included) for either kind.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .layout import TreeLayout
from .loss_map import LossMap
from .microbatch import MicrobatchStats, TreeMicrobatch
from .sample import Sample
from .routes import padding_routes, row_routes

__all__ = ["CarryInfo", "pack_carry", "assign_carry_groups", "assign_carry_ranks", "CUT_POLICIES", "carry_summary"]

#: `assign_carry_ranks`' ``cut``: never cut a group, cut those above one rank's share, cut every microbatch loose
CUT_POLICIES = ("never", "auto", "always")


@dataclass(frozen=True, eq=False)
class CarryInfo:
    """Where a carry microbatch's rows come from (numpy int64 arrays, host side).

    index            position of the microbatch in the step (`pack`'s output order)
    group            carry group id (-1: no carry in or out)
    keys             [N] step-global preorder row of every layout row (-1 on padding)
    carried          [C] layout rows it reads from earlier microbatches (ascending: one root path)
    carried_owner    [C] index of the microbatch that owns each carried row
    exported         [E] layout rows it owns that a later microbatch carries (ascending)
    state_rows       [P] the exported rows a later microbatch's own row hangs off: recurrent layers
                     export their state after these (ascending)
    path_sample_ids  ids of the samples whose path crosses one of its owned rows
    path_sample_lengths  their whole lengths (a path inside this layout may be a prefix of one)
    """

    index: int
    group: int
    keys: np.ndarray
    carried: np.ndarray
    carried_owner: np.ndarray
    exported: np.ndarray
    state_rows: np.ndarray
    path_sample_ids: tuple[int, ...]
    path_sample_lengths: tuple[int, ...] = ()

    @property
    def reads_from(self) -> tuple[int, ...]:
        return tuple(np.unique(self.carried_owner).tolist())

    @property
    def own(self) -> np.ndarray:
        """[N - C] layout rows it computes (owned real rows, then padding), ascending."""
        n = len(self.keys)
        mask = np.ones(n, bool)
        mask[self.carried] = False
        return np.flatnonzero(mask)


def _global_forest(toks: list, order: np.ndarray, lcp: np.ndarray, lens: np.ndarray):
    """The step's forest in preorder: per-row parent, depth, token, and every sorted sample's path.

    Returns ``(parent [R], depth [R], input_ids [R], paths (concatenated) [sum L], path_off [n+1],
    tail_start [n+1])`` for the samples in sorted order (``lcp[j]``: LCP with sample ``j - 1``)."""
    tails = lens - lcp
    tail_start = np.zeros(len(lens) + 1, np.int64)
    np.cumsum(tails, out=tail_start[1:])
    R = int(tail_start[-1])
    depth = np.repeat(lcp, tails) + (np.arange(R) - np.repeat(tail_start[:-1], tails))
    parent = np.arange(R, dtype=np.int64) - 1
    input_ids = np.concatenate([toks[i][l:] for i, l in zip(order.tolist(), lcp.tolist())]) if R else np.zeros(0, np.int64)
    path_off = np.zeros(len(lens) + 1, np.int64)
    np.cumsum(lens, out=path_off[1:])
    paths = np.empty(int(path_off[-1]), np.int64)
    prev = np.empty(0, np.int64)
    for j in range(len(lens)):  # once per sample: a path is the previous one's first lcp rows + its tail
        l, a, b = int(lcp[j]), int(tail_start[j]), int(tail_start[j + 1])
        if b > a:
            parent[a] = prev[l - 1] if l else -1
        cur = np.concatenate([prev[:l], np.arange(a, b, dtype=np.int64)])
        paths[path_off[j]: path_off[j + 1]] = cur
        prev = cur
    return parent, depth, input_ids, paths, path_off, tail_start


def _units(tail_start: np.ndarray, lcp: np.ndarray, budget: int):
    """Ownership units of the global preorder: ``(start_row, stop_row, tree, is_chunk)``.

    Trees of at most ``budget`` rows are one unit; a larger tree gives chunks (``is_chunk``) and a
    remainder (possibly none). A chunk ends at the last sample tail that starts in the second half of
    its ``budget`` rows (a branch point: the next chunk then reads the shared prefix only, not the cut
    branch's first rows, so the chunks after a prompt read the prompt's owner and not each other), or
    after exactly ``budget`` rows where none does (a long path)."""
    tree_first = np.flatnonzero(lcp == 0)
    starts = tail_start[tree_first]
    stops = np.append(starts[1:], tail_start[-1])
    units = []
    for t, (a, b) in enumerate(zip(starts.tolist(), stops.tolist())):
        if b - a <= budget:
            units.append((a, b, t, False))
            continue
        s = a
        while b - s > budget:
            end = s + budget
            k = int(np.searchsorted(tail_start, end, side="right")) - 1  # the last tail starting at or before end
            cut = int(tail_start[k]) if tail_start[k] > s + budget // 2 else end
            units.append((s, cut, t, True))
            s = cut
        if s < b:
            units.append((s, b, t, False))
    return units, starts


def _bins(units: list, tree_start: np.ndarray, budget: int) -> list[list[int]]:
    """Full chunks alone (in preorder), then first-fit-decreasing of whole trees and remainders, at
    most one remainder (a unit that reads carried rows) per bin."""
    chunks = [[u] for u, (a, b, t, c) in enumerate(units) if c]
    rest = [u for u, (a, b, t, c) in enumerate(units) if not c]
    sizes = np.array([units[u][1] - units[u][0] for u in rest], np.int64)
    order = np.lexsort((np.arange(len(rest)), -sizes))
    bins: list[list[int]] = []
    free: list[int] = []
    has_reader: list[bool] = []
    for k in order.tolist():
        u = rest[k]
        a, b, t, _ = units[u]
        reads = a != tree_start[t]
        for i in range(len(bins)):
            if free[i] >= b - a and not (reads and has_reader[i]):
                bins[i].append(u)
                free[i] -= b - a
                has_reader[i] |= reads
                break
        else:
            bins.append([u])
            free.append(budget - (b - a))
            has_reader.append(reads)
    return chunks + [sorted(x) for x in bins]


def pack_carry(samples: list[Sample], toks: list, order: np.ndarray, lcp: np.ndarray, budget: int, *,
               pad_multiple: int, pad_id: int, pad_to_budget: bool, routes: list | None = None) -> list[TreeMicrobatch]:
    """The carry plan of `pack` (see the module docstring). ``order`` / ``lcp`` from `sort_and_lcp`
    of the samples' tokens (of their (token, route) symbols under route-aware packing, so rows are
    shared only where routes agree); every sample already validated (any length). ``routes``: every
    sample's ``routed_experts`` (caller's order) or None; each microbatch then gets the routes of its
    layout's rows (``TreeMicrobatch.routes``: carried rows, own rows, padding)."""
    lens = np.array([len(toks[i]) for i in order], dtype=np.int64)
    parent, depth, gids, paths, path_off, tail_start = _global_forest(toks, order, lcp, lens)
    units, tree_start = _units(tail_start, lcp, budget)
    bins = _bins(units, tree_start, budget)
    R = int(tail_start[-1])
    # ownership: the microbatch of every global row
    owner = np.empty(R, np.int64)
    for m, us in enumerate(bins):
        for u in us:
            owner[units[u][0]: units[u][1]] = m
    group_of_tree: dict = {}
    for a, b, t, c in units:
        if c:
            group_of_tree.setdefault(t, len(group_of_tree))
    # rows each microbatch needs: its own ranges plus the ancestors of each range's first row
    needed, carried_of = [], []
    for us in bins:
        own = np.concatenate([np.arange(units[u][0], units[u][1], dtype=np.int64) for u in us])
        car = []
        for u in us:
            a, _, t, _ = units[u]
            if a != tree_start[t]:
                j = int(np.searchsorted(tail_start, a, side="right")) - 1  # the sorted sample whose tail holds a
                car.append(paths[path_off[j]: path_off[j] + depth[a]])
        car = np.sort(np.concatenate(car)) if car else np.zeros(0, np.int64)
        carried_of.append(car)
        needed.append(np.union1d(car, own))
    read_anywhere = np.zeros(R, bool)
    state_point = np.zeros(R, bool)  # rows whose recurrent state after them a later microbatch starts from
    for m, (car, rows) in enumerate(zip(carried_of, needed)):
        read_anywhere[car] = True
        par = parent[rows]
        state_point[par[(par >= 0) & (owner[rows] == m) & (owner[np.maximum(par, 0)] != m)]] = True

    # occurrences, in sorted-sample order (one vectorised pass per sample); routed to the owner of
    # their source row
    has = {f: any(getattr(samples[i], f) is not None for i in order.tolist())
           for f in ("advantage", "old_logprobs", "ref_logprobs")}
    cols: dict = {k: [] for k in ("sample", "pos", "src", "target", "weight", *[f for f in has if has[f]])}
    for j, i in enumerate(order.tolist()):
        s = samples[i]
        t = np.flatnonzero(s.target_mask())
        cols["sample"].append(np.full(t.shape, i, np.int64))
        cols["pos"].append(t)
        cols["src"].append(paths[path_off[j] + t - 1])
        cols["target"].append(toks[i][t])
        cols["weight"].append(s.per_token("weight", 1.0)[t])
        for f in has:
            if has[f]:  # NaN where a sample lacks the field: policy_loss names it if it is needed
                cols[f].append(s.per_token(f, float("nan"))[t])
    occ = {k: np.concatenate(v) if v else np.zeros(0) for k, v in cols.items()}
    occ_src = occ["src"].astype(np.int64)
    occ_mb = owner[occ_src]
    last_row = paths[path_off[1:] - 1]
    completes = owner[last_row]  # the microbatch owning each sorted sample's last row
    path_owner = owner[paths]
    path_sample = np.repeat(np.arange(len(lens)), lens)
    touch = np.unique(path_owner * len(lens) + path_sample)
    touch_mb, touch_sample = touch // len(lens), touch % len(lens)

    forest_routes = None
    if routes is not None:  # one route per global row (every path through it agrees: route-aware order)
        forest_routes = row_routes(paths, [routes[i] for i in order.tolist()], R)
    out = []
    for m, rows in enumerate(needed):
        out.append(_carry_microbatch(
            m, rows, carried_of[m], owner, parent, depth, gids, read_anywhere, state_point, order, paths, path_off,
            lens, {k: v[occ_mb == m] for k, v in occ.items()}, np.flatnonzero(completes == m),
            touch_sample[touch_mb == m], budget, pad_multiple, pad_id, pad_to_budget,
            group=_group(bins[m], units, tree_start, group_of_tree),
            routes=None if forest_routes is None else forest_routes[rows]))
    return out


def _group(us: list, units: list, tree_start: np.ndarray, group_of_tree: dict) -> int:
    for u in us:
        a, _, t, c = units[u]
        if c or a != tree_start[t]:
            return group_of_tree[t]
    return -1


def _carry_microbatch(m, rows, carried, owner, parent, depth, gids, read_anywhere, state_point, sorted_ids, paths,
                      path_off,
                      lens, occ, complete, touching, budget, pad_multiple, pad_id, pad_to_budget, *,
                      group, routes=None) -> TreeMicrobatch:
    n_real = len(rows)
    n_own = n_real - len(carried)
    n_pad = (budget - n_own) if pad_to_budget else (-n_own) % pad_multiple
    lpar = np.searchsorted(rows, parent[rows])
    lpar[parent[rows] < 0] = -1
    idx = np.arange(n_real)
    kids = np.bincount(lpar[lpar >= 0], minlength=n_real)
    # a segment starts at a root, where the parent is not the previous row, or after a fork
    starts = (lpar < 0) | (lpar != idx - 1) | np.concatenate([[True], kids[:-1] > 1])
    cut = np.flatnonzero(starts)
    seg_of_row = np.cumsum(starts) - 1
    seg_parent = np.where(lpar[cut] >= 0, seg_of_row[np.maximum(lpar[cut], 0)], -1)
    layout = TreeLayout.from_segments(np.diff(np.append(cut, n_real)), seg_parent, gids[rows],
                                      num_padding=n_pad, pad_id=pad_id)
    assert torch.equal(layout.position_ids[:n_real], torch.from_numpy(depth[rows]))

    car_local = np.searchsorted(rows, carried)
    is_own = np.ones(n_real, bool)
    is_own[car_local] = False
    exported = np.flatnonzero(is_own & read_anywhere[rows])
    state_rows = np.flatnonzero(is_own & state_point[rows])
    keys = np.concatenate([rows, np.full(n_pad, -1, np.int64)])

    # loss map in ascending (caller's) sample id, then position
    k = np.lexsort((occ["pos"], occ["sample"]))
    i64 = lambda x: torch.from_numpy(np.ascontiguousarray(x[k]).astype(np.int64))
    f64 = lambda f: torch.from_numpy(np.ascontiguousarray(occ[f][k]).astype(np.float64)) if f in occ else None
    loss_map = LossMap(source_rows=torch.from_numpy(np.searchsorted(rows, occ["src"][k].astype(np.int64))),
                       targets=i64(occ["target"]), sample_index=i64(occ["sample"]), positions=i64(occ["pos"]),
                       weights=f64("weight"), advantages=f64("advantage"), old_logprobs=f64("old_logprobs"),
                       ref_logprobs=f64("ref_logprobs"))

    # sample paths inside this layout (a prefix of each path: rows are ancestor-closed)
    path_ids = np.sort(sorted_ids[touching])
    by_id = np.argsort(sorted_ids)
    pr, po = [], [0]
    for i in path_ids.tolist():
        j = int(by_id[i])
        p = paths[path_off[j]: path_off[j + 1]]
        loc = np.searchsorted(rows, p)
        inside = (loc < n_real) & (rows[np.minimum(loc, n_real - 1)] == p)
        pr.append(loc[: int(np.argmin(inside)) if not inside.all() else len(p)])
        po.append(po[-1] + len(pr[-1]))
    done = np.sort(sorted_ids[complete])
    flat = int(lens[by_id[done]].sum()) if len(done) else 0
    stats = MicrobatchStats(num_samples=len(done), num_trees=int((lpar[~np.isin(idx, car_local)] < 0).sum()),
                            num_segments=len(cut), num_targets=len(loss_map), flat_tokens=flat, tree_tokens=n_own,
                            padding_tokens=n_pad, flat_attention_pairs=int((lens[by_id[done]] * (lens[by_id[done]] + 1)
                                                                            // 2).sum()) if len(done) else 0,
                            tree_attention_pairs=layout.visible_pairs(), max_tokens_per_mb=budget)
    info = CarryInfo(index=m, group=group, keys=keys, carried=car_local.astype(np.int64),
                     carried_owner=owner[carried], exported=exported.astype(np.int64),
                     state_rows=state_rows.astype(np.int64),
                     path_sample_ids=tuple(path_ids.tolist()),
                     path_sample_lengths=tuple(lens[by_id[path_ids]].tolist()) if len(path_ids) else ())
    if routes is not None:
        routes = torch.from_numpy(np.concatenate([routes, padding_routes(n_pad, *routes.shape[1:])]))
    return TreeMicrobatch(layout=layout, loss_map=loss_map, sample_ids=tuple(done.tolist()), stats=stats,
                          _path_rows=np.concatenate(pr) if pr else np.zeros(0, np.int64),
                          _path_offsets=np.asarray(po, np.int64), carry=info,
                          _path_ids=tuple(path_ids.tolist()), routes=routes)


def assign_carry_groups(microbatches: list, dp_size: int) -> list[list[int]]:
    """Microbatch indices per data-parallel rank: a carry group never crosses ranks and keeps its
    order; groups and free microbatches go to the rank with the fewest owned rows so far (largest
    first). Every rank's list is in step order."""
    units = _carry_units(microbatches)
    load = np.zeros(dp_size, np.int64)
    ranks: list[list[int]] = [[] for _ in range(dp_size)]
    sizes = {k: sum(microbatches[i].owned_rows for i in v) for k, v in units.items()}
    for k in sorted(units, key=lambda k: (-sizes[k], units[k][0])):
        r = int(np.argmin(load))
        ranks[r] += units[k]
        load[r] += sizes[k]
    return [sorted(x) for x in ranks]


def assign_carry_ranks(microbatches: list, dp_size: int, *, work=None, cut: str = "auto",
                       refine: bool = False) -> list[list[int]]:
    """Microbatch indices per data-parallel rank (each in step order), balancing predicted work (``work(mb)``;
    default: owned rows) with carry groups cut over ranks where that balances better; the state that then crosses
    ranks is scheduled by `cp.planning.carry_ranks.rank_schedule`. ``cut``: "never" keeps every group on one rank
    (`assign_carry_groups`); "auto" cuts a group whose work exceeds one rank's share (the step's work over
    ``dp_size``) into its *chains*: a microbatch stays with the latest owner it reads unless other microbatches
    read that owner too (a shared prefix: its readers may then run on every rank at once, while a chain runs
    one link after the other wherever it is); "always" makes every microbatch a unit of its own. Units then go,
    largest first, to the rank with the least work so far. ``refine``: then move or swap units off the most
    loaded rank while that lowers it (`_refine_units`). It balances the summed work only: a rank that holds an
    owner others wait on idles them while it runs, so a flatter sum can be a slower lock-step schedule, and the
    caller judges (`cp.planning.carry_ranks.plan_carry_ranks` keeps whichever predicts the faster step).

    Invariants (any flags): every microbatch on exactly one rank; a unit (a whole group, or a chain) on one rank."""
    if cut not in CUT_POLICIES:
        raise ValueError(f"carry cut policy {cut!r}: choose from {', '.join(CUT_POLICIES)}")
    if cut == "never" or dp_size == 1:
        return assign_carry_groups(microbatches, dp_size)
    w = np.array([float(work(mb)) if work is not None else float(mb.owned_rows) for mb in microbatches])
    units = _carry_units(microbatches)
    share = w.sum() / dp_size
    pieces = []
    for idx in units.values():
        if cut == "always":
            pieces += [[i] for i in idx]
        elif w[idx].sum() <= share * (1 + 1e-9):
            pieces.append(idx)
        else:
            pieces += _chains([microbatches[i] for i in idx], idx)
    pieces.sort(key=lambda p: (-w[p].sum(), p[0]))
    size = np.array([w[p].sum() for p in pieces])
    load = np.zeros(dp_size)
    rank_of = np.empty(len(pieces), np.int64)
    for u, s in enumerate(size):
        rank_of[u] = int(np.argmin(load))
        load[rank_of[u]] += s
    if refine:
        rank_of = _refine_units(size, rank_of, dp_size)
    ranks: list[list[int]] = [[] for _ in range(dp_size)]
    for p, r in zip(pieces, rank_of.tolist()):
        ranks[r] += p
    return [sorted(x) for x in ranks]


def _refine_units(size: np.ndarray, rank_of: np.ndarray, dp_size: int) -> np.ndarray:
    """``rank_of`` (the rank of every unit of work ``size``) after local improvement of the largest-first
    assignment: while some move of one unit off the most loaded rank, or swap of one of its units for a smaller one
    elsewhere, leaves both ranks below that rank's load, apply the one giving the lower of the two new loads.

    Each step lowers the sum of squared rank loads (a move of ``a`` from load ``T`` to load ``L`` with ``L + a < T``
    changes it by ``2a (L + a - T) < 0``; a swap moves their difference the same way), so it ends; the round bound
    only guards against float churn. Units never split, so every invariant of the assignment holds."""
    rank_of = rank_of.copy()
    load = np.bincount(rank_of, weights=size, minlength=dp_size)
    for _ in range(4 * len(size) + 8):
        hi = int(np.argmax(load))
        top = load[hi] * (1 - 1e-9)  # strictly below the current max: no churn on ties
        on, off = np.flatnonzero(rank_of == hi), np.flatnonzero(rank_of != hi)
        if not len(on):
            break
        # moves: unit on[u] to rank r, the pair's larger new load
        move = np.maximum(load[hi] - size[on][:, None], load[None, :] + size[on][:, None])
        move[:, hi] = np.inf
        m = np.unravel_index(int(np.argmin(move)), move.shape)
        best, act = move[m], ("move", int(on[m[0]]), int(m[1]))
        if len(off):  # swaps: on[u] for a smaller off[v]
            d = size[on][:, None] - size[off][None, :]
            swap = np.where(d > 0, np.maximum(load[hi] - d, load[rank_of[off]][None, :] + d), np.inf)
            s = np.unravel_index(int(np.argmin(swap)), swap.shape)
            if swap[s] < best:
                best, act = swap[s], ("swap", int(on[s[0]]), int(off[s[1]]))
        if not best < top:
            break
        if act[0] == "move":
            rank_of[act[1]] = act[2]
        else:
            rank_of[act[1]], rank_of[act[2]] = rank_of[act[2]], hi
        load = np.bincount(rank_of, weights=size, minlength=dp_size)
    return rank_of


def _carry_units(microbatches: list) -> dict:
    """``{key: [step indices]}``: each carry group's microbatches, and each microbatch without carry alone."""
    units: dict = {}
    for i, mb in enumerate(microbatches):
        g = mb.carry.group if getattr(mb, "carry", None) is not None else -1
        units.setdefault(("g", g) if g >= 0 else ("m", i), []).append(i)
    return units


def _chains(group: list, idx: list) -> list[list[int]]:
    """A carry group's microbatches (step indices ``idx``) as chains: each joins the latest owner it reads when it
    is that owner's only reader."""
    readers: dict = {}
    for mb in group:
        for o in mb.carry.reads_from:
            readers[o] = readers.get(o, 0) + 1
    head = {}
    for i, mb in zip(idx, group):
        owners = mb.carry.reads_from
        head[i] = head[max(owners)] if owners and readers[max(owners)] == 1 else i
    out: dict = {}
    for i in idx:
        out.setdefault(head[i], []).append(i)
    return list(out.values())


def carry_summary(microbatches: list, *, bytes_per_row: int = 0) -> dict:
    """Rows computed, rows carried and (with ``bytes_per_row``: the carried state of one row over
    every layer) the carry store's bytes of a carry plan."""
    owned = sum(mb.owned_rows for mb in microbatches)
    carried = sum(len(mb.carry.carried) for mb in microbatches if mb.carry is not None)
    exported = sum(len(mb.carry.exported) for mb in microbatches if mb.carry is not None)
    return {"rows_computed": owned, "carried_rows": carried, "stored_rows": exported,
            "store_bytes": exported * bytes_per_row, "num_microbatches": len(microbatches)}
