"""``megatron-tree demo``: train a tiny hybrid model on prefix trees on CPU, and measure the gain.

On two gloo ranks (data parallel 2), in one set of processes:

1. tree run: `trainer.train` for ``steps`` optimizer steps of a small hybrid stack (Mamba-2, Gated
   DeltaNet, attention, MLP and MoE layers) on a scaled-down synthetic GRPO preset, packed into
   prefix trees. Its loss curve is the demo's first result.
2. flat run: the same model from the same initial weights, same data, same microbatch budget, for
   ``flat_steps`` steps with flat packing (every sample its own chain: what packing without prefix
   sharing trains). Its losses equal the tree run's on the same steps (tree training is exact) to
   within `TREE_FLAT_LOSS_RTOL`; its useful tokens/s is the baseline.

Throughput is "useful tokens/s": per-sample (flat-equivalent) tokens trained per second, the
median over each run's steps after the first (warm-up). The ideal gain is the tree_token_ratio
(flat tokens / tree rows): what tree packing would gain if time were proportional to rows.
Outputs ``OUT/demo.png`` (loss vs step; throughput tree vs flat) and ``OUT/metrics.json``.
"""
from __future__ import annotations

import json
import os
import time
from typing import Optional

import numpy as np

DEMO_PATTERN = "MG*-*E"  # Mamba-2, GDN, attention, MLP, attention, MoE
# Tree and flat runs sum the same float32 terms in different orders (and GPU kernels chunk a tree
# differently from a chain): ~1e-7 apart on CPU. A real tree bug moves the loss by far more.
TREE_FLAT_LOSS_RTOL = 1e-4


def demo_train_argv(out_dir: str, *, steps: int, preset: str, scale: float, loss: str, pattern: str,
                    packing: str = "tree", seed: int = 1234, budget: int = 1024) -> list[str]:
    """``megatron-tree train`` arguments of the demo (printed, so a user can rerun it)."""
    return ["--synthetic-preset", preset, "--synthetic-scale", str(scale), "--vocab-size", "256",
            "--hybrid-override-pattern", pattern, "--num-experts", "4", "--hidden-size", "64",
            "--num-attention-heads", "4", "--num-query-groups", "2", "--ffn-hidden-size", "128",
            "--train-iters", str(steps), "--lr", "1e-2", "--min-lr", "1e-4", "--lr-warmup-iters", "3",
            "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.0", "--seed", str(seed),
            "--tree-global-batch-samples", "32", "--tree-max-tokens-per-mb", str(budget), "--tree-loss", loss,
            "--tree-lookahead", "1", "--packing", packing, "--nproc", "2", "--log-interval", "5",
            "--tensorboard-dir", os.path.join(out_dir, "tb", packing)]


def _demo_body(tree_args, flat_args) -> tuple:
    from .trainer import _quiet_warnings, train

    _quiet_warnings()
    tree = train(tree_args)
    flat = train(flat_args)
    return tree, flat


def _throughput(history: list, key: str = "useful_tokens_per_s", how=np.median) -> float:
    """Median (or ``how``) of a per-step rate over the steps after the first (warm-up)."""
    vals = [m[key] for m in history[1:]] or [m[key] for m in history]
    return float(how(vals))


