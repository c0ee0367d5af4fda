"""`megatron-tree` command line (also `python -m megatron_tree`)."""
from __future__ import annotations

import argparse
import os
import sys


def _load_samples(args):
    from .data.io import read_jsonl
    from .data.synthetic import make_preset

    if args.data:
        vision = None
        if getattr(args, "hf_model", None):
            from .data.images import VisionInput

            vision = VisionInput.from_hf(args.hf_model)
        return read_jsonl(args.data, vision=vision), args.data
    return make_preset(args.preset, seed=args.seed, scale=args.scale), f"preset {args.preset} (seed {args.seed})"


def cmd_stats(args) -> int:
    from .data.synthetic import default_budget
    from .tree import pack, summarize

    samples, what = _load_samples(args)
    budget = args.max_tokens_per_mb or default_budget(samples)
    if getattr(args, "carry", False):  # cmd_demo calls this with its own namespace
        return _carry_report(samples, what, budget, args.pad_to_multiple_of)
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
    rows += _route_rows(samples) + _image_rows(mbs, samples)
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


def _carry_report(samples, what: str, budget: int, pad: int) -> int:
    """``stats --carry``: rows computed per step with carry, beside today's split packing and the
    unlimited budget (every row once), and what carry reads and stores."""
    from .tree import pack, summarize
    from .tree.carry import carry_summary

    flat = sum(len(getattr(s, "tokens", s)) for s in samples)
    unlimited = summarize(pack(samples, 1 << 62))["tree_tokens"]
    longest = max(len(getattr(s, "tokens", s)) for s in samples)
    split = summarize(pack(samples, budget, pad_to_multiple_of=pad)) if longest <= budget else None
    mbs = pack(samples, budget, pad_to_multiple_of=pad, carry=True)
    c = carry_summary(mbs)
    real = sum(mb.owned_rows - mb.stats.padding_tokens for mb in mbs)
    assert real == unlimited  # carry computes every row of the step once
    chains = max((len(mb.carry.reads_from) for mb in mbs), default=0)
    rows = [("source", what), ("samples", f"{len(samples):,}"), ("flat tokens", f"{flat:,}"),
            ("max tokens per microbatch", f"{budget:,}"),
            ("rows, unlimited budget", f"{unlimited:,} ({flat / max(unlimited, 1):.2f}x fewer than flat)"),
            ("rows, split packing", "refused: a sample is longer than the budget" if split is None else
             f"{split['tree_tokens']:,} ({flat / max(split['tree_tokens'], 1):.2f}x; "
             f"{(flat - split['tree_tokens']) / max(flat - unlimited, 1):.0%} of the sharing) in "
             f"{split['num_microbatches']} microbatches"),
            ("rows, carry", f"{real:,} ({flat / max(real, 1):.2f}x; 100% of the sharing) in {len(mbs)} microbatches"),
            ("carried rows read", f"{c['carried_rows']:,}"),
            ("rows stored for later microbatches", f"{c['stored_rows']:,}"),
            ("microbatches that fill + restore", f"{sum(len(mb.carry.exported) > 0 for mb in mbs)} "
                                                 "(one extra forward each, no saved activations)"),
            ("longest carry chain (microbatches read)", f"{chains}")] + _image_rows(mbs, samples)
    w = max(len(k) for k, _ in rows)
    print("megatron-tree carry report")
    print("-" * (w + 24))
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    return 0


def _image_rows(mbs, samples) -> list:
    """Report lines on images (none without image records): image tokens and vision-encoder work per
    record vs what the microbatches encode (each distinct occurrence once)."""
    from .tree.images import image_stats

    if not any(getattr(s, "images", None) for s in samples):
        return []
    st = image_stats(mbs, samples)
    saved = lambda a, b: f"{1 - b / max(a, 1):.1%} saved"
    return [("images (records / encoded / distinct)", f"{st['images_flat']:,} / {st['images_tree']:,} / "
                                                       f"{st['distinct_images']:,}"),
            ("image tokens flat / tree", f"{st['image_tokens_flat']:,} / {st['image_tokens_tree']:,} "
                                         f"({saved(st['image_tokens_flat'], st['image_tokens_tree'])})"),
            ("encoder patches flat / tree", f"{st['patches_flat']:,} / {st['patches_tree']:,} "
                                            f"({saved(st['patches_flat'], st['patches_tree'])})")]


