"""``megatron-tree score``: forward-only per-token log-probs and entropies of every record of a file.

    megatron-tree score --load runs/ckpt --data rollouts.jsonl --out scores.parquet \\
        --hidden-size 64 --num-layers 2 --vocab-size 128 --max-tokens-per-mb 8192 --nproc 2

What an RL step needs twice (old-policy and reference log-probs), without training code around the
model. The model flags are ``megatron-tree train``'s (`trainer.add_model_args` /
`trainer.add_parallel_args`; the model is built by the same `models.build_model`); ``--load`` is a
``megatron-tree train`` checkpoint directory (its ``latest`` marker), a Megatron-LM one (its
``latest_checkpointed_iteration.txt``; distributed-checkpoint format, with model flags that build
the same parameters: ``--swiglu``, ``--rotary-base``, ``--vocab-size`` = Megatron-LM's padded size;
Megatron-LM ties the output layer to the embedding unless ``--untie-embeddings-and-output-weights``
and has biases unless ``--disable-bias-linear``, our models never do) or one ``iter_XXXXXXX``
directory. Only the model's sharded tensors are read: no optimizer (or its state) is built. Before
any rank starts, the model flags must be those the checkpoint was trained with: a train checkpoint's
recorded flags, or a Megatron-LM checkpoint's numerics arguments (its saved ``args``: norm epsilon,
rotary percent / base / scaling, SwiGLU, biases, tying, qk norms, groups, widths, ...), every difference
named in one error (`check_checkpoint_flags`, `megatron_lm_arg_differences`; the Megatron-LM names
``--norm-epsilon``, ``--rotary-percent``, ``--use-rope-scaling``, ``--rope-scaling-factor``,
``--qk-layernorm``, ``--kv-channels`` set them). The checkpoint's model tensors (names, global shapes;
``optimizer.*`` aside) must be exactly what the model's sharded state dict writes, factories built
(the stock Mamba-2 / GDN mixers' ``in_proj`` and ``conv1d`` sub-tensors), every stage's gathered:
anything else is a `CheckpointMismatch` naming each tensor, never a partial or silent load
(`check_checkpoint_tensors`).

What a run does (every rank):

1. The records (``--data`` JSONL / Parquet files, `data.pipeline.read_samples`; a bad record is an
   error naming ``file:line``, never skipped, so output row i is input record i; with
   ``--routing-replay`` a record's ``routed_experts`` must be there and fit ``--moe-router-topk`` and
   ``--num-experts``, the training readers' rule) are checked against the budget: a record longer than
   ``--max-tokens-per-mb`` is an error naming it (scoring never truncates).
2. All records are packed at once (`tree.pack`: prefixes shared across the whole file, duplicates
   kept as separate samples), the microbatches assigned to DP ranks by predicted cost
   (`data.sharding.balance`; every rank gets the same count, padding microbatches fill the rest,
   so expert-parallel collectives stay matched).
3. Megatron's ``get_forward_backward_func`` runs them with ``forward_only=True`` under
   ``torch.no_grad()`` (TP, SP, PP, EP and tree CP as in training: `forward_step.context_parallel_params`
   plans each microbatch; ``--routing-replay``: route-aware packing and every MoE layer replays its
   rows' routes, `megatron.routing_replay`), the model returning ``(logprobs, entropy)`` per occurrence
   (``TreePackedSeqParams.return_entropy``); the loss function only hands them back with their
   ``(sample, position)`` keys.
4. Rank 0 gathers every occurrence (each CP rank holds its own), checks that each record's target
   positions came back exactly once, and writes ``--out``: one row per record, in input order,
   ``record`` (its index), ``logprobs`` and ``entropy`` (float64 lists aligned with the record's
   loss-masked target tokens, i.e. positions t with ``loss_mask[t]``, ascending; ``--all-tokens``:
   every position 1..L-1). Entropies are in nats. ``--top-k K``: also ``topk_ids`` and ``topk_logprobs``,
   per target the K most likely next tokens under the full-vocabulary softmax and their log-probs,
   descending (`megatron.loss.vocab_parallel_topk`: each TP rank's shard top K, one all-gather of the
   candidates, no ``[tokens, vocab]`` tensor gathered): a teacher's top-k for distillation. ``--values``
   (a value or reward model: a ``train --tree-loss value|rm`` checkpoint, its scalar head
   `megatron.value_head` included): ``values`` (per scored target t, ``V(s_t)``, the head at its source
   row, as the critic trains) and ``reward`` (the head at the record's last row, as the reward model
   trains: the record is scored with one leaf token appended, a row that changes no other row) in
   place of ``logprobs`` / ``entropy``.

The forward pass has no activation memory for a backward, so ``--max-tokens-per-mb`` may exceed
training's. ``--packing flat`` scores every record as its own chain (the baseline of
``tools/bench_score.py``).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from .arguments import CP_PLANNERS, DEFAULT_PAD_MULTIPLE
from .files import replaced_atomically

__all__ = ["add_score_args", "build_score_parser", "check_score_args", "load_score_records", "score", "run",
           "resolve_checkpoint", "check_checkpoint_flags", "check_checkpoint_tensors", "megatron_lm_arg_differences",
           "score_mtp_tail", "CheckpointMismatch", "SCORE_COLUMNS"]

SCORE_COLUMNS = ("record", "logprobs", "entropy")
# Test-only fault switch (None in normal use): "occurrence_shift" writes every record's values one
# scored token off (the last token of the previous record first), which tests/test_score.py must catch.
_FAULT = None
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


# --------------------------------------------------------------------------------------------- arguments
def add_score_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``megatron-tree train``'s model and parallelism flags, plus the scoring group. Returns ``parser``."""
    from .trainer import add_model_args, add_parallel_args

    add_model_args(parser)
    add_parallel_args(parser, training=False)
    g = parser.add_argument_group("scoring")
    g.add_argument("--load", default=None, metavar="DIR",
                   help="checkpoint: a megatron-tree train --save directory (DIR/latest), a Megatron-LM one "
                        "(DIR/latest_checkpointed_iteration.txt, distributed format) or one iter_XXXXXXX directory; "
                        "with --hf-model the architecture comes from that Hugging Face checkpoint and the weights "
                        "from DIR (a train --hf-model run's checkpoint)")
    g.add_argument("--data", nargs="+", required=True, metavar="FILE",
                   help="records to score: JSONL (.jsonl/.json) or Parquet (.parquet/.pq) files or directories, "
                        "read in the order given")
    g.add_argument("--out", required=True, metavar="FILE.parquet",
                   help="one row per record, in input order: record, logprobs, entropy (and with --top-k: "
                        "topk_ids, topk_logprobs)")
    g.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="also write, per scored token, the K most likely next tokens (topk_ids) and their "
                        "log-probs (topk_logprobs) under the full-vocabulary softmax, computed vocab-parallel "
                        "(no [tokens, vocab] tensor is gathered)")
    g.add_argument("--values", action="store_true",
                   help="a value / reward model (a train --tree-loss value|rm checkpoint with its scalar head): write "
                        "values (per scored token, the head at its source row) and reward (the head at the record's "
                        "last row) in place of logprobs / entropy")
    g.add_argument("--max-tokens-per-mb", "--tree-max-tokens-per-mb", dest="tree_max_tokens_per_mb", type=int,
                   default=None, metavar="N",
                   help="row budget of a microbatch (padding included; may exceed training's: no backward). "
                        "Default: the smallest multiple of the padding that holds the longest record and the "
                        "largest tree. A longer record is an error")
    g.add_argument("--all-tokens", action="store_true",
                   help="score every position 1..L-1 of each record, not only its loss-masked targets")
    g.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="parameter / activation dtype (default float32; --bf16 = bfloat16). Softmax and entropy "
                        "are float32 or wider whatever it is")
    g.add_argument("--bf16", action="store_true", help="same as --dtype bfloat16")
    g.add_argument("--packing", choices=("tree", "flat"), default="tree",
                   help="tree: share prefixes across all records (default); flat: each record its own chain")
    g.add_argument("--routing-replay", action="store_true",
                   help="rollout routing replay (R3) for MoE models: every record carries routed_experts "
                        "([tokens][moe_layers][topk]); rows are shared only where tokens and routes agree and every "
                        "MoE layer replays the routes of its rows (a record without routes is an error)")
    g.add_argument("--tree-hybrid-pattern", type=str, default=None, metavar="PATTERN",
                   help="same as --hybrid-override-pattern for our hybrid stack (train's --tree-* spelling)")
    g.add_argument("--tree-cp-planner", choices=CP_PLANNERS, default="balanced",
                   help="row ownership planner under --context-parallel-size > 1")
    g.add_argument("--tree-pad-to-multiple-of", type=int, default=None, metavar="K",
                   help=f"pad every microbatch's rows to a multiple of K (default {DEFAULT_PAD_MULTIPLE}, "
                        "lcm with the TP size under sequence parallelism)")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--quiet", action="store_true", help="no summary line")
    parser.set_defaults(recompute_granularity=None, use_distributed_optimizer=False)
    return parser