def summarize(tree: dict, flat: dict) -> dict:
    """The demo's figures from the two `train` results."""
    th, fh = tree["history"], flat["history"]
    tree_tps, flat_tps = _throughput(th), _throughput(fh)
    ideal = tree["tree_token_ratio"]
    gain = tree_tps / max(flat_tps, 1e-12)
    step_s = sum(m["step_s"] for m in th)
    wait_s = sum(m["data_wait_frac"] * m["step_s"] for m in th)
    same = min(len(th), len(fh))
    loss_diff = max(abs(th[i]["loss"] - fh[i]["loss"]) / max(abs(fh[i]["loss"]), 1e-12) for i in range(same))
    return {
        "loss_first": th[0]["loss"], "loss_last": th[-1]["loss"],
        "useful_tokens_per_s_tree": tree_tps, "useful_tokens_per_s_flat": flat_tps,
        "rows_per_s_tree": _throughput(th, "rows_per_s"), "rows_per_s_flat": _throughput(fh, "rows_per_s"),
        "samples_per_s_tree": _throughput(th, "samples_per_s"), "samples_per_s_flat": _throughput(fh, "samples_per_s"),
        # best steps: the least disturbed by other processes on a shared machine
        "useful_tokens_per_s_tree_best": _throughput(th, how=np.max),
        "useful_tokens_per_s_flat_best": _throughput(fh, how=np.max),
        "gain_best": _throughput(th, how=np.max) / max(_throughput(fh, how=np.max), 1e-12),
        "gain": gain, "ideal_gain": ideal, "gain_over_ideal": gain / ideal,
        "data_wait_frac": wait_s / max(step_s, 1e-12), "tree_flat_loss_max_rel_diff": loss_diff,
        "tree_flat_loss_rtol": TREE_FLAT_LOSS_RTOL, "tree_flat_loss_agree": loss_diff <= TREE_FLAT_LOSS_RTOL,
        "planner_imbalance_mean": float(np.mean([m["planner_imbalance"] for m in th])),
    }


