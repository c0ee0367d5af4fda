"""``megatron-tree train``: a Megatron-Core training loop over packed prefix trees.

    megatron-tree train --synthetic-preset varied_5k_16x100 --synthetic-scale 0.1 --nproc 2 \\
        --hybrid-override-pattern "MG*-*E" --num-experts 4 --train-iters 30 --lr 3e-3 \\
        --tree-max-tokens-per-mb 1024 --tree-global-batch-samples 32 --save runs/ckpt --load runs/ckpt

What one optimizer step does (every rank, `train`):

1. `TreeDataPipeline` hands this DP rank its `TreeStep`: the window of ``--tree-global-batch-samples``
   samples packed into prefix-tree microbatches, balanced over DP ranks (every rank the same
   microbatch count), built ahead by a background thread (``--tree-lookahead``).
2. `models.forward_backward` runs them through Megatron's ``get_forward_backward_func`` (variable
   sequence lengths between pipeline stages), DDP reduces the gradients, ``finalize_model_grads``
   divides them by the global target count (per-token loss: per-sample training, exactly).
3. ``get_megatron_optimizer`` steps (grad clipping included), ``OptimizerParamScheduler`` moves lr/wd.
4. Metrics: loss (sum of per-occurrence losses / targets over all DP ranks), lr, grad norm,
   tree_token_ratio, tree rows/s, samples/s, useful (flat-equivalent) tokens/s, data-wait fraction
   of the step time and the planner's DP imbalance (max / mean predicted rank cost); with
   ``--tree-bad-sample skip``, the bad samples skipped (named on rank 0 at start; in the log line
   and TensorBoard's ``data/skipped_samples``).

Checkpoints (``--save``, every ``--save-interval`` steps and at the end) are Megatron distributed
checkpoints in ``SAVE/iter_XXXXXXX/``: model and optimizer as sharded tensors, and as common state
the scheduler, the data pipeline position and the step; ``SAVE/latest`` names the newest one.
``--load DIR`` resumes from ``DIR/latest`` (a missing directory or marker starts fresh): the
resumed run trains exactly the steps (and samples) the uninterrupted run would have. A checkpoint
cannot be half-read: a save writes ``iter_XXXXXXX.partial/``, which becomes ``iter_XXXXXXX`` and is
named in ``latest`` only once an all-reduced flag says every rank's part succeeded; a failure on
any rank (ENOSPC, any error of dist_checkpointing) stops every rank with one `CheckpointSaveError`
naming the directory, the failing ranks, the errno and the bytes needed vs free, ``latest``
unchanged (`_save_checkpoint`). It is never retried: not by ``--max-restarts``, nor by torchrun's
restarts (a restarted attempt of the job finds the save's ``SAVE/save_failed.json`` and raises the
same error before training: `checkpoint_errors.refuse_restart_after_failed_save`). A load reads
only the directory ``latest`` names.

Preemption: inside the training loop SIGTERM and SIGUSR1 (what SLURM sends ahead of a time limit or
a preemption, ``#SBATCH --signal=TERM@120``) are recorded, not fatal. Each step's end all-reduces a
flag with the step timings (no extra collective), so when any rank got a signal every rank stops
after the same step; with ``--save`` that step is checkpointed as above (model, optimizer,
scheduler, data pipeline position), and the process exits with `PREEMPTED_EXIT_CODE` (75,
``EX_TEMPFAIL``: "try again"). Rerunning the same command with ``--load`` on the same directory
resumes exactly (the same losses and samples as an uninterrupted run). Requeue in an sbatch script
with ``srun megatron-tree train ... ; [ $? -eq 75 ] && scontrol requeue $SLURM_JOB_ID``. Without
``--save`` the run says that nothing was saved and exits with the same status. The handlers are
installed only around the loop (a signal during start-up ends the process as usual) and the
previous ones are restored after it. The local launcher (``--nproc``) forwards the two signals to
its ranks; a signal to every process of the job at once (a time limit) ends the same way, since the
launcher's forkserver ignores it (`launch`), and a rank that fails after a signal reports its own
error, never "stopped before the first step". With ``--max-restarts N`` a rank that dies (SIGKILL,
the OOM killer, a crash) makes the launcher restart every rank in place, up to N times, each time
resuming from the newest checkpoint. A run killed outright (SIGKILL) resumes from its last
``--save-interval`` checkpoint; ``--metrics-jsonl`` keeps every step's metrics on disk as they
happen, so the steps it recomputes can be compared.

Non-finite steps: with ``--check-for-nan-in-loss-and-grad`` (default on, Megatron-LM's flag) every
rank checks its microbatch losses and the reduced gradient buffers after the backward, one all-reduce
decides, and a NaN / Inf stops every rank before the optimizer step with a `FloatingPointError`
naming the step, the microbatch (rank, index) and its samples (`_stop_on_nonfinite`).

Launch: under torchrun / srun (``RANK`` and ``WORLD_SIZE`` in the environment) `main` trains in
the current process group (NCCL on GPU, gloo on CPU); otherwise it spawns ``--nproc`` local ranks
with `launch.run_distributed`. On CPU the ranks enable `cpu.megatron_core` and turn TorchDynamo off
(Megatron's ``jit_fuser`` would compile on CPU, which is slow and gains nothing here).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import shutil
import signal
import sys
import threading
import time
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from ..tree.pair_loss import PAIR_LOSSES
from .arguments import VALUE_HEAD_LOSSES, add_moe_balancing_args, add_tree_args, moe_balancing_fields, validate_tree_args
from .checkpoint_errors import dir_bytes as _dir_bytes, iteration_dir as _iter_dir
from .files import write_atomically
from .objectives import check_loss_fields, gspo_stats_pass, objective_samples, pair_stats_pass, token_fields

__all__ = ["add_train_args", "build_train_parser", "check_train_args", "load_train_samples", "train", "main",
           "latest_checkpoint", "format_progress", "format_skipped", "exit_status", "PREEMPTED_EXIT_CODE",
           "PREEMPTION_SIGNALS"]

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")
MODEL_FAMILIES = ("gpt", "mamba")
PACKINGS = ("tree", "flat")
# Exit status of a run stopped by a preemption signal (after saving, with --save): sysexits.h's
# EX_TEMPFAIL, "a temporary failure; the user is invited to retry". Distinct from 0 (done), 1 (an
# error), 2 (bad arguments) and 128+N (killed by signal N), so a job script can requeue on it alone.
PREEMPTED_EXIT_CODE = 75
# What SLURM sends ahead of a time limit / preemption (--signal, default SIGTERM) and the user signal
# schedulers and users pick to ask for a checkpoint-and-exit without touching SIGTERM.
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


# --------------------------------------------------------------------------------------------- arguments
def add_train_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM-named model / parallel / optimizer / checkpoint / logging flags, a data source
    (``--tree-data-path`` or ``--synthetic-preset``) and the ``--tree-*`` group. Returns ``parser``."""
    from ..data.synthetic import PRESETS

    add_model_args(parser)
    add_moe_balancing_args(parser)
    add_parallel_args(parser)
    _add_optimizer_args(parser)
    c = parser.add_argument_group("checkpoints and logging")
    c.add_argument("--save", type=str, default=None, help="checkpoint directory")
    c.add_argument("--load", type=str, default=None,
                   help="resume from DIR/latest when present (an absent checkpoint starts fresh)")
    c.add_argument("--save-interval", type=int, default=None, help="steps between checkpoints (and one at the end)")
    c.add_argument("--save-hf", type=str, default=None, metavar="DIR",
                   help="with --hf-model: after the last step, save the trained model as a Hugging Face directory "
                        "(weights gathered over TP / PP / EP first, then config.json, then the source's tokenizer "
                        "and processor files copied as they are; DIR's writability is checked before step 1)")
    c.add_argument("--log-interval", type=int, default=1)
    c.add_argument("--check-for-nan-in-loss-and-grad", action=argparse.BooleanOptionalAction, default=True,
                   help="after each step's forward and backward, stop before the optimizer step when a "
                        "microbatch's loss or a reduced gradient is NaN or Inf, naming the microbatch and its "
                        "samples (no update, no checkpoint from that state; Megatron-LM's flag and default)")
    c.add_argument("--tensorboard-dir", type=str, default=None)
    c.add_argument("--wandb-project", type=str, default=None)
    c.add_argument("--wandb-exp-name", type=str, default=None)
    c.add_argument("--metrics-json", type=str, default=None, help="write the per-step history here (rank 0)")
    c.add_argument("--metrics-jsonl", type=str, default=None, metavar="FILE",
                   help="append each step's metrics to FILE as one JSON line when the step ends (rank 0): a "
                        "preempted or killed run keeps the steps it made, a resumed run appends its own")
    c.add_argument("--quiet", action="store_true", help="no progress bar / log lines")

    d = parser.add_argument_group("data")
    d.add_argument("--synthetic-preset", choices=PRESETS, default=None,
                   help="train on a seeded synthetic workload instead of --tree-data-path")
    d.add_argument("--synthetic-scale", type=float, default=1.0, help="shrink the preset's lengths by this factor")
    d.add_argument("--synthetic-seed", type=int, default=0)
    d.add_argument("--packing", choices=PACKINGS, default="tree",
                   help="tree: share prefixes (default); flat: every sample its own chain, same budget "
                        "(the baseline tree packing is measured against)")
    d.add_argument("--routing-replay", action="store_true",
                   help="rollout routing replay (R3) for MoE models: every record carries routed_experts "
                        "([tokens][moe_layers][topk]); packing shares rows only where tokens and routes agree and "
                        "every MoE layer replays the routes of its rows (missing routes are an error)")
    add_tree_args(parser)
    parser.set_defaults(tree_packing=True)
    return parser


