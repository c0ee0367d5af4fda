"""What each rank computes and moves under a chunk ownership: `RankLoads` from a `PairMatrix`.

For ownership ``chunk_owner[M]`` and ``num_waves``:

* ``local_pairs[r]``: pairs whose query and key chunks are both owned by ``r``;
* for a key chunk ``j`` not owned by ``r``: ``pairs[r, j]`` (pairs of r's queries against ``j``)
  and ``need[r, j]``, the K/V rows of ``j`` that r's queries see: without a window the rows seen
  by the first chunk r owns after ``j`` (exact, see `pairs`), with a window
  ``min(that, pairs[r, j])`` (an upper bound);
* waves (the `CPPlan` rule): r's needed rows sorted by global row are cut into ``num_waves``
  contiguous near-equal parts (``np.array_split`` sizes: the first ``R % W`` parts one row
  longer). A chunk cut by a wave boundary gives each side its share of ``pairs[r, j]`` in
  proportion to its rows; ``send_rows[s, w]`` counts the rows of ``s``'s chunks that the other
  ranks receive in their wave ``w``.

`rank_loads` is vectorised (dense ``[cp, M]`` arrays, sparse entry lists); `rank_loads_reference`
recomputes the same quantities from the row-level predicate with plain loops (O(N^2); a test
oracle, never used by the planner).
"""
from __future__ import annotations

import numpy as np

from .cost_model import RankLoads
from .pairs import ChunkGrid, LayoutArrays, PairMatrix

__all__ = ["rank_loads", "rank_loads_reference", "RemoteNeeds", "remote_needs", "wave_split", "rank_key_pairs",
           "move_rows", "rank_waves", "wave_sends"]


class RemoteNeeds:
    """Sparse (rank, key chunk) entries of remote work, sorted by (rank, chunk).

    rank [E], chunk [E], pairs [E] float64, need [E] int64 rows; plus ``local_pairs`` [cp].
    """

    __slots__ = ("rank", "chunk", "pairs", "need", "local_pairs")

    def __init__(self, rank, chunk, pairs, need, local_pairs):
        self.rank, self.chunk, self.pairs, self.need, self.local_pairs = rank, chunk, pairs, need, local_pairs


def _next_owned(owned: np.ndarray) -> np.ndarray:
    """[R, M] smallest chunk i > j owned by the row's rank (M when none)."""
    R, M = owned.shape
    idx = np.where(owned, np.arange(M), M)
    suf = np.minimum.accumulate(idx[:, ::-1], axis=1)[:, ::-1]  # min over i >= j
    return np.concatenate([suf[:, 1:], np.full((R, 1), M)], axis=1)


def rank_key_pairs(W: PairMatrix, chunk_owner: np.ndarray, cp_size: int) -> np.ndarray:
    """[cp, M] float64 ``A[r, j]``: visible pairs of rank r's queries against key chunk j.

    O(P) once; a move of chunk ``a`` from rank r to s updates it in O(row nnz) (`move_rows`).
    """
    M = W.num_chunks
    co = np.asarray(chunk_owner, np.int64)
    return np.bincount(co[W.q] * M + W.k, weights=W.pairs, minlength=cp_size * M).reshape(cp_size, M)


def move_rows(W: PairMatrix, A: np.ndarray, chunk: int, src: int, dst: int) -> None:
    """Update ``A`` in place for query chunk ``chunk`` moving from rank ``src`` to ``dst``."""
    lo, hi = W.rowptr[chunk], W.rowptr[chunk + 1]
    ks, ps = W.k[lo:hi], W.pairs[lo:hi]
    A[src, ks] -= ps
    A[dst, ks] += ps


