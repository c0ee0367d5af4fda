"""CP planner benchmark for a DSA model (DeepSeek Sparse Attention, `cp.tree_dsa_cp`).

Same microbatches as `tools/bench_cp.py` (weak scaling over the synthetic presets, plus the two
chains), planned with ``plan_context_parallel(..., dsa=DSAWork(...))``: the cost model prices the
indexer per visible pair (full-index layers), the fixed selected-key work ``min(topk, visible)`` per
query (every layer) and the candidate / winner bytes (`cp.cost_model` module doc).

Reported per (preset, CP): predicted imbalance (max / mean rank time) of the balanced plan and of
the zigzag / contiguous folds under the same DSA model; the balance of the selected-key work and of
the visible pairs; and the bytes one DSA layer moves under the balanced plan (summed over ranks):
candidate rows of the stages (index keys, plus main keys with ``--loss dense``), the winners' K|V
upper bound ``min(remote rows, selected keys)`` per rank, against what dense attention of the same
model would fetch on that plan (every visible remote K|V row). ``--measure-rows N``: for layouts
of at most N rows also the *measured* remote winners of random indexer inputs (single-device
`ops.tree_dsa_topk`, counted per rank as `tree_dsa_cp` fetches them).

    .venv/bin/python tools/bench_cp_dsa.py                         # GPU profile, CP 2..32, topk 2048
    .venv/bin/python tools/bench_cp_dsa.py --cp 2,8 --presets chain_100k --loss dense
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_tree.cp import CostModel, plan_context_parallel  # noqa: E402
from megatron_tree.cp.planning.cost_model import DSAWork  # noqa: E402
from megatron_tree.cp.planning.planner import evaluate_plan  # noqa: E402
from megatron_tree.data.synthetic import PRESETS  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cp import CHAINS, weak_layout  # noqa: E402

GOAL_IMBALANCE = 1.05


def dsa_work(topk: int, fraction: float, loss: str) -> DSAWork:
    """The default DSAWork (DeepSeek-V3.2-like, see its docstring) for the chosen indexer loss.

    ``loss="dense"``: the loss's passes also score every visible pair against the main heads
    (128 heads x 576 dims, ~150 kFLOP per pair at ~400 TFLOP/s, two passes) and fetch main keys
    (576 bf16 = 1152 bytes); its backward re-scores the pairs; index-key gradients return.
    ``"sparse"``: the loss runs on the selected keys only (folded into the per-key terms).
    """
    d = DSAWork(topk=topk, index_layers_fraction=fraction)
    if loss == "dense":
        return dataclasses.replace(d, index_fwd_ms_per_pair=d.index_fwd_ms_per_pair + 7.5e-7,
                                   index_bwd_ms_per_pair=2 * d.index_fwd_ms_per_pair + 3.8e-7,
                                   cand_bytes_per_row=d.cand_bytes_per_row + 1152.0,
                                   cand_grad_bytes_per_row=d.cand_bytes_per_row)
    if loss == "sparse":
        return dataclasses.replace(d, sel_fwd_ms_per_key=1.5 * d.sel_fwd_ms_per_key,
                                   sel_bwd_ms_per_key=d.sel_bwd_ms_per_key + 0.5 * d.sel_fwd_ms_per_key,
                                   cand_grad_bytes_per_row=d.cand_bytes_per_row)
    return d


def measured_winners(layout, plan, topk: int, seed: int = 0) -> np.ndarray:
    """[cp] distinct remote rows among each rank's selected ids, random indexer inputs (one device)."""
    import torch

    from megatron_tree.ops.dsa import tree_dsa_topk

    n = layout.num_rows
    g = torch.Generator().manual_seed(seed)
    iq, w, ik = torch.randn(n, 4, 16, generator=g), torch.randn(n, 4, generator=g), torch.randn(n, 16, generator=g)
    ids = tree_dsa_topk(iq, w, ik, layout, topk)[1].numpy()
    owner = plan.owner.astype(np.int64)
    out = np.zeros(plan.cp_size)
    q_owner = np.repeat(owner[:, None], ids.shape[1], 1)
    ok = ids >= 0
    rem = ok & (owner[np.where(ok, ids, 0)] != q_owner)
    for r in range(plan.cp_size):  # loop over ranks, not rows
        out[r] = np.unique(ids[rem & (q_owner == r)]).size
    return out