def format_summary(s: dict, tree: dict, flat: dict, *, loss: str) -> str:
    th = tree["history"]
    pick = sorted({0, len(th) // 4, len(th) // 2, 3 * len(th) // 4, len(th) - 1})
    lines = ["", f"megatron-tree demo: loss = {loss} ({len(th)} steps, DP{tree['dp_size']} on CPU)",
             f"{'step':>6} {'loss':>9} {'lr':>10} {'grad norm':>10}"]
    for i in pick:
        m = th[i]
        gn = "-" if m["grad_norm"] is None else f"{m['grad_norm']:.3f}"
        lines.append(f"{m['step']:>6} {m['loss']:>9.4f} {m['lr']:>10.2e} {gn:>10}")
    lines += [
        f"loss: {s['loss_first']:.4f} (first step) -> {s['loss_last']:.4f} (last step)",
        f"tree vs flat loss on the same {len(flat['history'])} steps: max rel. diff {s['tree_flat_loss_max_rel_diff']:.1e}"
        + (f" (tree training is exact: within {s['tree_flat_loss_rtol']:.0e})" if s["tree_flat_loss_agree"] else
           f" EXCEEDS the tolerance {s['tree_flat_loss_rtol']:.0e}: tree training differs from flat training"),
        f"useful tokens/s: tree {s['useful_tokens_per_s_tree']:,.0f} vs flat {s['useful_tokens_per_s_flat']:,.0f} "
        f"-> gain {s['gain']:.2f}x; ideal (tree_token_ratio) {s['ideal_gain']:.2f}x; "
        f"gain/ideal {s['gain_over_ideal']:.0%}  (medians over steps 2..; best steps: "
        f"{s['useful_tokens_per_s_tree_best']:,.0f} vs {s['useful_tokens_per_s_flat_best']:,.0f}, {s['gain_best']:.2f}x)",
        f"samples/s: tree {s['samples_per_s_tree']:,.1f} vs flat {s['samples_per_s_flat']:,.1f}; "
        f"rows/s: tree {s['rows_per_s_tree']:,.0f} vs flat {s['rows_per_s_flat']:,.0f}",
        f"data wait: {s['data_wait_frac']:.1%} of step time (packing runs ahead in a background thread); "
        f"planner imbalance (max/mean predicted rank cost) {s['planner_imbalance_mean']:.3f}",
    ]
    return "\n".join(lines)


def plot_demo(tree: dict, flat: dict, s: dict, path: str) -> Optional[str]:
    """Loss vs step and throughput tree vs flat, as a PNG (None if matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    th, fh = tree["history"], flat["history"]
    a.plot([m["step"] for m in th], [m["loss"] for m in th], "-o", ms=3, label="tree packing")
    a.plot([m["step"] for m in fh], [m["loss"] for m in fh], "x", ms=8, color="C3", label="flat packing (same steps)")
    a.set_xlabel("step")
    a.set_ylabel("loss")
    a.set_title("training loss")
    a.legend()
    a.grid(alpha=0.3)
    vals = [s["useful_tokens_per_s_flat"], s["useful_tokens_per_s_tree"], s["useful_tokens_per_s_flat"] * s["ideal_gain"]]
    bars = b.bar(["flat", "tree", "ideal\n(flat x ratio)"], vals, color=["C3", "C0", "lightgray"])
    for r, v in zip(bars, vals):
        b.text(r.get_x() + r.get_width() / 2, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=9)
    b.set_ylabel("useful tokens / s")
    b.set_title(f"throughput: gain {s['gain']:.1f}x of ideal {s['ideal_gain']:.1f}x")
    b.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_demo(out_dir: str = "runs/demo", steps: int = 40, flat_steps: int = 5, *,
             preset: str = "varied_5k_16x100", scale: float = 0.2, loss: str = "sft",
             pattern: str = DEMO_PATTERN, budget: int = 2048, timeout: float = 900.0, verbose: bool = True) -> dict:
    """Run the demo (module docstring); returns the figures (`summarize`) plus output paths.

    ``loss`` "sft" by default: on the presets' random completions GRPO's surrogate has no trend to
    show, while SFT's falls clearly as the tiny model memorises them."""
    from .launch import run_distributed
    from .trainer import build_train_parser, check_train_args, load_train_samples

    os.makedirs(out_dir, exist_ok=True)
    parser = build_train_parser()
    tree_argv = demo_train_argv(out_dir, steps=steps, preset=preset, scale=scale, loss=loss, pattern=pattern,
                                budget=budget)
    flat_argv = demo_train_argv(out_dir, steps=flat_steps, preset=preset, scale=scale, loss=loss, pattern=pattern,
                                packing="flat", budget=budget)
    tree_args, flat_args = parser.parse_args(tree_argv), parser.parse_args(flat_argv)
    flat_args.quiet = not verbose
    tree_args.quiet = not verbose
    # the flat run must follow the tree run's schedule on its steps, so the losses are comparable
    flat_args.train_iters, flat_args.exit_interval = steps, flat_steps
    for a in (tree_args, flat_args):
        check_train_args(a, load_train_samples(a))
    if verbose:
        print(f"megatron-tree demo: a {len(pattern)}-layer hybrid model ({pattern}: Mamba-2, GDN, attention, MLP, MoE) "
              f"on {preset} x{scale}, 2 CPU ranks (DP2), loss {loss}\n"
              f"  tree run:  megatron-tree train {' '.join(tree_argv)}\n"
              f"  flat run:  the same with --packing flat, {flat_steps} steps\n", flush=True)
    t0 = time.perf_counter()
    tree, flat = run_distributed(_demo_body, 2, tree_args, flat_args, timeout=timeout)[0]
    s = summarize(tree, flat)
    s["wall_s"] = time.perf_counter() - t0
    s["loss"] = loss
    png = plot_demo(tree, flat, s, os.path.join(out_dir, "demo.png"))
    out = {"summary": s, "tree": tree, "flat": flat, "png": png, "argv": tree_argv}
    with open(os.path.join(out_dir, "metrics.json"), "w") as f:
        json.dump(out, f, indent=1)
    if verbose:
        print(format_summary(s, tree, flat, loss=loss))
        print(f"wrote {png or '(no PNG: matplotlib missing)'} and {os.path.join(out_dir, 'metrics.json')} "
              f"({s['wall_s']:.0f} s)")
    return out
