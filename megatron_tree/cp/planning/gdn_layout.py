"""GDN-friendly ownership for "layout islands": runs of recurrent / token-local layers whose rows
are owned so the Gated DeltaNet summary scan has little to do.

The attention planner's balanced ownership cuts chains into many cross-rank pieces; in summary mode
every cut moves a state (``E`` [HV, K, V]) and often a map (``M`` [HV, K, K]) and makes the ranks in
the middle of a chain run their rows twice (summary with ``K + V`` state columns, then the finish).
`plan_gdn_layout` instead gives every rank **one contiguous run of rows** (rows are in tree preorder,
so a run holds whole families) and places the ``cp - 1`` cuts by a cost model:

* a cut at row ``c`` creates ``cross[c]`` entries: the segments starting at or after ``c`` whose
  predecessor (parent's last row, or the previous row of the same segment) lies before ``c``; at a
  tree boundary ``cross[c] = 0`` (the family stays local), between two siblings it is the later
  siblings of that fork (a state, no summary), inside a segment one more (the chain is cut);
* each cut ``k`` is searched in a window around its balanced target ``k N / cp``, scoring
  ``|c - target| * row_seconds + cross[c] * entry_seconds`` (imbalance against crossings);
* candidates made with several window widths (exact balance, growing slack) and one with every cut
  moved to the nearest tree boundary (every family local, however unbalanced), and a few
  *rebalanced* ones: a rank in the middle of a chain runs its rows about three times (summary with
  ``K + V`` state columns, then the finish), so the cuts are re-aimed at rows inversely
  proportional to each run's predicted seconds per row
  are then priced exactly with the summary-mode cost of `gdn_plan.summary_terms` (recurrence and
  summary work per rank, state / map bytes, doubling rounds), and, when ``attention_plan`` is
  given, the island-boundary redistribution (rows whose owner differs, moved into and out of the
  island) against the GDN layers of the island; the attention ownership itself is a candidate too
  (no redistribution). The cheapest predicted island wins; ties go to the faster summary mode, then
to the earlier candidate.

Contiguous runs are relabelled to maximise the rows they share with ``attention_plan`` (fewer rows
move at the island boundary; the GDN cost does not depend on rank labels). Pure numpy, deterministic
(every rank makes the same plan from the same layout and attention plan).

`gdn_layout_figures` prices one layout at one CP size three ways (summary under the attention plan,
summary under the GDN layout plus its boundary redistribution, heads mode) for reports.
"""
from __future__ import annotations

import time

import numpy as np

from .gdn_plan import GDNCostModel, GDNHeads, _build_pieces, _host, heads_terms, summary_terms
from .plan import CPPlan

__all__ = ["plan_gdn_layout", "gdn_layout_figures", "cut_crossings", "redistribution_bytes", "DEFAULT_HEADS",
           "DEFAULT_HIDDEN", "predict_gdn_seconds"]

# One TP rank of a Qwen3-Next-like GDN layer (H key heads, HV value heads, K, V, conv width) and hidden size.
DEFAULT_HEADS = GDNHeads(num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128, conv_width=4)
DEFAULT_HIDDEN = 2048
REBALANCE_STEPS = 6
SLACKS = (0.0, 1 / 64, 1 / 16, 1 / 8, 1 / 4, 1 / 2)  # cut windows, as a fraction of N / cp


def cut_crossings(offsets: np.ndarray, seg_parent: np.ndarray) -> np.ndarray:
    """[N + 1] int64: entries a cut before row ``c`` creates (rows ``< c`` on one rank, ``>= c`` on
    another), for a layout's ``segment_offsets`` [S + 1] and ``segment_parent`` [S] (preorder).

    A child segment ``s`` of ``p`` crosses every cut ``c`` with ``offsets[p+1] <= c <= offsets[s]``
    (its parent's last row before the cut, its first row after); a cut strictly inside a segment
    adds one (the segment continues on the other side). Zero exactly at tree boundaries."""
    offsets = np.asarray(offsets, np.int64)
    seg_parent = np.asarray(seg_parent, np.int64)
    N = int(offsets[-1]) if offsets.size else 0
    diff = np.zeros(N + 2, np.int64)
    child = np.flatnonzero(seg_parent >= 0)
    lo = offsets[seg_parent[child] + 1]
    hi = offsets[child]
    np.add.at(diff, lo, 1)
    np.add.at(diff, hi + 1, -1)
    cross = np.cumsum(diff)[:N + 1]
    inside = np.ones(N + 1, bool)
    inside[offsets] = False
    return cross + inside


