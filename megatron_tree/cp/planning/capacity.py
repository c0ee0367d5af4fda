"""Dry-run capacity planning: what one microbatch looks like at each CP size, for each strategy.

Pure planning and report formatting on a `TreeLayout` (reading presets or data files is the job of
`megatron_tree.training.plan`, behind ``megatron-tree plan``). Per CP size and strategy:
rows per rank, predicted ms per rank (max / mean) and imbalance, the model-neutral balance
(visible pairs and rows per rank), remote K/V rows and bytes moved, the peak of remote K/V rows
held at once, the wave count, the predicted slowest rank against the ideal (one rank's time / CP)
and the planning time. `plot_plan` draws the ownership over the tree and the chunk pair matrix W.
`recurrent_report` / `format_recurrent` add the recurrent layers' exchange per CP size: a Gated
DeltaNet layer in summary mode under the attention plan, in summary mode under the GDN layout
island (`gdn_layout.plan_gdn_layout`, with the island-boundary redistribution), in heads mode, and a
Mamba-2 layer's head all-to-all.
"""
from __future__ import annotations

import numpy as np

from .cost_model import CostModel, default_cost_model
from .pairs import chunk_grid, layout_arrays, visible_pairs
from .plan import CPPlan
from .planner import STRATEGIES, plan_context_parallel

__all__ = ["capacity_report", "format_capacity", "plot_plan", "MIB", "recurrent_report", "format_recurrent",
           "MAMBA_DEFAULT"]

MAMBA_DEFAULT = (64, 64, 8, 128)  # Nemotron-Nano-like Mamba-2 layer of one TP rank: heads, head dim, groups, state

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


def recurrent_report(layout, attention_plans, *, heads=None, mamba=MAMBA_DEFAULT, cost=None,
                     hidden_size: int | None = None, gdn_layers: int = 3, act_bytes: int = 2,
                     state_bytes: int = 4) -> list[dict]:
    """Bytes and predicted time of one recurrent layer (forward; backward moves the same back) per
    attention plan (one per CP size > 1, in order).

    heads     `GDNHeads` of one TP rank (default `gdn_layout.DEFAULT_HEADS`, Qwen3-Next-like)
    mamba     (heads, head dim, groups, state) of one TP rank's Mamba-2 layer (Nemotron-Nano-like)
    cost      `GDNCostModel` (default: GPU figures with CUDA, else the CPU fit ``gdn_cost_cpu.json``)

    Keys per row: cp, gdn_attn_bytes / gdn_attn_ms (summary mode under the attention plan: halos,
    states, maps), gdn_attn_entries, gdn_attn_rounds, gdn_layout_bytes / gdn_layout_ms (summary
    mode under the GDN layout of `plan_gdn_layout` without regard to the attention plan: the
    recurrence-friendly ownership), gdn_layout_entries, gdn_layout_rounds, redistribution_bytes
    (rows whose owner differs between the two plans, both island boundaries, ``hidden_size``
    activations), redistribution_ms, gdn_heads_bytes / gdn_heads_ms (None when cp does not divide
    the value heads), island_choice (what `plan_gdn_layout` given the attention plan picks: the
    contiguous layout or the attention ownership, and the mode), mamba_bytes / mamba_ms (None when
    cp does not divide the Mamba heads). ms: predicted slowest rank.
    """
    from .gdn_layout import DEFAULT_HEADS, DEFAULT_HIDDEN, gdn_layout_figures, plan_gdn_layout
    from .gdn_plan import GDNCostModel
    from .mamba_heads import mamba_exchange_figures

    heads = heads or DEFAULT_HEADS
    cost = cost or GDNCostModel.default()
    hidden_size = hidden_size or DEFAULT_HIDDEN
    kw = dict(heads=heads, cost=cost, hidden_size=hidden_size, gdn_layers=gdn_layers, act_bytes=act_bytes,
              state_bytes=state_bytes)
    out = []
    for ap in attention_plans:
        cp = ap.cp_size
        if cp == 1:
            continue
        free = plan_gdn_layout(layout, cp, **kw)  # the GDN-optimal ownership (contiguous runs)
        f = gdn_layout_figures(layout, ap, gdn_plan=free, **kw)
        island = plan_gdn_layout(layout, cp, attention_plan=ap, **kw)
        a, lay, h = f["attention"], f["layout"], f["heads"]
        row = dict(cp=cp, gdn_attn_bytes=a["bytes"], gdn_attn_ms=1e3 * a["max_s"], gdn_attn_entries=a["entries"],
                   gdn_attn_rounds=a["rounds"], gdn_layout_bytes=lay["bytes"], gdn_layout_ms=1e3 * lay["max_s"],
                   gdn_layout_entries=lay["entries"], gdn_layout_rounds=lay["rounds"],
                   redistribution_bytes=lay["redistribution_bytes"], redistribution_ms=1e3 * lay["redistribution_s"],
                   gdn_heads_bytes=None if h is None else h["bytes"],
                   gdn_heads_ms=None if h is None else 1e3 * h["max_s"],
                   island_choice=f"{island.stats['source']}/{island.stats['mode']}",
                   mamba_bytes=None, mamba_ms=None)
        H, P, G, S = mamba
        if H % cp == 0:
            m = mamba_exchange_figures(ap, H, P, G, S)
            sent = m["forward_sent"].astype(float) * act_bytes
            recv = m["backward_sent"].astype(float) * act_bytes  # what each rank receives in forward
            row["mamba_bytes"] = float(sent.sum())
            row["mamba_ms"] = 1e3 * float(cost.seconds(0, np.maximum(sent, recv).max(), 2))
        out.append(row)
    return out