def build_score_parser(prog: str = "megatron-tree score") -> argparse.ArgumentParser:
    return add_score_args(argparse.ArgumentParser(prog=prog, description="Forward-only per-token log-probs and "
                                                                         "entropies of records"))


def load_score_records(args) -> tuple[list, list]:
    """``(samples, sources)``: every record of ``--data`` in input order (a bad one is an error, never
    skipped) and where each came from (``file:line`` / ``file:row R``). With ``--routing-replay`` every
    record must carry ``routed_experts`` whose top-k and expert ids fit the model flags, the training
    readers' rule (`tree.routes.read_time_route_spec`), refused with ``file:line`` before any rank starts."""
    from ..data.io import ReadReport
    from ..data.pipeline import read_samples
    from ..tree.routes import read_time_route_spec

    report = ReadReport()
    replay = bool(getattr(args, "routing_replay", False))
    if getattr(args, "hf_model", None) is not None:  # the vocabulary the records are checked against
        from ..bridge.hf_config import hf_config_value

        args.vocab_size = int(hf_config_value(args.hf_model, "vocab_size",
                                              trust_remote_code=bool(getattr(args, "trust_remote_code", False))))
    from .models import hf_vision_input

    args.vision_input = hf_vision_input(args)
    samples = read_samples(args.data, vocab_size=args.vocab_size, bad_sample="error", report=report,
                           route_spec=read_time_route_spec(args) if replay else None, require_routes=replay,
                           vision=args.vision_input)
    return samples, list(report.sources)


