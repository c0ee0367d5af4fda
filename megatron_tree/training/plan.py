"""``megatron-tree plan``: dry-run CP capacity planning for a preset or a data file.

    megatron-tree plan --preset dominant_14745_16x921 --cp 1,2,4,8,16,32
    megatron-tree plan --data rollouts.jsonl --cp 2,4,8 --strategy balanced,zigzag --plot plan.png

Reads the samples (a synthetic preset or JSONL / Parquet files), packs them into microbatches of
``--max-tokens-per-mb`` rows (default: the largest prefix tree, so no tree is cut), takes the
largest microbatch (the one that decides whether a CP size fits) and prints, per CP size, what
`megatron_tree.cp.planning.capacity.capacity_report` finds: rows per rank, predicted ms per rank (max /
mean), the imbalance of every strategy, the model-neutral balance, remote K/V rows and bytes, the
peak remote K/V held at once, waves and planning time; then the recurrent layers' exchange
(`megatron_tree.cp.planning.capacity.recurrent_report`: a Gated DeltaNet layer in summary mode under the
balanced attention plan, under its GDN layout island with the boundary redistribution, in heads
mode, and a Mamba-2 layer's all-to-all; shapes from ``--gdn-heads`` / ``--mamba-dims``, off with
``--no-recurrent``). ``--plot`` draws the ownership over the tree and the chunk pair matrix for the
largest CP size.

`add_plan_args(parser)` adds the options to a parser; `run_plan(argv_or_args)` runs them (an argv
list, or the parsed namespace) and returns an exit status.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

__all__ = ["add_plan_args", "run_plan", "build_plan_parser"]


def _int_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"CP sizes must be positive integers, got {text!r}")
    return out


def _strategies(text: str) -> list[str]:
    from ..cp.planning.planner import STRATEGIES

    out = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in out if x not in STRATEGIES]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"unknown strategy {bad[0] if bad else text!r}; choose from "
                                         f"{', '.join(STRATEGIES)} (comma-separated)")
    return out


def add_plan_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``megatron-tree plan``."""
    from ..data.synthetic import PRESETS

    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", choices=PRESETS, help="a synthetic workload (megatron_tree.data.synthetic)")
    src.add_argument("--data", nargs="+", metavar="FILE", help="JSONL / Parquet files or directories of samples")
    parser.add_argument("--seed", type=int, default=0, help="preset seed (default 0)")
    parser.add_argument("--scale", type=float, default=1.0, help="preset length scale (default 1.0)")
    parser.add_argument("--cp", type=_int_list, default=[1, 2, 4, 8, 16, 32], metavar="N,N,...",
                        help="CP sizes to plan (default 1,2,4,8,16,32)")
    parser.add_argument("--strategy", type=_strategies, default=["balanced", "zigzag", "contiguous"],
                        metavar="S,S,...", help="strategies to compare (default balanced,zigzag,contiguous)")
    parser.add_argument("--max-tokens-per-mb", type=int, default=None, metavar="N",
                        help="rows per microbatch (default: the largest prefix tree, so no tree is cut)")
    parser.add_argument("--window", type=int, default=None, help="sliding window (depth) of the attention layers")
    parser.add_argument("--cost-model", default=None, metavar="gpu|cpu|FILE.json",
                        help="cost model: the built-in GPU profile, the shipped CPU profile or a calibrated JSON "
                             "(tools/calibrate_cp.py); default: gpu with CUDA, else cpu")
    parser.add_argument("--plot", default=None, metavar="PNG", help="ownership and W heat map of the largest CP size")
    parser.add_argument("--no-recurrent", action="store_true", help="skip the recurrent (GDN / Mamba) exchange table")
    parser.add_argument("--gdn-heads", type=lambda t: _shape(t, 5, "--gdn-heads"), default=(16, 32, 128, 128, 4),
                        metavar="H,HV,K,V,W", help="GDN key heads, value heads, key dim, value dim, conv width of one "
                                                   "TP rank (default 16,32,128,128,4: Qwen3-Next-like)")
    parser.add_argument("--mamba-dims", type=lambda t: _shape(t, 4, "--mamba-dims"), default=(64, 64, 8, 128),
                        metavar="H,P,G,S", help="Mamba-2 heads, head dim, groups, state of one TP rank "
                                                "(default 64,64,8,128: Nemotron-Nano-like)")
    parser.add_argument("--hidden-size", type=int, default=2048, help="hidden width moved at GDN island boundaries")
    parser.add_argument("--gdn-layers-per-island", type=int, default=3, metavar="N",
                        help="consecutive GDN layers between attention layers (default 3)")
    parser.add_argument("--carry", action="store_true",
                        help="plan carry instead (pack(..., carry=True) at --max-tokens-per-mb): per microbatch and per "
                             "DP rank the rows computed, carried rows read, rows and states stored and the carry "
                             "store's bytes for --pattern / --kv / --gdn-heads / --mamba-dims")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel ranks the carry plan is spread over (default 1)")
    parser.add_argument("--carry-cut", choices=("never", "auto", "always"), default="auto",
                        help="--carry --dp N: which carry groups are cut over the ranks, their state crossing at syncs "
                             "(tree.carry.assign_carry_ranks): never, those over one rank's share of the predicted work "
                             "(auto, default, as train does) or every microbatch")
    parser.add_argument("--tflops", type=float, default=400.0,
                        help="--carry: a rank's sustained TFLOP/s in the predicted step times (default 400)")
    parser.add_argument("--link-gbs", type=float, default=50.0,
                        help="--carry: GB/s between data-parallel ranks for carried state crossing them (default 50)")
    parser.add_argument("--pp", type=int, default=1,
                        help="--carry: 1F1B pipeline stages the --pattern layers are split over, evenly (default 1): "
                             "each stage's carry store peak, its releases as late as 1F1B's pending backwards make them")
    parser.add_argument("--pattern", default="*-" * 16, metavar="LETTERS",
                        help="--carry: the model's layers (* attention, D DeepSeek sparse attention, G GDN, M Mamba-2, - MLP, "
                             "E MoE; default 16 x '*-')")
    parser.add_argument("--kv", type=lambda t: _shape(t, 2, "--kv"), default=(8, 128), metavar="HEADS,DIM",
                        help="--carry: attention key/value heads and head dim of one TP rank (default 8,128)")
    parser.add_argument("--act-bytes", type=int, default=2, help="--carry: bytes per activation element (default 2)")
    parser.add_argument("--activation-profile", default=None, metavar="FILE.json",
                        help="--carry: the model's activation profile (tools/calibrate_activations.py): adds the bytes "
                             "each schedule item keeps for its backward, and the peak of store + activations")
    parser.add_argument("--carry-memory", type=float, default=0.0, metavar="GIB",
                        help="--carry: memory for kept graphs per rank (train's --tree-carry-memory): the exporters whose "
                             "graph fits run once (keep / release) instead of fill + restore; their graphs estimated from "
                             "--pattern's layers, --hidden-size, --act-bytes and --vocab-size, or the --activation-profile "
                             "(default 0: none kept)")
    parser.add_argument("--vocab-size", type=int, default=128256,
                        help="--carry --carry-memory: the vocabulary (per TP rank) whose logits a kept graph holds at its "
                             "targets' source rows (default 128256)")
    parser.add_argument("--gdn-cost", default=None, metavar="gpu|cpu|FILE.json",
                        help="GDN cost model: GPU defaults, the shipped CPU fit (tools/bench_cp_gdn.py --calibrate) or "
                             "a JSON; default: gpu with CUDA, else cpu")
    return parser