def remote_needs(W: PairMatrix, chunk_owner: np.ndarray, cp_size: int, A: np.ndarray | None = None,
                 ranks: np.ndarray | None = None) -> RemoteNeeds:
    """Local pairs and remote (rank, key chunk) entries of ``ranks`` (default: all) under one ownership.

    ``A`` (`rank_key_pairs` of this ownership) may be passed to skip its O(P) construction; the
    rest costs O(R * M) for R ranks. ``RemoteNeeds.rank`` indexes ``ranks``.
    """
    M = W.num_chunks
    co = np.asarray(chunk_owner, np.int64)
    if A is None:
        A = rank_key_pairs(W, co, cp_size)
    if ranks is None:
        ranks = np.arange(cp_size)
    Ar = A[ranks]
    owned = co[None, :] == np.asarray(ranks)[:, None]
    local_pairs = np.where(owned, Ar, 0.0).sum(1)
    # > 0.5: entries are integer counts kept in float64 (incremental updates may leave +-0 noise)
    r_idx, j_idx = np.nonzero((Ar > 0.5) & ~owned)
    pairs = np.round(Ar[r_idx, j_idx])
    nxt = _next_owned(owned)[r_idx, j_idx]
    need = W.need_table[nxt, j_idx]
    if W.window is not None:
        need = np.minimum(need, pairs.astype(np.int64))
    return RemoteNeeds(r_idx, j_idx, pairs, need.astype(np.int64), np.round(local_pairs))


def rank_waves(needs: RemoteNeeds, num_ranks: int, num_waves: int):
    """Per-wave rows and pairs received by each of ``num_ranks`` ranks (``needs.rank`` indexes them).

    Returns (wave_rows [R, W], wave_pairs [R, W], flows): ``flows = (dst, chunk, wave, rows)``, one
    entry per (receiving rank, key chunk, wave) with rows > 0 (``dst`` indexes the R ranks), from
    which `wave_sends` counts what every owner sends per wave.
    """
    R, nw = num_ranks, num_waves
    e, w, wr, wp = wave_split(needs.rank, needs.need, needs.pairs, R, nw)
    dst = needs.rank[e]
    wave_rows = np.bincount(dst * nw + w, weights=wr, minlength=R * nw).reshape(R, nw)
    wave_pairs = np.bincount(dst * nw + w, weights=wp, minlength=R * nw).reshape(R, nw)
    return wave_rows, wave_pairs, (dst, needs.chunk[e], w, wr)


def wave_sends(chunk_owner: np.ndarray, cp_size: int, num_waves: int, chunk: np.ndarray, wave: np.ndarray,
               rows: np.ndarray) -> np.ndarray:
    """[cp, W] rows each rank sends per wave: every flow is sent by its chunk's owner."""
    src = np.asarray(chunk_owner, np.int64)[chunk]
    return np.bincount(src * num_waves + wave, weights=rows, minlength=cp_size * num_waves).reshape(cp_size, num_waves)


def wave_split(rank: np.ndarray, need: np.ndarray, pairs: np.ndarray, cp_size: int, num_waves: int):
    """Cut each rank's needed rows into its waves.

    rank [E] (entries sorted by rank, then chunk), need [E], pairs [E] -> (entry [K], wave [K],
    rows [K], pairs [K]): for each (entry, wave) overlap, the entry's rows in that wave and their
    share of its pairs. An entry meets only the waves its row span crosses, so K <= E + cp * W.
    """
    E = len(rank)
    total = np.bincount(rank, weights=need, minlength=cp_size).astype(np.int64)
    first = np.searchsorted(rank, np.arange(cp_size))  # first entry of each rank
    csum = np.cumsum(need) - need  # exclusive, global
    start = csum - csum[np.minimum(first[rank], max(E - 1, 0))] if E else csum  # within the rank
    end = start + need
    q, rem = np.divmod(total, num_waves)
    # wave of a row position x < total in a rank: the first rem waves hold q+1 rows, the rest q
    def wave_of(x, r):
        big = rem[r] * (q[r] + 1)
        return np.where(x < big, x // np.maximum(q[r] + 1, 1), rem[r] + (x - big) // np.maximum(q[r], 1))
    live = need > 0
    ent = np.nonzero(live)[0]
    wf = wave_of(start[ent], rank[ent])
    wl = wave_of(end[ent] - 1, rank[ent])
    cnt = wl - wf + 1
    e = np.repeat(ent, cnt)
    w = np.repeat(wf, cnt) + (np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt))
    r = rank[e]
    lo = w * q[r] + np.minimum(w, rem[r])
    hi = lo + q[r] + (w < rem[r])
    rows = np.minimum(end[e], hi) - np.maximum(start[e], lo)
    return e, w, rows, pairs[e] * rows / need[e]


