"""`megatron-tree` command line (also `python -m megatron_tree`)."""
from __future__ import annotations

import argparse
import sys


def _load_samples(args):
    from .data.io import read_jsonl
    from .data.synthetic import make_preset

    if args.data:
        return read_jsonl(args.data), args.data
    return make_preset(args.preset, seed=args.seed, scale=args.scale), f"preset {args.preset} (seed {args.seed})"


def cmd_stats(args) -> int:
    from .data.synthetic import default_budget
    from .tree import pack, summarize

    samples, what = _load_samples(args)
    budget = args.max_tokens_per_mb or default_budget(samples)
    mbs = pack(samples, budget, pad_to_multiple_of=args.pad_to_multiple_of)
    tot = summarize(mbs)
    saved = 1 - tot["tree_attention_pairs"] / max(tot["flat_attention_pairs"], 1)
    rows = [
        ("source", what),
        ("samples", f"{tot['num_samples']:,}"),
        ("flat tokens", f"{tot['flat_tokens']:,}"),
        ("tree tokens", f"{tot['tree_tokens']:,}"),
        ("tree_token_ratio (flat/tree)", f"{tot['tree_token_ratio']:.3f}"),
        ("max tokens per microbatch", f"{budget:,}"),
        ("microbatches", f"{tot['num_microbatches']}"),
        ("trees / segments", f"{tot['num_trees']} / {tot['num_segments']}"),
        ("fill (tree rows / budget)", f"{tot['fill']:.1%}"),
        ("padding rows", f"{tot['padding_tokens']:,}"),
        ("attention pairs flat", f"{tot['flat_attention_pairs']:,}"),
        ("attention pairs tree", f"{tot['tree_attention_pairs']:,}"),
        ("attention pairs saved", f"{saved:.1%} ({tot['attention_pair_ratio']:.2f}x fewer)"),
        ("loss targets", f"{tot['num_targets']:,}"),
    ]
    w = max(len(k) for k, _ in rows)
    print("megatron-tree sharing report")
    print("-" * (w + 24))
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    if args.plot:
        from .viz import plot_microbatch_tree

        big = max(mbs, key=lambda m: m.stats.flat_tokens)
        plot_microbatch_tree(big, args.plot)
        print(f"tree plot of the largest microbatch written to {args.plot}")
    return 0


def cmd_demo(args) -> int:
    """The README's first command: the sharing report of a GRPO preset, with a tree plot."""
    import os

    os.makedirs("runs", exist_ok=True)
    ns = argparse.Namespace(data=None, preset="varied_5k_16x100", seed=0, scale=1.0, max_tokens_per_mb=None,
                            pad_to_multiple_of=1, plot=None)
    try:
        import matplotlib  # noqa: F401

        ns.plot = os.path.join("runs", "demo_tree.png")
    except ImportError:
        pass
    return cmd_stats(ns)


def build_parser() -> argparse.ArgumentParser:
    from .data.synthetic import PRESETS

    p = argparse.ArgumentParser(prog="megatron-tree", description="Prefix-tree training for Megatron-Core")
    sub = p.add_subparsers(dest="command", required=True)
    st = sub.add_parser("stats", help="pack samples and print the sharing report")
    src = st.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", choices=PRESETS)
    src.add_argument("--data", help="JSONL file, one sample per line")
    st.add_argument("--max-tokens-per-mb", type=int, default=None,
                    help="row budget per microbatch (default: power of two >= longest sample, >= 4096)")
    st.add_argument("--pad-to-multiple-of", type=int, default=1)
    st.add_argument("--seed", type=int, default=0)
    st.add_argument("--scale", type=float, default=1.0, help="shrink preset lengths by this factor")
    st.add_argument("--plot", default=None, help="write a PNG of the largest microbatch's tree")
    st.set_defaults(func=cmd_stats)
    dm = sub.add_parser("demo", help="the CPU demo (README's first command)")
    dm.set_defaults(func=cmd_demo)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"megatron-tree: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