def _shape(text: str, n: int, flag: str) -> tuple:
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{flag}: expected {n} comma-separated integers, got {text!r}") from None
    if len(out) != n or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{flag}: expected {n} comma-separated positive integers, got {text!r}")
    return out


def _gdn_cost(spec):
    from ..cp.planning.gdn_plan import GDNCostModel

    if spec is None:
        return GDNCostModel.default()
    if spec == "gpu":
        return GDNCostModel()
    if spec == "cpu":
        return GDNCostModel.cpu()
    if not os.path.exists(spec):
        raise ValueError(f"--gdn-cost: no such file {spec!r} (use gpu, cpu or a JSON from tools/bench_cp_gdn.py)")
    return GDNCostModel.from_json(spec)


def build_plan_parser(prog: str = "megatron-tree plan") -> argparse.ArgumentParser:
    return add_plan_args(argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0]))


def _cost_model(spec):
    from ..cp.planning.cost_model import CostModel, default_cost_model

    if spec is None:
        return default_cost_model()
    if spec == "gpu":
        return CostModel.gpu()
    if spec == "cpu":
        return CostModel.cpu()
    if not os.path.exists(spec):
        raise ValueError(f"--cost-model: no such file {spec!r} (use gpu, cpu or a JSON from tools/calibrate_cp.py)")
    return CostModel.from_json(spec)