def rank_loads(W: PairMatrix, chunk_owner: np.ndarray, cp_size: int, num_waves: int,
               needs: RemoteNeeds | None = None) -> RankLoads:
    """`RankLoads` of ``chunk_owner`` [M] (vectorised; see the module doc)."""
    co = np.asarray(chunk_owner, np.int64)
    rows = np.bincount(co, weights=W.grid.rows, minlength=cp_size).astype(np.int64)
    nd = needs if needs is not None else remote_needs(W, co, cp_size)
    wave_rows, wave_pairs, (_, chunk, wave, wr) = rank_waves(nd, cp_size, num_waves)
    return RankLoads(rows=rows, local_pairs=nd.local_pairs.astype(np.float64), wave_rows=wave_rows,
                     wave_pairs=wave_pairs, send_rows=wave_sends(co, cp_size, num_waves, chunk, wave, wr))


def rank_loads_reference(la: LayoutArrays, grid: ChunkGrid, row_owner: np.ndarray, cp_size: int, num_waves: int,
                         window: int | None = None) -> RankLoads:
    """`rank_loads` from the row-level predicate with plain loops (test oracle; O(N^2)).

    ``row_owner`` [N] must be constant on the chunks of ``grid``.
    """
    N = la.num_rows
    vu, pos = la.visible_until.tolist(), la.position_ids.tolist()
    own = [int(x) for x in row_owner]
    M = grid.num_chunks
    chunk_of = [int(c) for c in grid.chunk_of_row(np.arange(N))]
    starts, ends = grid.starts.tolist(), grid.ends.tolist()

    def sees(q, k):
        return k <= q < vu[k] and (window is None or pos[q] - pos[k] < window)

    rows = [0] * cp_size
    local = [0.0] * cp_size
    for q in range(N):
        rows[own[q]] += 1
    pairs = {}  # (rank, chunk) -> remote pairs
    for q in range(N):
        for k in range(q + 1):
            if sees(q, k):
                if own[q] == own[k]:
                    local[own[q]] += 1
                else:
                    key = (own[q], chunk_of[k])
                    pairs[key] = pairs.get(key, 0) + 1
    entries = []  # (rank, chunk, need, pairs), by rank then chunk
    for r in range(cp_size):
        for j in range(M):
            p = pairs.get((r, j), 0)
            if p == 0:
                continue
            need = 0
            for k in range(starts[j], ends[j]):
                if any(own[q] == r for q in range(k, vu[k])):  # visible without window
                    need += 1
            if window is not None:
                need = min(need, p)
            entries.append((r, j, need, p))
    wave_rows = np.zeros((cp_size, num_waves))
    wave_pairs = np.zeros((cp_size, num_waves))
    send = np.zeros((cp_size, num_waves))
    for r in range(cp_size):
        mine = [e for e in entries if e[0] == r]
        total = sum(e[2] for e in mine)
        sizes = [len(part) for part in np.array_split(np.arange(total), num_waves)]
        bounds = [0]
        for s in sizes:
            bounds.append(bounds[-1] + s)
        at = 0
        for _, j, need, p in mine:
            for w in range(num_waves):
                inside = max(0, min(at + need, bounds[w + 1]) - max(at, bounds[w]))
                if inside:
                    wave_rows[r, w] += inside
                    wave_pairs[r, w] += p * inside / need
                    send[own[starts[j]], w] += inside
            at += need
    return RankLoads(rows=np.array(rows, np.int64), local_pairs=np.array(local, np.float64), wave_rows=wave_rows,
                     wave_pairs=wave_pairs, send_rows=send)
