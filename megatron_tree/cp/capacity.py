"""Dry-run capacity planning: what one microbatch looks like at each CP size, for each strategy.

Pure planning and report formatting on a `TreeLayout` (reading presets or data files is the job of
`megatron_tree.training.plan`, behind ``megatron-tree plan``). Per CP size and strategy:
rows per rank, predicted ms per rank (max / mean) and imbalance, the model-neutral balance
(visible pairs and rows per rank), remote K/V rows and bytes moved, the peak of remote K/V rows
held at once, the wave count, the predicted slowest rank against the ideal (one rank's time / CP)
and the planning time. `plot_plan` draws the ownership over the tree and the chunk pair matrix W.
"""
from __future__ import annotations

import numpy as np

from .cost_model import CostModel, default_cost_model
from .pairs import chunk_grid, layout_arrays, visible_pairs
from .plan import CPPlan
from .planner import STRATEGIES, plan_context_parallel

__all__ = ["capacity_report", "format_capacity", "plot_plan", "MIB"]

MIB = float(1 << 20)


def capacity_report(layout, cp_sizes, *, strategies=STRATEGIES, cost_model: CostModel | None = None,
                    window: int | None = None) -> list[dict]:
    """One dict per (CP size, strategy), CP sizes in the given order, strategies in order.

    Keys: cp, strategy, rows, rows_per_rank_max, rows_per_rank_mean, pred_max_ms, pred_mean_ms,
    imbalance, pair_balance, row_balance, vs_ideal (slowest rank / (one rank's time / cp)),
    remote_kv_rows, remote_kv_bytes, peak_remote_kv_rows, waves, chunks, planning_ms, hash,
    fallback; and ``plan`` (the `CPPlan`).
    """
    cm = cost_model if cost_model is not None else default_cost_model()
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown CP strategy {unknown[0]!r}; choose from {', '.join(STRATEGIES)}")
    single = float(plan_context_parallel(layout, 1, cost_model=cm, window=window).predicted_ms[0])
    out = []
    for cp in cp_sizes:
        for strategy in strategies:
            p = plan_context_parallel(layout, int(cp), strategy=strategy, cost_model=cm, window=window)
            s = p.stats
            rows = p.rows_per_rank()
            out.append(dict(
                cp=int(cp), strategy=strategy, rows=p.num_rows, rows_per_rank_max=int(rows.max()),
                rows_per_rank_mean=float(rows.mean()), pred_max_ms=float(p.predicted_ms.max()),
                pred_mean_ms=float(p.predicted_ms.mean()), imbalance=p.imbalance, pair_balance=s["pair_balance"],
                row_balance=s["row_balance"], vs_ideal=float(p.predicted_ms.max()) / (single / int(cp)),
                remote_kv_rows=s["remote_kv_rows"], remote_kv_bytes=s["remote_kv_bytes"],
                peak_remote_kv_rows=s["peak_remote_kv_rows"], waves=p.num_waves, chunks=s["num_chunks"],
                planning_ms=s["planning_ms"], hash=p.hash, fallback=s.get("fallback"), plan=p))
    return out


def format_capacity(rows: list[dict], *, title: str = "", cost_model: CostModel | None = None) -> str:
    """A fixed-width table: one line per CP size (the balanced plan's figures, with the imbalance
    of every strategy side by side), or per (CP size, strategy) when balanced was not planned."""
    cm = cost_model if cost_model is not None else default_cost_model()
    by_cp: dict = {}
    for r in rows:
        by_cp.setdefault(r["cp"], {})[r["strategy"]] = r
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    lines = []
    if title:
        lines.append(title)
    lines.append(f"cost model: {cm.name} (per attention layer with its token-local work; "
                 f"{cm.kv_bytes_per_row:.0f} K/V bytes per row)")
    head = (f"{'CP':>3}  {'plan':10}  {'rows/rank':>9}  {'max ms':>9}  {'mean ms':>9}  {'vs ideal':>8}  "
            + "  ".join(f"{'imb ' + s[:6]:>10}" for s in strategies)
            + f"  {'pairs bal':>9}  {'rows bal':>8}  {'remote KV rows':>14}  {'MiB':>8}  {'peak KV':>8}  "
              f"{'waves':>5}  {'plan ms':>7}")
    lines.append(head)
    lines.append("-" * len(head))
    for cp, per in by_cp.items():
        for name in (["balanced"] if "balanced" in per else strategies):
            r = per[name]
            imbs = "  ".join(f"{per[s]['imbalance']:>10.3f}" if s in per else f"{'-':>10}" for s in strategies)
            lines.append(
                f"{cp:>3}  {name:10}  {r['rows_per_rank_max']:>9,}  {r['pred_max_ms']:>9.2f}  {r['pred_mean_ms']:>9.2f}  "
                f"{r['vs_ideal']:>8.3f}  {imbs}  {r['pair_balance']:>9.3f}  {r['row_balance']:>8.3f}  "
                f"{r['remote_kv_rows']:>14,}  {r['remote_kv_bytes'] / MIB:>8.1f}  {r['peak_remote_kv_rows']:>8,}  "
                f"{r['waves']:>5}  {r['planning_ms']:>7.1f}")
    return "\n".join(lines)


def plot_plan(layout, plan: CPPlan, path: str, *, window: int | None = None, max_points: int = 200_000) -> str | None:
    """Ownership over the tree (each row at (physical row, depth), coloured by owner) and the pair
    matrix W between the plan's chunks (log scale, owners marked on both axes). Returns ``path``,
    or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    la = layout_arrays(layout)
    N = la.num_rows
    step = max(1, N // max_points)
    rows = np.arange(0, N, step)
    cmap = plt.get_cmap("tab20" if plan.cp_size > 10 else "tab10")
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(15, 6), gridspec_kw=dict(width_ratios=[1.6, 1]))
    ax0.scatter(rows, la.position_ids[rows], c=plan.owner[rows] % cmap.N, cmap=cmap, vmin=0, vmax=cmap.N - 1,
                s=2, linewidths=0, rasterized=True)
    ax0.set_xlabel("physical row (DFS preorder)")
    ax0.set_ylabel("depth on the root path")
    ax0.set_title(f"ownership over the tree: {plan.strategy}, CP{plan.cp_size}, imbalance {plan.imbalance:.3f}")
    grid = chunk_grid(N, plan.chunk_size, plan.chunk_starts)
    if grid.num_chunks > 1024:  # a plotted matrix of at most 1024 x 1024 chunks
        grid = chunk_grid(N, -(-N // 1024))
    W = visible_pairs(la, grid, window=window).dense().astype(np.float64)
    im = ax1.imshow(np.log10(1 + W), cmap="magma", origin="upper", aspect="auto", interpolation="nearest")
    owners = plan.owner[grid.starts]
    M = grid.num_chunks
    ax1.scatter(np.arange(M), np.full(M, -0.02 * M), c=owners % cmap.N, cmap=cmap, vmin=0, vmax=cmap.N - 1,
                marker="s", s=6, clip_on=False)
    ax1.scatter(np.full(M, -0.02 * M), np.arange(M), c=owners % cmap.N, cmap=cmap, vmin=0, vmax=cmap.N - 1,
                marker="s", s=6, clip_on=False)
    ax1.set_xlabel("key chunk")
    ax1.set_ylabel("query chunk")
    ax1.set_title(f"visible pairs W between {M} chunks (log10(1 + pairs))")
    fig.colorbar(im, ax=ax1, fraction=0.046)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