def check_score_args(args, samples=None, sources=None) -> argparse.Namespace:
    """Validate ``args`` in place (ValueError listing what to fix) and fill derived defaults; with the
    records, also the budget (default, or: no record may be longer)."""
    from .trainer import _default_budget, _family_errors, fill_model_defaults, hf_model_errors

    if args.bf16:
        if args.dtype not in (None, "bfloat16"):
            raise ValueError(f"--bf16 contradicts --dtype {args.dtype}")
        args.dtype = "bfloat16"
    args.dtype = args.dtype or "float32"
    args.bf16 = args.dtype == "bfloat16"
    errors = _family_errors(args) + hf_model_errors(args)
    if args.load is None and getattr(args, "hf_model", None) is None:
        errors.append("give --load DIR (a Megatron checkpoint), --hf-model PATH (a Hugging Face one), or both "
                      "(the architecture from PATH, the weights from DIR: a train --hf-model checkpoint)")
    tp, pp, ep = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size
    cp = args.context_parallel_size
    if min(tp, pp, ep, cp) < 1 or args.nproc < 1:
        errors.append("parallel sizes and --nproc must be >= 1")
    elif "RANK" not in os.environ and args.nproc % (tp * pp * cp):
        errors.append(f"--nproc ({args.nproc}) must be a multiple of tensor x pipeline x context parallel sizes "
                      f"({tp * pp * cp})")
    if args.sequence_parallel and tp == 1:
        errors.append("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if not 0 <= args.top_k <= (args.vocab_size or 0):
        errors.append(f"--top-k must be between 0 and the vocabulary size ({args.vocab_size}), got {args.top_k}")
    if getattr(args, "values", False):
        if args.top_k:
            errors.append("--top-k reads the LM head; --values scores a value / reward model's scalar head: one of them")
        if args.load is None:
            errors.append("--values needs --load DIR: the value / reward model's checkpoint (its scalar head is "
                          "trained, not in a Hugging Face causal-LM checkpoint)")
        if getattr(args, "mtp_num_layers", None):
            errors.append("--values: a value / reward model takes no MTP layers (--mtp-num-layers)")
    if args.num_attention_heads % tp and getattr(args, "hf_model", None) is None:
        errors.append(f"--num-attention-heads ({args.num_attention_heads}) must be divisible by TP ({tp})")
    if args.hybrid_override_pattern and args.tree_hybrid_pattern and \
            args.hybrid_override_pattern != args.tree_hybrid_pattern:
        errors.append("--hybrid-override-pattern and --tree-hybrid-pattern disagree; pass one of them")
    if args.routing_replay and not (args.num_experts or "E" in (args.hybrid_override_pattern or "")
                                    or "E" in (args.tree_hybrid_pattern or "")):
        errors.append("--routing-replay needs MoE layers: --num-experts N (or an 'E' in the hybrid pattern)")
    if not str(args.out).endswith((".parquet", ".pq")):
        errors.append(f"--out {args.out}: the output is Parquet, name it FILE.parquet")
    pad = args.tree_pad_to_multiple_of
    if pad is None:
        pad = int(np.lcm(DEFAULT_PAD_MULTIPLE, tp)) if args.sequence_parallel else DEFAULT_PAD_MULTIPLE
    elif pad < 1 or (args.sequence_parallel and pad % tp):
        errors.append(f"--tree-pad-to-multiple-of ({pad}) must be >= 1 (and a multiple of TP under "
                      "--sequence-parallel)")
    budget = args.tree_max_tokens_per_mb
    if budget is not None and (budget < 1 or budget % max(pad, 1)):
        errors.append(f"--max-tokens-per-mb ({budget}) must be a positive multiple of the padding multiple ({pad})")
    if errors:
        raise ValueError("invalid arguments for megatron-tree score:\n  - " + "\n  - ".join(errors))
    args.tree_pad_to_multiple_of = pad
    if samples is not None and args.routing_replay:
        missing = [i for i, s in enumerate(samples) if s.routed_experts is None]
        if missing:
            i = missing[0]
            raise ValueError(f"{sources[i] if sources else f'record {i}'}: record {i} has no routed_experts, but "
                             "--routing-replay replays every record's routes (it would be re-routed, not replayed)")
    if samples is not None:
        tail = score_mtp_tail(args)
        reward_row = int(bool(getattr(args, "values", False)))
        if reward_row:  # the reward position: one leaf token after each record
            samples = _records_for_scoring(samples, args.all_tokens, reward=True)
        lens = np.array([len(s) - reward_row for s in samples], dtype=np.int64)
        if budget is None:
            args.tree_max_tokens_per_mb = (_default_budget(samples, args) if not tail else
                                           _tail_budget(samples, tail, pad)) if len(samples) else pad
        elif len(lens) and int(lens.max()) + tail + reward_row > budget:
            i = int(np.argmax(lens + tail + reward_row > budget))
            where = sources[i] if sources else f"record {i}"
            rows = f" (and {tail} MTP tail rows: DSA in the MTP layers)" if tail else \
                " (and its reward row: --values)" if reward_row else ""
            raise ValueError(f"{where}: record {i} has {int(lens[i])} tokens{rows}, more than --max-tokens-per-mb "
                             f"{budget}: a record must fit in one microbatch and scoring never truncates; raise "
                             "--max-tokens-per-mb")
    fill_model_defaults(args)
    return args


def score_mtp_tail(args) -> int:
    """Rows `tree.pack` appends after each record for the model's MTP layers (``mtp_tail``):
    `megatron.mtp.mtp_tail_rows` of the config the flags build (DSA with an indexer loss in the MTP
    layers: ``--mtp-num-layers``; else 0). They are never shared, never scored, and count against
    the budget."""
    from types import SimpleNamespace

    from ..megatron.mtp import mtp_tail_rows
    from .models import DSA_DEFAULTS

    coeff = getattr(args, "dsa_indexer_loss_coeff", None)
    return mtp_tail_rows(SimpleNamespace(
        mtp_num_layers=getattr(args, "mtp_num_layers", None),
        experimental_attention_variant=getattr(args, "experimental_attention_variant", None),
        dsa_indexer_loss_coeff=DSA_DEFAULTS["dsa_indexer_loss_coeff"] if coeff is None else coeff))


def _tail_budget(samples, tail: int, pad: int) -> int:
    """The default budget with ``tail`` rows after every record: the longest record and the largest
    tree, tails included, rounded up to the padding multiple."""
    from ..tree.packing import PrefixPlan

    toks = [np.asarray(s.tokens) for s in samples]
    need = max(max(len(t) for t in toks) + tail, int(PrefixPlan(toks, mtp_tail=tail).tree_rows().max()))
    return -(-need // pad) * pad


# --------------------------------------------------------------------------------------------- checkpoint
def resolve_checkpoint(directory: str) -> str:
    """The checkpoint directory ``--load`` names: ``DIR/latest`` (megatron-tree train),
    ``DIR/latest_checkpointed_iteration.txt`` (Megatron-LM) or DIR itself when it is one checkpoint
    (holds ``metadata.json``). A clear error otherwise."""
    from .trainer import _iter_dir, latest_checkpoint

    if not os.path.isdir(directory):
        raise FileNotFoundError(f"--load {directory}: no such directory")
    step = latest_checkpoint(directory)
    if step is not None:
        return _iter_dir(directory, step)
    marker = os.path.join(directory, "latest_checkpointed_iteration.txt")
    if os.path.isfile(marker):
        with open(marker) as f:
            text = f.read().strip()
        if text == "release":
            path = os.path.join(directory, "release")
        elif text.isdigit():
            path = _iter_dir(directory, int(text))
        else:
            raise ValueError(f"{marker}: expected an iteration number or 'release', found {text!r}")
        if not os.path.isdir(path):
            raise ValueError(f"{marker} names {text!r}, but {path} is missing")
        if not os.path.isfile(os.path.join(path, "metadata.json")):
            raise ValueError(f"{path}: not a distributed checkpoint (no metadata.json); megatron-tree score reads "
                             "Megatron-LM checkpoints saved with --ckpt-format torch_dist")
        return path
    if os.path.isfile(os.path.join(directory, "metadata.json")):
        return directory
    raise ValueError(f"--load {directory}: no checkpoint there (neither a 'latest' marker of megatron-tree train, nor "
                     "Megatron-LM's latest_checkpointed_iteration.txt, nor a checkpoint's metadata.json)")


# model flags a megatron-tree train checkpoint records (run_args) that must match the scoring model
_MODEL_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size",
                "hybrid_override_pattern", "tree_hybrid_pattern", "num_experts", "moe_ffn_hidden_size",
                "moe_router_topk", "normalization", "model_family", "experimental_attention_variant",
                "multi_latent_attention", "linear_attention_freq", "dsa_indexer_topk", "swiglu", "rotary_base",
                "norm_epsilon", "rotary_percent", "use_rope_scaling", "rope_scaling_factor", "qk_layernorm",
                "kv_channels", "mtp_num_layers")
# what a checkpoint of a megatron-tree train that predates a flag was trained with (the flag's default)
_FLAG_DEFAULTS = {"swiglu": False, "rotary_base": 10000, "norm_epsilon": 1e-5, "rotary_percent": 1.0,
                  "use_rope_scaling": False, "rope_scaling_factor": 8.0, "qk_layernorm": False, "kv_channels": None,
                  "mtp_num_layers": None}
_ABSENT = object()


def _lm_arg(ns, *names):
    """The first of ``names`` that Megatron-LM's args ``ns`` has (0.19 keeps some under their
    TransformerConfig names: ``--norm-epsilon`` is ``layernorm_epsilon``), else `_ABSENT`."""
    for n in names:
        if hasattr(ns, n):
            return getattr(ns, n)
    return _ABSENT


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return abs(float(a) - float(b)) <= 1e-12 * max(abs(float(a)), abs(float(b)))
        except (TypeError, ValueError):
            return False
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and tuple(a) == tuple(b)
    return a == b


def megatron_lm_arg_differences(ckpt_args, args) -> list:
    """``["name: checkpoint X, flags Y (how to match)", ...]``: every numerics argument of a Megatron-LM
    checkpoint (its saved ``args``, Megatron-LM's names) that differs from the model ``args`` (score's
    model flags) build: the `models.make_config` TransformerConfig and `models.ModelArgs`, compared
    where Megatron-LM's model reads the argument (``core_transformer_config_from_args`` copies it into
    the config, or the model class takes it). An argument the checkpoint does not record is not compared.
    "(--flag)" names the score flag that sets it; "(fixed ...)" one megatron-tree's models do not vary."""
    import torch.nn.functional as F

    from .models import make_config
    from .trainer import _model_args

    margs = _model_args(args)
    config = make_config(margs)  # no process group needed: the numerics fields only
    a = ckpt_args
    mamba, mla = margs.kind == "mamba", bool(getattr(config, "multi_latent_attention", False))
    pattern = margs.pattern if margs.kind in ("hybrid", "mamba") else ""
    rows = []  # (Megatron-LM name, checkpoint value, ours, hint)

    def add(name, ck, ours, flag=None, fixed="fixed in megatron-tree's models"):
        if ck is not _ABSENT:
            rows.append((name, ck, ours, flag or fixed))

    gqa = _lm_arg(a, "group_query_attention")
    heads = _lm_arg(a, "num_attention_heads")
    add("hidden_size", _lm_arg(a, "hidden_size"), config.hidden_size, "--hidden-size")
    add("num_attention_heads", heads, config.num_attention_heads, "--num-attention-heads")
    add("padded_vocab_size", _lm_arg(a, "padded_vocab_size"), margs.vocab_size, "--vocab-size")
    if gqa is not _ABSENT:
        groups = _lm_arg(a, "num_query_groups") if gqa else heads
        add("group_query_attention/num_query_groups", groups, config.num_query_groups, "--num-query-groups")
    if not mla:
        add("kv_channels", _lm_arg(a, "kv_channels"), config.kv_channels, "--kv-channels")
    add("ffn_hidden_size", _lm_arg(a, "ffn_hidden_size"), config.ffn_hidden_size, "--ffn-hidden-size")
    add("normalization", _lm_arg(a, "normalization"), config.normalization, "--normalization")
    add("norm_epsilon", _lm_arg(a, "norm_epsilon", "layernorm_epsilon"), config.layernorm_epsilon, "--norm-epsilon")
    add("apply_layernorm_1p", _lm_arg(a, "apply_layernorm_1p", "layernorm_zero_centered_gamma"),
        bool(config.layernorm_zero_centered_gamma), fixed="fixed: megatron-tree's models have no zero-centered norms")
    add("swiglu", _lm_arg(a, "swiglu"), bool(config.gated_linear_unit) and config.activation_func is F.silu, "--swiglu")
    add("squared_relu", _lm_arg(a, "squared_relu"), False)
    add("untie_embeddings_and_output_weights", _lm_arg(a, "untie_embeddings_and_output_weights"), True,
        fixed="fixed: megatron-tree's models never tie the output layer to the embedding")
    add("add_bias_linear", _lm_arg(a, "add_bias_linear"), bool(config.add_bias_linear),
        fixed="fixed: megatron-tree's models have no linear biases")
    add("add_qkv_bias", _lm_arg(a, "add_qkv_bias"), bool(config.add_qkv_bias),
        fixed="fixed: megatron-tree's models have no linear biases")
    if not mamba:  # MambaModel's attention has no query/key norms whatever the flag says
        add("qk_layernorm", _lm_arg(a, "qk_layernorm"), bool(config.qk_layernorm), "--qk-layernorm")
    add("qk_l2_norm", _lm_arg(a, "qk_l2_norm"), bool(getattr(config, "qk_l2_norm", False)))
    add("attention_output_gate", _lm_arg(a, "attention_output_gate"),
        bool(getattr(config, "attention_output_gate", False)))
    add("softmax_type", _lm_arg(a, "softmax_type"), getattr(config, "softmax_type", "vanilla"))
    window = _lm_arg(a, "window_size")
    if window is not _ABSENT and window is not None:
        add("window_size", window, config.window_size)
    ck_pos = _lm_arg(a, "position_embedding_type")
    add("position_embedding_type", ck_pos, margs.position_embedding_type)
    if mla:  # MLA builds its own rotary (YaRN) from the config; GPTModel's rotary arguments do not reach it
        add("rotary_base", _lm_arg(a, "rotary_base"), config.rotary_base, "--rotary-base")
        for f in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
                  "rotary_scaling_factor", "mscale", "mscale_all_dim"):
            add(f, _lm_arg(a, f), getattr(config, f), fixed="fixed: megatron-tree's MLA shapes (models.MLA_DEFAULTS)")
        if _lm_arg(a, "rope_type") not in (None, _ABSENT):
            add("rope_type", _lm_arg(a, "rope_type"), config.rope_type)
    elif ck_pos == "rope" and margs.position_embedding_type == "rope":
        add("rotary_percent", _lm_arg(a, "rotary_percent"), margs.rotary_percent, "--rotary-percent")
        add("rotary_base", _lm_arg(a, "rotary_base"), margs.rotary_base, "--rotary-base")
        add("rotary_interleaved", _lm_arg(a, "rotary_interleaved"), bool(getattr(config, "rotary_interleaved", False)))
        add("rotary_seq_len_interpolation_factor", _lm_arg(a, "rotary_seq_len_interpolation_factor"), None)
        if not mamba:  # MambaModel takes no rope scaling
            ck_scaling = _lm_arg(a, "use_rope_scaling")
            add("use_rope_scaling", ck_scaling, margs.rope_scaling, "--use-rope-scaling")
            if ck_scaling is True or margs.rope_scaling:
                add("rope_scaling_factor", _lm_arg(a, "rope_scaling_factor"), margs.rope_scaling_factor,
                    "--rope-scaling-factor")
    ck_experts = _lm_arg(a, "num_experts")
    if ck_experts not in (None, _ABSENT) or config.num_moe_experts:
        add("num_experts", ck_experts, config.num_moe_experts, "--num-experts")
        add("moe_ffn_hidden_size", _lm_arg(a, "moe_ffn_hidden_size"), config.moe_ffn_hidden_size,
            "--moe-ffn-hidden-size")
        add("moe_router_topk", _lm_arg(a, "moe_router_topk"), config.moe_router_topk, "--moe-router-topk")
        for f in ("moe_router_score_function", "moe_router_pre_softmax", "moe_router_topk_scaling_factor",
                  "moe_router_enable_expert_bias", "moe_shared_expert_intermediate_size"):
            add(f, _lm_arg(a, f), getattr(config, f, None))
    if mamba or "M" in pattern:
        for f in ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups"):
            add(f, _lm_arg(a, f), getattr(config, f),
                fixed="fixed: megatron-tree's Mamba-2 shapes (models.make_config)")
    if margs.kind == "qwen3next" or "G" in pattern:
        for f in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                  "linear_num_value_heads"):
            add(f, _lm_arg(a, f), getattr(config, f), fixed="fixed: megatron-tree's GDN shapes (models.make_config)")
    return [f"{name}: checkpoint {ck!r}, flags {ours!r} ({hint})" for name, ck, ours, hint in rows
            if not _same(ck, ours)]