def _cuts(cross: np.ndarray, cp: int, slack: float, row_s: float, entry_s: float,
          target: np.ndarray | None = None) -> np.ndarray:
    """[cp + 1] run boundaries: cut ``k`` is the row in ``target_k ± slack N / cp`` with the least
    ``|c - target_k| row_s + cross[c] entry_s`` (ties: nearer the target, then the lower row).
    ``target`` [cp - 1] defaults to the equal-rows targets ``k N / cp``."""
    N = cross.shape[0] - 1
    if target is None:
        target = (np.arange(1, cp) * N) // cp
    target = np.asarray(target, np.int64)
    tol = int(slack * N / cp)
    if tol == 0 or cp == 1:
        cuts = target
    else:
        off = np.arange(-tol, tol + 1)
        cand = np.clip(target[:, None] + off[None, :], 0, N)  # [cp-1, 2 tol + 1]
        dist = np.abs(cand - target[:, None])
        score = dist * row_s + cross[cand] * entry_s
        # lexicographic (score, dist, row): argmin over a stable order of (dist, row) ties
        order = np.lexsort((cand, dist, score), axis=1)
        cuts = cand[np.arange(cp - 1), order[:, 0]]
    cuts = np.maximum.accumulate(cuts)  # windows of neighbouring cuts may overlap at large slack
    return np.concatenate([[0], cuts, [N]]).astype(np.int64)


def _tree_cuts(cross: np.ndarray, cp: int) -> np.ndarray:
    """[cp + 1] run boundaries with every cut moved to the tree boundary nearest its balanced
    target (ties: the lower row): no tree is ever split."""
    N = cross.shape[0] - 1
    bounds = np.flatnonzero(cross == 0)  # includes 0 and N
    target = (np.arange(1, cp) * N) // cp
    i = np.clip(np.searchsorted(bounds, target), 1, bounds.size - 1)
    lo, hi = bounds[i - 1], bounds[i]
    cuts = np.where(target - lo <= hi - target, lo, hi)
    return np.concatenate([[0], np.maximum.accumulate(cuts), [N]]).astype(np.int64)


def _relabel(cuts: np.ndarray, attn_rows: tuple | None, cp: int) -> np.ndarray:
    """[cp] rank given to each contiguous run ``[cuts[j], cuts[j+1])``: greedy maximum overlap with
    the attention ownership (``attn_rows[r]``: ascending rows of attention rank ``r``); largest
    shared row count first, ties to the lower run, then the lower rank."""
    if attn_rows is None:
        return np.arange(cp)
    # overlap[j, r] = rows of run j owned by attention rank r (binary search, no pass over rows)
    overlap = np.stack([np.diff(np.searchsorted(rows, cuts)) for rows in attn_rows], axis=1)
    label = np.full(cp, -1, np.int64)
    used = np.zeros(cp, bool)
    flat = np.lexsort((np.arange(cp * cp), -overlap.reshape(-1)))  # descending overlap, stable
    left = cp
    for f in flat:  # at most cp * cp steps over ranks (not rows); stops once every run has a rank
        j, r = divmod(int(f), cp)
        if label[j] < 0 and not used[r]:
            label[j], used[r] = r, True
            left -= 1
            if not left:
                break
    return label


