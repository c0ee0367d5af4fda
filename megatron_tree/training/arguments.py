"""``--tree-*`` command-line arguments for Megatron-LM's ``pretrain()`` (and any argparse parser).

    pretrain(..., extra_args_provider=add_tree_args, args_defaults={"dataloader_type": "external"})

`add_tree_args` adds a "tree" argument group; `validate_tree_args` checks a parsed namespace
against the rules tree training depends on and fills the derived defaults. Megatron-LM has no hook
for validating extra arguments, so the hooks in `megatron_tree.training.megatron_lm` call
`validate_tree_args` themselves the first time they see the arguments.

Nothing here imports Megatron: a bare ``argparse.ArgumentParser`` works, and checks about
Megatron-LM arguments (``micro_batch_size``, ``attention_dropout``, ...) are skipped when the
namespace has no such attribute.
"""
from __future__ import annotations

import argparse
import math

from ..tree.loss_agg import LOSS_AGGS

__all__ = ["add_tree_args", "validate_tree_args", "add_moe_balancing_args", "add_seq_aux_per_sample_arg",
           "moe_balancing_fields", "BALANCING_TYPES", "TREE_LOSSES", "VALUE_HEAD_LOSSES", "CP_PLANNERS", "BAD_SAMPLE_POLICIES",
           "DEFAULT_PAD_MULTIPLE"]

TREE_LOSSES = ("sft", "grpo", "ppo", "gspo", "dpo", "ipo", "simpo", "rm", "value", "distill")
#: the losses of a scalar head (`megatron.value_head`): a reward model, a value model (critic)
VALUE_HEAD_LOSSES = ("rm", "value")
CP_PLANNERS = ("contiguous", "zigzag", "balanced")
BAD_SAMPLE_POLICIES = ("error", "skip")
# Rows are padded to a multiple of this unless --tree-pad-to-multiple-of says otherwise: GEMM tiles
# like multiples of 8, and the padding costs at most 7 rows a microbatch.
DEFAULT_PAD_MULTIPLE = 8
#: Megatron-LM's --moe-router-load-balancing-type choices the tree weighs per row (sinkhorn is refused)
BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")


def add_moe_balancing_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """MoE load-balancing flags under Megatron-LM's names and defaults (``megatron-tree train`` and
    ``verify``; a ``pretrain()`` script has Megatron-LM's own). On a tree every statistic they switch
    on counts a row once per sample through it (`megatron_tree.megatron.moe_balance`)."""
    g = parser.add_argument_group("MoE load balancing (Megatron-LM's flags)")
    g.add_argument("--moe-router-load-balancing-type", choices=BALANCING_TYPES, default="aux_loss",
                   help="aux_loss (per microbatch), seq_aux_loss (per sequence: a packed microbatch is one), "
                        "global_aux_loss (running over the step's microbatches) or none; off unless "
                        "--moe-aux-loss-coeff > 0 (Megatron-LM's defaults)")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    g.add_argument("--moe-z-loss-coeff", type=float, default=None)
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="aux-loss-free balancing: a per-expert bias updated after each step from the step's "
                        "tokens per expert (counted per flat token); needs --moe-router-score-function sigmoid "
                        "to steer routing")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3)
    g.add_argument("--moe-router-score-function", choices=("softmax", "sigmoid"), default="softmax")
    return parser


def add_seq_aux_per_sample_arg(group) -> None:
    """``--tree-seq-aux-per-sample`` (the tree group of train and the ``pretrain()`` hooks; verify)."""
    group.add_argument("--tree-seq-aux-per-sample", action="store_true",
                       help="seq_aux_loss per sample, DeepSeek-V3's definition (each sample's own tokens, a shared "
                            "prefix row counted in every sample through it, divided by the sample's length). "
                            "Default: as stock computes it on the packed microbatch, one sequence (= aux_loss)")