def check_checkpoint_flags(path: str, args) -> None:
    """ValueError naming every model flag that differs from what the checkpoint was trained with: the
    flags a megatron-tree train checkpoint recorded (``run_args``), or the numerics arguments of a
    Megatron-LM one (its ``args``; `megatron_lm_arg_differences`). `run` calls it before any rank starts."""
    from megatron.core import dist_checkpointing

    try:
        common = dist_checkpointing.load_common_state_dict(path)
    except Exception:  # noqa: BLE001 - no common state (a bare dist_checkpointing save): the tensor check still applies
        common = {}
    common = common if isinstance(common, dict) else {}
    run_args, lm_args = common.get("run_args"), common.get("args")
    if isinstance(run_args, dict):
        def recorded(k):
            return run_args[k] if k in run_args else _FLAG_DEFAULTS.get(k, _ABSENT)

        bad = [f"--{k.replace('_', '-')}: checkpoint {recorded(k)!r}, here {getattr(args, k, None)!r}"
               for k in _MODEL_FLAGS if recorded(k) is not _ABSENT and not _same(getattr(args, k, None), recorded(k))
               and not (k == "rope_scaling_factor" and not (getattr(args, "use_rope_scaling", False)
                                                             or recorded("use_rope_scaling")))]
        if bad:
            raise ValueError(f"--load {path}: the model flags differ from those the checkpoint was trained with:\n  - "
                             + "\n  - ".join(bad))
    elif lm_args is not None and hasattr(lm_args, "hidden_size"):
        bad = megatron_lm_arg_differences(lm_args, args)
        if bad:
            raise ValueError(f"--load {path}: the Megatron-LM checkpoint's model arguments differ from the model the "
                             "score flags build (pass the flag in parentheses with the checkpoint's value; 'fixed' "
                             "ones megatron-tree's models do not build otherwise):\n  - " + "\n  - ".join(bad))