def redistribution_bytes(src_owner: np.ndarray, dst_owner: np.ndarray, cp: int, row_bytes: float):
    """([cp] bytes sent, [cp] bytes received) moving every row from ``src_owner`` to ``dst_owner``
    (one island boundary); a row that keeps its owner moves nothing."""
    moved = src_owner != dst_owner
    sent = np.bincount(src_owner[moved], minlength=cp).astype(float) * row_bytes
    recv = np.bincount(dst_owner[moved], minlength=cp).astype(float) * row_bytes
    return sent, recv


class _Pricer:
    """Prices candidate ownerships of one layout (summary / heads mode per rank, redistribution)."""

    def __init__(self, layout, cp, heads, cost, act_bytes, state_bytes, hidden_size, gdn_layers, attn_owner,
                 mode="auto"):
        self.cp, self.heads, self.cost, self.mode = cp, heads, cost, mode
        self.kw = dict(act_bytes=act_bytes, state_bytes=state_bytes, cost=cost)
        self.off = _host(layout, "segment_offsets")
        self.par = _host(layout, "segment_parent")
        self.vu = _host(layout, "visible_until")
        self.path_prev = None
        self.layout = layout
        self.row_bytes = float(hidden_size * act_bytes)
        self.gdn_layers = gdn_layers
        self.attn_owner = attn_owner

    def halo(self, owner: np.ndarray, pieces):
        """Owner and destination of every travelling conv-halo row (up to W - 1 steps back along
        ``path_prev``). Only a row among the first W - 1 of its piece can reach a remote row (the
        walk stays in the piece until its start), so only those rows are walked."""
        if self.path_prev is None:
            self.path_prev = _host(self.layout, "path_prev")
        N, W = owner.shape[0], self.heads.conv_width
        if W == 1 or pieces.num_pieces == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        k = np.arange(W - 1)
        rows = (pieces.start[:, None] + k[None, :])[k[None, :] < pieces.length[:, None]]
        step = np.append(self.path_prev, -1)
        cur = rows
        keys = []
        for _ in range(1, W):  # W - 1 vectorised steps
            cur = step[np.where(cur < 0, N, cur)]
            far = (cur >= 0) & (owner[np.maximum(cur, 0)] != owner[rows])
            keys.append(owner[rows[far]] * (N + 1) + cur[far])
        key = np.unique(np.concatenate(keys))
        dst, h = key // (N + 1), key % (N + 1)
        return owner[h], dst

    def price(self, owner: np.ndarray) -> dict:
        cp = self.cp
        pieces = _build_pieces(owner, self.off, self.par, self.vu, cp)
        rows = np.bincount(owner, minlength=cp)
        hs, hd = self.halo(owner, pieces)
        summ = summary_terms(pieces, rows, self.heads, hs, hd, **self.kw)
        heads = heads_terms(rows, self.heads, **self.kw) if self.mode != "summary" else None
        gdn = float(summ["seconds"].max())
        mode = "summary"
        if heads is not None and float(heads["seconds"].max()) < gdn:
            gdn, mode = float(heads["seconds"].max()), "heads"
        redis_s, redis_b = 0.0, 0.0
        if self.attn_owner is not None:
            sent, recv = redistribution_bytes(self.attn_owner, owner, cp, self.row_bytes)
            if sent.sum() > 0:  # into and out of the island: the same bytes in reverse
                redis_s = 2 * float(self.cost.seconds(0, np.maximum(sent, recv).max(), 1))
            redis_b = 2 * float(sent.sum())
        total = self.gdn_layers * gdn + redis_s
        return dict(total_s=total, gdn_s=gdn, mode=mode, redistribution_s=redis_s, redistribution_bytes=redis_b,
                    summary=summ, heads=heads, entries=int(pieces.entries.size), rounds=len(pieces.rounds))