def add_model_args(parser: argparse.ArgumentParser):
    """The "model" argument group of ``megatron-tree train`` (also ``megatron-tree score``'s)."""
    m = parser.add_argument_group("model")
    m.add_argument("--hf-model", default=None, metavar="PATH",
                   help="a Hugging Face checkpoint (directory or hub id): architecture and weights from it through "
                        "Megatron-Bridge (megatron_tree.bridge; the hf extra), token ids in the records (no "
                        "tokenizer); the other model flags are then refused")
    m.add_argument("--trust-remote-code", action="store_true",
                   help="with --hf-model: let transformers run the checkpoint's own Python code (its config.json's "
                        "auto_map, e.g. MiMo as published); off by default, as in transformers")
    m.add_argument("--freeze-vision", action="store_true",
                   help="with a vision-language --hf-model (Qwen3-VL, Qwen3.5): the vision tower runs without "
                        "gradient and is not updated (each image is still encoded once per step)")
    m.add_argument("--num-layers", type=int, default=None,
                   help="GPT layers (default 4); with --hybrid-override-pattern it must equal the pattern length")
    m.add_argument("--hidden-size", type=int, default=64)
    m.add_argument("--num-attention-heads", type=int, default=4)
    m.add_argument("--num-query-groups", type=int, default=None, help="GQA groups (default: heads)")
    m.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden size")
    m.add_argument("--vocab-size", type=int, default=1024,
                   help="vocabulary size (token ids of the data must be below it; synthetic data draws from it)")
    m.add_argument("--max-position-embeddings", type=int, default=None,
                   help="default: the microbatch budget (a sample may be as deep as the budget)")
    m.add_argument("--hybrid-override-pattern", type=str, default=None, metavar="PATTERN",
                   help="hybrid stack, one letter per layer: M Mamba-2, G Gated DeltaNet, * attention, "
                        "- MLP, E MoE (same as --tree-hybrid-pattern). Default: a GPT stack")
    m.add_argument("--num-experts", type=int, default=None, help="MoE experts (E layers of a hybrid pattern)")
    m.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="default: --ffn-hidden-size / 2")
    m.add_argument("--moe-router-topk", type=int, default=2)
    m.add_argument("--normalization", choices=["RMSNorm", "LayerNorm"], default="RMSNorm")
    m.add_argument("--swiglu", action="store_true",
                   help="SwiGLU MLPs (gated linear unit with SiLU; fc1 is 2 x --ffn-hidden-size wide), as Megatron-LM's "
                        "flag. Default: GeLU MLPs")
    m.add_argument("--rotary-base", type=int, default=10000, help="base period of the rotary embeddings (Megatron-LM's "
                                                                  "flag and default)")
    # numerics flags under Megatron-LM's names and defaults (a Megatron-LM checkpoint's args are compared
    # with them by megatron-tree score: training/score.py, megatron_lm_arg_differences)
    m.add_argument("--norm-epsilon", type=float, default=1e-5, help="epsilon of every LayerNorm / RMSNorm "
                                                                    "(Megatron-LM's flag and default)")
    m.add_argument("--rotary-percent", type=float, default=1.0,
                   help="fraction of each head's dimensions that get rotary embeddings (Megatron-LM's flag and "
                        "default)")
    m.add_argument("--use-rope-scaling", action="store_true",
                   help="Llama 3.x RoPE frequency scaling (Megatron-LM's flag; GPT-family rope models)")
    m.add_argument("--rope-scaling-factor", type=float, default=8.0,
                   help="with --use-rope-scaling: its factor (Megatron-LM's flag and default)")
    m.add_argument("--qk-layernorm", action="store_true",
                   help="norms on each attention head's query and key (Megatron-LM's flag; Qwen3-Next's attention "
                        "layers have them whatever it says; not in MambaModel's attention)")
    m.add_argument("--kv-channels", type=int, default=None,
                   help="query/key/value head width (Megatron-LM's flag; default --hidden-size / "
                        "--num-attention-heads)")
    m.add_argument("--model-family", choices=MODEL_FAMILIES, default="gpt",
                   help="gpt: GPTModel (our hybrid stack with --hybrid-override-pattern); mamba: Megatron's "
                        "MambaModel (Nemotron-H), layers from --hybrid-override-pattern letters M * - E")
    m.add_argument("--experimental-attention-variant", choices=["gated_delta_net", "dsa"], default=None,
                   help="GPT family: gated_delta_net, Megatron's Gated DeltaNet layers (Qwen3-Next style: gated "
                        "attention with qk-norm every --linear-attention-freq layers, MoE with a gated shared expert "
                        "if --num-experts); dsa, DeepSeek sparse attention (Multi-Latent Attention whose core "
                        "attention attends to the --dsa-indexer-topk keys a learned indexer picks on the tree)")
    m.add_argument("--multi-latent-attention", action="store_true",
                   help="GPT family: Multi-Latent Attention layers (DeepSeek-V3 style; implied by "
                        "--experimental-attention-variant dsa)")
    m.add_argument("--dsa-indexer-topk", type=int, default=None, help="dsa: keys per query (default 4)")
    m.add_argument("--dsa-indexer-loss-coeff", type=float, default=None,
                   help="dsa: weight of the indexer's KL loss (default 0.5; 0 trains no indexer)")
    m.add_argument("--dsa-indexer-use-sparse-loss", action="store_true",
                   help="dsa: the indexer loss over the selected keys only (default: over every visible key)")
    m.add_argument("--linear-attention-freq", type=int, default=None, metavar="N",
                   help="with --experimental-attention-variant: one standard attention layer every N layers")
    m.add_argument("--mtp-num-layers", type=int, default=None, metavar="K",
                   help="multi-token prediction: K MTP layers after the last stage (Megatron's "
                        "MultiTokenPredictionBlock on the tree: depth k predicts k+1 tokens ahead along each path)")
    m.add_argument("--mtp-loss-scaling-factor", type=float, default=0.1,
                   help="weight of the MTP losses (their mean over the depths), as Megatron's flag")
    m.add_argument("--mtp-pattern", type=str, default="*-", metavar="PATTERN",
                   help="--model-family mamba: each MTP depth's inner layers (letters of --hybrid-override-pattern; "
                        "Megatron-LM's unified --hybrid-layer-pattern MAIN/PATTERN/PATTERN; megatron-core >= 0.19)")
    return m


def add_parallel_args(parser: argparse.ArgumentParser, *, training: bool = True):
    """The "parallelism" argument group (``training=False``: without recomputation and the
    distributed optimizer, which a forward-only run has no use for)."""
    p = parser.add_argument_group("parallelism")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--expert-model-parallel-size", type=int, default=1)
    p.add_argument("--context-parallel-size", type=int, default=1,
                   help="tree-aware context parallelism: each microbatch's rows are spread over this many ranks "
                        "(ownership from --tree-cp-planner); attention, MLP and MoE layers")
    p.add_argument("--sequence-parallel", action="store_true")
    if training:
        p.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
        p.add_argument("--use-distributed-optimizer", action="store_true")
    p.add_argument("--nproc", type=int, default=1,
                   help="local ranks to spawn when not launched by torchrun/srun (default 1)")
    p.add_argument("--timeout", type=float, default=24 * 3600.0, help="seconds before spawned ranks are stopped")
    if training:
        p.add_argument("--max-restarts", type=int, default=0,
                       help="with --nproc: when a rank dies (killed, out of memory, a crash), restart every rank "
                            "in place up to this many times, each restart resuming from the newest checkpoint "
                            "(needs --save and --load on one directory; torchrun's name and meaning)")
    return p


def _add_optimizer_args(parser: argparse.ArgumentParser):
    o = parser.add_argument_group("optimizer")
    o.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    o.add_argument("--lr", type=float, default=1e-3)
    o.add_argument("--min-lr", type=float, default=0.0)
    o.add_argument("--lr-decay-style", choices=LR_DECAY_STYLES, default="cosine")
    o.add_argument("--lr-warmup-iters", type=int, default=0)
    o.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    o.add_argument("--train-iters", type=int, default=None, help="optimizer steps of the whole run (required)")
    o.add_argument("--exit-interval", type=int, default=None,
                   help="stop (and save, with --save) once this step is reached; the schedule still "
                        "follows --train-iters, so a later --load run continues it")
    o.add_argument("--weight-decay", type=float, default=0.01)
    o.add_argument("--clip-grad", type=float, default=1.0)
    o.add_argument("--adam-beta1", type=float, default=0.9)
    o.add_argument("--adam-beta2", type=float, default=0.999)
    o.add_argument("--adam-eps", type=float, default=1e-8)
    o.add_argument("--seed", type=int, default=1234)
    o.add_argument("--bf16", action="store_true", help="bf16 parameters with fp32 main weights")
    return o


def model_flags_given(args) -> list:
    """The model flags (`add_model_args`, but ``--hf-model`` and ``--vocab-size``) whose value is not
    the default: with ``--hf-model`` the checkpoint's config decides the architecture."""
    parser = argparse.ArgumentParser(add_help=False)
    add_model_args(parser)
    return [a.option_strings[0] for a in parser._actions
            if a.dest not in ("help", "hf_model", "trust_remote_code", "freeze_vision", "vocab_size")
            and hasattr(args, a.dest)
            and getattr(args, a.dest) != a.default]


def hf_model_errors(args) -> list:
    """With ``--hf-model``: the model flags given beside it (checked once, on the flags as given: the
    checked args are filled with model defaults afterwards), a checkpoint that needs its own code without
    ``--trust-remote-code``, and what the checkpoint carries that the tree cannot build (`checkpoint_refusals`).
    Also sets ``args.vocab_size`` from the checkpoint's config (the records' token ids are checked against
    it before any rank starts)."""
    if getattr(args, "hf_model_flags_checked", False):
        return []
    trust = bool(getattr(args, "trust_remote_code", False))
    if not getattr(args, "hf_model", None):
        return ["--trust-remote-code needs --hf-model PATH (the checkpoint whose code it runs)"] if trust else []
    from ..bridge.hf_config import local_config, checkpoint_refusals, hf_config_value, remote_code_error

    errors = [f"{flag}: the architecture comes from --hf-model" for flag in model_flags_given(args)]
    args.hf_model_flags_checked = True
    config = local_config(args.hf_model)  # (read once for both checks; None for a hub id)
    remote = remote_code_error(args.hf_model, trust, config)
    if remote:
        return errors + [remote]
    errors += checkpoint_refusals(args.hf_model, config)
    args.vocab_size = int(hf_config_value(args.hf_model, "vocab_size", trust_remote_code=trust))
    return errors


def build_train_parser(prog: str = "megatron-tree train") -> argparse.ArgumentParser:
    """The ``megatron-tree train`` parser (`add_train_args` on a fresh parser)."""
    return add_train_args(argparse.ArgumentParser(prog=prog, description="Train a Megatron-Core model on prefix trees"))


def _pattern(args) -> Optional[str]:
    return args.hybrid_override_pattern or args.tree_hybrid_pattern