def format_recurrent(rows: list[dict], *, heads=None, mamba=MAMBA_DEFAULT, hidden_size: int | None = None,
                     gdn_layers: int = 3) -> str:
    """Fixed-width table of `recurrent_report` rows (MiB summed over ranks, ms of the slowest rank);
    lines start with ``CP<n>`` (the attention table's lines start with the bare CP size)."""
    from .gdn_layout import DEFAULT_HEADS, DEFAULT_HIDDEN

    heads = heads or DEFAULT_HEADS
    hidden_size = hidden_size or DEFAULT_HIDDEN
    lines = [f"recurrent layers, one layer's forward (backward moves the same back): GDN H={heads.num_k_heads} "
             f"HV={heads.num_v_heads} K={heads.head_k_dim} V={heads.head_v_dim} W={heads.conv_width}; Mamba-2 "
             f"H={mamba[0]} P={mamba[1]} G={mamba[2]} S={mamba[3]}; island boundary rows {hidden_size} wide, "
             f"{gdn_layers} GDN layers per island",
             "GDN sum@attn = summary mode under the attention plan; sum@layout = under the GDN layout island "
             "(+ redistribution in and out of the island); heads = head all-to-all; island = plan_gdn_layout's "
             "choice given the attention plan"]
    head = (f"{'CP':>4}  {'GDN sum@attn MiB':>16} {'ms':>8} {'entr':>5} {'rnds':>4}  {'sum@layout MiB':>14} "
            f"{'ms':>8} {'entr':>5} {'rnds':>4}  {'redistr MiB':>11} {'ms':>8}  {'heads MiB':>9} {'ms':>8}  "
            f"{'island':>18}  {'Mamba a2a MiB':>13} {'ms':>8}")
    lines += [head, "-" * len(head)]
    opt = lambda v, fmt: f"{'-':>{fmt[0]}}" if v is None else f"{v:>{fmt[0]}.{fmt[1]}f}"  # noqa: E731
    for r in rows:
        lines.append(
            f"{'CP' + str(r['cp']):>4}  {r['gdn_attn_bytes'] / MIB:>16.1f} {r['gdn_attn_ms']:>8.3f} {r['gdn_attn_entries']:>5} "
            f"{r['gdn_attn_rounds']:>4}  {r['gdn_layout_bytes'] / MIB:>14.1f} {r['gdn_layout_ms']:>8.3f} "
            f"{r['gdn_layout_entries']:>5} {r['gdn_layout_rounds']:>4}  {r['redistribution_bytes'] / MIB:>11.1f} "
            f"{r['redistribution_ms']:>8.3f}  "
            f"{opt(None if r['gdn_heads_bytes'] is None else r['gdn_heads_bytes'] / MIB, (9, 1))} "
            f"{opt(r['gdn_heads_ms'], (8, 3))}  {r['island_choice']:>18}  "
            f"{opt(None if r['mamba_bytes'] is None else r['mamba_bytes'] / MIB, (13, 1))} {opt(r['mamba_ms'], (8, 3))}")
    return "\n".join(lines)
