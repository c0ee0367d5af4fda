"""What each rank computes and moves under a chunk ownership: `RankLoads` from a `PairMatrix`.

Every stored chunk pair carries three work quantities (``WORK``): visible pairs, full tiles and
partial tiles (`pairs.tile_counts`). For ownership ``chunk_owner[M]`` and ``num_waves``:

* local work of rank ``r``: the work of entries whose query and key chunks ``r`` both owns;
* for a key chunk ``j`` not owned by ``r``: the work of r's queries against ``j`` and
  ``need[r, j]``, the K/V rows of ``j`` that r's queries see: without a window the rows seen by
  the first chunk r owns after ``j`` (exact, see `pairs`), with a window ``min(that, pairs)`` (an
  upper bound);
* waves (the `CPPlan` rule): r's needed rows sorted by global row are cut into ``num_waves``
  contiguous near-equal parts (``np.array_split`` sizes: the first ``R % W`` parts one row
  longer). A chunk cut by a wave bound gives each side its share of the chunk's work in
  proportion to its rows; ``send_rows[s, w]`` counts the rows of ``s``'s chunks that the other
  ranks receive in their wave ``w``.

`rank_loads` is vectorised (dense ``[3, cp, M]`` work, sparse entry lists), and `remote_needs` /
`rank_waves` also run for a subset of ranks, which the planner's local search uses to recompute
only the ranks a move touches. `rank_loads_reference` recomputes the same quantities from the
row-level predicate with plain loops (O(N^2); a test oracle, never used by the planner).
"""
from __future__ import annotations

import numpy as np

from .cost_model import RankLoads
from .pairs import ChunkGrid, LayoutArrays, PairMatrix, tile_units

__all__ = ["rank_loads", "rank_loads_reference", "RemoteNeeds", "remote_needs", "wave_split", "rank_key_work",
           "move_rows", "rank_waves", "wave_sends", "WORK", "entry_work"]

#: the work quantities carried per chunk pair, in this order
WORK = ("pairs", "full_tiles", "part_tiles")


def entry_work(W: PairMatrix) -> np.ndarray:
    """[3, P] float64 work of every stored entry (pairs, full tiles, partial tiles)."""
    return W.work


class RemoteNeeds:
    """Sparse (rank, key chunk) entries of remote work, sorted by (rank, chunk).

    rank [E] (index into the ranks evaluated), chunk [E], work [3, E] float64, need [E] int64 rows;
    ``local`` [3, R] local work of each evaluated rank.
    """

    __slots__ = ("rank", "chunk", "work", "need", "local")

    def __init__(self, rank, chunk, work, need, local):
        self.rank, self.chunk, self.work, self.need, self.local = rank, chunk, work, need, local


def _next_owned(owned: np.ndarray) -> np.ndarray:
    """[R, M] smallest chunk i > j owned by the row's rank (M when none)."""
    R, M = owned.shape
    idx = np.where(owned, np.arange(M), M)
    suf = np.minimum.accumulate(idx[:, ::-1], axis=1)[:, ::-1]  # min over i >= j
    return np.concatenate([suf[:, 1:], np.full((R, 1), M)], axis=1)


def rank_key_work(W: PairMatrix, chunk_owner: np.ndarray, cp_size: int, work: np.ndarray | None = None) -> np.ndarray:
    """[3, cp, M] float64 ``A[:, r, j]``: work of rank r's queries against key chunk j.

    O(P) once; a move of chunk ``a`` from rank r to s updates it in O(row nnz) (`move_rows`).
    """
    M = W.num_chunks
    co = np.asarray(chunk_owner, np.int64)
    key = co[W.q] * M + W.k
    work = entry_work(W) if work is None else work
    return np.stack([np.bincount(key, weights=w, minlength=cp_size * M).reshape(cp_size, M) for w in work])


def move_rows(W: PairMatrix, A: np.ndarray, chunk: int, src: int, dst: int) -> None:
    """Update ``A`` in place for query chunk ``chunk`` moving from rank ``src`` to ``dst``."""
    lo, hi = W.rowptr[chunk], W.rowptr[chunk + 1]
    ks, ws = W.k[lo:hi], W.work[:, lo:hi]
    A[:, src, ks] -= ws
    A[:, dst, ks] += ws


