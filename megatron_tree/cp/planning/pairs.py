"""Visible (query, key) pair counts between row chunks, in closed form from the layout.

The planner cuts the ``N`` physical rows into ``M`` contiguous chunks of ``chunk_size`` rows (the
last one may be short) and needs, for every query chunk ``i`` and key chunk ``j``:

* ``pairs[i, j]``: visible pairs ``(q, k)`` with ``q`` in chunk ``i``, ``k`` in chunk ``j``
  (the attention work query chunk ``i`` does against key chunk ``j``);
* ``key_rows[i, j]``: rows of chunk ``j`` that at least one query of chunk ``i`` sees (the K/V rows
  chunk ``i`` needs from chunk ``j``).

How, without any row-by-row mask. Key row ``k`` is seen by exactly the query rows
``[k, visible_until[k])`` (its subtree from ``k`` on), so the pairs between key chunk ``j`` and a
query row interval ``[a, b)`` are an overlap count::

    overlap(j, [a, b)) = sum_{k in j} |[k, vu[k]) ∩ [a, b)|
                       = sum_{k in j} clip(vu[k] - a, 0, b - a) - clip(k - a, 0, b - a)

``visible_until`` is constant on a segment, so the first sum runs over *pieces* (a segment cut at
chunk bounds: ``c`` rows sharing one ``vu``): with the pieces of each chunk sorted by ``vu`` and
prefix sums of ``c`` and ``c * vu``, it is two ``searchsorted`` lookups. The second sum is an
arithmetic series. Padding rows (one-row segments seen only by themselves) are kept out of the
pieces and contribute their diagonal pair directly. Query chunk ``i`` sees key chunk ``j <= i`` iff
the largest ``vu`` of chunk ``j`` exceeds chunk ``i``'s first row, so each key chunk's non-zero
query chunks are one contiguous range: only non-zero entries are ever formed (``P`` of them; a
single unbranched chain is dense: ``M (M + 1) / 2``).

For ``j < i`` the key rows chunk ``i`` needs from ``j`` are ``{k in j : vu[k] > lo_i}``; these
sets shrink as ``i`` grows, so the rows a *set* of query chunks needs from ``j`` are those of its
first member after ``j`` (exact, used by the planner's remote-KV count).

Sliding window (``window = w``, measured in depth). Query ``q`` loses the ancestors ``k`` with
``pos[q] - pos[k] >= w``: exactly the ancestors-or-self of ``a(q)``, the ancestor of ``q`` at depth
``pos[q] - w``. Summed over ``q`` in chunk ``i`` that is ``sum_x overlap(j, {x})`` over the points
``x = a(q)``; consecutive queries of one segment have consecutive ancestors along a root path, so
the points form few row runs (found by walking up the segment tree, one vectorised step per tree
level) and ``pairs_w[i, j] = pairs[i, j] - sum_runs overlap(j, run)``: **exact** (tested against
brute force). ``key_rows`` with a window is an **upper bound**: ``min(key_rows without window,
pairs_w)``.

Tiles. The kernels compute whole ``TILE_ROWS`` x ``TILE_ROWS`` tiles of a stage's query and key
rows (skipping empty tiles, masking partial ones), so the cost model counts tiles, not pairs:
`tile_counts` gives, per stored entry, the full and the partially visible tiles between the two
chunks' blocks (blocks counted from each chunk's start), by the same range-overlap sums over
blocks instead of rows. On chunks of whole blocks (`block_grid`, the planner's default) a rank's
local-stage tiles are exactly those the kernel visits (tested against ``ops.blocks.block_pairs``).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

__all__ = ["ChunkGrid", "PairMatrix", "chunk_grid", "visible_pairs", "default_chunk_size", "LayoutArrays",
           "layout_arrays", "snapped_grid", "count_entries",
           "default_num_chunks", "tile_counts", "tile_units", "TILE_ROWS",
           "block_grid"]

#: rows per attention tile (query block x key block) of the kernels (``ops.attention.DEFAULT_BLOCK_SIZE``
#: and FlexAttention's block): the unit of work the cost model counts
TILE_ROWS = 128
#: the default grid aims at this many chunks per CP rank ...
CHUNKS_PER_RANK = 16
#: ... and at least this many chunks in all (small CP sizes still get a fine grid) ...
MIN_CHUNKS = 64
#: ... and at most this many (planning cost grows with the number of non-zero chunk pairs).
MAX_CHUNKS = 1024


def _merge_sorted(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Sorted union of two sorted int arrays (a stable sort of the concatenation finds the two runs
    and merges them in linear time; cheaper than ``np.union1d``'s generic unique)."""
    m = np.sort(np.concatenate([a, b]), kind="stable")
    if len(m) > 1:
        m = m[np.concatenate([[True], m[1:] != m[:-1]])]
    return m