def _model_tensor_shapes(sharded: dict) -> dict:
    """``{key: global shape}`` of every tensor the model's sharded state dict writes to a checkpoint:
    its ``ShardedTensor``s and what each ``ShardedTensorFactory`` builds (the stock Mamba-2 and Gated
    DeltaNet mixers save ``in_proj.weight`` and ``conv1d.*`` as sub-tensors, e.g. ``in_proj.weight.z``,
    ``conv1d.weight.query``, ``conv1d.bias.x``: those names, not the parameter's, are in a checkpoint).
    Factories are built on the side (``build()``, views of the parameters); ``sharded`` is not changed."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = {}

    def visit(values):
        for v in values:
            if isinstance(v, ShardedTensor):
                out[v.key] = tuple(v.global_shape)
            elif isinstance(v, ShardedTensorFactory):
                built = v.build()
                visit(nested_values(built) if isinstance(built, (dict, list)) else [built])

    visit(nested_values(sharded))
    return out


class CheckpointMismatch(ValueError):
    """The checkpoint's parameters are not the ones the model flags build (`check_checkpoint_tensors`)."""


# optimizer state: ``optimizer.*``, or ``chained_N.optimizer.*`` when the optimizer is Megatron's
# ChainedOptimizer (expert parallelism: dense and expert parameters have an optimizer each)
_OPTIMIZER_KEY = re.compile(r"(chained_\d+\.)?optimizer\.")