def run_plan(argv_or_args=None) -> int:
    """Run ``megatron-tree plan`` on an argv list (or a parsed namespace); returns the exit status."""
    from ..cp.planning.capacity import capacity_report, format_capacity, format_recurrent, plot_plan, recurrent_report
    from ..data.pipeline import read_samples
    from ..data.synthetic import make_preset
    from ..tree import pack
    from ..tree.packing import PrefixPlan

    if argv_or_args is None or isinstance(argv_or_args, (list, tuple)):
        args = build_plan_parser().parse_args(argv_or_args)
    else:
        args = argv_or_args
    try:
        cm = _cost_model(args.cost_model)
        if args.preset:
            samples = make_preset(args.preset, seed=args.seed, scale=args.scale)
            what = f"preset {args.preset} (seed {args.seed}, scale {args.scale})"
        else:
            samples = read_samples(args.data)
            what = ", ".join(args.data)
        if not samples:
            raise ValueError(f"{what}: no samples")
        toks = [s.tokens for s in samples]
        budget = args.max_tokens_per_mb
        if getattr(args, "carry", False):
            if budget is None:
                raise ValueError("--carry needs --max-tokens-per-mb (the budget the trees are cut at)")
            print(carry_plan_report(samples, what, budget, args))
            return 0
        if budget is None:
            budget = max(int(PrefixPlan(toks).tree_rows().max()), max(len(t) for t in toks))
        mbs = pack(samples, budget)
        mb = max(mbs, key=lambda m: (m.num_rows, m.stats.tree_attention_pairs))
        rows = capacity_report(mb.layout, args.cp, strategies=args.strategy, cost_model=cm, window=args.window)
        recurrent = None
        if not getattr(args, "no_recurrent", False):
            from ..cp.planning.gdn_plan import GDNHeads

            heads = GDNHeads(*args.gdn_heads)
            by_cp = {}
            for r in rows:  # the balanced plan of each CP size (else the first strategy planned)
                if r["cp"] not in by_cp or r["strategy"] == "balanced":
                    by_cp[r["cp"]] = r["plan"]
            rkw = dict(heads=heads, mamba=tuple(args.mamba_dims), hidden_size=args.hidden_size,
                       gdn_layers=args.gdn_layers_per_island)
            recurrent = format_recurrent(
                recurrent_report(mb.layout, list(by_cp.values()), cost=_gdn_cost(args.gdn_cost), **rkw), **rkw)
    except ValueError as e:
        print(f"megatron-tree plan: error: {e}", file=sys.stderr)
        return 2
    title = (f"CP capacity plan: {what}\n"
             f"{len(samples)} samples -> {len(mbs)} microbatch(es) of <= {budget:,} rows; planned: the largest, "
             f"{mb.num_rows:,} rows, {mb.stats.num_trees} tree(s), {mb.stats.tree_attention_pairs:,} visible pairs"
             + (f", window {args.window}" if args.window else ""))
    print(format_capacity(rows, title=title, cost_model=cm))
    if recurrent is not None:
        print()
        print(recurrent)
    fb = sorted({(r["cp"], r["fallback"]) for r in rows if r["strategy"] == "balanced" and r["fallback"]})
    if fb:
        print("balanced fell back to a fold where it predicted faster: "
              + ", ".join(f"CP{cp} -> {f}" for cp, f in fb))
    if args.plot:
        cp = max(args.cp)
        pick = [r for r in rows if r["cp"] == cp]
        plan = next((r["plan"] for r in pick if r["strategy"] == "balanced"), pick[0]["plan"])
        out = plot_plan(mb.layout, plan, args.plot, window=args.window)
        print(f"plot of CP{cp} ({plan.strategy}) written to {out}" if out else "matplotlib missing: no plot")
    return 0