def check_train_args(args, samples=None) -> argparse.Namespace:
    """Validate ``args`` in place (ValueError listing what to fix); fill derived defaults.

    Needs the samples only when ``--tree-max-tokens-per-mb`` is unset (the budget then defaults to
    the smallest multiple of the padding that holds the longest sample and the largest tree)."""
    errors = []
    if not args.tree_data_path and not args.synthetic_preset:
        errors.append("no training data: pass --tree-data-path FILE... or --synthetic-preset NAME")
    if args.tree_data_path and args.synthetic_preset:
        errors.append("pass either --tree-data-path or --synthetic-preset, not both")
    if args.train_iters is None or args.train_iters < 1:
        errors.append("--train-iters N (>= 1) is required: the number of optimizer steps")
    if args.exit_interval is not None and args.exit_interval < 1:
        errors.append(f"--exit-interval must be >= 1, got {args.exit_interval}")
    if args.nproc < 1:
        errors.append(f"--nproc must be >= 1, got {args.nproc}")
    if args.log_interval < 1:
        errors.append(f"--log-interval must be >= 1, got {args.log_interval}")
    if args.save_interval is not None and (args.save_interval < 1 or not args.save):
        errors.append("--save-interval needs --save DIR and a value >= 1")
    if args.max_restarts < 0:
        errors.append(f"--max-restarts must be >= 0, got {args.max_restarts}")
    elif args.max_restarts and not (args.save and args.load
                                    and os.path.abspath(args.save) == os.path.abspath(args.load)):
        errors.append("--max-restarts needs --save DIR and --load DIR on the same directory: a restart resumes from "
                      "the newest checkpoint there")
    if not args.synthetic_scale > 0:
        errors.append(f"--synthetic-scale must be > 0, got {args.synthetic_scale}")
    if args.hybrid_override_pattern and args.tree_hybrid_pattern and \
            args.hybrid_override_pattern != args.tree_hybrid_pattern:
        errors.append("--hybrid-override-pattern and --tree-hybrid-pattern disagree; pass one of them")
    errors += _family_errors(args) + hf_model_errors(args)
    if args.save_hf and args.tree_loss in VALUE_HEAD_LOSSES:
        errors.append(f"--save-hf writes a causal LM: the scalar head of --tree-loss {args.tree_loss} has no Hugging "
                      "Face mapping here (save a Megatron checkpoint with --save)")
    if args.save_hf and not args.hf_model:
        errors.append("--save-hf DIR needs --hf-model PATH (the Hugging Face config and mapping it saves with)")
    elif args.save_hf:
        from ..bridge.mapping import save_hf_errors  # (no Bridge import: plain file checks)

        errors += save_hf_errors(args.save_hf, args.hf_model)
    if getattr(args, "routing_replay", False):
        if not (args.num_experts or "E" in (args.tree_hybrid_pattern or args.hybrid_override_pattern or "")):
            errors.append("--routing-replay needs MoE layers: --num-experts N (or an 'E' in the hybrid pattern)")
        if args.synthetic_preset:
            errors.append("--routing-replay needs records with routed_experts (--tree-data-path): the synthetic "
                          "presets carry no routes")
        if args.packing == "flat":
            errors.append("--routing-replay packs route-aware prefix trees: drop --packing flat")
    tp, pp, ep = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size
    cp = args.context_parallel_size
    if min(tp, pp, ep, cp) < 1:
        errors.append("parallel sizes must be >= 1")
    elif not _launched() and args.nproc % (tp * pp * cp):
        errors.append(f"--nproc ({args.nproc}) must be a multiple of tensor x pipeline x context parallel sizes "
                      f"({tp * pp * cp})")
    if not torch.cuda.is_available():
        for flag, on in (("--bf16", args.bf16), ("--use-distributed-optimizer", args.use_distributed_optimizer)):
            if on:
                errors.append(f"{flag} needs CUDA: Megatron's mixed-precision and distributed optimizers only "
                              "wrap CUDA tensors (leave it off on CPU)")
    if args.sequence_parallel and tp == 1:
        errors.append("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if args.num_attention_heads % tp and not args.hf_model:
        errors.append(f"--num-attention-heads ({args.num_attention_heads}) must be divisible by TP ({tp})")
    if args.tree_data_path is None and args.synthetic_preset and args.tree_global_batch_samples is None:
        args.tree_global_batch_samples = 16  # one GRPO group of the presets
    if args.tree_max_tokens_per_mb is None and samples is not None and args.tree_packing:
        args.tree_max_tokens_per_mb = _default_budget(samples, args)
    if errors:
        raise ValueError("invalid arguments for megatron-tree train:\n  - " + "\n  - ".join(errors))
    fill_model_defaults(args)
    validate_tree_args(args)
    return args


def fill_model_defaults(args) -> argparse.Namespace:
    """The derived defaults of the "model" flags (`add_model_args`), in place: the hybrid pattern of our
    own stack, ``--num-layers`` and ``--moe-ffn-hidden-size``. Returns ``args``."""
    args.tree_hybrid_pattern = _pattern(args) if args.model_family == "gpt" else None  # our hybrid stack only
    if args.num_layers is None and not args.tree_hybrid_pattern:
        args.num_layers = len(args.hybrid_override_pattern) if args.model_family == "mamba" else 4
    if args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = max(1, (args.ffn_hidden_size or 4 * args.hidden_size) // 2)
    return args


def _family_errors(args) -> list:
    """What is wrong with the model-family flags (``--model-family``, ``--experimental-attention-variant``)."""
    errors = []
    gdn = args.experimental_attention_variant == "gated_delta_net"
    dsa = args.experimental_attention_variant == "dsa"
    if dsa or args.multi_latent_attention:
        what = "--experimental-attention-variant dsa" if dsa else "--multi-latent-attention"
        if args.model_family != "gpt" or _pattern(args):
            errors.append(f"{what} builds Megatron's GPT block of MLA layers; it does not combine with "
                          "--model-family mamba or a hybrid pattern")
        if dsa and args.sequence_parallel:
            errors.append("--experimental-attention-variant dsa with --sequence-parallel is not verified against "
                          "per-sample training yet: run DSA without sequence parallelism")
        if dsa and args.recompute_granularity == "selective":
            errors.append("--experimental-attention-variant dsa: selective recomputation drops the indexer's inputs "
                          "in Megatron-Core's MLA checkpoint; use --recompute-granularity full")
        if dsa and getattr(args, "mtp_num_layers", None):
            from ..compat.dsa import stock_dsa_mtp_runs

            if not stock_dsa_mtp_runs():
                errors.append("--experimental-attention-variant dsa with --mtp-num-layers needs megatron-core >= 0.19: "
                              "0.16's DSA inside an MTP layer indexes its indexer-loss tracker out of range")
        if getattr(args, "rotary_percent", 1.0) != 1.0 or getattr(args, "use_rope_scaling", False):
            errors.append(f"{what}: Multi-Latent Attention builds its own YaRN rotary over qk_pos_emb_head_dim; "
                          "--rotary-percent and --use-rope-scaling do not apply to it")
    elif (args.dsa_indexer_topk is not None or args.dsa_indexer_loss_coeff is not None
          or args.dsa_indexer_use_sparse_loss):
        errors.append("--dsa-indexer-* options need --experimental-attention-variant dsa")
    if args.model_family == "mamba":
        from .models import MAMBA_LETTERS

        if getattr(args, "mtp_num_layers", None):
            from ..compat.mtp import hybrid_has_mtp

            if not hybrid_has_mtp():
                errors.append("--mtp-num-layers with --model-family mamba needs megatron-core >= 0.19 (this "
                              "Megatron-Core's MambaModel has no multi-token prediction layers)")
            if not args.mtp_pattern or set(args.mtp_pattern) - set(MAMBA_LETTERS):
                errors.append(f"--mtp-pattern needs letters {MAMBA_LETTERS}, got {args.mtp_pattern!r}")

        pattern = args.hybrid_override_pattern
        if args.tree_hybrid_pattern:
            errors.append("--tree-hybrid-pattern is the pattern of our own hybrid stack (--model-family gpt); "
                          "MambaModel takes --hybrid-override-pattern")
        if not pattern or set(pattern) - set(MAMBA_LETTERS):
            errors.append(f"--model-family mamba needs --hybrid-override-pattern with letters {MAMBA_LETTERS} "
                          f"(M Mamba-2, * attention, - MLP, E MoE), got {pattern!r}")
        elif args.num_layers is not None and args.num_layers != len(pattern):
            errors.append(f"--num-layers ({args.num_layers}) must equal the --hybrid-override-pattern length "
                          f"({len(pattern)}) for MambaModel")
        if gdn:
            errors.append("--experimental-attention-variant is a GPT-family option; MambaModel has no GDN layers")
        for flag, on in (("--qk-layernorm", getattr(args, "qk_layernorm", False)),
                         ("--use-rope-scaling", getattr(args, "use_rope_scaling", False))):
            if on:
                errors.append(f"{flag}: Megatron's MambaModel has no such option (its attention layers have no "
                              "query/key norms, its rotary no frequency scaling)")
        if args.recompute_granularity == "full":
            errors.append("MambaModel has no full-layer recomputation in Megatron-Core 0.16.1: use "
                          "--recompute-granularity selective")
    if gdn:
        if _pattern(args):
            errors.append("--experimental-attention-variant builds Megatron's GPT block; it does not combine with "
                          "a hybrid pattern (use the G letter of --hybrid-override-pattern for our hybrid stack)")
        if args.linear_attention_freq is None or args.linear_attention_freq < 1:
            errors.append("--experimental-attention-variant gated_delta_net needs --linear-attention-freq N >= 1 "
                          "(one standard attention layer every N layers)")
    elif args.linear_attention_freq is not None:
        errors.append("--linear-attention-freq needs --experimental-attention-variant gated_delta_net")
    return errors


def _default_budget(samples, args) -> int:
    from ..tree.packing import PrefixPlan

    toks = [np.asarray(s.tokens) for s in samples]
    largest_tree = int(PrefixPlan(toks).tree_rows().max())
    need = max(max(len(t) for t in toks), largest_tree)
    tp = args.tensor_model_parallel_size
    pad = args.tree_pad_to_multiple_of or (math.lcm(8, tp) if args.sequence_parallel else 8)
    return -(-need // pad) * pad


def load_train_samples(args, report=None) -> list:
    """The training samples: ``--tree-data-path`` files, or the synthetic preset (vocab = --vocab-size).

    ``report`` (a `data.io.ReadReport`), when given, receives where each file sample came from and,
    under ``--tree-bad-sample skip``, ``report.skipped``: ``("file:line", reason)`` of each skipped one."""
    if args.synthetic_preset:
        from ..data.synthetic import make_preset

        return make_preset(args.synthetic_preset, seed=args.synthetic_seed, vocab=args.vocab_size,
                           scale=args.synthetic_scale)
    from ..data.pipeline import read_samples

    route_spec, replay = None, bool(getattr(args, "routing_replay", False))
    if replay:  # routes present, top-k and expert ids checked where file:line is known (`run` reads before any
        from ..tree.routes import read_time_route_spec  # rank starts); the MoE layer count once the model is built

        route_spec = read_time_route_spec(args)
    from .models import hf_vision_input

    if getattr(args, "vision_input", None) is None:  # a vision-language --hf-model: records' images read with it
        args.vision_input = hf_vision_input(args)
    return read_samples(args.tree_data_path, vocab_size=args.vocab_size, bad_sample=args.tree_bad_sample,
                        report=report, route_spec=route_spec, require_routes=replay, vision=args.vision_input)


# --------------------------------------------------------------------------------------------- process group
def _launched() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _init_process_group() -> None:
    """The default group: from torchrun/srun's environment, or a single local rank.

    A world of one process with no ``MASTER_PORT`` (no launcher, or ``RANK=0 WORLD_SIZE=1`` alone) forms
    on an in-process ``HashStore``: it touches no port, so any number of such runs share a machine.
    A ``MASTER_PORT`` the user or the launcher gives (torchrun, SLURM scripts) is used as given."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:  # srun without torchrun
        os.environ.setdefault("RANK", os.environ["SLURM_PROCID"])
        os.environ.setdefault("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1"))
        os.environ.setdefault("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
    if not _launched():
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    store = None
    if os.environ["WORLD_SIZE"] == "1" and "MASTER_PORT" not in os.environ:
        store = dist.HashStore()
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        from ..compat.torchelastic import isolate_restart_attempts

        isolate_restart_attempts()  # under torchrun --max-restarts: no keys of the attempt before
    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        backend = "nccl"
    if store is None:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=store, rank=0, world_size=1)


# --------------------------------------------------------------------------------------------- checkpoints
#: A complete dist_checkpointing directory holds this file: Megatron writes it last, after every
#: rank's tensors and the global metadata (both 0.16 and 0.19).
CHECKPOINT_COMPLETE_FILE = "metadata.json"
#: Suffix of the directory a save writes into; renamed to ``iter_XXXXXXX`` once every rank wrote
#: its part. A directory with it is never loaded (only the one ``latest`` names is).
PARTIAL_SUFFIX = ".partial"
#: How long a rank waits for the others to report their outcome of dist_checkpointing.save. Ranks
#: leave a successful save (or one whose failure dist_checkpointing reports to every rank) together,
#: so this only bounds the wait of a rank that failed alone while the others are still blocked in
#: one of dist_checkpointing's collectives (a write only rank 0 does: common.pt in 0.16, the global
#: metadata, metadata.json): it then raises instead of hanging, and its exit releases them.
SAVE_OUTCOME_TIMEOUT_S = 120


def _marker_step(directory: str) -> Optional[int]:
    """The step ``directory/latest`` names, None without a readable one (no checks of the checkpoint)."""
    try:
        with open(os.path.join(directory, "latest")) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def latest_checkpoint(directory: Optional[str]) -> Optional[int]:
    """Step of the checkpoint ``directory/latest`` names, None if there is no marker.

    Only that checkpoint is ever loaded: a newer ``iter_XXXXXXX.partial`` directory (a save that
    failed or was killed) or any directory ``latest`` does not name is ignored. A marker that names a
    missing or incomplete directory (no ``metadata.json``) is an error naming both, never a fall back
    to another checkpoint."""
    if not directory:
        return None
    marker = os.path.join(directory, "latest")
    if not os.path.isfile(marker):
        return None
    with open(marker) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise ValueError(f"{marker}: expected a step number, found {text!r}")
    step = int(text)
    path = _iter_dir(directory, step)
    if not os.path.isdir(path):
        raise ValueError(f"{marker} names step {step}, but {path} is missing")
    if not os.path.isfile(os.path.join(path, CHECKPOINT_COMPLETE_FILE)):
        raise ValueError(f"{marker} names step {step}, but {path} is incomplete (no {CHECKPOINT_COMPLETE_FILE}, "
                         "which dist_checkpointing writes last): megatron-tree train never names such a directory, "
                         f"so it was changed after the save; restore it or point {marker} at an intact iter_ directory")
    return step


def _sharded_state(ddp, opt, *, is_loading: bool) -> dict:
    # per-layer keys: a hybrid stack's layers differ (a Mamba layer has no input_layernorm), so
    # Megatron's stacked [num_layers, ...] tensors would have holes
    sd = {"model": ddp.module.sharded_state_dict()}
    sd["optimizer"] = opt.sharded_state_dict(sd["model"], is_loading=is_loading)
    return sd


def _checkpoint_bytes(sd: dict) -> int:
    """About the bytes this rank writes of ``sd``: the local tensors of its main-replica shards (a
    replica elsewhere is written by another rank) and, on rank 0, the common state's tensors."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory, is_main_replica

    total = 0
    for v in nested_values(sd):
        if isinstance(v, (ShardedTensor, ShardedTensorFactory)):
            if is_main_replica(v.replica_id) and isinstance(v.data, torch.Tensor):
                total += v.data.numel() * v.data.element_size()
        elif isinstance(v, torch.Tensor) and dist.get_rank() == 0:
            total += v.numel() * v.element_size()
    return total


def _fsync_path(path: str) -> None:
    """Flush a file's or directory's data and entry to disk. A filesystem that cannot fsync a
    directory (EINVAL / ENOTSUP, some network filesystems) still renames atomically: skipped there."""
    import errno

    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if not (os.path.isdir(path) and e.errno in (errno.EINVAL, errno.ENOTSUP, errno.EBADF)):
            raise
    finally:
        os.close(fd)


def _commit_checkpoint(directory: str, step: int, partial: str, final: str) -> None:
    """Rank 0, after every rank wrote its part into ``partial``: make it durable, rename it to
    ``final``, then replace ``latest`` (written to ``latest.tmp``, fsynced, ``os.replace``d: a reader
    sees the old marker or the new one, never a torn one). ``latest`` thus names a complete
    checkpoint at every instant, except when this step's checkpoint already exists and ``latest``
    names it (a run saving into a directory of an earlier one): between the two renames it names a
    missing directory, which a load refuses by name (`latest_checkpoint`), never half-reads; a
    failed second rename puts the earlier one back."""
    for name in os.listdir(partial):
        # the .distcp tensor files are fsynced by dist_checkpointing's writers (use_fsync); the small
        # files (common.pt, .metadata, metadata.json) are not all
        path = os.path.join(partial, name)
        if os.path.isfile(path) and not name.endswith(".distcp"):
            _fsync_path(path)
    _fsync_path(partial)
    replaced = None
    if os.path.lexists(final):
        if _marker_step(directory) == step:
            replaced = final + ".replaced"
            if os.path.lexists(replaced):
                shutil.rmtree(replaced)
            os.rename(final, replaced)
        else:  # not named by latest: an earlier run's or an old killed save's leftovers
            shutil.rmtree(final)
    try:
        os.rename(partial, final)
    except OSError:
        if replaced is not None:
            os.rename(replaced, final)
        raise
    _fsync_path(directory)
    write_atomically(os.path.join(directory, "latest"), f"{step}\n".encode(), fsync=True)
    # latest names the new checkpoint from here on: what is left is no reason to call the save failed
    for what, finish in ((f"could not fsync {directory}", lambda: _fsync_path(directory)),
                         (f"could not remove the checkpoint it replaced, {replaced}",
                          lambda: replaced is not None and shutil.rmtree(replaced))):
        try:
            finish()
        except OSError as e:
            print(f"megatron-tree train: warning: saved {final} and named it in {directory}/latest, but {what} "
                  f"({type(e).__name__}: {e})", file=sys.stderr, flush=True)


def _exchange_outcome(error: Optional[BaseException], record: dict, *, device, group=None, directory: str = "",
                      logged=()):
    """Every rank calls this at the same point of a save: one MAX all-reduce of a failure flag; when
    any rank failed, every rank's ``record`` plus its ``failure`` (`describe_failure` of ``error``
    and the errors dist_checkpointing ``logged`` on this rank; None on success) is gathered, rank 0's with ``previous_bytes``: the size on disk of the
    checkpoint ``directory/latest`` names (measured then only: a failed save is rare, a walk of a
    large checkpoint is not free). Returns (None, "") when all succeeded, else (the records in rank
    order, "") on every rank. When the exchange itself fails (a rank that never arrives: blocked in
    a dist_checkpointing collective, or gone; the group's timeout), returns this rank's record alone
    (others None) and why, so that this rank raises instead of waiting: a rank never takes the save
    for done without every rank's word."""
    from .checkpoint_errors import describe_failure

    mine = dict(record, failure=None if error is None else describe_failure(error, logged))
    try:
        flag = torch.tensor([0.0 if error is None else 1.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if float(flag[0]) == 0.0:
            return None, ""
        previous = _marker_step(directory) if directory and dist.get_rank() == 0 else None
        if previous is not None:
            try:
                mine["previous_bytes"] = _dir_bytes(_iter_dir(directory, previous))
            except OSError:
                pass  # the message then has the tensor estimate alone
        records = [None] * dist.get_world_size(group)
        dist.all_gather_object(records, mine, group=group)
        return records, ""
    except Exception as e:  # noqa: BLE001 - any failure of the exchange leaves the outcome unknown
        records = [None] * dist.get_world_size()
        records[dist.get_rank()] = mine
        return records, (f"rank {dist.get_rank()} could not learn the other ranks' outcome ("
                         f"{type(e).__name__}: {' '.join(str(e).split())[:300]}); it takes the save as failed")


def _fail_save(records: list, unreachable: str, *, stage: str, directory: str, step: int, final: str,
               partial: str, remove: Optional[str]) -> None:
    """Raise the `CheckpointSaveError` of a failed save on this rank (every rank calls it with the
    same records). Rank 0 first removes ``remove`` (the partial directory, or ``final`` when the
    commit renamed it but ``latest`` was not replaced; best effort, the outcome is in its message):
    nothing of the failed save stays, and it would never be loaded anyway."""
    from .checkpoint_errors import CheckpointSaveError, failing_ranks, record_failed_save, save_failure_message

    failures = failing_ranks(records)
    if not failures:  # the exchange failed on a rank that had no error of its own
        failures = {dist.get_rank(): {"error": "no error of its own", "errno": None}}
    previous = _marker_step(directory)
    if remove is None:
        cleanup = "no partial directory was created"
    elif dist.get_rank() == 0:
        try:
            if os.path.lexists(remove):
                shutil.rmtree(remove)
                cleanup = f"the partial directory {remove} was removed"
            else:
                cleanup = "no partial directory is left"
        except OSError as e:
            cleanup = (f"rank 0 could not remove the partial directory {remove} ({type(e).__name__}: {e}); it is "
                       "never loaded (only the directory latest names is)")
    else:
        cleanup = f"rank 0 removes the partial directory {remove} (never loaded: only the directory latest names is)"
    complete = previous is not None and os.path.isfile(os.path.join(_iter_dir(directory, previous),
                                                                      CHECKPOINT_COMPLETE_FILE))
    message = save_failure_message(stage=stage, directory=directory, step=step, final=final, failures=failures,
                                   records=records, previous=previous, previous_complete=complete, cleanup=cleanup,
                                   unreachable=unreachable)
    error = CheckpointSaveError(message, directory=directory, step=step, failures=failures)
    if dist.get_rank() == 0:  # under torchrun: its restart of this job refuses to train again
        record_failed_save(directory, error)
    raise error


def _outcome_group():
    """A gloo group over every rank for the outcome of dist_checkpointing.save, with its own short
    timeout (`SAVE_OUTCOME_TIMEOUT_S`) and on its own connections: its all-reduce never pairs with
    a collective of the default group that a blocked rank is still inside. Collective: every rank
    creates it at the same point (the caller destroys it)."""
    import datetime

    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=SAVE_OUTCOME_TIMEOUT_S))


def _save_checkpoint(directory: str, step: int, ddp, opt, sched, pipeline_state: dict, args, *, device,
                     outcome_group) -> str:
    """Save step ``step`` to ``directory/iter_XXXXXXX`` and then name it in ``directory/latest``.
    Returns the checkpoint directory.

    Invariants: ``latest`` only ever names a checkpoint every rank finished writing: the save goes
    to ``iter_XXXXXXX.partial``, which rank 0 renames and names in ``latest`` (`_commit_checkpoint`)
    only after an all-reduced flag says every rank's ``dist_checkpointing.save`` succeeded. No bare
    barrier: each stage (rank 0 preparing the directory, every rank's save, rank 0's commit) ends
    with `_exchange_outcome`, so a failure on any rank (an OSError such as ENOSPC, any exception of
    dist_checkpointing) reaches every rank, and every rank raises the same `CheckpointSaveError`
    (directory, failing ranks, errno, bytes needed vs free, what ``latest`` still names); ``latest``
    is left as it was and rank 0 removes the partial directory. The caller stops training on it.
    After such an error the default process group may be unusable (a rank can be left inside a
    collective of dist_checkpointing): end the process."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    from .checkpoint_errors import capture_logged_errors, clear_failed_save

    rank = dist.get_rank()
    final = _iter_dir(directory, step)
    partial = final + PARTIAL_SUFFIX
    sd = _sharded_state(ddp, opt, is_loading=False)
    # common (replicated) state: written once by rank 0, read by every rank
    sd["scheduler"] = sched.state_dict()
    sd["data"] = dict(pipeline_state)
    sd["iteration"] = step
    sd["run_args"] = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, type(None)))}
    record = {"need": _checkpoint_bytes(sd), "free": None}
    fail = dict(directory=directory, step=step, final=final, partial=partial)

    error = None
    if rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            if os.path.lexists(partial):  # a failed or killed earlier save of this step
                shutil.rmtree(partial)
            os.makedirs(partial)
        except Exception as e:  # noqa: BLE001 - every rank must learn of any failure here
            error = e
    records, why = _exchange_outcome(error, record, device=device, directory=directory)
    if records is not None:
        _fail_save(records, why, stage="preparing the checkpoint directory", remove=None, **fail)

    try:
        record["free"] = shutil.disk_usage(partial).free
    except OSError:
        pass  # the save below fails on this rank then, with the reason
    error = None
    # what dist_checkpointing logs holds a writer's errno where its exception lost it (0.19)
    with capture_logged_errors("megatron.core.dist_checkpointing") as logged:
        try:
            dist_checkpointing.save(sd, partial)
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            error = e
    records, why = _exchange_outcome(error, record, device=torch.device("cpu"), group=outcome_group,
                                     directory=directory, logged=logged.messages)
    if records is not None:
        _fail_save(records, why, stage="writing (dist_checkpointing.save)", remove=partial, **fail)

    error = None
    if rank == 0:
        try:
            _commit_checkpoint(directory, step, partial, final)
        except Exception as e:  # noqa: BLE001 - every rank must learn of any failure here
            error = e
    records, why = _exchange_outcome(error, record, device=device, directory=directory)
    if records is not None:
        committed = not os.path.lexists(partial) and _marker_step(directory) != step
        _fail_save(records, why, stage="committing (rename, latest marker)",
                   remove=final if committed else partial, **fail)
    if rank == 0:  # an earlier failed save's marker no longer holds
        clear_failed_save(directory)
    return final


def _load_checkpoint(directory: str, step: int, ddp, opt, sched) -> dict:
    from megatron.core import dist_checkpointing

    sd = _sharded_state(ddp, opt, is_loading=True)
    sd["scheduler"] = None
    sd["data"] = None
    sd["iteration"] = None
    loaded = dist_checkpointing.load(sd, _iter_dir(directory, step))
    ddp.module.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    sched.load_state_dict(loaded["scheduler"])
    if int(loaded["iteration"]) != step:
        raise ValueError(f"checkpoint {_iter_dir(directory, step)} holds step {loaded['iteration']}, not {step}")
    return loaded["data"]


# --------------------------------------------------------------------------------------------- logging
def format_progress(step: int, total: int, m: dict, width: int = 20) -> str:
    """One log line: a text bar, then the step's metrics (``m`` is one `train` history entry)."""
    done = int(width * step / max(total, 1))
    bar = "#" * done + "-" * (width - done)
    gn = m.get("grad_norm")
    ent = f"entropy {m['entropy']:.4f} | " if m.get("entropy") is not None else ""
    ent += "".join(f"{k} {v:.4f} | " for k, v in m.items() if k.startswith("mtp_") and k.endswith(" loss"))
    return (f"[{bar}] {step:>{len(str(total))}}/{total} | loss {m['loss']:.4f} | {ent}lr {m['lr']:.3e} | "
            f"grad norm {gn if gn is None else f'{gn:.3f}'} | tree_token_ratio {m['tree_token_ratio']:.2f} | "
            f"rows/s {m['rows_per_s']:,.0f} | samples/s {m['samples_per_s']:,.1f} | "
            f"useful tok/s {m['useful_tokens_per_s']:,.0f} | data wait {100 * m['data_wait_frac']:.1f}% | "
            f"planner imbalance {m['planner_imbalance']:.3f} | "
            + (f"skipped samples {m['skipped_samples']} | " if m.get("skipped_samples") else "")
            + (f"CP imbalance predicted {m['cp_predicted_imbalance']:.3f} measured {m['cp_attention_imbalance']:.3f} | "
               if "cp_attention_imbalance" in m else "")
            + f"{m['step_s']:.2f}s")


def format_skipped(skipped: list) -> str:
    """The start-of-run message for samples ``--tree-bad-sample skip`` dropped: their count, then the
    first few of them as ``file:line: reason`` (`data.io.ReadReport.summary`)."""
    from ..data.io import ReadReport

    return "megatron-tree train: " + ReadReport(skipped=list(skipped)).summary()


class _Loggers:
    """TensorBoard (tensorboardX) and wandb writers on the logging rank; no-ops elsewhere."""

    def __init__(self, args, active: bool):
        self.tb = self.wandb = None
        if not active:
            return
        if args.tensorboard_dir:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(args.tensorboard_dir)
        if args.wandb_project:
            try:
                import wandb
            except ImportError:
                print("megatron-tree train: --wandb-project given but wandb is not installed; skipping wandb",
                      file=sys.stderr)
            else:
                self.wandb = wandb.init(project=args.wandb_project, name=args.wandb_exp_name,
                                        config={k: v for k, v in vars(args).items() if not k.startswith("_")})

    DATA_SCALARS = ("skipped_samples",)  # logged as data/<name>; every other scalar as train/<name>

    def log(self, m: dict) -> None:
        # rank_* entries are the logging rank's own share, not a figure of the run: left out
        scalars = {f"{'data' if k in self.DATA_SCALARS else 'train'}/{k}": v for k, v in m.items()
                   if isinstance(v, (int, float)) and k != "step" and not k.startswith("rank_") and v is not None}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, m["step"])
        if self.wandb is not None:
            self.wandb.log(scalars, step=m["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


# --------------------------------------------------------------------------------------------- preemption
class _PreemptionSignals:
    """Context manager for a rank's training loop: while active, `PREEMPTION_SIGNALS` set
    ``received`` (the signal number, 0 for none; the largest one when several arrive) instead of
    ending the process; the loop stops after the step in which any rank got one. The previous
    handlers are restored on exit. Python delivers signals to the main thread only, so on another
    thread (a caller running `train` in a thread) nothing is installed and ``received`` stays 0."""

    def __init__(self, signals=PREEMPTION_SIGNALS):
        self.signals, self.received, self._previous = tuple(signals), 0, {}

    def _handle(self, signum: int) -> None:
        self.received = max(self.received, signum)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, lambda signum, frame: self._handle(int(signum)))
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


class _ForwardSignals(_PreemptionSignals):
    """For the local launcher (``--nproc``): signals reaching this process are passed on to the rank
    processes it starts meanwhile (its multiprocessing children that were not running on entry);
    ``received`` is the last signal number. A batch system that signals only the job's first process
    (``sbatch --signal=B:TERM@120``) thus reaches every rank, and each rank decides with the others
    when to stop (`_PreemptionSignals`)."""

    def __enter__(self):
        import multiprocessing

        self._before = {p.pid for p in multiprocessing.active_children()}
        return super().__enter__()

    def _handle(self, signum: int) -> None:
        import multiprocessing

        self.received = signum
        for proc in multiprocessing.active_children():
            if proc.pid not in self._before:
                try:
                    os.kill(proc.pid, signum)
                except ProcessLookupError:  # exited meanwhile
                    pass


# --------------------------------------------------------------------------------------------- non-finite steps
def _stop_on_nonfinite(step_no: int, reports: list, microbatches: list, ddp, dev, sources=None) -> None:
    """Raise `FloatingPointError` on every rank, before the optimizer step, when any rank's microbatch
    loss (``reports``: this rank's loss reports, one per microbatch in order; empty off the loss
    ranks) or any reduced gradient is NaN / Inf. The message names the step, each bad microbatch
    (rank, index) and its samples (``file:line`` where ``sources`` is known). One all-reduce per step;
    the details are gathered only on failure."""
    bad = [i for i, r in enumerate(reports) if "lm loss" in r and not bool(torch.isfinite(r["lm loss"]).all())]
    # the DDP's contiguous gradient buffers (a few large tensors), one host sync for all of them
    buffers = list(getattr(ddp, "buffers", [])) + list(getattr(ddp, "expert_parallel_buffers", []))
    grads = [b.grad_data for b in buffers] or [p.main_grad if getattr(p, "main_grad", None) is not None else p.grad
                                               for p in ddp.parameters()]
    finite = [torch.isfinite(g).all() for g in grads if g is not None]
    grad_bad = bool(finite) and not bool(torch.stack(finite).all())
    flag = torch.tensor([float(bool(bad)), float(grad_bad)], device=dev)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not bool(flag.any()):
        return

    def name(i):
        return sources[i] if sources is not None and 0 <= i < len(sources) else f"sample {i}"

    mine = (dist.get_rank(), [(i, [name(j) for j in microbatches[i].sample_ids]) for i in bad], grad_bad)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    parts = [f"microbatch {i} of rank {rank} has a non-finite loss (samples: {', '.join(ids) or 'none'})"
             for rank, mbs, _ in every for i, ids in mbs]
    grad_ranks = [rank for rank, _, g in every if g]
    if grad_ranks:
        parts.append(f"the reduced gradients are not finite on rank{'s' * (len(grad_ranks) > 1)} "
                     f"{', '.join(map(str, grad_ranks))}")
    raise FloatingPointError(f"megatron-tree train: step {step_no}: " + "; ".join(parts) + ". Stopped before the "
                             "optimizer step: no parameter was updated and no checkpoint was written from this state "
                             "(--no-check-for-nan-in-loss-and-grad turns the check off)")


def _preempted_message(preempted: dict, args) -> str:
    head = f"megatron-tree train: received {preempted['signal']}; "
    if preempted.get("step") is None:
        return (head + "stopped before the first step finished, nothing new to save; rerun the same command "
                f"to start again{' from ' + args.load if args.load else ''} (exit status {PREEMPTED_EXIT_CODE})")
    if preempted["saved"]:
        load = (f"--load {args.load}" if args.load and os.path.abspath(args.load) == os.path.abspath(args.save)
                else f"--load {args.save}")
        return (head + f"stopped after step {preempted['step']} and saved {preempted['saved']}; rerun with "
                f"{load} to resume exactly (exit status {PREEMPTED_EXIT_CODE})")
    return (head + f"stopped after step {preempted['step']} WITHOUT a checkpoint (no --save given): a rerun "
            f"starts again from {'the last checkpoint in ' + args.load if args.load else 'step 0'} "
            f"(exit status {PREEMPTED_EXIT_CODE})")


def exit_status(result: dict) -> int:
    """The process exit status for a `train` / `run` result: `PREEMPTED_EXIT_CODE` when a preemption
    signal stopped it early, else 0."""
    return PREEMPTED_EXIT_CODE if result.get("preempted") else 0


# --------------------------------------------------------------------------------------------- training
def _make_pipeline(samples, packing: str, **kw):
    """`TreeDataPipeline` over ``samples``; ``packing="flat"`` shares nothing (the baseline)."""
    from ..data.pipeline import TreeDataPipeline

    return TreeDataPipeline(samples, share_prefixes=packing == "tree", **kw)


def _model_args(args):
    from .models import ModelArgs

    pattern = args.tree_hybrid_pattern
    kind = "hybrid" if pattern else "gpt"
    extra = {"bf16": True} if args.bf16 else {}
    if args.num_experts or "E" in (args.tree_hybrid_pattern or args.hybrid_override_pattern or ""):
        extra.update(moe_balancing_fields(args))  # each statistic counted per flat token (megatron.moe_balance)
    if getattr(args, "swiglu", False):  # Megatron-LM's --swiglu: gated linear unit with SiLU
        extra.update(gated_linear_unit=True, activation_func=torch.nn.functional.silu)
    # Megatron-LM's numerics flags (TransformerConfig fields), set only where they leave the defaults
    if getattr(args, "norm_epsilon", 1e-5) != 1e-5:
        extra["layernorm_epsilon"] = args.norm_epsilon
    if getattr(args, "qk_layernorm", False):
        extra["qk_layernorm"] = True
    if getattr(args, "kv_channels", None) is not None:
        extra["kv_channels"] = args.kv_channels
    if args.model_family == "mamba":
        kind, pattern = "mamba", args.hybrid_override_pattern
    elif args.experimental_attention_variant == "dsa":
        kind = "dsa"
        extra.update({k: v for k, v in (("dsa_indexer_topk", args.dsa_indexer_topk),
                                        ("dsa_indexer_loss_coeff", args.dsa_indexer_loss_coeff)) if v is not None})
        if args.dsa_indexer_use_sparse_loss:
            extra["dsa_indexer_use_sparse_loss"] = True
    elif args.experimental_attention_variant:
        kind = "qwen3next"
    elif args.multi_latent_attention:
        kind = "mla"
    return ModelArgs(
        kind=kind, pattern=pattern or "", num_layers=args.num_layers or 0,
        linear_attention_freq=args.linear_attention_freq or 2,
        hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups or args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size, vocab_size=args.vocab_size,
        max_position=args.max_position_embeddings or args.tree_max_tokens_per_mb, num_experts=args.num_experts,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size, moe_router_topk=args.moe_router_topk,
        normalization=args.normalization, rotary_base=getattr(args, "rotary_base", 10000),
        rotary_percent=getattr(args, "rotary_percent", 1.0), rope_scaling=getattr(args, "use_rope_scaling", False),
        rope_scaling_factor=getattr(args, "rope_scaling_factor", 8.0),
        extra=dict(extra, **_mtp_extra(args)), mtp_pattern=getattr(args, "mtp_pattern", None) or "*-")


def _mtp_extra(args) -> dict:
    """TransformerConfig fields of ``--mtp-num-layers`` / ``--mtp-loss-scaling-factor`` (none without MTP)."""
    k = getattr(args, "mtp_num_layers", None)
    return dict(mtp_num_layers=k, mtp_loss_scaling_factor=args.mtp_loss_scaling_factor) if k else {}


def init_parallel(args) -> bool:
    """This rank's process group (`_init_process_group`), the CPU shims on a host without CUDA, and
    Megatron's model-parallel state from ``args``' TP / PP / CP / EP sizes. Returns True on CPU.
    Shared by `train` and ``megatron-tree score``; the caller destroys the model-parallel state."""
    from megatron.core import parallel_state as ps

    _init_process_group()
    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        from ..cpu import megatron_core as cpu_layer

        cpu_layer.enable(kernels=True)
        torch._dynamo.config.disable = True
    if args.experimental_attention_variant == "dsa":
        from ..megatron.dsa import prepare_stock_dsa

        prepare_stock_dsa()
    tp, pp, ep = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size
    cp = args.context_parallel_size
    if dist.get_world_size() % (tp * pp * cp):
        raise ValueError(f"world size {dist.get_world_size()} is not a multiple of TP x PP x CP = {tp * pp * cp}")
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 context_parallel_size=cp, expert_model_parallel_size=ep)
    return on_cpu


def train(args, samples=None, *, skipped=None, sources=None) -> dict:
    """Train on the current process group (initialised here from the environment if needed).

    ``args``: a namespace from `build_train_parser` (checked with `check_train_args`); ``samples``:
    the training samples (default `load_train_samples(args)`); ``skipped``: the ``(where, reason)``
    bad samples dropped while reading them (default: those of that read; none with given samples);
    ``sources``: the ``file:line`` of each sample (default: those of that read), which the data
    pipeline's errors name.
    Returns, on every rank, ``{"history": [per-step metric dicts], "resumed_from": step or None,
    "saved": [paths], "timing": data-pipeline timing, "tree_token_ratio": over the run, "skipped":
    [(where, reason)]}``. History entries: step (1-based), loss (with the ``--tree-entropy-coef``
    bonus when set), entropy (mean per-token entropy of the policy, nats), num_targets (all ranks), lr,
    grad_norm, tree_token_ratio, rows_per_s, samples_per_s, useful_tokens_per_s, data_wait_frac,
    planner_imbalance, step_s, tree_rows, flat_tokens, num_samples, sample_ids (the window, all
    ranks), skipped_samples (bad samples dropped so far: the data is read before step 1, so it is
    the final count from the start) and this rank's share: rank_sample_ids (the samples of the
    microbatches this rank ran, ascending; over the DP ranks of one step they are disjoint and make
    up ``sample_ids``) and rank_num_targets (targets whose loss this rank computed: 0 off the last
    pipeline stage and on TP ranks > 0; over the loss-computing ranks they sum to num_targets).
    With --tree-carry also rank_carry_kept (this rank's exporting microbatches that kept their graph,
    --tree-carry-memory), rank_carry_extra_rows (the rows its other exporters forwarded twice) and carry_syncs (the
    step's syncs where carried state crossed DP ranks, --tree-carry-cut; 0 when every group stayed on one rank).
    Under context parallelism also cp_predicted_imbalance (the planner's max / mean predicted rank
    time, averaged over this rank's microbatches), cp_attention_s (the slowest CP rank's time in
    tree CP attention this step) and cp_attention_imbalance (measured max / mean of that time).
    ``"preempted"``: None for a run that reached its last step, else ``{"step": the last step
    trained, "signal": "SIGTERM" or "SIGUSR1", "saved": the checkpoint of that step, None without
    --save}`` (the same on every rank; see the module docstring).
    """
    from megatron.core import parallel_state as ps

    from ..data.io import ReadReport

    if samples is None:
        report = ReadReport()
        samples = load_train_samples(args, report)
        skipped, sources = report.skipped, report.sources
    check_train_args(args, samples)
    # (main checked them before any rank started; a direct call here)
    check_loss_fields(args.tree_loss, samples, sources, value_clip=getattr(args, "tree_value_clip", None),
                      vocab_size=args.vocab_size)
    samples = objective_samples(args.tree_loss, samples)
    on_cpu = init_parallel(args)
    sources = list(sources) if sources is not None and len(sources) == len(samples) else None
    try:
        return _train_loop(args, samples, on_cpu, list(skipped or []), sources)
    finally:
        ps.destroy_model_parallel()


def _train_loop(args, samples, on_cpu: bool, skipped: list, sources=None) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from ..megatron.carry import kept_exporters, step_carry_items
    from .models import build_hf_model, build_model, forward_backward, make_config, wrap_ddp

    rank = dist.get_rank()
    margs = _model_args(args)
    if getattr(args, "routing_replay", False):  # Megatron gives every router a replay hook
        margs.extra["moe_enable_routing_replay"] = True
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    # a fresh config per model: DDP hangs hooks on it, MoE experts deep-copy it
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)
    hf = None
    if args.hf_model:
        hf, config, model = build_hf_model(args, dtype, on_cpu, recompute=args.recompute_granularity)
    else:
        config = make_config(margs, tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                             ep=args.expert_model_parallel_size, cp=args.context_parallel_size,
                             sp=args.sequence_parallel, recompute=args.recompute_granularity or "none", dtype=dtype,
                             cpu=on_cpu)
        model = build_model(config, margs)
        if not on_cpu:
            model = model.cuda()
    replay = None
    if getattr(args, "routing_replay", False):
        from ..megatron.routing_replay import install_routing_replay, reset_routing_replay
        from ..tree.routes import RouteSpec

        install_routing_replay(model)
        replay = RouteSpec(moe_layers=model.routing_replay_moe_layers, topk=config.moe_router_topk,
                           num_experts=config.num_moe_experts)
    if args.tree_loss in VALUE_HEAD_LOSSES:  # a reward / value model: a scalar head in place of the LM head's output
        from ..megatron.value_head import add_value_head

        # a reward model's head has no bias (as Hugging Face's sequence-classification score): Bradley-Terry sees
        # only differences of rewards, so a bias would get a zero gradient
        add_value_head(model, bias=args.tree_loss != "rm")
    if getattr(args, "tree_seq_aux_per_sample", False):  # DeepSeek-V3's per-sample seq aux loss
        from ..megatron.moe_balance import set_seq_aux_per_sample

        set_seq_aux_per_sample(model)
    ddp = wrap_ddp(model, config, use_distributed_optimizer=args.use_distributed_optimizer)
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad,
        bf16=args.bf16, params_dtype=dtype, use_distributed_optimizer=args.use_distributed_optimizer), [ddp])
    sched = OptimizerParamScheduler(
        opt, init_lr=0.0 if args.lr_warmup_iters else args.lr, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters, lr_decay_steps=args.lr_decay_iters or args.train_iters,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters, wd_incr_style="constant")

    from ..cp.planning.carry_ranks import rank_schedule

    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    kw = dict(max_tokens_per_mb=args.tree_max_tokens_per_mb, global_batch_samples=args.tree_global_batch_samples,
              dp_rank=dp_rank, dp_size=dp_size, seed=args.seed, num_epochs=None,
              pad_to_multiple_of=args.tree_pad_to_multiple_of, vocab_size=args.vocab_size,
              lookahead=args.tree_lookahead, carry=bool(getattr(args, "tree_carry", False)),
              # carry groups cut over DP ranks: not under 1F1B (a sync needs every earlier item's backward done)
              carry_cut=getattr(args, "tree_carry_cut", "auto") if args.pipeline_model_parallel_size == 1 else "never",
              carry_schedule_fn=rank_schedule,
              loss_agg=getattr(args, "loss_agg", "token-mean"), loss_agg_norm=getattr(args, "loss_agg_norm", None),
              vision=getattr(args, "vision_input", None))
    from ..megatron.mtp import mtp_tail_rows

    kw["mtp_tail"] = mtp_tail_rows(model.config)  # DSA in the MTP layers: each sample's trailing MTP positions
    # every CP rank plans its DP rank's microbatches ahead, identically (carry plans each item's layout as it
    # runs, carried rows included: `forward_step.carry_cp`)
    if args.context_parallel_size > 1 and not getattr(args, "tree_carry", False):
        from ..cp import make_plan_fn
        from ..megatron.forward_step import dsa_work, island_plan_fn, uses_gdn_islands

        # the planner prices DSA's own work, as the plans made while a microbatch runs do
        kw["plan_fn"] = make_plan_fn(args.context_parallel_size, strategy=args.tree_cp_planner,
                                     dsa=dsa_work(model.config))

        if uses_gdn_islands(ddp):  # GDN layout islands: the island plan is made ahead too, as a pair
            kw["plan_fn"] = island_plan_fn(kw["plan_fn"], args.context_parallel_size,
                                            model.gdn_island_geometry)
    if replay is not None:  # rows shared only where tokens and routes agree; every row carries its route
        kw.update(route_aware=True, route_spec=replay)
    pipeline = _make_pipeline(samples, args.packing, sources=sources, **kw)  # errors name file:line

    start, resumed_from = 0, None
    ckpt = latest_checkpoint(args.load) if args.load else None
    if ckpt is not None:
        data_state = _load_checkpoint(args.load, ckpt, ddp, opt, sched)
        pipeline.load_state_dict(data_state)
        start = resumed_from = ckpt
        if rank == 0 and not args.quiet:
            print(f"megatron-tree train: resumed from {_iter_dir(args.load, ckpt)} (step {ckpt})", flush=True)
    elif args.load and rank == 0 and not args.quiet:
        print(f"megatron-tree train: no checkpoint in {args.load}; starting fresh", flush=True)

    if skipped and rank == 0:  # dropped data is a warning, shown even with --quiet
        print(format_skipped(skipped), file=sys.stderr, flush=True)
    # the rank that reports: global rank 0 learns the loss through an all-reduce over the world
    loss_owner = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    loggers = _Loggers(args, active=rank == 0)
    stop = min(args.train_iters, args.exit_interval or args.train_iters)
    loss_kwargs = dict(loss_type=args.tree_loss, clip_eps=args.tree_clip_eps, clip_eps_high=args.tree_clip_eps_high,
                       kl_coef=args.tree_kl_coef, return_entropy=True, entropy_coef=args.tree_entropy_coef,
                       cp_strategy=args.tree_cp_planner)
    tables = token_fields(args.tree_loss, samples)  # value / distill: per-token record fields, read per occurrence
    if tables:
        loss_kwargs.update(token_fields=tables, value_clip=getattr(args, "tree_value_clip", None),
                           distill_kl=getattr(args, "tree_distill_kl", "forward"))
    if args.tree_loss == "distill":  # the student's log-probs at the teacher's ids, vocab-parallel
        loss_kwargs["occurrence_ids"] = tables["teacher_topk_ids"].at
    dev = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())
    cp_group = ps.get_context_parallel_group() if args.context_parallel_size > 1 else None
    dp_group = ps.get_data_parallel_group()  # carry groups cut over DP ranks exchange state over it
    if cp_group is not None:
        from ..cp.execution.attention import attention_seconds
        from ..megatron.forward_step import dsa_work, planned
    history, saved = [], []
    mtp_k = int(getattr(args, "mtp_num_layers", None) or 0)
    show = rank == 0 and not args.quiet
    tty = show and sys.stdout.isatty()
    ratio_num = ratio_den = 0
    preempted = None
    jsonl = open(args.metrics_jsonl, "a") if args.metrics_jsonl and rank == 0 else None
    outcome_group = _outcome_group() if args.save else None  # every rank: --save is the same everywhere
    data = iter(pipeline)
    try:
        with _PreemptionSignals() as signals:
            for it in range(start, stop):
                t0 = time.perf_counter()
                step = next(data)
                ddp.zero_grad_buffer()
                opt.zero_grad()
                if replay is not None:
                    reset_routing_replay(ddp)
                items = list(zip(step.microbatches, step.plans)) if step.plans else step.microbatches
                if getattr(args, "tree_carry", False):  # fill / run, then the restores, one store per step
                    kept = kept_exporters(step.microbatches, model.config, getattr(args, "tree_carry_memory", None))
                    items = step_carry_items(step, dp_group, keep=kept)
                extra = {}
                if args.tree_loss in ("gspo", "rm") + PAIR_LOSSES:  # per-sample statistics first, a forward-only pass
                    if args.tree_loss == "gspo":
                        extra["sequence_ratios"] = gspo_stats_pass(ddp, step, items, args, loss_kwargs)
                    else:
                        extra["pair_factors"] = pair_stats_pass(ddp, step, items, args, loss_kwargs, samples)
                    if getattr(args, "tree_carry", False):  # the stats pass ran the step's carry items
                        items = step_carry_items(step, dp_group, keep=kept)
                    if replay is not None:
                        reset_routing_replay(ddp)
                if cp_group is not None:
                    attention_seconds(reset=True)
                reports = forward_backward(ddp, items, **loss_kwargs, **extra)
                if args.check_for_nan_in_loss_and_grad:  # reports follow the schedule items
                    item_mbs = [getattr(x, "mb", x) for x in items]
                    _stop_on_nonfinite(it + 1, reports if loss_owner else [], item_mbs, ddp, dev, sources)
                lr = float(opt.param_groups[0]["lr"])  # the rate this step uses (sched.step sets the next one)
                ok, grad_norm, _ = opt.step()
                sched.step(1)
                step_s = time.perf_counter() - t0

                # loss sum, targets, entropy sum, then (loss sum, targets) of each MTP depth
                tot = torch.zeros(3 + 2 * mtp_k, dtype=torch.float64)
                if loss_owner and reports:
                    tot[:2] += torch.stack([r["lm loss"].double().cpu() for r in reports if "lm loss" in r]).sum(0)
                    tot[2] += sum(float(r["entropy"][0]) for r in reports if "entropy" in r)
                    for k in range(mtp_k):
                        tot[3 + 2 * k: 5 + 2 * k] += sum(r[f"mtp_{k + 1} loss"].double().cpu() for r in reports
                                                         if f"mtp_{k + 1} loss" in r)
                rank_targets = int(tot[1])  # read before the all-reduce: on CPU ``red`` is ``tot`` itself
                red = tot.to(dev)
                # the preemption flag rides with the timings: MAX over the world is the largest signal
                # number any rank received so far, so every rank takes the same decision after this step
                timing = torch.tensor([step_s, step.wait_s, signals.received], dtype=torch.float64, device=dev)
                dist.all_reduce(red)
                dist.all_reduce(timing, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
                loss_sum, n_tok, ent_sum = float(red[0]), float(red[1]), float(red[2])
                step_s, wait_s, stop_signal = float(timing[0]), float(timing[1]), int(timing[2])
                ratio_num += step.flat_tokens
                ratio_den += step.tree_tokens
                m = dict(step=it + 1, loss=loss_sum / max(n_tok, 1.0), entropy=ent_sum / max(n_tok, 1.0),
                         num_targets=int(n_tok),
                         lr=lr, grad_norm=None if grad_norm is None else float(grad_norm),
                         update_ok=bool(ok), tree_token_ratio=step.tree_token_ratio,
                         rows_per_s=step.tree_tokens / step_s, samples_per_s=step.num_samples / step_s,
                         useful_tokens_per_s=step.flat_tokens / step_s, data_wait_frac=min(wait_s / step_s, 1.0),
                         planner_imbalance=step.balance_ratio, step_s=step_s, tree_rows=step.tree_tokens,
                         flat_tokens=step.flat_tokens, num_samples=step.num_samples,
                         microbatches_per_rank=step.microbatches_per_rank, sample_ids=list(step.sample_ids),
                         epoch=step.epoch, skipped_samples=len(skipped),
                         # from the microbatches this rank ran, not the pipeline's bookkeeping of them
                         rank_sample_ids=sorted(i for mb in step.microbatches for i in mb.sample_ids),
                         rank_num_targets=rank_targets)
                if getattr(args, "tree_carry", False):  # this rank's exporters: kept graphs, or a second forward
                    exporters = [mb for mb in step.microbatches if mb.carry is not None and len(mb.carry.exported)]
                    m.update(rank_carry_kept=sum(mb.carry.index in kept for mb in exporters),
                             rank_carry_extra_rows=sum(mb.owned_rows for mb in exporters if mb.carry.index not in kept),
                             carry_syncs=len(step.carry_schedule.syncs) if step.carry_schedule is not None else 0)
                if cp_group is not None:  # predicted (planner) vs measured (this step) balance of CP attention
                    att = torch.tensor([attention_seconds()], dtype=torch.float64, device=dev)
                    every = [torch.zeros_like(att) for _ in range(dist.get_world_size(cp_group))]
                    dist.all_gather(every, att, group=cp_group)
                    every = torch.cat(every)
                    plans = [p[0] if isinstance(p, tuple) else p for p in step.plans] if step.plans else [
                        planned(mb.layout, args.context_parallel_size, args.tree_cp_planner,  # carry's, as it ran
                                dsa_work(model.config))
                        for mb in step.microbatches]
                    m.update(cp_predicted_imbalance=float(np.mean([p.imbalance for p in plans])),
                             cp_attention_s=float(every.max()),
                             cp_attention_imbalance=float(every.max() / every.mean()) if every.mean() > 0 else 1.0)
                for k in range(mtp_k):  # each MTP depth's per-token loss, named as Megatron-LM logs it
                    m[f"mtp_{k + 1} loss"] = float(red[3 + 2 * k]) / max(float(red[4 + 2 * k]), 1.0)
                history.append(m)
                loggers.log(m)
                if jsonl is not None:  # on disk as the step ends: survives a SIGKILL of the run
                    jsonl.write(json.dumps(m) + "\n")
                    jsonl.flush()
                if show:
                    line = format_progress(it + 1, args.train_iters, m)
                    if (it + 1) % args.log_interval == 0 or it + 1 == stop:
                        print(("\r" if tty else "") + line, flush=True)
                    elif tty:  # between log lines only the bar and the loss move, in place
                        print("\r" + " | ".join(line.split(" | ")[:2]), end="", flush=True)
                if args.save and ((args.save_interval and (it + 1) % args.save_interval == 0) or it + 1 == stop
                                  or stop_signal):
                    # raises CheckpointSaveError on every rank when any rank's part failed: the run stops
                    saved.append(_save_checkpoint(args.save, it + 1, ddp, opt, sched, step.state, args, device=dev,
                                                  outcome_group=outcome_group))
                    if show:
                        print(f"megatron-tree train: saved {saved[-1]}", flush=True)
                if stop_signal and it + 1 < stop:  # the last step needs no early stop: the run is complete
                    preempted = {"step": it + 1, "signal": signal.Signals(stop_signal).name,
                                 "saved": saved[-1] if args.save else None}
                    if rank == 0:  # shown even with --quiet: the run ends early
                        print(_preempted_message(preempted, args), file=sys.stderr, flush=True)
                    break
    finally:
        pipeline.close()
        loggers.close()
        if jsonl is not None:
            jsonl.close()
        if outcome_group is not None:
            # ours alone; after a failed exchange its teardown may fail too, which must not hide the
            # CheckpointSaveError on its way out
            with contextlib.suppress(Exception):
                dist.destroy_process_group(outcome_group)
    if args.save_hf and preempted is None:  # the trained weights as a Hugging Face directory (collective)
        from ..bridge import save_hf_pretrained

        with contextlib.redirect_stdout(io.StringIO()) if args.quiet else contextlib.nullcontext():
            save_hf_pretrained(hf, [model], args.save_hf, trust_remote_code=bool(args.trust_remote_code))
        saved.append(args.save_hf)
        if rank == 0 and not args.quiet:
            print(f"megatron-tree train: saved the Hugging Face model to {args.save_hf}", flush=True)
    out = {"history": history, "resumed_from": resumed_from, "saved": saved, "timing": pipeline.timing.as_dict(),
           "tree_token_ratio": ratio_num / max(ratio_den, 1), "dp_size": dp_size,
           "world_size": dist.get_world_size(), "packing": args.packing, "skipped": skipped, "preempted": preempted}
    if args.metrics_json and rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.metrics_json)), exist_ok=True)
        with open(args.metrics_json, "w") as f:
            json.dump(out, f, indent=1)
    return out


