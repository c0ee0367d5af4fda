"""Predicted per-rank time of a CP plan: calibrated coefficients and a staged-schedule simulator.

What one CP rank does per transformer layer (the executor's staged schedule):

forward
  1. token-local work of its rows (projections, norms, MLP / MoE): ``rows * tok_fwd_ms_per_row``;
  2. the *local stage*: its queries against its own K/V;
  3. ``num_waves`` *remote stages*: wave ``w``'s K/V rows arrive by all-to-all; the fetch of wave
     ``w + 1`` is issued when wave ``w``'s compute starts and overlaps it (fraction ``overlap`` of a
     transfer can hide behind compute; 0 means transfers block, as with gloo on a CPU); each
     remote stage is followed by an exact LSE merge over the rank's query rows.
backward
  the remote waves again (their K/V refetched when ``bwd_refetch``: the executor's recompute mode),
  each returning its dK/dV to
  the owners while the next wave computes, then the local stage; the layer's backward ends when the
  compute and every dK/dV return have finished; plus token-local backward.

A stage costs ``launch + max(full * full_tile_ms + partial * part_tile_ms, underfill_tiles *
full_tile_ms) + stage_row_ms * (nq + nk)``. The kernels (the torch reference and FlexAttention)
compute whole ``tile_rows`` x ``tile_rows`` tiles of the stage's query and key rows, skipping tiles
with no visible pair and masking the partial ones, so work is counted in tiles (`pairs.tile_counts`)
rather than visible pairs: a tree of short branches fills its tiles poorly, and a fragmented
ownership cuts tiles. Full and partial tiles have their own calibrated costs (a partial tile also
evaluates its mask), forward and backward each; a floor for a stage too small to fill the device;
a per-row term for gathering / assembling the stage's rows. A transfer costs
``comm_latency_ms + bytes * comm_ms_per_byte`` with ``bytes = max(sent, received) rows * bytes per
row`` for that rank in that wave (the all-to-all's busier direction); a wave in which no rank moves
a row is skipped by every rank (the executor's rule), so it costs nothing.

These are empirical predictions: the coefficients come from `tools/calibrate_cp.py` (measured
stage timings on the machine), the defaults below describe a Hopper-class GPU with NVLink for a
GQA model (32 query heads, 8 K/V heads, head dim 128, hidden 4096, bf16).

`simulate` is vectorised over ranks (used by the planner's search); `simulate_reference` follows
the same schedule with plain loops, one rank at a time (tests check that the two agree).

DSA models (``CostModel.dsa``, a `DSAWork`; `cp.execution.dsa.tree_dsa_cp` is the executor). The staged
schedule above then runs the *indexer*: its stages score candidate keys, so a stage costs
``launch + pairs * index_{fwd,bwd}_ms_per_pair + stage_row_ms * (nq + nk)`` (work per visible
(query, key) pair: the indexer scores every visible key), its transfers move candidate rows
(``cand_bytes_per_row``: index keys, plus main keys for a dense indexer loss; the backward returns
``cand_grad_bytes_per_row``), and the top-k merge takes the place of the LSE merge. Only the layers
that run their own indexer pay it (``index_layers_fraction``; IndexShare layers reuse the ids).
Every DSA layer then runs ONE sparse attention over a fixed ``min(topk, visible keys)`` per query
(``sel_{fwd,bwd}_ms_per_key`` times `RankLoads.sel_keys`, the rank's sum of that count), after the
winners' K|V fetch (three all-to-alls: counts, ids, rows; rows estimated by the bound
``min(remote rows, sel_keys)``, returned as dK|dV in backward). Per layer::

    attn_fwd = f * staged_indexer_fwd + winners_fetch + sel_fwd_ms_per_key * sel_keys
    attn_bwd = winners_return + sel_bwd_ms_per_key * sel_keys + f * staged_indexer_bwd

With ``kv_with_candidates`` (the executor's ``kv_fetch="stages"``) there is no winners' fetch: the
waves carry candidate + K|V bytes (f of the layers, with the indexer's work) or K|V bytes alone
(the IndexShare layers, stages without scoring), all overlapped like dense attention's fetch.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass, field

import numpy as np

__all__ = ["CostModel", "DSAWork", "RankLoads", "RankTimes", "simulate", "simulate_reference", "default_cost_model",
           "CPU_COST_JSON", "dsa_selected_keys"]

CPU_COST_JSON = os.path.join(os.path.dirname(__file__), "cost_cpu.json")


@dataclass(frozen=True)
class DSAWork:
    """The DSA terms of the CP cost model (milliseconds and bytes per DSA layer; see the module doc).

    topk                        keys each query attends (``min(topk, visible keys)`` per query row)
    index_layers_fraction       share of the DSA layers that run their own indexer (candidate
                                scoring, its stages and transfers); the others reuse ids (IndexShare)
    index_fwd_ms_per_pair       indexer forward per visible (query, key) pair: top-k scoring, plus
                                the loss's passes when the indexer loss is trained
    index_bwd_ms_per_pair       indexer-loss backward per visible pair (0 without the loss)
    sel_fwd_ms_per_key, sel_bwd_ms_per_key   sparse attention per (query, selected key)
    cand_bytes_per_row          bytes of one fetched candidate row (index key; + main key for the
                                dense indexer loss)
    cand_grad_bytes_per_row     bytes of one returned index-key gradient (0 without the loss)
    winner_kv_bytes_per_row     K|V bytes of one fetched winner row
    kv_with_candidates          the executor's ``kv_fetch="stages"``: every visible remote row's K|V
                                travels with the candidates in the waves (overlapped, dense-sized;
                                also on IndexShare layers, whose stages then only move K|V) instead
                                of the winners' fetch after the top-k

    Defaults: a DeepSeek-V3.2-like layer on a Hopper-class GPU: indexer 64 heads x 128 dims in FP8
    (~33 kFLOP per pair at ~1.2 PFLOP/s, with the top-k select), MLA main attention 128 heads over
    the 576 / 512-dim latent in bf16 (~280 kFLOP per selected key forward at ~400 TFLOP/s, backward
    2.5x), index key 128 bytes (FP8) + scale, latent K|V row 1152 bytes; no indexer loss.
    """

    topk: int = 2048
    index_layers_fraction: float = 1.0
    index_fwd_ms_per_pair: float = 2.8e-8
    index_bwd_ms_per_pair: float = 0.0
    sel_fwd_ms_per_key: float = 7.0e-7
    sel_bwd_ms_per_key: float = 1.75e-6
    cand_bytes_per_row: float = 132.0
    cand_grad_bytes_per_row: float = 0.0
    winner_kv_bytes_per_row: float = 1152.0
    kv_with_candidates: bool = False

    def __post_init__(self):
        if int(self.topk) < 1:
            raise ValueError(f"DSAWork.topk must be >= 1, got {self.topk}")
        if not 0.0 <= self.index_layers_fraction <= 1.0:
            raise ValueError(f"DSAWork.index_layers_fraction must lie in [0, 1], got {self.index_layers_fraction}")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, float) and v < 0:
                raise ValueError(f"DSAWork.{f.name} must be >= 0, got {v}")


def dsa_selected_keys(position_ids: np.ndarray, topk: int) -> np.ndarray:
    """[N] float64 ``min(topk, visible keys)`` per row: a row sees its root path (depth + 1 keys)."""
    return np.minimum(np.asarray(position_ids, np.float64) + 1.0, float(topk))


@dataclass(frozen=True)
class CostModel:
    """Calibrated coefficients (milliseconds, per transformer layer) of the CP time model.

    tok_fwd_ms_per_row, tok_bwd_ms_per_row   token-local work per owned row
    {fwd,bwd}_{full,part}_tile_ms            attention time per full / partially masked tile
    tile_rows                               rows per tile side (the kernels' block)
    fwd_launch_ms, bwd_launch_ms            fixed cost of one attention stage
    underfill_tiles                         a stage with less work costs as many full tiles
    stage_row_ms                            per query + key row of a stage (gather, block metadata)
    merge_fwd_ms_per_row, merge_bwd_ms_per_row   LSE merge of one remote stage, per query row
    comm_latency_ms, comm_ms_per_byte       one all-to-all: latency + bytes / bandwidth
    kv_bytes_per_row, dkv_bytes_per_row     K + V bytes of one row (forward fetch / dK + dV return)
    overlap                                 fraction of a transfer that hides behind compute (0..1)
    bwd_refetch                             backward fetches each wave's K/V again: the executor's
                                            ``recompute=True`` mode (remote K/V held: two waves); by
                                            default stages keep their graph (held: all fetched rows)
    layers                                  attention layers the prediction covers (multiplier)
    max_remote_kv_rows                      optional cap on remote K/V rows held at once
    dsa                                     `DSAWork` for a DSA model (None: dense attention)
    name, meta                              where the figures come from
    """

    name: str = "gpu-default"
    # token-local: ~436 MFLOP per row forward (hidden 4096, GQA projections, SwiGLU MLP 14336) at
    # ~600 TFLOP/s; backward twice that
    tok_fwd_ms_per_row: float = 7.3e-4
    tok_bwd_ms_per_row: float = 1.46e-3
    # attention: a full 128 x 128 tile is 4 * 128 * 128 * head_dim 128 * 32 q-heads = 268 MFLOP
    # forward at ~420 TFLOP/s, backward 2.5x the FLOPs at ~350 TFLOP/s; a masked (partial) tile
    # ~1.5x a full one. Not yet measured on a GPU: tools/calibrate_cp.py --device cuda.
    fwd_full_tile_ms: float = 6.4e-4
    fwd_part_tile_ms: float = 9.6e-4
    bwd_full_tile_ms: float = 1.9e-3
    bwd_part_tile_ms: float = 2.9e-3
    tile_rows: int = 128
    fwd_launch_ms: float = 0.02
    bwd_launch_ms: float = 0.04
    underfill_tiles: float = 4.0  # 32 heads x 4 tiles ~ one wave of thread blocks on 132 SMs
    # per query/key row of a stage: Q, O, LSE (and K, V) through HBM at ~2.5 TB/s
    stage_row_ms: float = 3.5e-6
    # an LSE merge reads two outputs and writes one (fp32): ~48 KB per query row; backward twice
    merge_fwd_ms_per_row: float = 1.9e-5
    merge_bwd_ms_per_row: float = 3.8e-5
    comm_latency_ms: float = 0.03
    comm_ms_per_byte: float = 7.0e-9  # ~140 GB/s per GPU in an all-to-all over NVLink
    kv_bytes_per_row: float = 4096.0  # 2 (K, V) x 8 heads x 128 dims x 2 bytes
    dkv_bytes_per_row: float = 4096.0
    overlap: float = 0.9
    bwd_refetch: bool = False
    layers: int = 1
    max_remote_kv_rows: int | None = None
    dsa: DSAWork | None = None
    meta: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"CostModel.overlap must lie in [0, 1], got {self.overlap}")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, float) and v < 0:
                raise ValueError(f"CostModel.{f.name} must be >= 0, got {v}")
        if self.layers < 1:
            raise ValueError(f"CostModel.layers must be >= 1, got {self.layers}")

    # ------------------------------------------------------------------ construction / IO
    @classmethod
    def gpu(cls, **overrides) -> "CostModel":
        """Built-in Hopper-class GPU profile (see the module doc)."""
        return cls(**overrides)

    @classmethod
    def cpu(cls, **overrides) -> "CostModel":
        """The CPU profile fitted by `tools/calibrate_cp.py` and shipped as ``cost_cpu.json``."""
        m = cls.from_json(CPU_COST_JSON)
        return dataclasses.replace(m, **overrides) if overrides else m

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)
            f.write("\n")

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown CostModel fields {unknown}; known: {sorted(names)}")
        if isinstance(d.get("dsa"), dict):
            d = dict(d, dsa=DSAWork(**d["dsa"]))
        return cls(**d)

    @classmethod
    def from_json(cls, path: str) -> "CostModel":
        with open(path) as f:
            return cls.from_dict(json.load(f))

    @property
    def key(self) -> tuple:
        """Hashable identity of the coefficients (plan-cache key part)."""
        return tuple((f.name, getattr(self, f.name)) for f in dataclasses.fields(self) if f.compare)

    # ------------------------------------------------------------------ stage formulas
    def stage_ms(self, full, part, nq, nk, *, backward: bool):
        """Time of one attention stage of ``full`` + ``part`` tiles (elementwise over numpy arrays);
        0 where it has no query or no key row."""
        if backward:
            cf, cpart, launch = self.bwd_full_tile_ms, self.bwd_part_tile_ms, self.bwd_launch_ms
        else:
            cf, cpart, launch = self.fwd_full_tile_ms, self.fwd_part_tile_ms, self.fwd_launch_ms
        nq, nk = np.asarray(nq, np.float64), np.asarray(nk, np.float64)
        tiles = np.maximum(np.multiply(full, cf) + np.multiply(part, cpart), self.underfill_tiles * cf)
        t = launch + tiles + self.stage_row_ms * (nq + nk)
        return t * ((nq > 0) & (nk > 0))

    def transfer_ms(self, nbytes):
        """One all-to-all moving ``nbytes`` through the rank's busier direction."""
        return self.comm_latency_ms + self.comm_ms_per_byte * np.asarray(nbytes, np.float64)


@functools.lru_cache(maxsize=1)
def default_cost_model() -> CostModel:
    """The GPU profile when CUDA is available, else the shipped CPU profile (same on every rank of
    a job, so plans stay identical across ranks). Read once per process."""
    import torch

    return CostModel.gpu() if torch.cuda.is_available() else CostModel.cpu()


@dataclass(frozen=True)
class RankLoads:
    """What each rank computes and moves under one ownership (input of the simulator).

    rows [cp]            owned rows (token-local work, query rows of every stage)
    local_pairs [cp]     visible pairs of the local stage
    wave_rows [cp, W]    remote K/V rows received in each wave
    wave_pairs [cp, W]   visible pairs of each remote stage
    send_rows [cp, W]    rows of the rank's K/V sent to others in each wave
    local_tiles [cp, 2]  (full, partial) tiles of the local stage
    wave_tiles [cp, W, 2]  (full, partial) tiles of each remote stage
    sel_keys [cp]        DSA only: sum over the rank's query rows of ``min(topk, visible keys)``
    """

    rows: np.ndarray
    local_pairs: np.ndarray
    wave_rows: np.ndarray
    wave_pairs: np.ndarray
    send_rows: np.ndarray
    local_tiles: np.ndarray
    wave_tiles: np.ndarray
    sel_keys: np.ndarray | None = None

    @property
    def cp_size(self) -> int:
        return int(self.rows.shape[0])

    @property
    def num_waves(self) -> int:
        return int(self.wave_rows.shape[1])

    @property
    def query_pairs(self) -> np.ndarray:
        """[cp] all visible pairs of the rank's queries (model-neutral attention work)."""
        return self.local_pairs + self.wave_pairs.sum(1)


@dataclass(frozen=True)
class RankTimes:
    """Predicted ms per rank: token-local and attention, forward and backward; ``total`` [cp]."""

    tok_fwd: np.ndarray
    attn_fwd: np.ndarray
    tok_bwd: np.ndarray
    attn_bwd: np.ndarray
    layers: int = 1

    @property
    def total(self) -> np.ndarray:
        return (self.tok_fwd + self.attn_fwd + self.tok_bwd + self.attn_bwd) * self.layers


def _dsa_times(cm: CostModel, loads: RankLoads, staged) -> RankTimes:
    """The DSA model (module doc) on top of ``staged`` (`simulate` or `simulate_reference` of the
    dense schedule), which prices the indexer stages: per-pair work as "tiles" of one pair each."""
    dsa = cm.dsa
    if loads.sel_keys is None:
        raise ValueError("a DSA cost model needs RankLoads.sel_keys (min(topk, visible keys) summed per rank)")
    cmi = dataclasses.replace(
        cm, dsa=None, fwd_full_tile_ms=dsa.index_fwd_ms_per_pair, fwd_part_tile_ms=dsa.index_fwd_ms_per_pair,
        bwd_full_tile_ms=dsa.index_bwd_ms_per_pair, bwd_part_tile_ms=dsa.index_bwd_ms_per_pair, underfill_tiles=0.0,
        kv_bytes_per_row=dsa.cand_bytes_per_row, dkv_bytes_per_row=dsa.cand_grad_bytes_per_row, layers=1)
    zeros = np.zeros_like(loads.local_pairs, dtype=np.float64)
    pair_loads = dataclasses.replace(
        loads, local_tiles=np.stack([loads.local_pairs, zeros], -1),
        wave_tiles=np.stack([loads.wave_pairs, np.zeros_like(loads.wave_pairs, dtype=np.float64)], -1))
    f = dsa.index_layers_fraction
    sel = np.asarray(loads.sel_keys, np.float64)
    if dsa.kv_with_candidates:
        wkv = dsa.winner_kv_bytes_per_row
        idx = staged(dataclasses.replace(cmi, kv_bytes_per_row=cmi.kv_bytes_per_row + wkv,
                                         dkv_bytes_per_row=cmi.dkv_bytes_per_row + wkv), pair_loads)
        # IndexShare layers: the same stages move K|V only, no scoring
        kv_only = staged(dataclasses.replace(cmi, fwd_full_tile_ms=0.0, fwd_part_tile_ms=0.0, bwd_full_tile_ms=0.0,
                                             bwd_part_tile_ms=0.0, kv_bytes_per_row=wkv, dkv_bytes_per_row=wkv),
                         pair_loads)
        attn_f = f * idx.attn_fwd + (1 - f) * kv_only.attn_fwd + dsa.sel_fwd_ms_per_key * sel
        attn_b = dsa.sel_bwd_ms_per_key * sel + f * idx.attn_bwd + (1 - f) * kv_only.attn_bwd
        return RankTimes(idx.tok_fwd, attn_f, idx.tok_bwd, attn_b, cm.layers)
    idx = staged(cmi, pair_loads)
    if loads.cp_size > 1:
        # remote winners: at most the rank's remote rows and at most its selected keys (upper bound)
        win = np.minimum(loads.wave_rows.sum(1), sel) * dsa.winner_kv_bytes_per_row
        x_f = 3 * cm.comm_latency_ms + cm.comm_ms_per_byte * win
        x_b = cm.comm_latency_ms + cm.comm_ms_per_byte * win
    else:
        x_f = x_b = np.zeros_like(sel)
    attn_f = f * idx.attn_fwd + x_f + dsa.sel_fwd_ms_per_key * sel
    attn_b = x_b + dsa.sel_bwd_ms_per_key * sel + f * idx.attn_bwd
    return RankTimes(idx.tok_fwd, attn_f, idx.tok_bwd, attn_b, cm.layers)


def simulate(cm: CostModel, loads: RankLoads) -> RankTimes:
    """Per-rank times of the staged schedule (module doc), vectorised over ranks."""
    if cm.dsa is not None:
        return _dsa_times(cm, loads, simulate)
    cp, W = loads.cp_size, loads.num_waves
    rows = loads.rows.astype(np.float64)
    a = cm.overlap
    tok_f, tok_b = rows * cm.tok_fwd_ms_per_row, rows * cm.tok_bwd_ms_per_row
    lt, wt = loads.local_tiles, loads.wave_tiles
    local_f = cm.stage_ms(lt[:, 0], lt[:, 1], rows, rows, backward=False)
    local_b = cm.stage_ms(lt[:, 0], lt[:, 1], rows, rows, backward=True)
    if cp == 1:
        return RankTimes(tok_f, local_f, tok_b, local_b, cm.layers)
    busy = np.maximum(loads.wave_rows, loads.send_rows)
    moves = loads.wave_rows.sum(0) > 0  # [W] a wave that moves no row on any rank is skipped by all
    x_kv = np.where(moves, cm.transfer_ms(busy * cm.kv_bytes_per_row), 0.0)  # [cp, W]
    x_dkv = np.where(moves, cm.transfer_ms(busy * cm.dkv_bytes_per_row), 0.0)
    rf = (cm.stage_ms(wt[..., 0], wt[..., 1], rows[:, None], loads.wave_rows, backward=False)
          + np.where(loads.wave_rows > 0, cm.merge_fwd_ms_per_row * rows[:, None], 0.0))
    rb = (cm.stage_ms(wt[..., 0], wt[..., 1], rows[:, None], loads.wave_rows, backward=True)
          + np.where(loads.wave_rows > 0, cm.merge_bwd_ms_per_row * rows[:, None], 0.0))
    # forward: local stage while wave 0 arrives; wave w+1 is fetched while wave w computes
    t = local_f.copy()
    ready = x_kv[:, 0].copy()
    for w in range(W):
        start = np.maximum(t + (1 - a) * x_kv[:, w], ready)
        if w + 1 < W:
            ready = start + x_kv[:, w + 1]
        t = start + rf[:, w]
    attn_f = t
    # backward: remote waves (refetched K/V), each returning dK/dV under the next one, then local
    x_b = x_kv if cm.bwd_refetch else np.zeros_like(x_kv)
    t = np.zeros(cp)
    ready = x_b[:, 0].copy()
    returned = np.zeros(cp)
    for w in range(W):
        start = np.maximum(t + (1 - a) * x_b[:, w], ready)
        if w + 1 < W:
            ready = start + x_b[:, w + 1]
        t = start + rb[:, w]
        returned = np.maximum(returned, t + x_dkv[:, w])
        t = t + (1 - a) * x_dkv[:, w]
    attn_b = np.maximum(t + local_b, returned)
    return RankTimes(tok_f, attn_f, tok_b, attn_b, cm.layers)


def simulate_reference(cm: CostModel, loads: RankLoads) -> RankTimes:
    """`simulate` written as plain per-rank, per-wave loops over Python floats (test oracle)."""
    if cm.dsa is not None:
        return _dsa_times(cm, loads, simulate_reference)
    cp, W = loads.cp_size, loads.num_waves
    out = {k: [] for k in ("tok_fwd", "attn_fwd", "tok_bwd", "attn_bwd")}

    def stage(tiles, nq, nk, backward):
        if nq <= 0 or nk <= 0:
            return 0.0
        if backward:
            cf, cpart, launch = cm.bwd_full_tile_ms, cm.bwd_part_tile_ms, cm.bwd_launch_ms
        else:
            cf, cpart, launch = cm.fwd_full_tile_ms, cm.fwd_part_tile_ms, cm.fwd_launch_ms
        work = max(float(tiles[0]) * cf + float(tiles[1]) * cpart, cm.underfill_tiles * cf)
        return launch + work + cm.stage_row_ms * (nq + nk)

    for r in range(cp):
        n = float(loads.rows[r])
        out["tok_fwd"].append(n * cm.tok_fwd_ms_per_row)
        out["tok_bwd"].append(n * cm.tok_bwd_ms_per_row)
        lf = stage(loads.local_tiles[r], n, n, False)
        lb = stage(loads.local_tiles[r], n, n, True)
        if cp == 1:
            out["attn_fwd"].append(lf)
            out["attn_bwd"].append(lb)
            continue
        xs, xd, fwd_stage, bwd_stage = [], [], [], []
        for w in range(W):
            busy = max(float(loads.wave_rows[r, w]), float(loads.send_rows[r, w]))
            if sum(float(loads.wave_rows[s, w]) for s in range(cp)) > 0:
                xs.append(cm.comm_latency_ms + cm.comm_ms_per_byte * busy * cm.kv_bytes_per_row)
                xd.append(cm.comm_latency_ms + cm.comm_ms_per_byte * busy * cm.dkv_bytes_per_row)
            else:  # no rank moves a row in this wave: every rank skips its collective
                xs.append(0.0)
                xd.append(0.0)
            has = loads.wave_rows[r, w] > 0
            fwd_stage.append(stage(loads.wave_tiles[r, w], n, loads.wave_rows[r, w], False)
                             + (cm.merge_fwd_ms_per_row * n if has else 0.0))
            bwd_stage.append(stage(loads.wave_tiles[r, w], n, loads.wave_rows[r, w], True)
                             + (cm.merge_bwd_ms_per_row * n if has else 0.0))
        # forward
        clock, arrival = lf, xs[0]
        for w in range(W):
            begin = max(clock + (1 - cm.overlap) * xs[w], arrival)
            if w + 1 < W:
                arrival = begin + xs[w + 1]
            clock = begin + fwd_stage[w]
        out["attn_fwd"].append(clock)
        # backward
        fetch = xs if cm.bwd_refetch else [0.0] * W
        clock, arrival, last_return = 0.0, fetch[0], 0.0
        for w in range(W):
            begin = max(clock + (1 - cm.overlap) * fetch[w], arrival)
            if w + 1 < W:
                arrival = begin + fetch[w + 1]
            clock = begin + bwd_stage[w]
            last_return = max(last_return, clock + xd[w])
            clock += (1 - cm.overlap) * xd[w]
        out["attn_bwd"].append(max(clock + lb, last_return))
    return RankTimes(*(np.array(out[k]) for k in ("tok_fwd", "attn_fwd", "tok_bwd", "attn_bwd")), cm.layers)