def plan_gdn_layout(layout, cp_size: int, *, attention_plan: CPPlan | None = None, cost: GDNCostModel | None = None,
                    heads: GDNHeads | None = None, hidden_size: int = DEFAULT_HIDDEN, gdn_layers: int = 3,
                    act_bytes: int = 2, state_bytes: int = 4, mode: str = "auto") -> CPPlan:
    """The GDN-friendly ownership of ``layout`` over ``cp_size`` ranks, as a `CPPlan`.

    layout          `TreeLayout` of the microbatch (host or device tensors; read on the host)
    attention_plan  the attention ownership of the same rows, if the island sits between attention
                    layers: redistribution bytes are priced, runs are relabelled to share rows with
                    it, and its ownership is a candidate (returned when cheapest: then
                    ``stats["source"] == "attention"`` and the plan hash equals the attention plan's,
                    so the caller can skip the redistribution)
    cost            `GDNCostModel` (default `GDNCostModel.default()`: GPU figures with CUDA, else
                    the CPU fit)
    heads           GDN head shapes of one TP rank (default `DEFAULT_HEADS`, Qwen3-Next-like)
    hidden_size     hidden width of the rows moved at island boundaries (activations, ``act_bytes``)
    gdn_layers      GDN layers per island (boundary cost is paid once per island, GDN per layer)
    mode            "auto": each ownership is priced at the cheaper of summary and heads mode (as
                    ``gdn_cp_mode="auto"`` runs); "summary": summary mode only (the layers are
                    forced to summary mode, or heads mode is not wanted)

    Returns a `CPPlan` with ``strategy="gdn"``, every row owned exactly once, ``predicted_ms``
    [cp] the predicted summary- (or heads-, whichever is cheaper) mode seconds of one GDN layer per
    rank, in ms, and ``stats``: source ("contiguous" | "attention"), slack (window of the chosen
    cuts), cuts, entries, rounds, mode, gdn_ms, redistribution_ms, redistribution_bytes, candidates
    (each candidate's predicted island ms), planning_ms.
    """
    t0 = time.perf_counter()
    if mode not in ("auto", "summary"):
        raise ValueError(f"plan_gdn_layout: mode must be 'auto' or 'summary', got {mode!r}")
    cp = int(cp_size)
    if cp < 1:
        raise ValueError(f"plan_gdn_layout: cp_size must be >= 1, got {cp_size}")
    if attention_plan is not None:
        if not isinstance(attention_plan, CPPlan):
            raise TypeError(f"attention_plan must be a CPPlan, got {type(attention_plan).__name__}")
        if attention_plan.cp_size != cp or attention_plan.num_rows != layout.num_rows:
            raise ValueError(f"attention_plan (cp={attention_plan.cp_size}, rows={attention_plan.num_rows}) does not "
                             f"match cp_size={cp} and the layout's {layout.num_rows} rows")
    heads = heads or DEFAULT_HEADS
    cost = cost or GDNCostModel.default()
    vu, pos = _host(layout, "visible_until"), _host(layout, "position_ids")
    N = vu.shape[0]
    attn_owner = None if attention_plan is None else attention_plan.owner.astype(np.int64)
    attn_rows = None if attention_plan is None else tuple(attention_plan.owner_rows(r) for r in range(cp))
    if cp == 1 or N == 0:
        owner = np.zeros(N, np.int32)
        return CPPlan(cp_size=cp, strategy="gdn", owner=owner, visible_until=vu, position_ids=pos,
                      stats=dict(source="contiguous", cuts=[0, N], entries=0, rounds=0, mode="summary",
                                 planning_ms=1e3 * (time.perf_counter() - t0)))
    pr = _Pricer(layout, cp, heads, cost, act_bytes, state_bytes, hidden_size, gdn_layers, attn_owner, mode)
    cross = cut_crossings(pr.off, pr.par)
    K, V, HV = heads.head_k_dim, heads.head_v_dim, heads.num_v_heads
    row_s = float(cost.seconds(HV * 8 * K * V + 2 * heads.conv_width * heads.conv_channels, 0, 0))
    entry_s = float(cost.seconds(0, HV * K * (K + V) * state_bytes, 1))
    candidates = []  # (label, owner)
    seen = set()
    runs = [(f"slack={s:g}", _cuts(cross, cp, s, row_s, entry_s)) for s in SLACKS]
    runs.append(("trees", _tree_cuts(cross, cp)))  # every family whole, however unbalanced
    for label, cuts in runs:
        key = cuts.tobytes()
        if key in seen:
            continue
        seen.add(key)
        owner = np.repeat(_relabel(cuts, attn_rows, cp), np.diff(cuts))
        candidates.append((label, cuts, owner))
    priced = [pr.price(o) for _, _, o in candidates]
    # Rebalance: ranks in the middle of a chain run their rows ~3x (summary with K + V state columns,
    # then the finish), so equal rows are not equal time. Re-aim the cuts at rows inversely
    # proportional to each run's predicted seconds per row, a few damped fixed-point steps from the best
    # summary-mode candidate (window search as before, so cheap boundaries still attract the cuts).
    # (from the best candidate where some rank runs rows twice: elsewhere equal rows are equal time)
    twice = [i for i in range(len(priced)) if priced[i]["summary"]["summary_rows"].sum() > 0]
    i0 = min(twice, key=lambda i: (float(priced[i]["summary"]["seconds"].max()), i)) if twice else 0
    label0, cuts, owner = candidates[i0]
    slack0 = float(label0.split("=")[1]) if label0.startswith("slack=") else 0.0
    steps = REBALANCE_STEPS if twice else 0
    for it in range(steps):
        n = np.diff(cuts).astype(float)
        run_s = priced[i0 if it == 0 else -1]["summary"]["seconds"][owner[np.minimum(cuts[:-1], N - 1)]]
        rate = np.where(n > 0, run_s / np.maximum(n, 1), np.nan)
        rate = np.where(np.isnan(rate), np.nanmean(rate), rate)
        share = (1.0 / rate) / (1.0 / rate).sum()
        share = 0.5 * share + 0.5 * n / n.sum()  # damped: a run's rate changes when its cuts move
        cuts = _cuts(cross, cp, slack0, row_s, entry_s, np.round(np.cumsum(share)[:-1] * N).astype(np.int64))
        if cuts.tobytes() in seen:
            break
        seen.add(cuts.tobytes())
        owner = np.repeat(_relabel(cuts, attn_rows, cp), np.diff(cuts))
        candidates.append((f"rebalanced{it + 1}({label0})", cuts, owner))
        priced.append(pr.price(owner))
    if attn_owner is not None:
        candidates.append(("attention", None, attn_owner))
        priced.append(pr.price(attn_owner))
    # ties (e.g. heads mode cheapest for every ownership) go to the faster summary mode, then the earlier
    best = min(range(len(priced)), key=lambda i: (priced[i]["total_s"], float(priced[i]["summary"]["seconds"].max()),
                                                  i))
    label, cuts, owner = candidates[best]
    p = priced[best]
    per_rank = p["summary"]["seconds"] if p["mode"] == "summary" else p["heads"]["seconds"]
    stats = dict(source="attention" if label == "attention" else "contiguous", slack=label,
                 cuts=None if cuts is None else cuts.tolist(), entries=p["entries"], rounds=p["rounds"],
                 mode=p["mode"], gdn_ms=1e3 * p["gdn_s"], redistribution_ms=1e3 * p["redistribution_s"],
                 redistribution_bytes=p["redistribution_bytes"], gdn_layers=gdn_layers,
                 candidates={lab: 1e3 * q["total_s"] for (lab, _, _), q in zip(candidates, priced)})
    stats["planning_ms"] = 1e3 * (time.perf_counter() - t0)
    if label == "attention":  # same ownership, waves and chunking: the same hash (no redistribution)
        return CPPlan(cp_size=cp, strategy="gdn", owner=attention_plan.owner, visible_until=vu, position_ids=pos,
                      num_waves=attention_plan.num_waves, chunk_size=attention_plan.chunk_size,
                      predicted_ms=1e3 * per_rank, stats=stats, chunk_starts=attention_plan.chunk_starts)
    return CPPlan(cp_size=cp, strategy="gdn", owner=owner.astype(np.int32), visible_until=vu, position_ids=pos,
                  predicted_ms=1e3 * np.asarray(per_rank, float), stats=stats)