def _route_rows(samples) -> list:
    """Report lines on routing-replay routes (none when no record carries ``routed_experts``): the forks
    routes cause (same token, different experts) and the rows route-aware sharing costs over token-only
    sharing (whole forest, no row budget)."""
    from .tree.routes import route_sharing_cost

    n = sum(s.routed_experts is not None for s in samples)
    if n == 0:
        return []
    if n < len(samples):
        return [("routed records", f"{n} of {len(samples)} (route-aware packing needs routes on every record)")]
    c = route_sharing_cost(samples)
    extra = c["route_extra_rows"] / max(c["token_rows"], 1)
    return [
        ("routed records", f"{n:,} ([moe_layers, topk] = {list(samples[0].routed_experts.shape[1:])})"),
        ("route forks", f"{c['route_forks']:,} (same token, routes disagree)"),
        ("trie rows token-only", f"{c['token_rows']:,} (flat/tree {c['flat_rows'] / max(c['token_rows'], 1):.3f})"),
        ("trie rows route-aware", f"{c['route_rows']:,} (flat/tree {c['flat_rows'] / max(c['route_rows'], 1):.3f})"),
        ("rows cost by route forks", f"{c['route_extra_rows']:,} (+{extra:.1%})"),
    ]


def cmd_demo(args) -> int:
    """The README's first command: the sharing report of a GRPO preset (with a tree plot), then a
    tiny hybrid model trained on CPU with tree packing vs flat packing (`training.demo.run_demo`).
    Exit status 1 when the tree and flat losses disagree past `demo.TREE_FLAT_LOSS_RTOL`."""
    import os

    from .training.demo import run_demo

    os.makedirs(args.out_dir, exist_ok=True)
    ns = argparse.Namespace(data=None, preset=args.preset, seed=0, scale=1.0, max_tokens_per_mb=None,
                            pad_to_multiple_of=1, plot=None)
    try:
        import matplotlib  # noqa: F401

        ns.plot = os.path.join(args.out_dir, "demo_tree.png")
    except ImportError:
        pass
    cmd_stats(ns)
    print()
    out = run_demo(args.out_dir, steps=args.steps, flat_steps=args.flat_steps, preset=args.preset, scale=args.scale,
                   loss=args.loss, budget=args.max_tokens_per_mb)
    return 0 if out["summary"]["tree_flat_loss_agree"] else 1  # the demo's exactness claim failed


def cmd_train(args) -> int:
    """Exit status 0, or `trainer.PREEMPTED_EXIT_CODE` (75) when SIGTERM / SIGUSR1 stopped the run early
    (after saving its last step with --save): a job script requeues on it."""
    from .training.trainer import exit_status, run

    return exit_status(run(args))


def cmd_score(args) -> int:
    """Forward-only per-token log-probs and entropies of every record (`training.score`)."""
    from .training.score import run

    run(args)
    return 0


def cmd_verify(args) -> int:
    from .training.arguments import moe_balancing_fields
    from .training.verify import VerifyConfig, format_report, run_verify

    cfg = VerifyConfig(model=args.model, pattern=args.pattern, tp=args.tp, pp=args.pp, dp=args.dp, ep=args.ep,
                       cp=args.cp, cp_strategy=args.cp_strategy, sp=args.sp, recompute=args.recompute, dtype=args.dtype, loss=args.loss, window=args.window,
                       sinks=args.sinks, seed=args.seed, families=args.families, budget=args.max_tokens_per_mb,
                       fault=args.inject_fault, tolerance=args.tolerance, dsa_sparse_loss=args.dsa_sparse_loss,
                       dsa_topk_freq=args.dsa_topk_freq, dsa_topk=args.dsa_topk)
    cfg.mtp_num_layers = args.mtp_num_layers
    cfg.mtp_pattern = args.mtp_pattern
    cfg.routing_replay = args.routing_replay
    cfg.carry, cfg.carry_keep, cfg.carry_cut = args.carry, args.carry_keep, args.carry_cut
    cfg.balancing = moe_balancing_fields(args)
    cfg.steps, cfg.optimizer = args.steps, args.optimizer
    cfg.seq_aux_per_sample = args.tree_seq_aux_per_sample
    cfg.loss_agg, cfg.loss_agg_norm = args.loss_agg, args.loss_agg_norm
    out = run_verify(cfg)
    print(format_report(cfg, out))
    return 0 if out["passed"] else 1