def _quiet_warnings() -> None:
    import warnings

    # Megatron announces every missing optional GPU package (Apex, TE) once per module
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
    warnings.filterwarnings("ignore", message=".*cuda_graph_scope.*")


#: the import-time notes of the libraries (every missing optional GPU package, experimental APIs), as
#: ``PYTHONWARNINGS`` entries: rank processes print them while importing, before any filter of ours runs
_IMPORT_NOTES = ("Transformer Engine", "Apex", "Only transformer-engine", "absl.logging", "MimoModelConfig",
                 "full scope is deprecated")


def _quiet_logs() -> None:
    """``--quiet``: the libraries' informational logs off too (Megatron-Core's deprecation notes, the
    Bridge's fusion notes, transformers' advice), here and in rank processes started afterwards (their
    import-time warnings); warnings of ours and errors still show."""
    import logging

    for name in ("megatron.core", "megatron.bridge", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # transformers sets its level when imported
    have = os.environ.get("PYTHONWARNINGS", "")
    notes = [f"ignore:{m}:UserWarning" for m in _IMPORT_NOTES if f"ignore:{m}:UserWarning" not in have]
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [have, *notes]))  # (a rank inherits the launcher's)


def _rank_train(args) -> dict:
    _quiet_warnings()
    if args.quiet:
        _quiet_logs()
    return train(args)