def check_checkpoint_tensors(path: str, model_shapes: dict) -> None:
    """ValueError unless checkpoint ``path`` holds exactly the model's tensors (``model_shapes``: every
    pipeline stage's ``{key: global shape}``), with their shapes: a tensor the model lacks (a bias,
    a tied or untied output layer, an extra layer) would otherwise be silently ignored, one the
    checkpoint lacks or of another shape would load wrong. Optimizer state (``[chained_N.]optimizer.*``) is not
    the model's and is skipped."""
    from megatron.core import dist_checkpointing

    stored = {k: tuple(v.global_shape) for k, v in dist_checkpointing.load_tensors_metadata(path).items()
              if not _OPTIMIZER_KEY.match(k)}
    missing = sorted(set(model_shapes) - set(stored))
    extra = sorted(set(stored) - set(model_shapes))
    shapes = sorted(f"{k}: checkpoint {list(stored[k])}, model {list(s)}" for k, s in model_shapes.items()
                    if k in stored and stored[k] != tuple(s))
    problems = ([f"not in the checkpoint: {', '.join(missing)}"] if missing else []) + \
               ([f"in the checkpoint, not in the model: {', '.join(extra)}"] if extra else []) + \
               [f"shape differs: {x}" for x in shapes]
    if problems:
        hint = ""
        if "output_layer.weight" in missing:
            hint += ("\n  (no output_layer.weight: a Megatron-LM model with tied embeddings; our models are untied, "
                     "train with --untie-embeddings-and-output-weights)")
        if any(k.endswith(".bias") for k in extra):
            hint += "\n  (biases: our models have none, train with --disable-bias-linear)"
        if any(k.startswith("value_head.") for k in extra):
            hint += "\n  (value_head.*: a value / reward model's checkpoint (train --tree-loss value|rm): pass --values)"
        if any(k.startswith("value_head.") for k in missing):
            hint += "\n  (no value_head.*: a language model's checkpoint; --values scores a value / reward model)"
        if any("linear_fc1" in x for x in shapes):
            hint += "\n  (linear_fc1 twice as wide: the checkpoint's MLPs are SwiGLU: pass --swiglu; half: drop it)"
        raise CheckpointMismatch(f"--load {path}: the checkpoint's parameters do not match the model the flags build "
                         "(pass the model flags it was trained with; the vocabulary is Megatron-LM's padded size):\n"
                         "  - " + "\n  - ".join(problems) + hint)


def _load_model(path: str, model, args) -> None:
    """The model's tensors from checkpoint ``path`` (nothing else is read into memory), after checking
    that the checkpoint holds exactly the model's parameters (`check_checkpoint_tensors`)."""
    from megatron.core import dist_checkpointing

    check_checkpoint_flags(path, args)
    sharded = model.sharded_state_dict()
    shapes = [None] * dist.get_world_size()
    dist.all_gather_object(shapes, _model_tensor_shapes(sharded))  # every stage's tensors
    check_checkpoint_tensors(path, {k: v for d in shapes for k, v in d.items()})
    loaded = dist_checkpointing.load({"model": sharded}, path)
    model.load_state_dict(loaded["model"])


# --------------------------------------------------------------------------------------------- forward
def _collect(loss_map, output):
    """The schedule's ``loss_func``: hands back this microbatch's occurrences (no loss)."""
    lp, ent = output[:2]
    zero = lp.sum() * 0.0
    num = torch.tensor(len(loss_map), dtype=torch.int, device=lp.device)
    report = {"sample_index": loss_map.sample_index.cpu(), "positions": loss_map.positions.cpu(),
              "logprobs": lp.detach().double().cpu(), "entropy": ent.detach().double().cpu()}
    if len(output) == 4:  # --top-k
        report.update(topk_ids=output[2].cpu(), topk_logprobs=output[3].double().cpu())
    return zero, num, report


def _score_step(data_iterator, model, *, cp_strategy: str = "balanced", device=None, top_k: int = 0):
    from ..megatron.forward_step import context_parallel_params
    from ..megatron.packed_seq import tree_packed_seq_params

    mb = next(data_iterator)
    dev = device if device is not None else next(model.parameters()).device
    psp = context_parallel_params(tree_packed_seq_params(mb, dev, return_entropy=True, return_topk=top_k), model,
                                  strategy=cp_strategy)
    out = model(psp.input_ids.unsqueeze(0), psp.position_ids.unsqueeze(0), None, packed_seq_params=psp)
    return out, partial(_collect, psp.loss_map)