def cmd_launch(args) -> int:
    from .training.launch_lm import launch

    try:
        return launch(args.script, args.script_args, nproc=args.nproc, nnodes=args.nnodes, node_rank=args.node_rank,
                      rdzv_backend=args.rdzv_backend, rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id,
                      max_restarts=args.max_restarts, dry_run=args.dry_run)
    except RuntimeError as e:  # megatron.training is not importable: what to install
        print(f"megatron-tree: error: {e}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    from .data.synthetic import PRESETS
    from .training.arguments import add_moe_balancing_args, add_seq_aux_per_sample_arg
    from .training.verify import ALL_FAULTS as FAULTS
    from .tree.loss_agg import LOSS_AGGS

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
    st.add_argument("--carry", action="store_true",
                    help="plan carry (every row once per step: pack(..., carry=True)) and report rows computed beside "
                         "split packing and the unlimited budget")
    st.add_argument("--hf-model", default=None,
                    help="a vision-language HF checkpoint directory: read the records' images with its image processor "
                         "and placeholder token, and report image tokens and encoder work")
    st.set_defaults(func=cmd_stats)
    vf = sub.add_parser("verify", help="tree-packed vs per-sample training of a tiny model: logits, loss, grads, step")
    vf.add_argument("--model", choices=["gpt", "hybrid", "mla", "dsa", "mamba", "qwen3next", "vlm"], default="gpt",
                    help="mla: GPT with Multi-Latent Attention (MLATransformerConfig, YaRN, q/kv latents); dsa: MLA with "
                         "DeepSeek sparse attention (per-sample side: stock DSAttention); mamba: "
                         "Megatron's MambaModel (Nemotron-H, --pattern letters M * - E, default M*-E); qwen3next: "
                         "GPTModel with Megatron's gated_delta_net attention variant (GDN, attention every 2nd layer); vlm: "
                         "a vision encoder + GPT with multimodal RoPE on image records (screenshots in shared prompts "
                         "and completions; per-record side: each record's images encoded alone)")
    vf.add_argument("--pattern", default=None, help="hybrid layer pattern (M Mamba-2, G GDN, * attention, - MLP, E MoE); "
                                                    "with --model mamba, MambaModel's hybrid_override_pattern")
    vf.add_argument("--tp", type=int, default=1)
    vf.add_argument("--pp", type=int, default=1)
    vf.add_argument("--dp", type=int, default=1)
    vf.add_argument("--ep", type=int, default=1)
    vf.add_argument("--cp", type=int, default=1, help="tree context parallel size (attention, MLP and MoE layers)")
    vf.add_argument("--cp-strategy", choices=["balanced", "zigzag", "contiguous"], default="balanced",
                    help="CP ownership planner for the tree side")
    vf.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp > 1)")
    vf.add_argument("--recompute", choices=["none", "selective", "full"], default="none")
    vf.add_argument("--dtype", choices=["float32", "float64", "bfloat16"], default="float64",
                    help="float64 (default) is the exact check; float32 uses a float-noise tolerance; bfloat16 "
                         "passes iff the tree side's error against per-sample float64 training is at most 1.5x "
                         "that of flat-packed bf16 training (plus --tolerance, default 2^-16)")
    vf.add_argument("--loss", choices=["sft", "grpo", "ppo", "gspo", "dpo", "ipo", "simpo", "rm", "value", "distill"],
                    default="sft",
                    help="gspo: both sides run GSPO's two passes (each sample's sequence ratio from a forward-only "
                         "pass); fault gspo_one_microbatch (with --carry or --cp > 1) takes it from one microbatch. "
                         "dpo / ipo / simpo: the same two passes over preference pairs (samples 2p and 2p + 1, the "
                         "even one chosen, the samples' old log-probs as the reference, beta 0.5, SimPO gamma 0.3); "
                         "fault wrong_partner pairs each chosen sample with another pair's rejected one. rm: a reward "
                         "model (a scalar head at each sample's last row) with Bradley-Terry over the same pairs. "
                         "value: a value model, PPO's value loss clipped at 0.2 against random per-token returns. "
                         "distill: forward KL to a random teacher's top-4 per token. Fault field_shift (value / "
                         "distill) reads each occurrence's return / teacher of the next position")
    vf.add_argument("--loss-agg", choices=LOSS_AGGS, default="token-mean",
                    help="the step's loss aggregation (as train --loss-agg): each sample's exact factor over the "
                         "whole batch on both sides; fault loss_agg_per_microbatch takes it per microbatch instead")
    vf.add_argument("--loss-agg-norm", type=float, default=None, metavar="L",
                    help="seq-mean-token-sum-norm's constant length (default: the batch's longest sample)")
    vf.add_argument("--carry-keep", action="store_true",
                    help="with --carry: every exporting microbatch runs one forward with its graph kept until its "
                         "readers' backward are done (no fill + restore forward)")
    vf.add_argument("--carry-cut", choices=("never", "auto", "always"), default="auto",
                    help="with --carry and DP > 1: which carry groups are cut over data-parallel ranks, their carried "
                         "state and its gradient crossing ranks at syncs (tree.carry.assign_carry_ranks): never, those "
                         "over one rank's share of the rows (auto, the default, as train does), or every microbatch "
                         "loose (always). Fault carry_return_dropped drops the gradient readers return across ranks")
    vf.add_argument("--window", type=int, default=None, help="sliding-window attention (left context)")
    vf.add_argument("--sinks", action="store_true", help="learned attention sinks")
    vf.add_argument("--families", type=int, default=6, help="number of sample families in the random batch")
    vf.add_argument("--max-tokens-per-mb", type=int, default=64)
    vf.add_argument("--seed", type=int, default=1234)
    vf.add_argument("--tolerance", type=float, default=None,
                    help="max relative error (default by dtype); bfloat16: the ratio rule's absolute floor")
    vf.add_argument("--dsa-sparse-loss", action="store_true", help="--model dsa: indexer loss over the selected keys")
    vf.add_argument("--dsa-topk-freq", type=int, default=1,
                    help="--model dsa: IndexShare, every n-th layer computes top-k and the others reuse it")
    vf.add_argument("--dsa-topk", type=int, default=None, help="--model dsa: keys per query (default 4)")
    vf.add_argument("--routing-replay", action="store_true",
                    help="rollout routing replay: samples carry MoE routes that disagree on shared prefixes; the tree "
                         "side packs route-aware and replays per row, the per-sample side replays through stock "
                         "RouterReplay (dense models get 4 experts in every layer)")
    vf.add_argument("--carry", action="store_true",
                    help="the tree side packs with carry (every row once per step at --max-tokens-per-mb: trees and "
                         "paths over it are cut into microbatches that read their ancestors' layer state, with the "
                         "gradient restored) and trains through fill / run / restore items")
    vf.add_argument("--mtp-num-layers", type=int, default=0,
                    help="multi-token prediction depths (--model gpt, mla, dsa, qwen3next; mamba and dsa need "
                         "megatron-core >= 0.19): the per-sample side is stock MTP (Megatron's "
                         "MultiTokenPredictionLayer rolling each sample); each depth's loss is compared")
    vf.add_argument("--mtp-pattern", default="*-",
                    help="--model mamba with --mtp-num-layers: each MTP depth's inner layers (letters as --pattern; "
                         "Megatron's 'main/mtp/mtp' hybrid pattern)")
    vf.add_argument("--inject-fault", default=None, choices=FAULTS,
                    help="inject a known bug into the tree side (verify must then fail; nan: a NaN in one "
                         "parameter's gradient and one logit; mla_rope_physical, with --model mla: MLA's rotary "
                         "indexed by physical row instead of tree depth; dsa_tie_order / dsa_loss_weight, with --model dsa: "
                         "top-k ties by the larger row id / indexer loss without the per-sample row weights)")
    vf.add_argument("--steps", type=int, default=1,
                    help="optimizer steps on the batch; params_after_step (and expert_bias) compare after the last")
    vf.add_argument("--optimizer", choices=["adam", "sgd"], default=None,
                    help="default: Adam in float64, SGD in float32 and for routing replay / MoE balancing (Megatron's "
                         "router rounds its scores to float32, and Adam's first step is lr * sign(g))")
    add_moe_balancing_args(vf)
    add_seq_aux_per_sample_arg(vf)
    vf.set_defaults(func=cmd_verify)
    dm = sub.add_parser("demo", help="the CPU demo (README's first command): sharing report, then tree vs flat "
                                     "training of a tiny hybrid model on 2 CPU ranks")
    dm.add_argument("--out-dir", default=os.path.join("runs", "demo"), help="where demo.png and metrics.json go")
    dm.add_argument("--steps", type=int, default=40, help="tree-packed training steps")
    dm.add_argument("--flat-steps", type=int, default=5, help="flat-packed steps (throughput baseline)")
    dm.add_argument("--preset", choices=PRESETS, default="varied_5k_16x100")
    dm.add_argument("--scale", type=float, default=0.2, help="shrink the preset's lengths for CPU")
    dm.add_argument("--max-tokens-per-mb", type=int, default=2048, help="row budget per microbatch")
    dm.add_argument("--loss", choices=["sft", "grpo"], default="sft")
    dm.set_defaults(func=cmd_demo)
    from .training.trainer import add_train_args

    tr = sub.add_parser("train", help="train a Megatron-Core model on prefix trees (torchrun/srun, or --nproc "
                                      "local ranks); SIGTERM/SIGUSR1 save the current step and exit with status 75")
    add_train_args(tr)
    tr.set_defaults(func=cmd_train)
    from .training.score import add_score_args

    sc = sub.add_parser("score", help="forward-only scoring: per-token log-probs and entropies of every record of "
                                      "--data under a --load checkpoint, written to --out FILE.parquet in input order "
                                      "(torchrun/srun, or --nproc local ranks)")
    add_score_args(sc)
    sc.set_defaults(func=cmd_score)
    from .training.plan import add_plan_args, run_plan

    pl = sub.add_parser("plan", help="dry-run context-parallel capacity planning: rows, predicted ms and "
                                     "imbalance per rank, KV moved, for each CP size and strategy")
    add_plan_args(pl)
    pl.set_defaults(func=run_plan)
    la = sub.add_parser("launch", help="run a Megatron-LM entry point (pretrain_*.py) on this machine's ranks, one "
                                       "launcher per machine: torchrun with CUDA; without CUDA with the CPU layer for "
                                       "megatron.training and the non-TE CPU flags")
    la.add_argument("--nproc", "--nproc-per-node", "--nproc_per_node", dest="nproc", type=int, default=1,
                    help="processes (ranks) on this machine (default 1)")
    la.add_argument("--nnodes", default="1", help="machines, N or MIN:MAX (default 1: --standalone, no other flag needed)")
    la.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=None,
                    help="this machine's rank (torchrun uses it with --rdzv-backend static; c10d numbers machines "
                         "as they join)")
    la.add_argument("--rdzv-backend", "--rdzv_backend", dest="rdzv_backend", default=None,
                    help="rendezvous backend with --rdzv-endpoint (default c10d)")
    la.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint", default=None,
                    help="HOST:PORT the ranks of all machines meet on (required with --nnodes > 1)")
    la.add_argument("--rdzv-id", "--rdzv_id", dest="rdzv_id", default=None,
                    help="rendezvous id, the same on every machine (e.g. $SLURM_JOB_ID)")
    la.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", type=int, default=0,
                    help="torchrun's in-place restart budget: when a rank dies, restart every rank up to this many "
                         "times (the entry point resumes from its --load checkpoint; default 0)")
    la.add_argument("--dry-run", action="store_true", help="print the command and exit")
    la.add_argument("script", help="the entry point, e.g. examples/pretrain_tree_gpt.py")
    la.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments, passed through")
    la.set_defaults(func=cmd_launch)
    return p


def main(argv=None) -> int:
    import warnings

    # Megatron-Core warns at import that TE / Apex are absent (expected on CPU); keep the output readable.
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex) (is|are) not installed.*")
    args = build_parser().parse_args(argv)
    from .training.checkpoint_errors import CheckpointSaveError  # standard library and torch only

    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"megatron-tree: error: {e}", file=sys.stderr)
        return 2
    except CheckpointSaveError as e:  # it names the directory, ranks, errno and bytes itself: no traceback
        print(e, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