# --------------------------------------------------------------------------------------------- entry point
def run(args) -> dict:
    """Check ``args`` and train: here under torchrun/srun, else on ``--nproc`` spawned local ranks.
    Returns rank 0's `train` result. A torchrun restart of a job whose save failed raises that
    save's `CheckpointSaveError` before anything else (`refuse_restart_after_failed_save`)."""
    from ..data.io import ReadReport
    from .checkpoint_errors import refuse_restart_after_failed_save

    refuse_restart_after_failed_save(args.save)
    if args.hf_model:  # the vocabulary the records are checked against
        from ..bridge.hf_config import hf_config_value

        args.vocab_size = int(hf_config_value(args.hf_model, "vocab_size",
                                              trust_remote_code=bool(getattr(args, "trust_remote_code", False))))
    report = ReadReport()
    samples = load_train_samples(args, report) if (args.tree_data_path or args.synthetic_preset) else None
    check_train_args(args, samples)
    if samples is not None:
        check_loss_fields(args.tree_loss, samples, report.sources, value_clip=getattr(args, "tree_value_clip", None),
                          vocab_size=args.vocab_size)
    if _launched() or dist.is_initialized():
        _quiet_warnings()
        if args.quiet:
            _quiet_logs()
        return train(args, samples, skipped=report.skipped, sources=report.sources)
    from .checkpoint_errors import CheckpointSaveError
    from .launch import DistributedError, run_distributed

    latest_checkpoint(args.load)  # a marker naming a missing / incomplete checkpoint: refused before any rank starts
    if args.quiet:
        _quiet_logs()  # (before the ranks start: their environment)
    restarts = args.max_restarts
    while True:
        with _ForwardSignals() as forward:
            try:
                return run_distributed(_rank_train, args.nproc, args, timeout=args.timeout)[0]
            except DistributedError as e:
                if isinstance(e.exception, CheckpointSaveError):
                    # the run's error as the ranks raised it (directory, ranks, errno, space), not the
                    # launcher's wrapping of a traceback; never restarted: the steps since the last
                    # checkpoint would be trained again only to fail the same way (a full disk stays full)
                    raise e.exception from None
                if forward.received:
                    # only a rank that the signal itself ended (before its training loop installed a
                    # handler: no traceback of its own) means "stopped before the first step"; any other
                    # failure after a signal is that rank's own error and is shown as such
                    if e.signal != forward.received:
                        raise
                    break
                if restarts <= 0:
                    raise
                restarts -= 1
                step = latest_checkpoint(args.load)
                print(f"megatron-tree train: {str(e).splitlines()[0].rstrip(':')}; restarting every rank from "
                      f"{'step %d (%s)' % (step, args.load) if step is not None else 'the start (no checkpoint yet)'}"
                      f", {restarts} restart{'s' * (restarts != 1)} left (--max-restarts {args.max_restarts})",
                      file=sys.stderr, flush=True)
    # a rank ended by the forwarded signal before its training loop (start-up: no handler yet)
    preempted = {"step": None, "signal": signal.Signals(forward.received).name, "saved": None}
    print(_preempted_message(preempted, args), file=sys.stderr, flush=True)
    return {"history": [], "resumed_from": None, "saved": [], "preempted": preempted}


def main(argv=None) -> int:
    """``megatron-tree train`` entry point; exit status 0, `PREEMPTED_EXIT_CODE` when a preemption
    signal stopped the run early (checkpointed with --save), 2 with a message for bad arguments, or 1
    with the `CheckpointSaveError` message when a checkpoint could not be written."""
    from .checkpoint_errors import CheckpointSaveError

    args = build_train_parser().parse_args(argv)
    try:
        return exit_status(run(args))
    except (ValueError, FileNotFoundError) as e:
        print(f"megatron-tree train: error: {e}", file=sys.stderr)
        return 2
    except CheckpointSaveError as e:  # its message says what failed, where, and what to do
        print(e, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