def default_num_chunks(num_rows: int, cp_size: int) -> int:
    """Chunks of the default grid: ``clip(16 * cp, 64, 1024)`` rounded up to a multiple of ``2 * cp``
    (so equal chunks of an unbranched chain fold into equal rank shares), at most ``num_rows``.

    The chunks are near-equal (sizes differ by at most one row) rather than block-aligned: tree
    bounds are not block-aligned either, and the kernels tile each rank's concatenated rows, not
    the chunks. E.g. N=100, cp=4: 64 chunks of 1-2 rows; N=100000, cp=32: 512 chunks of ~195 rows.
    """
    if num_rows <= 0:
        return 0
    cp = max(int(cp_size), 1)
    target = min(max(CHUNKS_PER_RANK * cp, MIN_CHUNKS), MAX_CHUNKS)
    target = -(-target // (2 * cp)) * 2 * cp
    return int(min(target, num_rows))


def default_chunk_size(num_rows: int, cp_size: int) -> int:
    """Nominal rows per chunk of the default grid: ``ceil(N / default_num_chunks(N, cp))``."""
    m = default_num_chunks(num_rows, cp_size)
    return -(-int(num_rows) // m) if m else 1


@dataclass(frozen=True)
class LayoutArrays:
    """The numpy view of a `TreeLayout` the planner needs (int64, host memory).

    offsets [S+1], parent [S], subtree_end [S] of the real (non-padding) segments; ``num_rows`` N
    (padding included); ``num_padding`` trailing padding rows (one-row roots seen only by themselves).
    ``visible_until`` [N] and ``position_ids`` [N] are the layout's own arrays.
    """

    offsets: np.ndarray
    parent: np.ndarray
    subtree_end: np.ndarray
    visible_until: np.ndarray
    position_ids: np.ndarray
    num_rows: int
    num_padding: int

    @property
    def num_real(self) -> int:
        return self.num_rows - self.num_padding

    @cached_property
    def seg_depth0(self) -> np.ndarray:
        """[S] depth of each real segment's first row."""
        return self.position_ids[self.offsets[:-1]] if len(self.parent) else np.zeros(0, np.int64)


def layout_arrays(layout) -> LayoutArrays:
    """`LayoutArrays` of a `TreeLayout` (tensors moved to host numpy once)."""
    np_ = lambda t: t.detach().cpu().numpy().astype(np.int64, copy=False)
    npad = int(layout.num_padding)
    S = int(layout.num_segments) - npad  # padding rows are the last ``npad`` one-row segments
    offsets = np_(layout.segment_offsets)[: S + 1]
    return LayoutArrays(offsets=offsets, parent=np_(layout.segment_parent)[:S], subtree_end=np_(layout.subtree_end)[:S],
                        visible_until=np_(layout.visible_until), position_ids=np_(layout.position_ids),
                        num_rows=int(layout.num_rows), num_padding=npad)


@dataclass(frozen=True, eq=False)
class ChunkGrid:
    """``M`` contiguous chunks covering ``num_rows`` rows: chunk ``c`` is rows ``[starts[c], ends[c])``.

    starts [M], ends [M], rows [M] int64 (no empty chunk). ``chunk_size`` is the nominal size;
    ``uniform`` says every chunk but the last has exactly that size.
    """

    num_rows: int
    chunk_size: int
    starts: np.ndarray

    @property
    def num_chunks(self) -> int:
        return int(self.starts.shape[0])

    @cached_property
    def ends(self) -> np.ndarray:
        return np.append(self.starts[1:], self.num_rows).astype(np.int64)

    @cached_property
    def rows(self) -> np.ndarray:
        return self.ends - self.starts

    @cached_property
    def uniform(self) -> bool:
        return (self.num_chunks == -(-self.num_rows // self.chunk_size)
                and bool(np.array_equal(self.starts, np.arange(self.num_chunks, dtype=np.int64) * self.chunk_size)))

    def chunk_of_row(self, rows) -> np.ndarray:
        """Chunk of each row (int64)."""
        if self.uniform:
            return np.asarray(rows, np.int64) // self.chunk_size
        return np.searchsorted(self.starts, np.asarray(rows, np.int64), side="right") - 1

    def row_owner(self, chunk_owner: np.ndarray) -> np.ndarray:
        """[N] int32 owner of every row from [M] chunk owners."""
        return np.repeat(np.asarray(chunk_owner, np.int32), self.rows)


def chunk_grid(num_rows: int, chunk_size: int, starts: np.ndarray | None = None) -> ChunkGrid:
    """Uniform grid of ``chunk_size`` rows (the last chunk may be short), or the given ``starts``."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if starts is None:
        starts = np.arange(0, int(num_rows), int(chunk_size), dtype=np.int64)
    else:
        starts = np.asarray(starts, np.int64)
        if num_rows and (starts[0] != 0 or (np.diff(starts) <= 0).any() or starts[-1] >= num_rows):
            raise ValueError("chunk starts must begin at 0, increase strictly and lie below num_rows")
    return ChunkGrid(int(num_rows), int(chunk_size), starts)


def block_grid(num_rows: int, num_chunks: int, tile_rows: int = TILE_ROWS) -> ChunkGrid:
    """``num_chunks`` chunks of whole ``tile_rows`` blocks, near-equal in blocks (the last chunk may
    end short with the rows). Every set of such chunks concatenates into whole blocks, so the tiles
    `tile_counts` gives a rank's local stage are exactly the kernel's."""
    nb = -(-int(num_rows) // int(tile_rows))
    M = max(1, min(int(num_chunks), nb))
    starts = (np.arange(M, dtype=np.int64) * nb // M) * int(tile_rows)
    return chunk_grid(int(num_rows), -(-nb // M) * int(tile_rows), np.unique(starts))


def snapped_grid(la: "LayoutArrays", *, num_chunks: int | None = None, chunk_size: int | None = None) -> ChunkGrid:
    """A grid of ``num_chunks`` near-equal chunks (or chunks of ``chunk_size`` rows) whose bounds
    sit on tree bounds where possible.

    Each bound moves to the nearest tree start (a root segment, or the first padding row) within
    half a chunk; failing that, to the nearest segment start within a quarter chunk; else it
    stays. Every tree of at least a third of a chunk (half a chunk, when the thirds would more than
    double the chunk count) also starts and ends on a bound. A chunk then rarely
    splits a tree (or a completion) whose rows would otherwise need each other's K/V across ranks,
    and a big tree can be placed whole. Deterministic; O((S + M) log S).
    """
    N = la.num_rows
    if (num_chunks is None) == (chunk_size is None):
        raise ValueError("give exactly one of num_chunks and chunk_size")
    if chunk_size is not None:
        if int(chunk_size) < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        C = int(chunk_size)
        bounds = np.arange(C, N, C, dtype=np.int64)
    else:
        M = max(1, min(int(num_chunks), N))
        bounds = (np.arange(1, M, dtype=np.int64) * N) // M
        C = -(-N // M)
    bounds = np.unique(bounds[(bounds > 0) & (bounds < N)])
    if not len(bounds) or not len(la.parent):
        return chunk_grid(N, max(C, 1), np.concatenate([[0], bounds]).astype(np.int64) if N else None)
    seg_starts = la.offsets[:-1]
    tree_starts = np.append(seg_starts[la.parent < 0], la.num_real)

    def nearest(cands, x, radius):
        i = np.clip(np.searchsorted(cands, x), 1, len(cands) - 1) if len(cands) > 1 else np.zeros(len(x), np.int64)
        lo, hi = cands[np.maximum(i - 1, 0)], cands[i]
        pick = np.where(x - lo <= hi - x, lo, hi)
        return np.where(np.abs(pick - x) <= radius, pick, -1)

    t = nearest(tree_starts, bounds, C // 2)
    sg = nearest(seg_starts, bounds, C // 4)
    b = np.unique(np.where(t >= 0, t, np.where(sg >= 0, sg, bounds)))
    # a tree of at least a third (or half) of a chunk starts and ends on a chunk bound (so it is a
    # union of whole chunks); snapped bounds within a quarter chunk of such a bound give way to it
    tree_ends = np.append(tree_starts[1:], N)
    size = tree_ends - tree_starts
    big = size * 3 >= C
    if 2 * int(big.sum()) > len(bounds) + 1:  # many third-chunk trees: only half-chunk ones
        big = size * 2 >= C
    forced = np.unique(np.concatenate([tree_starts[big], tree_ends[big]]))
    if len(forced):
        near = nearest(forced, b, max(C // 4, 0))
        b = np.union1d(b[near < 0], forced)
    starts = np.unique(np.concatenate([[0], b]))
    starts = starts[(starts >= 0) & (starts < N)]
    return chunk_grid(N, C, starts)


class _Pieces:
    """Real rows grouped into pieces (segment ∩ chunk) sorted by (chunk, vu), with prefix sums.

    Answers, for vectors of (key chunk j, row a, row b):
      ``count_gt(j, x)``   rows of chunk j (real) with vu > x
      ``overlap(j, a, b)`` sum over k in j of |[k, vu[k]) ∩ [a, b)| (padding rows included)
    """

    def __init__(self, la: LayoutArrays, grid: ChunkGrid):
        N, M = grid.num_rows, grid.num_chunks
        self.N, self.M, self.n_real, self.grid = N, M, la.num_real, grid
        real = la.num_real
        bounds = _merge_sorted(la.offsets[:-1], grid.starts)
        bounds = bounds[bounds < real]
        ends = np.append(bounds[1:], real)
        seg = np.searchsorted(la.offsets, bounds, side="right") - 1
        chunk = grid.chunk_of_row(bounds)
        vu = la.subtree_end[seg] if len(seg) else np.zeros(0, np.int64)
        cnt = ends - bounds
        self.span = N + 1  # composite key chunk * span + vu (vu <= N)
        key = chunk * self.span + vu
        order = np.argsort(key, kind="stable")
        self.key = key[order]
        self.sc = np.concatenate([[0], np.cumsum(cnt[order])])
        self.scv = np.concatenate([[0], np.cumsum(cnt[order] * vu[order])])
        # largest vu of each chunk (real rows; a padding row's vu is row + 1)
        self.max_vu = np.zeros(M, np.int64)
        if len(chunk):
            np.maximum.at(self.max_vu, chunk, vu)
        if la.num_padding:
            pad_chunks = np.nonzero(grid.ends > real)[0]
            self.max_vu[pad_chunks] = np.maximum(self.max_vu[pad_chunks], grid.ends[pad_chunks])
        self.piece_chunk, self.piece_start, self.piece_end, self.piece_vu = chunk, bounds, ends, vu

    def _idx(self, j, x, side):
        return np.searchsorted(self.key, j * self.span + x, side=side)

    def count_gt(self, j: np.ndarray, x: np.ndarray) -> np.ndarray:
        """[K] real rows k of chunk j with vu[k] > x."""
        return self.sc[self._idx(j + 1, 0, "left")] - self.sc[self._idx(j, x, "right")]

    def overlap(self, j: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """[K] sum over key rows k of chunk j of |[k, vu[k]) ∩ [a, b)| (int64; a <= b)."""
        L = b - a
        lo = self._idx(j, a, "right")  # first piece with vu > a
        hi = self._idx(j, b, "left")  # first piece with vu >= b
        end = self._idx(j + 1, 0, "left")
        f = (self.scv[hi] - self.scv[lo]) - a * (self.sc[hi] - self.sc[lo]) + L * (self.sc[end] - self.sc[hi])
        # minus sum_{k real in j} clip(k - a, 0, L)  (arithmetic series)
        k0, kend = self.grid.starts[j], self.grid.ends[j]
        k1 = np.minimum(kend, self.n_real)
        g = _ramp_sum(k0, np.maximum(k1, k0), a, L)
        # padding rows k (vu = k + 1) in j contribute 1 each when a <= k < b
        p0 = np.maximum(k0, self.n_real)
        p1 = kend
        pad = np.maximum(np.minimum(p1, b) - np.maximum(p0, a), 0)
        return f - g + pad


def _ramp_sum(x0, x1, a, L):
    """sum_{k in [x0, x1)} clip(k - a, 0, L), elementwise (int64)."""
    # part 1: k in [max(x0, a), min(x1, a + L)) contributes k - a
    s = np.maximum(x0, a)
    e = np.minimum(x1, a + L)
    n1 = np.maximum(e - s, 0)
    part1 = n1 * (s - a) + n1 * (n1 - 1) // 2
    # part 2: k in [max(x0, a + L), x1) contributes L
    n2 = np.maximum(x1 - np.maximum(x0, a + L), 0)
    return part1 + n2 * L


@dataclass(frozen=True, eq=False)
class PairMatrix:
    """Sparse visible-pair matrix between query chunks and key chunks of one `ChunkGrid`.

    q [P], k [P]    int64 query / key chunk of each stored entry, sorted by (q, k), k <= q; every
                    entry with a visible pair *without* window is stored (with a window some stored
                    entries may hold 0 pairs)
    pairs [P]       int64 visible pairs (window applied when ``window`` is set)
    pairs_nowin [P] int64 visible pairs without the window
    full_tiles [P], part_tiles [P]  float64 attention tiles the kernels compute (`tile_counts`):
                    ``tile_rows`` x ``tile_rows`` tiles with every pair visible / with some pair
                    visible but not all (masked); with a window both are scaled by the entry's
                    share of pairs the window keeps (an estimate)
    rowptr [M+1]    CSR pointer: entries of query chunk i are ``rowptr[i]:rowptr[i+1]``
    window          the depth window (None: none)

    ``need_rows(i, j)`` gives the K/V rows query chunk(s) need from a key chunk (see module doc).
    ``dense()`` builds the [M, M] matrix (tests and plots only).
    """

    grid: ChunkGrid
    q: np.ndarray
    k: np.ndarray
    pairs: np.ndarray
    pairs_nowin: np.ndarray
    full_tiles: np.ndarray
    part_tiles: np.ndarray
    rowptr: np.ndarray
    window: int | None
    tile_rows: int
    _pieces: _Pieces

    @property
    def num_chunks(self) -> int:
        return self.grid.num_chunks

    @property
    def nnz(self) -> int:
        return int(self.q.shape[0])

    @cached_property
    def work(self) -> np.ndarray:
        """[3, P] float64 work of every entry: visible pairs, full tiles, partial tiles."""
        return np.stack([self.pairs.astype(np.float64), self.full_tiles, self.part_tiles])

    @cached_property
    def row_sums(self) -> np.ndarray:
        """[M] visible pairs of each query chunk (its attention work)."""
        return np.bincount(self.q, weights=self.pairs, minlength=self.num_chunks)

    @cached_property
    def col_sums(self) -> np.ndarray:
        """[M] visible pairs of each key chunk (how much its K/V is read)."""
        return np.bincount(self.k, weights=self.pairs, minlength=self.num_chunks)

    @property
    def total_pairs(self) -> int:
        return int(self.pairs.sum())

    @cached_property
    def need_table(self) -> np.ndarray:
        """[M, M] int64 ``need_rows(i, j)`` at every stored entry (0 elsewhere): the planner's
        remote-row lookups become gathers. Only read at stored entries: whenever query chunks
        after ``j`` see it at all, the first of them has a stored entry with ``j``."""
        M = self.num_chunks
        t = np.zeros((M, M), np.int64)
        t[self.q, self.k] = self.need_rows(self.q, self.k)
        return t

    def need_rows(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        """[K] rows of key chunk ``j`` visible to query chunk ``i`` (no window), for ``j <= i``.

        ``j < i``: ``#{k in j : vu[k] > first row of i}``; ``j == i``: all rows of the chunk (each
        row sees itself). Because these sets shrink with ``i``, the rows a set of query chunks
        needs from ``j`` are ``need_rows(first member after j, j)``.
        """
        i = np.asarray(i, np.int64)
        j = np.asarray(j, np.int64)
        out = self._pieces.count_gt(j, self.grid.starts[np.minimum(i, self.num_chunks - 1)] if self.num_chunks else i)
        return np.where(i == j, self.grid.rows[j] if self.num_chunks else 0, out)

    def dense(self) -> np.ndarray:
        """[M, M] int64 pair counts (test / plot helper; O(M^2) memory)."""
        M = self.num_chunks
        out = np.zeros((M, M), np.int64)
        out[self.q, self.k] = self.pairs
        return out

    def entry_index(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        """[K] position of entry (i, j) in the sorted arrays, -1 where it is not stored."""
        M = max(self.num_chunks, 1)
        key = self.q * M + self.k
        want = np.asarray(i, np.int64) * M + np.asarray(j, np.int64)
        pos = np.searchsorted(key, want)
        ok = (pos < len(key)) & (key[np.minimum(pos, len(key) - 1)] == want) if len(key) else np.zeros(len(want), bool)
        return np.where(ok, pos, -1)


def count_entries(la: LayoutArrays, grid: ChunkGrid) -> int:
    """Number of stored entries ``P`` `visible_pairs` would build on ``grid`` (O((S + M) log))."""
    pieces = _Pieces(la, grid)
    last = np.maximum(grid.chunk_of_row(pieces.max_vu - 1), np.arange(grid.num_chunks))
    return int((last - np.arange(grid.num_chunks) + 1).sum())


def visible_pairs(la: LayoutArrays, grid: ChunkGrid, *, window: int | None = None,
                  tile_rows: int = TILE_ROWS) -> PairMatrix:
    """The `PairMatrix` of a layout on a chunk grid (see module doc). No N x N object is formed.

    Cost: O((S + M) log + P) without window (S segments, M chunks, P non-zero chunk pairs); with a
    window add O(R log) for the R ancestor runs and O(sum over runs of the run's row nnz).
    """
    if window is not None and int(window) < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if grid.num_rows != la.num_rows:
        raise ValueError(f"the grid covers {grid.num_rows} rows but the layout has {la.num_rows}")
    M = grid.num_chunks
    pieces = _Pieces(la, grid)
    # key chunk j is seen by query chunks i in [j, last[j]]
    last = np.maximum(grid.chunk_of_row(pieces.max_vu - 1), np.arange(M))
    count = last - np.arange(M) + 1
    k = np.repeat(np.arange(M, dtype=np.int64), count)
    q = k + (np.arange(int(count.sum()), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count))
    order = np.lexsort((k, q))
    q, k = q[order], k[order]
    pairs = pieces.overlap(k, grid.starts[q], grid.ends[q])
    rowptr = np.searchsorted(q, np.arange(M + 1))
    pairs_nowin = pairs
    if window is not None:
        run_chunk, run_a, run_b = _window_runs(la, grid, int(window))
        if len(run_chunk):
            nnz_row = rowptr[run_chunk + 1] - rowptr[run_chunk]
            tot = int(nnz_row.sum())
            rep = np.repeat(np.arange(len(run_chunk)), nnz_row)
            ent = np.repeat(rowptr[run_chunk] - (np.cumsum(nnz_row) - nnz_row), nnz_row) + np.arange(tot)
            lost = pieces.overlap(k[ent], run_a[rep], run_b[rep])
            pairs = pairs - np.bincount(ent, weights=lost, minlength=len(q)).astype(np.int64)
    full, rel = tile_counts(la, grid, q, k, tile_rows)
    part = rel - full
    if window is not None:  # the window keeps a share of each entry's pairs: keep that share of its tiles
        keep = pairs / np.maximum(pairs_nowin, 1)
        full, part = full * keep, part * keep
    return PairMatrix(grid=grid, q=q, k=k, pairs=pairs, pairs_nowin=pairs_nowin, full_tiles=full.astype(np.float64),
                      part_tiles=part.astype(np.float64), rowptr=rowptr, window=None if window is None else int(window),
                      tile_rows=int(tile_rows), _pieces=pieces)


def tile_units(grid: ChunkGrid, tile_rows: int = TILE_ROWS):
    """Blocks of ``tile_rows`` rows counted from each chunk's start (the last block of a chunk may be
    short): the tiles of a rank's concatenated rows when its chunks are multiples of the block,
    and close to them otherwise. Returns (start [U], end [U], chunk [U], first [M+1]) with chunk
    c's units ``first[c]:first[c+1]``."""
    B = int(tile_rows)
    per = -(-grid.rows // B)
    first = np.concatenate([[0], np.cumsum(per)])
    U = int(first[-1])
    chunk = np.repeat(np.arange(grid.num_chunks), per)
    start = grid.starts[chunk] + (np.arange(U) - first[chunk]) * B
    end = np.minimum(start + B, grid.ends[chunk])
    return start, end, chunk, first


class _RangeSums:
    """``sum over items u of group j of |[lo_u, hi_u) ∩ [a, b)|`` for vectors (j, a, b), lo <= hi.

    |[lo, hi) ∩ [a, b)| = clip(hi - a, 0, L) - clip(lo - a, 0, L) with L = b - a, and
    sum_u clip(v_u - a, 0, L) needs, per group, the values sorted with prefix sums: two lookups.
    """

    def __init__(self, group: np.ndarray, lo: np.ndarray, hi: np.ndarray, span: int):
        self.span = int(span)
        self.lo = self._sorted(group, lo)
        self.hi = self._sorted(group, hi)

    def _sorted(self, group, v):
        key = group * self.span + v
        order = np.argsort(key, kind="stable")
        return key[order], np.concatenate([[0], np.cumsum(v[order])]), self.span

    @staticmethod
    def _clip_sum(tab, j, a, L):
        key, csum, span = tab
        lo = np.searchsorted(key, j * span + a, side="right")  # v > a
        hi = np.searchsorted(key, j * span + a + L, side="left")  # v < a + L
        end = np.searchsorted(key, (j + 1) * span, side="left")
        return (csum[hi] - csum[lo]) - a * (hi - lo) + L * (end - hi)

    def __call__(self, j, a, b):
        L = np.maximum(b - a, 0)
        return self._clip_sum(self.hi, j, a, L) - self._clip_sum(self.lo, j, a, L)


def tile_counts(la: LayoutArrays, grid: ChunkGrid, q: np.ndarray, k: np.ndarray, tile_rows: int = TILE_ROWS):
    """(full [P], relevant [P]) tiles between query chunk ``q[p]`` and key chunk ``k[p]`` (no window).

    Tiles are pairs of `tile_units` (blocks counted from each chunk's start). A tile is relevant when
    some query of its query block sees some key of its key block: query block qu sees key block ku
    iff ``ku <= qu`` and ``max vu(ku) > start(qu)``, so ku's relevant query blocks are the range
    ``[ku, unit of (max vu(ku) - 1)]``. It is full (no mask) when both blocks have ``tile_rows``
    rows and every query sees every key: ``ku < qu`` and ``min vu(ku) >= end(qu)``, a range again.
    Per entry both are range-overlap sums (`_RangeSums`): O((U + P) log U) for U blocks. On a grid
    of block multiples this is exactly what ``ops.blocks.block_pairs`` finds for a rank's rows.
    """
    B = int(tile_rows)
    us, ue, uc, first = tile_units(grid, B)
    U = len(us)
    if U == 0 or len(q) == 0:
        z = np.zeros(len(q), np.int64)
        return z, z
    vu = la.visible_until
    maxvu = np.maximum.reduceat(vu, us)
    minvu = np.minimum.reduceat(vu, us)
    idx = np.arange(U)
    last_rel = np.searchsorted(us, maxvu - 1, side="right") - 1  # >= idx (a row sees itself)
    rel = _RangeSums(uc, idx, last_rel + 1, U + 2)
    complete = (ue - us) == B
    last_full = np.searchsorted(ue, minvu, side="right") - 1  # last block ending at or before min vu
    hi_full = np.maximum(last_full + 1, idx + 1)
    cu = np.nonzero(complete)[0]
    full = _RangeSums(uc[cu], idx[cu] + 1, hi_full[cu], U + 2)
    a, b = first[q], first[q + 1]
    b_complete = a + grid.rows[q] // B  # a chunk's complete blocks are its leading ones
    return full(k, a, b_complete).astype(np.int64), rel(k, a, b).astype(np.int64)


def _window_runs(la: LayoutArrays, grid: ChunkGrid, w: int):
    """Runs of the points ``a(q)`` (ancestor of q at depth pos[q] - w) per query chunk.

    Returns (chunk [R], a [R], b [R]): the rows ``[a, b)`` lie on one root path and each is the
    point of exactly one query of ``chunk`` (a query with pos[q] < w has no point). Query pieces are
    segment ∩ chunk; their target depths form one interval, which meets each ancestor segment
    in one interval: walk up the segment tree, one vectorised step per level.
    """
    real = la.num_real
    if real == 0:
        z = np.zeros(0, np.int64)
        return z, z, z
    bounds = _merge_sorted(la.offsets[:-1], grid.starts)
    bounds = bounds[bounds < real]
    ends = np.append(bounds[1:], real)
    seg = np.searchsorted(la.offsets, bounds, side="right") - 1
    chunk = grid.chunk_of_row(bounds)
    d0 = la.position_ids[bounds]
    # target depths [t_lo, t_hi) of the piece's queries; query row for target t: bounds + t - (d0 - w)
    t_lo = np.maximum(d0 - w, 0)
    t_hi = d0 + (ends - bounds) - w
    live = t_hi > t_lo
    cur = seg.copy()
    seg_d0 = la.seg_depth0
    seg_len = la.offsets[1:] - la.offsets[:-1]
    out_c, out_a, out_b = [], [], []
    while live.any():
        idx = np.nonzero(live)[0]
        s = cur[idx]
        D0 = seg_d0[s]
        D1 = D0 + seg_len[s]
        T0 = np.maximum(t_lo[idx], D0)
        T1 = np.minimum(t_hi[idx], D1)
        ok = T1 > T0
        base = la.offsets[s] - D0
        out_c.append(chunk[idx][ok])
        out_a.append((base + T0)[ok])
        out_b.append((base + T1)[ok])
        # the segment holds the shallowest wanted depth: nothing above it is wanted
        done = D0 <= t_lo[idx]
        nxt = la.parent[s]
        live[idx[done | (nxt < 0)]] = False
        cur[idx] = np.where(nxt >= 0, nxt, s)
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int64)
    return cat(out_c), cat(out_a), cat(out_b)