def predict_gdn_seconds(plan: CPPlan, layout, *, heads: GDNHeads | None = None, cost: GDNCostModel | None = None,
                        mode: str = "summary", act_bytes: int = 2, state_bytes: int = 4) -> np.ndarray:
    """[cp] predicted seconds of one GDN layer's forward per rank under ``plan`` in ``mode``
    ("summary": state summaries and the doubling scan over ``plan``'s ownership; "heads": the
    head all-to-all, which ignores where rows live beyond their count)."""
    heads = heads or DEFAULT_HEADS
    cost = cost or GDNCostModel.default()
    owner = plan.owner.astype(np.int64)
    pr = _Pricer(layout, plan.cp_size, heads, cost, act_bytes, state_bytes, DEFAULT_HIDDEN, 1, None)
    if mode == "heads":
        h = heads_terms(plan.rows_per_rank(), heads, act_bytes=act_bytes, state_bytes=state_bytes, cost=cost)
        if h is None:
            raise ValueError(f"heads mode needs the CP size ({plan.cp_size}) to divide the value heads "
                             f"({heads.num_v_heads})")
        return h["seconds"]
    if mode != "summary":
        raise ValueError(f"mode must be 'summary' or 'heads', got {mode!r}")
    return pr.price(owner)["summary"]["seconds"]