def remote_needs(W: PairMatrix, chunk_owner: np.ndarray, cp_size: int, A: np.ndarray | None = None,
                 ranks: np.ndarray | None = None) -> RemoteNeeds:
    """Local work and the remote (rank, key chunk) entries of ``ranks`` (default: all) under one ownership.

    ``A`` (`rank_key_work` of this ownership) may be passed to skip its O(P) construction; the
    rest costs O(R * M) for R ranks. ``RemoteNeeds.rank`` indexes ``ranks``.
    """
    co = np.asarray(chunk_owner, np.int64)
    if A is None:
        A = rank_key_work(W, co, cp_size)
    if ranks is None:
        ranks = np.arange(cp_size)
    Ar = A[:, ranks]  # [3, R, M]
    owned = co[None, :] == np.asarray(ranks)[:, None]
    local = np.where(owned[None], Ar, 0.0).sum(2)
    # > 0.5: pair counts are integers kept in float64 (incremental updates may leave +-0 noise)
    r_idx, j_idx = np.nonzero((Ar[0] > 0.5) & ~owned)
    work = Ar[:, r_idx, j_idx]
    work[0] = np.round(work[0])
    nxt = _next_owned(owned)[r_idx, j_idx]
    need = W.need_table[nxt, j_idx]
    if W.window is not None:
        need = np.minimum(need, work[0].astype(np.int64))
    local[0] = np.round(local[0])
    return RemoteNeeds(r_idx, j_idx, work, need.astype(np.int64), local)


def wave_split(rank: np.ndarray, need: np.ndarray, num_ranks: int, num_waves: int):
    """Cut each rank's needed rows into its waves.

    rank [E] (entries sorted by rank, then chunk), need [E] -> (entry [K], wave [K], rows [K]): for
    each (entry, wave) overlap, the entry's rows in that wave. An entry meets only the waves its
    row span crosses, so K <= E + R * W.
    """
    E = len(rank)
    total = np.bincount(rank, weights=need, minlength=num_ranks).astype(np.int64)
    first = np.searchsorted(rank, np.arange(num_ranks))  # first entry of each rank
    csum = np.cumsum(need) - need  # exclusive, global
    start = csum - csum[np.minimum(first[rank], max(E - 1, 0))] if E else csum  # within the rank
    end = start + need
    q, rem = np.divmod(total, num_waves)

    def wave_of(x, r):  # wave of row position x < total of rank r: the first rem waves hold q+1 rows
        big = rem[r] * (q[r] + 1)
        return np.where(x < big, x // np.maximum(q[r] + 1, 1), rem[r] + (x - big) // np.maximum(q[r], 1))

    ent = np.nonzero(need > 0)[0]
    wf = wave_of(start[ent], rank[ent])
    wl = wave_of(end[ent] - 1, rank[ent])
    cnt = wl - wf + 1
    e = np.repeat(ent, cnt)
    w = np.repeat(wf, cnt) + (np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt))
    r = rank[e]
    lo = w * q[r] + np.minimum(w, rem[r])
    hi = lo + q[r] + (w < rem[r])
    rows = np.minimum(end[e], hi) - np.maximum(start[e], lo)
    return e, w, rows


def rank_waves(needs: RemoteNeeds, num_ranks: int, num_waves: int):
    """Per-wave rows and work received by each of ``num_ranks`` ranks (``needs.rank`` indexes them).

    Returns (wave_rows [R, W], wave_work [3, R, W], flows): ``flows = (dst, chunk, wave, rows)``, one
    entry per (receiving rank, key chunk, wave) with rows > 0 (``dst`` indexes the R ranks), from
    which `wave_sends` counts what every owner sends per wave.
    """
    R, nw = num_ranks, num_waves
    e, w, wr = wave_split(needs.rank, needs.need, R, nw)
    dst = needs.rank[e]
    slot = dst * nw + w
    wave_rows = np.bincount(slot, weights=wr, minlength=R * nw).reshape(R, nw)
    share = wr / needs.need[e] if len(e) else np.zeros(0)
    wave_work = np.stack([np.bincount(slot, weights=x[e] * share, minlength=R * nw).reshape(R, nw)
                          for x in needs.work])
    return wave_rows, wave_work, (dst, needs.chunk[e], w, wr)


def wave_sends(chunk_owner: np.ndarray, cp_size: int, num_waves: int, chunk: np.ndarray, wave: np.ndarray,
               rows: np.ndarray) -> np.ndarray:
    """[cp, W] rows each rank sends per wave: every flow is sent by its chunk's owner."""
    src = np.asarray(chunk_owner, np.int64)[chunk]
    return np.bincount(src * num_waves + wave, weights=rows, minlength=cp_size * num_waves).reshape(cp_size, num_waves)


def make_loads(rows, local: np.ndarray, wave_rows, wave_work: np.ndarray, send) -> RankLoads:
    """`RankLoads` from local work [3, cp] and wave work [3, cp, W]."""
    return RankLoads(rows=rows, local_pairs=local[0], wave_rows=wave_rows, wave_pairs=wave_work[0], send_rows=send,
                     local_tiles=np.stack([local[1], local[2]], axis=-1),
                     wave_tiles=np.stack([wave_work[1], wave_work[2]], axis=-1))