def _kept_bytes(args, profile):
    """``bytes(mb)`` of a microbatch's kept graph: the activation profile's prediction where there is one, else the
    estimate from the model's shape (`megatron.carry.kept_graph_bytes`: --pattern's mixer layers, --hidden-size,
    --act-bytes, --vocab-size)."""
    if profile is not None:
        return lambda mb: profile.predict(mb, "restore")
    from types import SimpleNamespace

    import torch

    from ..megatron.carry import kept_graph_bytes

    dtype = {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}.get(args.act_bytes,
                                                                                                torch.bfloat16)
    layers = sum(ch in "*DGM" for ch in args.pattern) or len(args.pattern)
    return kept_graph_bytes(SimpleNamespace(num_layers=layers, hidden_size=args.hidden_size, params_dtype=dtype,
                                            tensor_model_parallel_size=1, padded_vocab_size=args.vocab_size))


def carry_plan_report(samples, what: str, budget: int, args) -> str:
    """``plan --carry``: the carry plan's microbatches in schedule order per DP rank, with the carry
    store's bytes (`cp.planning.carry.carry_store_bytes`: what each fill writes;
    `carry_store_timeline`: what the store holds after each item, state and gradient accumulators)."""
    import numpy as np

    from ..cp.planning.carry import CarryGeometry, carry_store_bytes, carry_store_timeline, choose_kept
    from ..cp.planning.carry_ranks import PAD, CarryWork, plan_carry_ranks, rank_store_timeline, split_step_ms
    from ..tree import pack, summarize

    geom = CarryGeometry(args.pattern, kv=tuple(args.kv), gdn=tuple(args.gdn_heads[:4]), mamba=tuple(args.mamba_dims),
                         act_bytes=args.act_bytes)
    profile = None
    if getattr(args, "activation_profile", None):
        from ..cp.planning.activations import ActivationProfile

        if not os.path.exists(args.activation_profile):
            raise ValueError(f"--activation-profile: no such file {args.activation_profile!r} "
                             "(tools/calibrate_activations.py writes one)")
        profile = ActivationProfile.from_json(args.activation_profile)
    stages = []
    if args.pp > 1:  # Megatron splits the layers evenly over the stages; each stage has its own store
        if len(args.pattern) % args.pp:
            raise ValueError(f"--pp {args.pp} must divide the {len(args.pattern)} layers of --pattern {args.pattern!r}")
        per = len(args.pattern) // args.pp
        stages = [dataclasses.replace(geom, pattern=args.pattern[i * per:(i + 1) * per]) for i in range(args.pp)]
    mbs = pack(samples, budget, carry=True)
    unlimited = summarize(pack(samples, 1 << 62))["tree_tokens"]
    store = carry_store_bytes(mbs, geom)
    lines = [f"carry plan: {what}", f"{len(samples)} samples -> {len(mbs)} microbatches of <= {budget:,} owned rows; "
             f"rows computed {sum(mb.owned_rows for mb in mbs):,} (unlimited budget: {unlimited:,}); "
             f"{geom.row_bytes():,} B stored per carried row, {geom.state_row_bytes():,} B per state row "
             f"(pattern {args.pattern})",
             f"{'rank':>4} {'item':>4} {'mb':>4} {'phase':>7} {'group':>5} {'owned':>7} {'carried':>8} {'stored':>7} "
             f"{'states':>6} {'fill MiB':>9} {'held MiB':>9} {'grad MiB':>9}" + (f" {'act MiB':>9}" if profile else "")]
    if profile is not None:
        lines.insert(2, f"activations: profile {args.activation_profile} (pattern {profile.pattern}; "
                        f"{', '.join(f'{k}={v}' for k, v in sorted(profile.about.items()))})")
    kept_bytes = _kept_bytes(args, profile)
    dp = max(1, args.dp)
    work = CarryWork(geom, hidden=args.hidden_size, tflops=args.tflops, link_gbs=args.link_gbs,
                     layers=sum(ch in "*DGM" for ch in args.pattern) or len(args.pattern))
    keep_fn = ((lambda rank: choose_kept(rank, kept_bytes, args.carry_memory * 2 ** 30, remote=True))
               if args.carry_memory > 0 else None)
    chosen = plan_carry_ranks(samples, budget, dp, work, cut=args.carry_cut if args.pp == 1 else "never",
                              choose_keep=keep_fn)
    mbs, ranks, keeps, schedule, times = chosen.microbatches, chosen.ranks, chosen.keep, chosen.schedule, chosen.times
    if chosen.budget != budget:  # the same rows, in smaller pieces the ranks balance better
        lines.insert(2, f"DP {dp}: cut at {chosen.budget:,} owned rows per microbatch ({len(mbs)} microbatches), the "
                        f"fastest predicted of " + ", ".join(f"{b:,}: {t:,.1f} ms" for b, t in chosen.tried.items()))
        store = carry_store_bytes(mbs, geom)
    for r, idx in enumerate(ranks):
        rank = [mbs[i] for i in idx]
        keep = keeps[r]
        held = rank_store_timeline(mbs, schedule, r, geom)  # after each item: state, accumulators
        acts, kept_now, kept_peak = [], 0.0, 0.0
        for k, (i, phase) in enumerate(schedule.items[r]):
            if phase == PAD:
                continue
            mb = mbs[i]
            c = mb.carry
            wrote = store[c.index] if phase in ("fill", "keep") else 0
            kept_now += kept_bytes(mb) if phase == "keep" else 0.0
            kept_peak = max(kept_peak, kept_now)
            kept_now -= kept_bytes(mb) if phase == "release" else 0.0
            act = ""
            if profile is not None:
                acts.append(profile.predict(mb, phase))
                act = f" {acts[-1] / 2**20:>9.2f}"
            lines.append(f"{r:>4} {k:>4} {c.index:>4} {phase:>7} {c.group:>5} {mb.owned_rows:>7,} {len(c.carried):>8,} "
                         f"{len(c.exported):>7,} {len(c.state_rows):>6,} {wrote / 2**20:>9.2f} "
                         f"{held[k][0] / 2**20:>9.2f} {held[k][1] / 2**20:>9.2f}{act}")
        peak = max((a + b for a, b in held), default=0)
        if acts:  # an item's activations live from its forward to its backward, beside the store
            both = max(a + b + x for (a, b), x in zip(held, acts))
            lines.append(f"rank {r}: activations peak {max(acts) / 2**20:,.2f} MiB; store + activations peak "
                         f"<= {both / 2**20:,.2f} MiB")
        lines.append(f"rank {r}: {len(rank)} microbatches, {len(held)} schedule items, "
                     f"{sum(mb.owned_rows for mb in rank):,} rows computed, carry store peak {peak / 2**20:,.2f} MiB "
                     f"(state and gradient accumulators; the fills write {sum(store[m.carry.index] for m in rank) / 2**20:,.2f} MiB)")
        lines.append(f"rank {r}: predicted busy {times['rank_ms'][r]:,.1f} ms")
        exporters = [mb for mb in rank if len(mb.carry.exported)]
        lines.append(f"rank {r}: kept graphs {sum(mb.carry.index in keep for mb in exporters)} of {len(exporters)} "
                     f"exporters (peak {kept_peak / 2**30:,.2f} GiB of --carry-memory {args.carry_memory:g}), extra "
                     f"forward rows {sum(mb.owned_rows for mb in exporters if mb.carry.index not in keep):,}")
        for st, stage_geom in enumerate(stages):
            stage_held = carry_store_timeline(rank, stage_geom, pending=args.pp - st - 1)
            lines.append(f"rank {r} stage {st} ({stage_geom.pattern}): carry store peak "
                         f"{max((a + b for a, b in stage_held), default=0) / 2**20:,.2f} MiB")
    busy = np.asarray(times["rank_ms"])
    split_mbs = pack(samples, budget) if max(len(s) for s in samples) <= budget else None
    lines.append(f"DP {dp}: carry predicted step {times['step_ms']:,.1f} ms; slowest rank busy {busy.max():,.1f} ms = "
                 f"{busy.max() / max(busy.mean(), 1e-12):.2f}x the mean; {len(schedule.cut_owners())} owners' state "
                 f"crosses ranks at {len(schedule.syncs)} syncs ({times['sync_ms']:,.1f} ms), {schedule.num_items} "
                 f"schedule items per rank (cut: {args.carry_cut if args.pp == 1 else 'never, under pipelining'}; "
                 f"{args.tflops:g} TFLOP/s, {args.link_gbs:g} GB/s)")
    if split_mbs is None:
        lines.append(f"DP {dp}: split packing refuses a sample over {budget:,} rows")
    else:
        sp = split_step_ms(split_mbs, dp, work)
        lines.append(f"DP {dp}: split packing predicted step {sp['step_ms']:,.1f} ms, rows computed "
                     f"{sum(mb.owned_rows for mb in split_mbs):,} ({sp['step_ms'] / max(times['step_ms'], 1e-12):.2f}x "
                     f"carry's step)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(run_plan(sys.argv[1:]))