def gdn_layout_figures(layout, attention_plan: CPPlan, *, heads: GDNHeads | None = None,
                       cost: GDNCostModel | None = None, hidden_size: int = DEFAULT_HIDDEN, gdn_layers: int = 3,
                       act_bytes: int = 2, state_bytes: int = 4, gdn_plan: CPPlan | None = None) -> dict:
    """One GDN layer at ``attention_plan.cp_size`` priced three ways (forward; backward mirrors it).

    Returns ``{"attention": A, "layout": L, "heads": H or None, "gdn_plan": CPPlan}`` where A and L
    are summary mode under the attention ownership / under `plan_gdn_layout`'s ownership, each a
    dict: ``bytes`` (summed over ranks: halos + states + maps), ``max_s`` (predicted slowest rank),
    ``seconds`` [cp], ``entries``, ``rounds``, ``summary_rows`` (rows run with K + V columns); L
    adds ``redistribution_bytes`` (both island boundaries, summed over ranks) and
    ``redistribution_s``; H is heads mode: ``bytes``, ``max_s``, ``seconds``.
    """
    heads = heads or DEFAULT_HEADS
    cost = cost or GDNCostModel.default()
    cp = attention_plan.cp_size
    if gdn_plan is None:
        gdn_plan = plan_gdn_layout(layout, cp, attention_plan=attention_plan, cost=cost, heads=heads,
                                   hidden_size=hidden_size, gdn_layers=gdn_layers, act_bytes=act_bytes,
                                   state_bytes=state_bytes)
    attn_owner = attention_plan.owner.astype(np.int64)
    pr = _Pricer(layout, cp, heads, cost, act_bytes, state_bytes, hidden_size, gdn_layers, attn_owner)

    def pack(p):
        s = p["summary"]
        return dict(bytes=float(s["bytes_sent"].sum()), max_s=float(s["seconds"].max()), seconds=s["seconds"],
                    entries=p["entries"], rounds=p["rounds"], summary_rows=float(s["summary_rows"].sum()))

    pa = pr.price(attn_owner)
    pl = pr.price(gdn_plan.owner.astype(np.int64))
    out = {"attention": pack(pa), "layout": pack(pl), "gdn_plan": gdn_plan, "heads": None}
    out["layout"].update(redistribution_bytes=pl["redistribution_bytes"], redistribution_s=pl["redistribution_s"])
    h = pa["heads"]
    if h is not None:
        out["heads"] = dict(bytes=float(h["bytes_sent"].sum()), max_s=float(h["seconds"].max()),
                            seconds=h["seconds"])
    return out