def rank_loads(W: PairMatrix, chunk_owner: np.ndarray, cp_size: int, num_waves: int,
               needs: RemoteNeeds | None = None) -> RankLoads:
    """`RankLoads` of ``chunk_owner`` [M] (vectorised; see the module doc)."""
    co = np.asarray(chunk_owner, np.int64)
    rows = np.bincount(co, weights=W.grid.rows, minlength=cp_size).astype(np.int64)
    nd = needs if needs is not None else remote_needs(W, co, cp_size)
    wave_rows, wave_work, (_, chunk, wave, wr) = rank_waves(nd, cp_size, num_waves)
    return make_loads(rows, nd.local, wave_rows, wave_work, wave_sends(co, cp_size, num_waves, chunk, wave, wr))


def rank_loads_reference(la: LayoutArrays, grid: ChunkGrid, row_owner: np.ndarray, cp_size: int, num_waves: int,
                         window: int | None = None, tile_rows: int = 128) -> RankLoads:
    """`rank_loads` from the row-level predicate with plain loops (test oracle; O(N^2)).

    ``row_owner`` [N] must be constant on the chunks of ``grid``. Tiles follow `pairs.tile_counts`'
    definition (blocks counted from each chunk's start; with a window, each chunk pair's tiles
    scaled by the share of its pairs the window keeps), counted here tile by tile.
    """
    N = la.num_rows
    vu = la.visible_until.tolist()
    own = [int(x) for x in row_owner]
    M = grid.num_chunks
    starts, ends = grid.starts.tolist(), grid.ends.tolist()
    B = int(tile_rows)

    # the row-level predicate as a dense [N, N] mask (test sizes only), with and without the window
    qq, kk = np.arange(N)[:, None], np.arange(N)[None, :]
    vis_nw = (kk <= qq) & (qq < la.visible_until[None, :])
    vis = vis_nw & ((la.position_ids[:, None] - la.position_ids[None, :]) < window) if window is not None else vis_nw

    # chunk-pair work: pairs (window), pairs without window, full and relevant tiles (no window)
    pairs, pairs_nw, full, rel = {}, {}, {}, {}
    for i in range(M):
        for j in range(M):
            pairs[(i, j)] = int(vis[starts[i]:ends[i], starts[j]:ends[j]].sum())
            pairs_nw[(i, j)] = int(vis_nw[starts[i]:ends[i], starts[j]:ends[j]].sum())
    us, ue, uc, _ = tile_units(grid, B)
    for a in range(len(us)):
        for b in range(len(us)):
            tile = vis_nw[us[a]:ue[a], us[b]:ue[b]]
            if tile.any():
                key = (int(uc[a]), int(uc[b]))
                rel[key] = rel.get(key, 0) + 1
                if tile.all() and tile.shape == (B, B):
                    full[key] = full.get(key, 0) + 1

    def work(i, j):
        p, pn = pairs.get((i, j), 0), pairs_nw.get((i, j), 0)
        f, t = full.get((i, j), 0), rel.get((i, j), 0)
        keep = p / max(pn, 1) if window is not None else 1.0
        return np.array([p, f * keep, (t - f) * keep], float)

    chunk_owner = [own[s] for s in starts]
    rows = [0] * cp_size
    for q in range(N):
        rows[own[q]] += 1
    local = np.zeros((3, cp_size))
    remote = {}  # (rank, key chunk) -> work [3]
    for i in range(M):
        for j in range(M):
            w = work(i, j)
            if not w.any():
                continue
            r = chunk_owner[i]
            if chunk_owner[j] == r:
                local[:, r] += w
            else:
                remote[(r, j)] = remote.get((r, j), np.zeros(3)) + w
    wave_rows = np.zeros((cp_size, num_waves))
    wave_work = np.zeros((3, cp_size, num_waves))
    send = np.zeros((cp_size, num_waves))
    for r in range(cp_size):
        mine = []
        for j in range(M):
            w = remote.get((r, j))
            if w is None or w[0] == 0:
                continue
            need = sum(1 for k in range(starts[j], ends[j]) if any(own[q] == r for q in range(k, vu[k])))
            if window is not None:
                need = min(need, int(w[0]))
            mine.append((j, need, w))
        total = sum(m[1] for m in mine)
        sizes = [len(part) for part in np.array_split(np.arange(total), num_waves)]
        bounds = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        at = 0
        for j, need, w in mine:
            for wv in range(num_waves):
                inside = max(0, min(at + need, bounds[wv + 1]) - max(at, bounds[wv]))
                if inside:
                    wave_rows[r, wv] += inside
                    wave_work[:, r, wv] += w * inside / need
                    send[chunk_owner[j], wv] += inside
            at += need
    return make_loads(np.array(rows, np.int64), local, wave_rows, wave_work, send)