def _records_for_scoring(samples, all_tokens: bool, reward: bool = False) -> list:
    """Tokens, the scored positions and the routes only (RL fields play no part in a forward pass). ``reward``
    (``--values``): each record with one leaf token (0) appended as one more target, whose source row is the record's
    last row (the reward position; routes repeated for it)."""
    from ..tree.sample import Sample

    out = [Sample(tokens=s.tokens, loss_mask=None if all_tokens else s.target_mask(),
                  routed_experts=s.routed_experts, images=s.images) for s in samples]
    if not reward:
        return out
    return [Sample(tokens=np.append(s.tokens, 0), loss_mask=np.append(s.target_mask(), True),
                   routed_experts=None if s.routed_experts is None else
                   np.concatenate([s.routed_experts, s.routed_experts[-1:]]), images=s.images) for s in out]


def score(args, samples=None, sources=None) -> dict:
    """Score on the current process group (initialised here from the environment if needed); rank 0
    writes ``--out``. Returns (every rank) ``{"records", "targets", "tree_rows", "flat_tokens",
    "microbatches", "seconds" (the forward passes, slowest rank), "records_per_s", "tokens_per_s" (flat
    tokens, i.e. the records' total length, per second), "packing", "out"}``."""
    from megatron.core import parallel_state as ps

    from .trainer import init_parallel

    if samples is None:
        samples, sources = load_score_records(args)
    check_score_args(args, samples, sources)
    on_cpu = init_parallel(args)
    try:
        return _score(args, samples, on_cpu)
    finally:
        ps.destroy_model_parallel()