def moe_balancing_fields(args) -> dict:
    """The TransformerConfig fields of `add_moe_balancing_args`' flags (empty for a namespace without them)."""
    if not hasattr(args, "moe_router_load_balancing_type"):
        return {}
    return dict(moe_router_load_balancing_type=args.moe_router_load_balancing_type,
                moe_aux_loss_coeff=args.moe_aux_loss_coeff, moe_z_loss_coeff=args.moe_z_loss_coeff,
                moe_router_enable_expert_bias=bool(args.moe_router_enable_expert_bias),
                moe_router_bias_update_rate=args.moe_router_bias_update_rate,
                moe_router_score_function=args.moe_router_score_function)


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def add_tree_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the "tree" argument group to ``parser`` and return it (Megatron-LM's
    ``extra_args_provider`` contract). Attribute names are the flags with ``_`` for ``-``."""
    g = parser.add_argument_group(title="tree", description="prefix-tree packing (megatron-tree)")
    g.add_argument("--tree-packing", action="store_true",
                   help="Train on packed prefix trees: shared prefixes run once, loss and gradients "
                        "stay exactly per-sample. Required by the megatron_tree Megatron-LM hooks.")
    g.add_argument("--tree-max-tokens-per-mb", type=_positive_int, default=None, metavar="N",
                   help="Row budget of one microbatch (padding included). Default: --seq-length.")
    add_seq_aux_per_sample_arg(g)
    g.add_argument("--tree-routing-replay", action="store_true",
                   help="Rollout routing replay (R3) for MoE models: every record carries routed_experts "
                        "([tokens][moe_layers][topk]); rows are shared only where tokens and routes agree and "
                        "every MoE layer replays the routes of its rows (moe_enable_routing_replay). A record "
                        "without routes is an error, never re-routed.")
    g.add_argument("--tree-global-batch-samples", type=_positive_int, default=None, metavar="N",
                   help="Samples per optimizer step over all data-parallel ranks. They are packed into "
                        "exactly --global-batch-size / DP microbatches per rank (spare slots are tiny "
                        "padding microbatches). Required with --tree-data-path.")
    g.add_argument("--tree-cp-planner", choices=CP_PLANNERS, default="balanced",
                   help="Row ownership planner for tree context parallelism (default: balanced).")
    g.add_argument("--tree-loss", choices=TREE_LOSSES, default="sft",
                   help="sft: token-mean negative log-likelihood; grpo / ppo: clipped policy-gradient "
                        "surrogate per occurrence (needs advantages in the data); gspo: one clipped ratio per "
                        "sample, exp(mean log-ratio), from a forward-only stats pass first (needs advantages and "
                        "old_logprobs; megatron-tree train; pair it with --loss-agg seq-mean-token-mean as GSPO's "
                        "paper); dpo / ipo / simpo: preference pairs (records with pair_id and chosen, dpo / ipo "
                        "also ref_logprobs), the loss of each pair's summed log-probs averaged over the step's "
                        "pairs, from a forward-only stats pass first (megatron-tree train); rm: a reward model "
                        "(a scalar head read at each record's last row) trained with Bradley-Terry over preference "
                        "pairs (pair_id / chosen) or ranked groups (group / score), a stats pass first; value: a "
                        "value model (critic: the scalar head at every target's source row) trained with PPO's "
                        "value loss against the records' returns (old_values with --tree-value-clip); distill: KL to "
                        "a teacher's top-k per token (teacher_topk_ids / teacher_topk_logprobs, [tokens][k]; "
                        "--tree-distill-kl). Default: sft.")
    g.add_argument("--tree-value-clip", type=float, default=None, metavar="EPS",
                   help="--tree-loss value: clip each value to within EPS of the record's old_values (PPO's "
                        "clipped value loss). Default: unclipped.")
    g.add_argument("--tree-distill-kl", choices=("forward", "reverse"), default="forward",
                   help="--tree-loss distill: KL(teacher || student) (forward, default) or KL(student || teacher) "
                        "over the teacher's top-k ids.")
    g.add_argument("--tree-dpo-beta", type=float, default=0.1,
                   help="beta of --tree-loss dpo / ipo / simpo (default 0.1).")
    g.add_argument("--tree-simpo-gamma", type=float, default=0.5,
                   help="SimPO's target reward margin gamma (default 0.5).")
    g.add_argument("--loss-agg", choices=LOSS_AGGS, default="token-mean",
                   help="How a step's per-token losses are aggregated (verl's names): token-mean (every target of "
                        "the global batch alike; default), seq-mean-token-sum, seq-mean-token-mean, "
                        "seq-mean-token-sum-norm (Dr. GRPO: sums over a constant length, --loss-agg-norm). Exact "
                        "whatever microbatches, ranks and carry the samples are cut over (a per-sample weight).")
    g.add_argument("--loss-agg-norm", type=float, default=None, metavar="L",
                   help="seq-mean-token-sum-norm's constant length L (default: the step's longest sample's "
                        "target count).")
    g.add_argument("--tree-clip-eps", type=float, default=0.2,
                   help="PPO/GRPO lower clip range: ratio >= 1 - eps (default 0.2).")
    g.add_argument("--tree-clip-eps-high", type=float, default=None,
                   help="PPO/GRPO upper clip range: ratio <= 1 + eps_high (default: --tree-clip-eps).")
    g.add_argument("--tree-kl-coef", type=float, default=0.0,
                   help="Coefficient of the k3 KL estimator to ref_logprobs (default 0: off).")
    g.add_argument("--tree-entropy-coef", type=float, default=0.0,
                   help="Entropy bonus: the loss becomes loss - coef * mean per-token entropy of the policy "
                        "(same per-token denominator as the loss; > 0 raises the entropy, < 0 lowers it). "
                        "Default 0: off (the mean entropy is logged either way).")
    g.add_argument("--tree-bad-sample", choices=BAD_SAMPLE_POLICIES, default="error",
                   help="A malformed sample in the data: stop with file:line (error) or skip it and "
                        "count it (skip). Default: error.")
    g.add_argument("--tree-data-path", nargs="+", default=None, metavar="PATH",
                   help="Training data: JSONL (.jsonl/.json) or Parquet (.parquet/.pq) files or "
                        "directories of them, one sample per line/row.")
    g.add_argument("--tree-valid-data-path", nargs="+", default=None, metavar="PATH",
                   help="Validation data in the same formats (optional; no validation without it).")
    g.add_argument("--tree-pad-to-multiple-of", type=_positive_int, default=None, metavar="K",
                   help=f"Pad every microbatch's rows to a multiple of K. Default: lcm({DEFAULT_PAD_MULTIPLE}, "
                        "TP size) with sequence parallelism, else " f"{DEFAULT_PAD_MULTIPLE}.")
    g.add_argument("--tree-lookahead", type=_non_negative_int, default=1, metavar="N",
                   help="Optimizer steps packed ahead by a background thread (0: pack on demand). Default 1.")
    g.add_argument("--tree-flat-packing", action="store_true",
                   help="Baseline for comparisons: pack every sample as its own chain (no prefix shared), "
                        "with the same steps, budget and loss; the losses equal tree packing's up to rounding.")
    g.add_argument("--tree-carry", action="store_true",
                   help="Every row of a step computed once at any --tree-max-tokens-per-mb: a tree (or one path) over "
                        "the budget is cut into microbatches that read their ancestors' layer state (K/V, Gated "
                        "DeltaNet state) from earlier microbatches of the step, with the gradient restored to them "
                        "(one extra forward of each microbatch others read). Every layer kind (attention, MLA, DSA, "
                        "Gated DeltaNet, Mamba-2, MoE with routing replay) and MTP, under TP / SP, DP, tree CP and 1F1B "
                        "pipelining; not yet interleaved pipeline stages, or MTP layers running DSA.")
    g.add_argument("--tree-carry-memory", type=float, default=None, metavar="GIB",
                   help="--tree-carry: memory for kept graphs per rank. An exporting microbatch whose graph fits "
                        "(estimated from the model's shape) runs one forward and keeps its graph until its readers' "
                        "backward are done, instead of a no-grad fill forward now and a second forward later. "
                        "0: never keep. Default: 30%% of the GPU's memory (20%% of RAM on CPU). Without pipelining "
                        "or recomputation only (otherwise every exporter fills and restores).")
    g.add_argument("--tree-carry-cut", choices=("auto", "never", "always"), default="auto",
                   help="--tree-carry over data-parallel ranks: auto (default) cuts a carry group larger than one "
                        "rank's share of the step's rows over several ranks, its carried state sent to the readers' "
                        "ranks and their gradient returned (every row still computed once); never keeps each group on "
                        "one rank; always cuts every microbatch loose (testing). Never under pipelining.")
    g.add_argument("--tree-hybrid-pattern", type=str, default=None, metavar="PATTERN",
                   help="Hybrid layer pattern, one letter per layer: M Mamba-2, G Gated DeltaNet, "
                        "* attention, - MLP, E MoE ('|' marks pipeline stages and is ignored). "
                        "Default: a GPT stack of --num-layers attention+MLP layers.")
    return parser


def _get(args, name, default=None):
    return getattr(args, name, default)


def validate_tree_args(args) -> argparse.Namespace:
    """Check a parsed namespace for tree training and fill derived defaults in place; returns ``args``.

    Does nothing unless ``args.tree_packing``. Fills ``tree_max_tokens_per_mb`` (from
    ``seq_length``) and ``tree_pad_to_multiple_of`` (see the flag's help). Raises ``ValueError``
    listing every broken rule with the flag that fixes it. Rules on Megatron-LM arguments are
    checked only when the namespace has them.
    """
    if not _get(args, "tree_packing", False):
        return args
    errors: list[str] = []
    tp = int(_get(args, "tensor_model_parallel_size", 1) or 1)
    sp = bool(_get(args, "sequence_parallel", False)) and tp > 1

    # -- microbatch shape: the tree is the batch
    if _get(args, "micro_batch_size") not in (None, 1):
        errors.append(f"--micro-batch-size must be 1 with --tree-packing (the tree is the batch); "
                      f"got {args.micro_batch_size}")
    budget = _get(args, "tree_max_tokens_per_mb") or _get(args, "seq_length")
    if budget is None:
        errors.append("set --tree-max-tokens-per-mb (or --seq-length): the row budget of a microbatch")
    pad = _get(args, "tree_pad_to_multiple_of")
    if pad is None:
        pad = math.lcm(DEFAULT_PAD_MULTIPLE, tp) if sp else DEFAULT_PAD_MULTIPLE
    elif pad <= 0:
        errors.append(f"--tree-pad-to-multiple-of must be positive, got {pad}")
    elif sp and pad % tp:
        errors.append(f"--tree-pad-to-multiple-of ({pad}) must be a multiple of the tensor-parallel size ({tp}) "
                      "with --sequence-parallel: sequence parallelism splits the rows evenly over TP ranks")
    if budget is not None and pad and pad > 0 and budget % pad:
        errors.append(f"the microbatch budget ({budget}, --tree-max-tokens-per-mb or --seq-length) must be a "
                      f"multiple of --tree-pad-to-multiple-of ({pad})")

    # -- numerics tree attention does not have / loss settings
    if _get(args, "attention_dropout") not in (None, 0, 0.0):
        errors.append(f"--attention-dropout must be 0 with --tree-packing (tree attention has no attention "
                      f"dropout); got {args.attention_dropout}")
    if _get(args, "loss_agg_norm", None) is not None and (_get(args, "loss_agg", "token-mean") !=
                                                         "seq-mean-token-sum-norm" or not args.loss_agg_norm > 0):
        errors.append(f"--loss-agg-norm {args.loss_agg_norm} needs --loss-agg seq-mean-token-sum-norm and a length > 0")
    if _get(args, "tree_carry_memory", None) is not None and (args.tree_carry_memory < 0 or
                                                              not _get(args, "tree_carry", False)):
        errors.append(f"--tree-carry-memory {args.tree_carry_memory} needs --tree-carry and a value >= 0")
    if _get(args, "tree_loss", "sft") not in TREE_LOSSES:
        errors.append(f"--tree-loss must be one of {TREE_LOSSES}, got {args.tree_loss!r}")
    if _get(args, "tree_loss", "sft") in ("grpo", "ppo", "gspo"):
        if not _get(args, "tree_clip_eps", 0.2) > 0:
            errors.append(f"--tree-clip-eps must be > 0, got {args.tree_clip_eps}")
        high = _get(args, "tree_clip_eps_high")
        if high is not None and not high > 0:
            errors.append(f"--tree-clip-eps-high must be > 0, got {high}")
    loss = _get(args, "tree_loss", "sft")
    if loss in ("dpo", "ipo", "simpo", "rm"):
        if _get(args, "loss_agg", "token-mean") != "token-mean":
            errors.append(f"--loss-agg {args.loss_agg} does not apply to --tree-loss {args.tree_loss}: its loss is the "
                          "mean over preference pairs of a function of each pair's sums")
        if not _get(args, "tree_dpo_beta", 0.1) > 0:
            errors.append(f"--tree-dpo-beta must be > 0, got {args.tree_dpo_beta}")
    if loss in ("dpo", "ipo", "simpo", "rm", "value", "distill"):
        if _get(args, "tree_kl_coef", 0.0) or _get(args, "tree_entropy_coef", 0.0):
            errors.append(f"--tree-kl-coef / --tree-entropy-coef do not apply to --tree-loss {args.tree_loss} (not a "
                          "policy-gradient loss)")
    if _get(args, "tree_value_clip", None) is not None and (loss != "value" or not args.tree_value_clip > 0):
        errors.append(f"--tree-value-clip {args.tree_value_clip} needs --tree-loss value and a value > 0")
    if loss in VALUE_HEAD_LOSSES and int(_get(args, "mtp_num_layers", None) or 0):
        errors.append(f"--mtp-num-layers does not apply to --tree-loss {loss}: a reward / value model predicts no "
                      "tokens")
    if loss in ("dpo", "ipo", "simpo"):
        if (_get(args, "tree_global_batch_samples", None) or 0) % 2:
            errors.append(f"--tree-global-batch-samples {args.tree_global_batch_samples} is odd: a step of "
                          f"--tree-loss {args.tree_loss} holds whole preference pairs")
    if not _get(args, "tree_kl_coef", 0.0) >= 0:
        errors.append(f"--tree-kl-coef must be >= 0, got {args.tree_kl_coef}")
    if not math.isfinite(_get(args, "tree_entropy_coef", 0.0)):
        errors.append(f"--tree-entropy-coef must be finite, got {args.tree_entropy_coef}")
    if _get(args, "tree_cp_planner", "balanced") not in CP_PLANNERS:
        errors.append(f"--tree-cp-planner must be one of {CP_PLANNERS}, got {args.tree_cp_planner!r}")
    if _get(args, "tree_bad_sample", "error") not in BAD_SAMPLE_POLICIES:
        errors.append(f"--tree-bad-sample must be one of {BAD_SAMPLE_POLICIES}, got {args.tree_bad_sample!r}")
    if _get(args, "tree_lookahead", 0) < 0:
        errors.append(f"--tree-lookahead must be >= 0, got {args.tree_lookahead}")

    # -- loss normalisation: padding microbatches carry no targets, so only the global per-token
    #    convention (Megatron divides by the token count summed over microbatches and DP) is exact
    if _get(args, "calculate_per_token_loss") is False:
        errors.append("--calculate-per-token-loss is required with --tree-packing: the loss is normalised by "
                      "the global number of target tokens, exactly as per-sample training does")
    if _get(args, "sft", False):
        errors.append("--sft selects Megatron-LM's SFT dataset and per-microbatch loss averaging; with "
                      "--tree-packing use --tree-loss sft and --tree-data-path instead")
    if _get(args, "dataloader_type") not in (None, "external"):
        errors.append(f"--dataloader-type must be external with --tree-packing (the tree pipeline is its own "
                      f"loader); got {args.dataloader_type!r}")
    if _get(args, "rampup_batch_size"):
        errors.append("--rampup-batch-size is not supported with --tree-packing (the microbatch count per step "
                      "must stay fixed)")
    if _get(args, "train_samples"):
        errors.append("use --train-iters with --tree-packing, not --train-samples (a microbatch holds many samples)")
    if _get(args, "mtp_num_layers"):  # MTP on the tree (megatron_tree.megatron.mtp): GPT / MLA / DSA / Qwen3-Next
        variant = _get(args, "experimental_attention_variant")
        if _get(args, "tree_hybrid_pattern") or variant not in (None, "gated_delta_net", "dsa"):
            what = ("--tree-hybrid-pattern (the MTP layer would copy the stack's last layer)" if variant is None else
                    f"--experimental-attention-variant {variant}")
            errors.append("--mtp-num-layers with --tree-packing is verified for GPT, MLA, DSA and Qwen3-Next "
                          f"(--experimental-attention-variant gated_delta_net) stacks, not with {what}")
        if variant == "dsa":
            from ..compat.dsa import stock_dsa_mtp_runs

            if not stock_dsa_mtp_runs():
                errors.append("--mtp-num-layers with --experimental-attention-variant dsa needs megatron-core >= 0.19: "
                              "0.16's DSA inside an MTP layer indexes its indexer-loss tracker out of range")
        if _get(args, "pipeline_model_parallel_layout"):
            errors.append("--mtp-num-layers with --tree-packing places every MTP layer on the last pipeline stage: "
                          "drop --pipeline-model-parallel-layout")

    if _get(args, "tree_routing_replay") and not (_get(args, "num_experts")
                                                  or "E" in (_get(args, "tree_hybrid_pattern") or "")
                                                  or "E" in (_get(args, "hybrid_override_pattern") or "")):
        errors.append("--tree-routing-replay needs MoE layers (--num-experts, or 'E' in the hybrid pattern)")
    if _get(args, "tree_routing_replay") and _get(args, "tree_flat_packing"):
        errors.append("--tree-routing-replay packs route-aware prefix trees: drop --tree-flat-packing")

    if _get(args, "tree_carry"):
        if _get(args, "num_layers_per_virtual_pipeline_stage") or _get(args, "virtual_pipeline_model_parallel_size"):
            errors.append("--tree-carry runs 1F1B pipelining, not interleaved virtual stages (a chunk's backward "
                          "order then mixes two chunks' items): drop --num-layers-per-virtual-pipeline-stage")
        if _get(args, "mtp_num_layers") and _get(args, "experimental_attention_variant") == "dsa":
            errors.append("--tree-carry with --mtp-num-layers does not run with DeepSeek sparse attention yet (the MTP "
                          "tail rows its indexer loss reads are not carried)")
        if _get(args, "tree_flat_packing"):
            errors.append("--tree-carry carries the state of shared rows: drop --tree-flat-packing")
        if (_get(args, "expert_model_parallel_size") or 1) > 1:
            from ..megatron.carry import CARRY_EP_REFUSAL

            errors.append(CARRY_EP_REFUSAL)
        kinds, coeffs = _get(args, "moe_router_load_balancing_type"), _get(args, "moe_aux_loss_coeff")
        kinds = list(kinds) if isinstance(kinds, (list, tuple)) else [kinds]
        coeffs = list(coeffs) if isinstance(coeffs, (list, tuple)) else [coeffs] * len(kinds)
        aux = [k for k, c in zip(kinds, coeffs) if k not in (None, "none", "sinkhorn") and (c or 0) > 0]
        moe = _get(args, "num_experts") or "E" in (_get(args, "tree_hybrid_pattern") or "") + (
            _get(args, "hybrid_override_pattern") or "")
        if moe and aux:
            errors.append(f"--tree-carry with --moe-router-load-balancing-type {'/'.join(aux)} "
                          "(--moe-aux-loss-coeff > 0): an aux loss is a product of one microbatch's counts and carry's "
                          "microbatches hold parts of samples, so no flat run computes it; z-loss and expert bias "
                          "carry exactly")

    # -- parallelism
    if _get(args, "num_experts") and _get(args, "moe_token_dispatcher_type") == "allgather":
        errors.append("MoE with --tree-packing needs --moe-token-dispatcher-type alltoall (or flex): microbatch "
                      "lengths vary, which the allgather dispatcher does not support")

    # -- data
    if _get(args, "tree_data_path") and _get(args, "tree_global_batch_samples") is None:
        errors.append("--tree-global-batch-samples is required with --tree-data-path (samples per optimizer step "
                      "over all data-parallel ranks)")

    # -- model
    pattern = _get(args, "tree_hybrid_pattern")
    if pattern is not None:
        from ..megatron.hybrid_pattern import parse_hybrid_pattern  # no Megatron-Core import

        try:
            letters = parse_hybrid_pattern(pattern)
        except ValueError as e:
            errors.append(f"--tree-hybrid-pattern: {e}")
        else:
            if _get(args, "num_layers") is not None and args.num_layers != len(letters):
                errors.append(f"--num-layers ({args.num_layers}) must equal the number of letters of "
                              f"--tree-hybrid-pattern {pattern!r} ({len(letters)})")
            if "E" in letters and not _get(args, "num_experts"):
                errors.append("--tree-hybrid-pattern has MoE layers (E): set --num-experts")
    pos = _get(args, "position_embedding_type")
    if pos is not None and pos not in ("rope", "yarn", "learned_absolute", "none"):
        errors.append(f"--position-embedding-type must be rope, yarn, learned_absolute or none with --tree-packing "
                      f"(positions are depths on the tree); got {pos!r}")
    max_pos = _get(args, "max_position_embeddings")
    if pos == "learned_absolute" and max_pos is not None and budget is not None and max_pos < budget:
        errors.append(f"--max-position-embeddings ({max_pos}) must be >= the microbatch budget ({budget}): a "
                      "sample may be as deep as the budget")

    if errors:
        raise ValueError("invalid arguments for --tree-packing:\n  - " + "\n  - ".join(errors))
    args.tree_max_tokens_per_mb = int(budget)
    args.tree_pad_to_multiple_of = int(pad)
    return args