def bench(presets, cps, rows_per_rank: int, cm: CostModel, dsa: DSAWork, measure_rows: int) -> list[dict]:
    out = []
    for name in presets:
        for cp in cps:
            layout, how = weak_layout(name, cp, rows_per_rank)
            plans = {s: plan_context_parallel(layout, cp, strategy=s, cost_model=cm, dsa=dsa)
                     for s in ("balanced", "zigzag", "contiguous")}
            b = plans["balanced"]
            s = b.stats
            _, loads = evaluate_plan(layout, b, cost_model=cm, dsa=dsa)
            remote = loads.wave_rows.sum(1)
            sel = np.asarray(loads.sel_keys, np.float64)
            win_bound = np.minimum(remote, sel)
            row = dict(
                preset=name, cp=cp, rows=layout.num_rows, built=how,
                imb_balanced=b.imbalance, imb_zigzag=plans["zigzag"].imbalance,
                imb_contiguous=plans["contiguous"].imbalance, sel_balance=s["dsa_selected_balance"],
                pair_balance=s["pair_balance"], row_balance=s["row_balance"], waves=b.num_waves,
                fallback=s["fallback"], planning_ms=s["planning_ms"],
                cand_mib=float(remote.sum()) * dsa.cand_bytes_per_row / 2**20,
                winners_bound_mib=float(win_bound.sum()) * dsa.winner_kv_bytes_per_row / 2**20,
                dense_kv_mib=float(remote.sum()) * dsa.winner_kv_bytes_per_row / 2**20,
                winners_measured_mib=None)
            if layout.num_rows <= measure_rows:
                row["winners_measured_mib"] = float(measured_winners(layout, b, dsa.topk).sum()) \
                    * dsa.winner_kv_bytes_per_row / 2**20
            out.append(row)
            print(f"  {name} CP{cp}: {row['rows']:,} rows, imbalance {row['imb_balanced']:.3f} (zigzag "
                  f"{row['imb_zigzag']:.3f}, contiguous {row['imb_contiguous']:.3f}), plan {row['planning_ms']:.0f} ms",
                  file=sys.stderr, flush=True)
    return out


def table(rows, cm: CostModel, dsa: DSAWork, rows_per_rank: int, loss: str) -> str:
    def mib(x):
        return "-" if x is None else f"{x:,.1f}"

    lines = [f"cost model: {cm.name} + DSA (topk {dsa.topk}, index layers {dsa.index_layers_fraction:g}, "
             f"indexer loss: {loss}, kv_fetch: {'stages' if dsa.kv_with_candidates else 'winners'}); weak scaling at ~{rows_per_rank:,} rows per rank; bytes per DSA layer, all "
             f"ranks (candidate row {dsa.cand_bytes_per_row:g} B, K|V row {dsa.winner_kv_bytes_per_row:g} B)", "",
             "| preset | CP | rows | imb balanced | imb zigzag | imb contig | sel-keys bal | pairs bal | rows bal | "
             "candidates MiB | winners MiB (bound) | winners MiB (measured) | dense KV MiB | (cand + winners) / dense |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if dsa.kv_with_candidates:  # kv_fetch="stages": every visible remote row's K|V moves
            moved = r["cand_mib"] + r["dense_kv_mib"]
        else:
            moved = r["cand_mib"] + (r["winners_measured_mib"] if r["winners_measured_mib"] is not None
                                     else r["winners_bound_mib"])
        ratio = moved / r["dense_kv_mib"] if r["dense_kv_mib"] > 0 else float("nan")
        lines.append(f"| {r['preset']} | {r['cp']} | {r['rows']:,} | {r['imb_balanced']:.3f} | {r['imb_zigzag']:.3f} | "
                     f"{r['imb_contiguous']:.3f} | {r['sel_balance']:.3f} | {r['pair_balance']:.3f} | "
                     f"{r['row_balance']:.3f} | {mib(r['cand_mib'])} | {mib(r['winners_bound_mib'])} | "
                     f"{mib(r['winners_measured_mib'])} | {mib(r['dense_kv_mib'])} | {ratio:.3f} |")
    n = len(rows)
    met = sum(1 for r in rows if r["imb_balanced"] <= GOAL_IMBALANCE)
    lines += ["", f"goal: balanced imbalance <= {GOAL_IMBALANCE}: {met}/{n} "
              f"(worst {max(r['imb_balanced'] for r in rows):.3f})",
              "(cand + winners) / dense: kv_fetch=winners uses the measured winners where measured, else the bound; "
              "kv_fetch=stages moves candidates + dense K|V"]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default=",".join(PRESETS + CHAINS))
    ap.add_argument("--cp", default="2,4,8,16,32")
    ap.add_argument("--rows-per-rank", type=int, default=20480)
    ap.add_argument("--cost-model", default="gpu", help="gpu, cpu or a calibrated JSON")
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--index-fraction", type=float, default=1.0, help="share of DSA layers with their own indexer")
    ap.add_argument("--loss", choices=("none", "sparse", "dense"), default="none", help="indexer loss trained")
    ap.add_argument("--kv-fetch", choices=("winners", "stages"), default="winners",
                    help="tree_dsa_cp's kv_fetch: winners' K|V after the top-k, or every stage row's with the candidates")
    ap.add_argument("--measure-rows", type=int, default=0, help="measure winners on layouts up to this many rows")
    args = ap.parse_args(argv)
    presets = [p for p in args.presets.split(",") if p]
    bad = [p for p in presets if p not in PRESETS + CHAINS]
    if bad:
        ap.error(f"unknown preset {bad[0]!r}; choose from {', '.join(PRESETS + CHAINS)}")
    if args.cost_model == "gpu":
        cm = CostModel.gpu()
    elif args.cost_model == "cpu":
        cm = CostModel.cpu()
    else:
        cm = CostModel.from_json(args.cost_model)
    dsa = dataclasses.replace(dsa_work(args.topk, args.index_fraction, args.loss),
                              kv_with_candidates=args.kv_fetch == "stages")
    t0 = time.perf_counter()
    rows = bench(presets, [int(x) for x in args.cp.split(",")], args.rows_per_rank, cm, dsa, args.measure_rows)
    print(table(rows, cm, dsa, args.rows_per_rank, args.loss))
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