def _score(args, samples, on_cpu: bool) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from ..data.sharding import balance, microbatch_cost
    from ..tree import pack, padding_microbatch
    from .models import build_hf_model, build_model, make_config
    from .trainer import _model_args

    dtype = DTYPES[args.dtype]
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)
    if getattr(args, "hf_model", None) is not None:
        _, config, model = build_hf_model(args, dtype, on_cpu, hf_weights=args.load is None)
        _value_head(model, args)
        if args.load is not None:  # a train --hf-model checkpoint: the architecture from PATH, weights from DIR
            _load_model(resolve_checkpoint(args.load), model, args)
    else:
        margs = _model_args(args)
        if args.routing_replay:  # Megatron gives every router a replay hook
            margs.extra["moe_enable_routing_replay"] = True
        config = make_config(margs, tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                             ep=args.expert_model_parallel_size, cp=args.context_parallel_size,
                             sp=args.sequence_parallel, dtype=dtype, cpu=on_cpu)
        model = build_model(config, margs)
        _value_head(model, args)
        if not on_cpu:
            model = model.cuda()
        _load_model(resolve_checkpoint(args.load), model, args)
    model.eval()
    spec = None
    if args.routing_replay:
        from ..megatron.routing_replay import install_routing_replay, reset_routing_replay
        from ..tree.routes import RouteSpec

        install_routing_replay(model)
        spec = RouteSpec(moe_layers=model.routing_replay_moe_layers, topk=config.moe_router_topk,
                         num_experts=config.num_moe_experts)

    records = _records_for_scoring(samples, args.all_tokens, reward=getattr(args, "values", False))
    budget, pad = args.tree_max_tokens_per_mb, args.tree_pad_to_multiple_of
    from ..megatron.mtp import mtp_tail_rows

    mbs = pack(records, budget, pad_to_multiple_of=pad, vocab_size=args.vocab_size,
               share_prefixes=args.packing == "tree", route_aware=spec is not None, route_spec=spec,
               mtp_tail=mtp_tail_rows(config))  # DSA in the MTP layers: each record's trailing MTP rows
    vision = getattr(args, "vision_input", None)
    if vision is not None:  # each microbatch's image occurrences get their pixels
        mbs = [vision.attach(mb) for mb in mbs]
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    per_rank = max(1, -(-len(mbs) // dp_size))
    mine = [mbs[i] for i in balance([microbatch_cost(mb) for mb in mbs], dp_size, per_rank)[dp_rank]] if mbs else []
    shape = None if spec is None else (spec.moe_layers, spec.topk)
    mine += [padding_microbatch(budget, num_rows=pad, route_shape=shape) for _ in range(per_rank - len(mine))]
    if spec is not None:
        reset_routing_replay(model)

    dev = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())
    if dist.get_world_size() > 1:
        dist.barrier()
    t0 = time.perf_counter()
    with torch.no_grad():
        reports = get_forward_backward_func()(
            forward_step_func=partial(_score_step, cp_strategy=args.tree_cp_planner, device=dev, top_k=args.top_k),
            data_iterator=iter(mine), model=[model], num_microbatches=len(mine),
            seq_length=max(mb.num_rows for mb in mine), micro_batch_size=1, forward_only=True)
    seconds = time.perf_counter() - t0
    t = torch.tensor([seconds], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    seconds = float(t)

    # the loss-computing ranks (last stage, TP rank 0) hold every occurrence once, spread over DP x CP
    owner = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    keys = ("sample_index", "positions", "logprobs", "entropy") + (("topk_ids", "topk_logprobs") if args.top_k else ())
    empty = {"topk_ids": np.zeros((0, args.top_k), np.int64), "topk_logprobs": np.zeros((0, args.top_k))}
    part = {k: torch.cat([r[k] for r in reports]).numpy() if owner and reports else empty.get(k, np.zeros(0))
            for k in keys}
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(part, gathered, dst=0)
    n_targets = int(sum(int(s.target_mask().sum()) for s in records))
    out = {"records": len(records), "targets": n_targets, "tree_rows": int(sum(mb.stats.tree_tokens for mb in mbs)),
           "flat_tokens": int(sum(len(s) for s in records)), "microbatches": len(mbs), "seconds": seconds,
           "records_per_s": len(records) / seconds, "tokens_per_s": sum(len(s) for s in records) / seconds,
           "packing": args.packing, "out": args.out}
    if getattr(args, "values", False):  # (the reward positions are not targets of the records)
        out["targets"] -= len(records)
    if dist.get_rank() == 0:
        _write(args.out, records, {k: np.concatenate([g[k] for g in gathered]) for k in keys},
               values=getattr(args, "values", False))
    dist.barrier()
    return out


def _value_head(model, args) -> None:
    """``--values``: the model's scalar head (`megatron.value_head`, on the last stage, with a bias where the checkpoint
    has one), before the weights load."""
    if getattr(args, "values", False):
        from megatron.core import dist_checkpointing

        from ..megatron.value_head import add_value_head

        # a reward model's head has no bias (train --tree-loss rm), a value model's has: as the checkpoint holds it
        meta = dist_checkpointing.load_tensors_metadata(resolve_checkpoint(args.load))
        add_value_head(model, bias="value_head.bias" in meta)
        if getattr(model, "value_head", None) is not None:
            model.value_head.to(next(model.parameters()).device)


def _write(path: str, records: list, occ: dict, values: bool = False) -> None:
    """Rank 0: order the occurrences by (record, position), check each record's targets came back
    exactly once, write the Parquet file (whole or not at all: `replaced_atomically`). ``values``: the
    occurrences are a value model's (each record's last one its reward position)."""
    import pyarrow as pa

    sidx = occ["sample_index"].astype(np.int64)
    pos = occ["positions"].astype(np.int64)
    order = np.lexsort((pos, sidx))
    expected = np.concatenate([np.flatnonzero(s.target_mask()) for s in records] or [np.zeros(0, np.int64)])
    counts = np.array([int(s.target_mask().sum()) for s in records], dtype=np.int64)
    expected_sidx = np.repeat(np.arange(len(records)), counts)
    if len(order) != len(expected) or not (np.array_equal(sidx[order], expected_sidx)
                                           and np.array_equal(pos[order], expected)):
        raise RuntimeError(f"megatron-tree score: {len(order)} scored occurrences came back for {len(expected)} "
                           "targets, or not one per (record, position): a rank lost or repeated a microbatch")
    offsets = np.zeros(len(records) + 1, dtype=np.int32)
    np.cumsum(counts, out=offsets[1:])
    vals = {k: occ[k][order].astype(np.float64) for k in ("logprobs", "entropy")}
    if _FAULT == "occurrence_shift":
        vals = {k: np.roll(v, 1) for k, v in vals.items()}
    if values:  # per record: its targets' values, then its reward position's
        last = offsets[1:] - 1
        keep = np.ones(len(order), dtype=bool)
        keep[last] = False
        per_target = np.zeros(len(records) + 1, dtype=np.int32)
        np.cumsum(counts - 1, out=per_target[1:])
        table = pa.table({"record": pa.array(np.arange(len(records), dtype=np.int64)),
                          "values": pa.ListArray.from_arrays(pa.array(per_target), pa.array(vals["logprobs"][keep])),
                          "reward": pa.array(vals["logprobs"][last])})
        _write_table(path, table)
        return
    lists = {k: pa.ListArray.from_arrays(pa.array(offsets), pa.array(v)) for k, v in vals.items()}
    if "topk_ids" in occ:  # per target a list of K, descending
        for k, dtype in (("topk_ids", np.int64), ("topk_logprobs", np.float64)):
            v = occ[k][order].astype(dtype)
            per_target = pa.FixedSizeListArray.from_arrays(pa.array(v.reshape(-1)), v.shape[1])
            lists[k] = pa.ListArray.from_arrays(pa.array(offsets), per_target)
    _write_table(path, pa.table({"record": pa.array(np.arange(len(records), dtype=np.int64)), **lists}))


def _write_table(path: str, table) -> None:
    import pyarrow.parquet as pq

    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with replaced_atomically(path) as tmp:
        pq.write_table(table, tmp)


# --------------------------------------------------------------------------------------------- entry point
def _rank_score(args, samples, sources) -> dict:
    from .trainer import _quiet_warnings

    _quiet_warnings()
    try:
        return score(args, samples, sources)
    except CheckpointMismatch as e:  # every rank finds the same mismatch (gathered shapes): handed back, not a crash
        return {"error": str(e)}


def format_summary(out: dict) -> str:
    return (f"megatron-tree score: {out['records']:,} records, {out['targets']:,} scored tokens, "
            f"{out['microbatches']} microbatches ({out['packing']}: {out['tree_rows']:,} rows for "
            f"{out['flat_tokens']:,} tokens), {out['seconds']:.2f}s forward, {out['records_per_s']:,.1f} records/s, "
            f"{out['tokens_per_s']:,.0f} tokens/s -> {out['out']}")


def run(args) -> dict:
    """Check ``args`` and score: here under torchrun/srun, else on ``--nproc`` spawned local ranks.
    Returns rank 0's `score` result."""
    from .trainer import _launched

    samples, sources = load_score_records(args)
    check_score_args(args, samples, sources)
    if args.load is not None and getattr(args, "hf_model", None) is None:
        check_checkpoint_flags(resolve_checkpoint(args.load), args)  # before any rank starts
    if _launched() or dist.is_initialized():
        from .trainer import _quiet_warnings

        _quiet_warnings()
        out = score(args, samples, sources)
    else:
        from .launch import run_distributed

        out = run_distributed(_rank_score, args.nproc, args, samples, sources, timeout=args.timeout)[0]
        if "error" in out:
            raise CheckpointMismatch(out["error"])
    if not args.quiet and (not dist.is_initialized() or dist.get_rank() == 0):
        print(format_summary(out), flush=True)
    return out


def main(argv=None) -> int:
    args = build_score_parser().parse_args(argv)
    try:
        run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"megatron-tree score: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
