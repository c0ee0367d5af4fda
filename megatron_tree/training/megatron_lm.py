"""Hooks for Megatron-LM's ``pretrain()`` (Megatron-LM tag ``core_v0.16.1``): tree training from its CLI.

    from megatron.training import pretrain
    pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
             extra_args_provider=add_tree_args, args_defaults={"dataloader_type": "external"})

How a microbatch travels:

* `train_valid_test_datasets_provider` builds a `TreeDataPipeline` over ``--tree-data-path`` on
  every rank that Megatron-LM asks (TP rank 0 of every pipeline stage and DP rank). The pipeline
  is deterministic, so every pipeline stage of a DP replica reads an identical copy. Each optimizer
  step is exactly ``--global-batch-size / DP`` microbatches per rank (`TreeMicrobatch`es, padding
  microbatches in spare slots), which is what Megatron-LM's schedule pulls per iteration. On
  resume, the stream starts at the step after ``args.iteration`` (Megatron-LM restores it from the
  checkpoint before building data iterators), so no sample is repeated or skipped. This holds for
  every checkpoint Megatron-LM writes: periodic (``--save-interval``, the one a job killed outright
  resumes from) and the one ``--exit-signal-handler`` saves after the iteration in which the
  preemption signal (``--exit-signal``, SIGTERM by default) arrived; the rerun of the same command
  with ``--load`` trains the iterations, losses and samples of an uninterrupted run.
* `get_batch` takes the next microbatch on TP rank 0 and broadcasts its tree metadata (layout and
  loss map, as two int64 tensors: a header of sizes, then one payload) to the other TP ranks.
  Every pipeline stage needs it: attention masks, recurrences and RoPE depths are per layer.
* `forward_step` runs the model with a `TreePackedSeqParams`; the last stage returns one log-prob
  per loss occurrence and `loss_func` turns them into ``(loss_sum, num_tokens, report)``. With
  ``--calculate-per-token-loss`` Megatron-Core divides gradients by the token count summed over
  microbatches and DP ranks: per-sample token-mean training, exactly.

Every function takes ``args`` (an argparse namespace); when it is not given, Megatron-LM's
``get_args()`` supplies it, so the hooks are testable without Megatron-LM.
"""
from __future__ import annotations

import dataclasses
from collections import deque
import functools
from functools import partial
from typing import Optional

import torch
import torch.distributed as dist

from ..tree.layout import TreeLayout
from ..tree.loss_map import LossMap
from .arguments import validate_tree_args
from .lm_saves import guard_saves

__all__ = ["model_provider", "mamba_model_provider", "get_batch", "forward_step", "loss_func", "train_valid_test_datasets_provider",
           "encode_tree_batch", "decode_tree_batch", "MicrobatchStream", "broadcast_tree_batch", "build_pipeline"]

# -------------------------------------------------------------------------------------------- args
def _args(args):
    """``args`` or Megatron-LM's global arguments, validated once per namespace."""
    if args is None:
        from megatron.training import get_args  # Megatron-LM only, never at import time

        args = get_args()
    if not getattr(args, "tree_packing", False):
        raise ValueError("the megatron_tree Megatron-LM hooks train on prefix trees: pass --tree-packing "
                         "(and the other --tree-* arguments, see examples/README.md)")
    if not getattr(args, "_tree_args_validated", False):  # Megatron-LM offers no hook to validate extra args
        validate_tree_args(args)
        args._tree_args_validated = True
    return args


def _timers():
    try:
        from megatron.training import get_timers

        return get_timers()
    except Exception:  # no Megatron-LM, or its globals are not initialised (tests)
        return None


def _print_rank_0(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


# -------------------------------------------------------------------------------------------- model
def _tree_config(args, config):
    """``config`` (default: Megatron-LM's ``core_transformer_config_from_args(args)``) with
    ``variable_seq_lengths=True``; refuses a config without per-token loss."""
    if config is None:
        from megatron.training.arguments import core_transformer_config_from_args

        # set before building the config so TransformerConfig.__post_init__ checks the combination
        args.variable_seq_lengths = True
        if not getattr(args, "num_experts", None) and getattr(args, "moe_token_dispatcher_type", None) == "allgather":
            # TransformerConfig refuses variable lengths with the allgather dispatcher even without
            # experts; a dense model never dispatches, so the default is switched (MoE runs must
            # choose alltoall themselves: validate_tree_args says so)
            args.moe_token_dispatcher_type = "alltoall"
        config = core_transformer_config_from_args(args)
    config.variable_seq_lengths = True
    if getattr(args, "tree_routing_replay", False):  # every router gets a replay hook (`_replaying`)
        config.moe_enable_routing_replay = True
    if not getattr(config, "calculate_per_token_loss", False):
        raise ValueError("tree training needs calculate_per_token_loss=True (--calculate-per-token-loss)")
    loss = getattr(args, "tree_loss", "sft")
    if loss in ("gspo", "dpo", "ipo", "simpo", "rm"):
        raise ValueError(f"--tree-loss {loss} needs a forward-only stats pass before each step's forward-backward, "
                         "which Megatron-LM's train_step does not run: use megatron-tree train or "
                         f"megatron_tree.rl.forward_backward(loss={loss!r})")
    if loss in ("value", "distill"):
        raise ValueError(f"--tree-loss {loss} reads per-token record fields ("
                         f"{'returns' if loss == 'value' else 'teacher_topk_ids / teacher_topk_logprobs'}) that the "
                         "hooks' get_batch does not carry yet: use megatron-tree train or "
                         f"megatron_tree.rl.forward_backward(loss={loss!r})")
    return config


def _replaying(provider):
    """``--tree-routing-replay``: the provider's model replays the routes of the rows each MoE layer
    holds (`megatron_tree.megatron.routing_replay.install_routing_replay`; ``get_batch`` carries them);
    ``--tree-seq-aux-per-sample``: its seq aux loss is per sample (`moe_balance.set_seq_aux_per_sample`)."""

    @functools.wraps(provider)
    def build(*a, **kw):
        model = provider(*a, **kw)
        args = _args(kw.get("args"))
        if getattr(args, "tree_routing_replay", False):
            from ..megatron.routing_replay import install_routing_replay

            install_routing_replay(model)
        if getattr(args, "tree_seq_aux_per_sample", False):  # DeepSeek-V3's per-sample seq aux loss
            from ..megatron.moe_balance import set_seq_aux_per_sample

            set_seq_aux_per_sample(model)
        return model

    return build


@_replaying
def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: Optional[int] = None,
                   config=None, pg_collection=None, *, args=None):
    """This pipeline stage's `TreeGPTModel` from Megatron-LM arguments (``get_model``'s contract).

    GPT stack by default (Megatron's decoder block spec with tree attention: dense or MoE layers as
    ``--num-experts`` / ``--moe-layer-freq`` say); with ``--tree-hybrid-pattern`` a hybrid stack
    (Mamba-2 / Gated DeltaNet / attention / MLP / MoE letters); with Megatron-LM's
    ``--experimental-attention-variant gated_delta_net --linear-attention-freq N`` (Qwen3-Next) the
    tree variant of Megatron's experimental-attention block (`TreeGatedDeltaNet` in the linear-attention
    layers, the TE path when ``--transformer-impl transformer_engine``). ``config`` defaults to Megatron-LM's
    ``core_transformer_config_from_args(args)``. Either way the config gets
    ``variable_seq_lengths=True`` (microbatch rows vary; Megatron-LM's ``validate_args`` forces it
    to False), which the pipeline schedule reads from the model's config.
    """
    args = _args(args)
    config = _tree_config(args, config)

    from ..megatron.model import TreeGPTModel
    from ..megatron.specs import get_tree_gpt_decoder_block_spec, get_tree_hybrid_stack_spec

    use_te = getattr(args, "transformer_impl", "local") == "transformer_engine"
    normalization = getattr(args, "normalization", None) or config.normalization
    pattern = getattr(args, "tree_hybrid_pattern", None)
    if pattern and config.experimental_attention_variant:
        raise ValueError("--tree-hybrid-pattern and --experimental-attention-variant build different stacks; pass one")
    if config.experimental_attention_variant:
        from ..megatron.family_specs import get_tree_transformer_block_with_experimental_attention_variant_spec

        if config.experimental_attention_variant == "dsa":
            from ..megatron.dsa import prepare_stock_dsa

            prepare_stock_dsa()  # as `megatron-tree train` does: stock's indexer rotation on this host
        spec = get_tree_transformer_block_with_experimental_attention_variant_spec(
            config, vp_stage=vp_stage, use_transformer_engine=use_te)
    elif pattern:
        spec = get_tree_hybrid_stack_spec(pattern, config, use_transformer_engine=use_te, normalization=normalization,
                                          num_experts=getattr(args, "num_experts", None) or config.num_moe_experts,
                                          moe_grouped_gemm=bool(getattr(args, "moe_grouped_gemm", False)),
                                          qk_layernorm=bool(getattr(args, "qk_layernorm", False)), vp_stage=vp_stage)
    else:
        spec = get_tree_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization=normalization,
                                               qk_l2_norm=bool(getattr(args, "qk_l2_norm", False)), vp_stage=vp_stage)
    vocab = getattr(args, "padded_vocab_size", None) or args.vocab_size
    max_pos = getattr(args, "max_position_embeddings", None) or args.tree_max_tokens_per_mb
    kw = {}
    if pg_collection is not None:
        kw["pg_collection"] = pg_collection
    if getattr(config, "mtp_num_layers", None):  # MTP layers on the last stage, tree attention inside
        from ..megatron.specs import get_tree_gpt_mtp_block_spec

        kw["mtp_block_spec"] = get_tree_gpt_mtp_block_spec(config, spec, use_transformer_engine=use_te,
                                                           vp_stage=vp_stage)
    return TreeGPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=vocab, max_sequence_length=max_pos,
        pre_process=pre_process, post_process=post_process,
        fp16_lm_cross_entropy=bool(getattr(args, "fp16_lm_cross_entropy", False)), parallel_output=True,
        share_embeddings_and_output_weights=not getattr(args, "untie_embeddings_and_output_weights", False),
        position_embedding_type=getattr(args, "position_embedding_type", "rope"),
        rotary_percent=getattr(args, "rotary_percent", 1.0), rotary_base=getattr(args, "rotary_base", 10000),
        rope_scaling=bool(getattr(args, "use_rope_scaling", False)),
        rope_scaling_factor=float(getattr(args, "rope_scaling_factor", 8.0)), vp_stage=vp_stage, **kw)


@_replaying
def mamba_model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: Optional[int] = None,
                         config=None, pg_collection=None, *, args=None):
    """This pipeline stage's `TreeMambaModel` from Megatron-LM's ``pretrain_mamba.py`` arguments.

    The stack spec is ``--spec MODULE NAME`` treeified (`treeify_spec`: `TreeMambaMixer` and tree
    core attention in Megatron's structure, so the user's spec and checkpoints are kept), or
    `get_tree_mamba_stack_spec` (TE when ``--transformer-impl transformer_engine``). Layers come
    from ``--hybrid-override-pattern`` / ``--hybrid-attention-ratio`` / ``--hybrid-mlp-ratio`` as in
    ``MambaModel``, or 0.19's ``--hybrid-layer-pattern`` (whose ``main/mtp/...`` form adds MTP depths, run on
    the tree by `TreeMambaModel`). Config handling as `model_provider`.
    """
    args = _args(args)
    if vp_stage is not None:
        raise ValueError("MambaModel (Megatron-Core 0.16.1) has no virtual pipeline stages")
    config = _tree_config(args, config)

    from ..megatron.family_specs import get_tree_mamba_stack_spec
    from ..megatron.model import TreeMambaModel
    from ..megatron.specs import treeify_spec

    if getattr(args, "spec", None):
        from megatron.core.transformer.spec_utils import import_module

        spec = treeify_spec(import_module(args.spec))
    else:
        spec = get_tree_mamba_stack_spec(
            use_transformer_engine=getattr(args, "transformer_impl", "local") == "transformer_engine")
    kw = {"pg_collection": pg_collection} if pg_collection is not None else {}
    if getattr(args, "hybrid_layer_pattern", None) and not getattr(args, "hybrid_override_pattern", None):
        kw["hybrid_layer_pattern"] = args.hybrid_layer_pattern  # megatron-core 0.19's "main/mtp/..." (MTP depths)
    return TreeMambaModel(
        config=config, mamba_stack_spec=spec,
        vocab_size=getattr(args, "padded_vocab_size", None) or args.vocab_size,
        max_sequence_length=getattr(args, "max_position_embeddings", None) or args.tree_max_tokens_per_mb,
        pre_process=pre_process, post_process=post_process,
        hybrid_attention_ratio=float(getattr(args, "hybrid_attention_ratio", 0.0) or 0.0),
        hybrid_mlp_ratio=float(getattr(args, "hybrid_mlp_ratio", 0.0) or 0.0),
        hybrid_override_pattern=getattr(args, "hybrid_override_pattern", None),
        fp16_lm_cross_entropy=bool(getattr(args, "fp16_lm_cross_entropy", False)), parallel_output=True,
        share_embeddings_and_output_weights=not getattr(args, "untie_embeddings_and_output_weights", False),
        position_embedding_type=getattr(args, "position_embedding_type", "none"),
        rotary_percent=getattr(args, "rotary_percent", 1.0), rotary_base=getattr(args, "rotary_base", 10000), **kw)


# -------------------------------------------------------------------------------------------- batch wire format
# Header (int64, _HEADER_LEN): status, N rows, S segments, M occurrences, num_padding, bitmask of the
# optional float fields present, then one dtype code per float field (weights + optional ones).
# Payload (int64): the 7 layout fields, 4 integer loss-map fields, then the float fields as float64
# bit patterns (a view, so values survive exactly).
_STATUS_END, _STATUS_OK, _STATUS_ERROR = 0, 1, -1
_OPTIONAL = ("advantages", "old_logprobs", "ref_logprobs")
_FLOATS = ("weights",) + _OPTIONAL
_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_HEADER_LEN = 6 + len(_FLOATS)
_LAYOUT_FIELDS = ("input_ids", "position_ids", "segment_offsets", "segment_parent", "subtree_end", "visible_until",
                  "path_prev")
_LOSS_INT_FIELDS = ("source_rows", "targets", "sample_index", "positions")


def encode_tree_batch(layout: TreeLayout, loss_map: LossMap) -> tuple[torch.Tensor, torch.Tensor]:
    """(header [_HEADER_LEN] int64, payload [4N + 3S + 1 + (4 + F) M] int64) on the CPU, F float fields."""
    N, S, M = layout.num_rows, layout.num_segments, len(loss_map)
    present = [f for f in _OPTIONAL if getattr(loss_map, f) is not None]
    mask = sum(1 << i for i, f in enumerate(_OPTIONAL) if f in present)
    codes = [(_DTYPES.index(getattr(loss_map, f).dtype) if getattr(loss_map, f) is not None else -1) for f in _FLOATS]
    header = torch.tensor([_STATUS_OK, N, S, M, layout.num_padding, mask] + codes, dtype=torch.int64)
    parts = [getattr(layout, f).detach().cpu().to(torch.int64) for f in _LAYOUT_FIELDS]
    parts += [getattr(loss_map, f).detach().cpu().to(torch.int64) for f in _LOSS_INT_FIELDS]
    parts += [getattr(loss_map, f).detach().cpu().to(torch.float64).contiguous().view(torch.int64)
              for f in ("weights",) + tuple(present)]
    return header, torch.cat(parts)


def _payload_len(header: torch.Tensor) -> int:
    _, N, S, M, _, mask = (int(v) for v in header[:6])
    nfloat = 1 + bin(mask).count("1")
    return 4 * N + 3 * S + 1 + (len(_LOSS_INT_FIELDS) + nfloat) * M


def decode_tree_batch(header: torch.Tensor, payload: torch.Tensor, device=None) -> tuple[TreeLayout, LossMap]:
    """Inverse of `encode_tree_batch`; tensors land on ``device`` (default: the payload's)."""
    h = [int(v) for v in header.cpu()]
    _, N, S, M, num_padding, mask = h[:6]
    codes = h[6:]
    payload = payload.to(device) if device is not None else payload
    sizes = [N, N, S + 1, S, S, N, N] + [M] * len(_LOSS_INT_FIELDS)
    present = ("weights",) + tuple(f for i, f in enumerate(_OPTIONAL) if mask >> i & 1)
    sizes += [M] * len(present)
    if sum(sizes) != payload.numel():
        raise ValueError(f"tree batch payload has {payload.numel()} values, header says {sum(sizes)}")
    chunks = torch.split(payload, sizes)
    layout = TreeLayout(**dict(zip(_LAYOUT_FIELDS, chunks[:7])), num_padding=num_padding)
    ints = dict(zip(_LOSS_INT_FIELDS, chunks[7:11]))
    floats = {f: c.view(torch.float64).to(_DTYPES[codes[_FLOATS.index(f)]]) for f, c in zip(present, chunks[11:])}
    return layout, LossMap(**ints, **floats)


def _comm_device(group) -> torch.device:
    backend = dist.get_backend(group)
    if "nccl" in str(backend).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_tree_batch(mb, *, src: int, group, device=None) -> tuple[TreeLayout, LossMap]:
    """Broadcast one microbatch's layout and loss map from global rank ``src`` over ``group``.

    On ``src`` pass the microbatch (anything with ``.layout`` and ``.loss_map``), or ``None`` when
    its iterator is exhausted (every rank then raises ``StopIteration``), or an exception instance
    (every rank raises: the peers get a ``RuntimeError`` naming ``src``, so nobody waits in the
    broadcast forever). Other ranks pass ``mb=None``. Two collectives: the header (sizes), then the
    payload. Every rank decodes the same payload, so all of them hold identical tensors.
    """
    cdev = _comm_device(group)
    is_src = dist.get_rank() == src
    if is_src:
        if mb is None:
            header, payload = torch.zeros(_HEADER_LEN, dtype=torch.int64), None
            header[0] = _STATUS_END
        elif isinstance(mb, BaseException):
            header, payload = torch.zeros(_HEADER_LEN, dtype=torch.int64), None
            header[0] = _STATUS_ERROR
        else:
            header, payload = encode_tree_batch(mb.layout, mb.loss_map)
        header = header.to(cdev)
    else:
        header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=cdev)
    dist.broadcast(header, src, group=group)
    status = int(header[0])
    if status == _STATUS_END:
        raise StopIteration
    if status == _STATUS_ERROR:
        if is_src:
            raise mb
        raise RuntimeError(f"rank {src} (tensor-parallel source) failed to produce the next tree microbatch; "
                           "see its log for the error")
    payload = payload.to(cdev) if is_src else torch.empty(_payload_len(header), dtype=torch.int64, device=cdev)
    dist.broadcast(payload, src, group=group)
    return decode_tree_batch(header, payload, device=device)


def _tp_source():
    """``(group, src)``: Megatron's tensor-parallel group and the rank that reads the data, or
    ``(None, None)`` without tensor parallelism."""
    if dist.is_initialized():
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized() and ps.get_tensor_model_parallel_world_size() > 1:
            return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_src_rank()
    return None, None


def get_batch(data_iterator, *, device=None, group=None, src: Optional[int] = None):
    """The next microbatch as a `TreePackedSeqParams` (layout and loss map on ``device``).

    TP rank 0 reads ``data_iterator`` (`TreeMicrobatch`es); with tensor parallelism the metadata is
    broadcast to the other TP ranks, whose ``data_iterator`` may be ``None``. ``group``/``src``
    default to Megatron's tensor-parallel group and its source rank. Every pipeline stage calls
    this with its own iterator copy. ``device`` defaults to the current CUDA device, else the CPU.
    Raises ``StopIteration`` on every TP rank when TP rank 0's iterator is exhausted.
    """
    from ..megatron.packed_seq import TreePackedSeqParams

    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if group is None:
        group, src = _tp_source()
    if group is None or dist.get_world_size(group) == 1:
        mb = next(data_iterator)
        layout, loss_map = mb.layout.to(device), mb.loss_map.to(device)
        stats, routes, step_w = _row_stats(mb), getattr(mb, "routes", None), _step_weights(mb)
        paths = mb.sample_paths()
    else:
        if src is None:
            raise ValueError("get_batch: give src (the global rank that reads the data) together with group")
        mb = None
        if dist.get_rank() == src:
            if data_iterator is None:
                mb = RuntimeError("tensor-parallel rank 0 has no data iterator")
            else:
                try:
                    mb = next(data_iterator)
                except StopIteration:
                    mb = None
                except Exception as e:  # told to the peers before re-raising, so they do not hang
                    mb = e
        layout, loss_map = broadcast_tree_batch(mb, src=src, group=group, device=device)
        mine = dist.get_rank() == src
        cdev = _comm_device(group)
        stats = _row_stats(mb).to(cdev) if mine else torch.empty(4, layout.num_rows, dtype=torch.float64, device=cdev)
        dist.broadcast(stats, src, group=group)
        # routing replay: every row's routes; MTP logging: the step's target weights by source depth
        routes = _broadcast_optional(getattr(mb, "routes", None) if mine else None, 3, torch.int64, src, group, cdev)
        step_w = _broadcast_optional(_step_weights(mb) if mine else None, 1, torch.float64, src, group, cdev)
        # per-sample statistics (a per-sample seq aux loss): every path's rows
        paths = _broadcast_optional(mb.sample_paths() if mine else None, 1, torch.int64, src, group, cdev)
    stats = stats.to(device)
    tails = bool((stats[2] > 0).any())
    return TreePackedSeqParams(layout=layout, loss_map=loss_map, row_samples=stats[0], row_inv_length=stats[1],
                               sample_paths=None if paths is None else paths.to(device),
                               routes=None if routes is None else routes.to(device),
                               mtp_tail_index=stats[2].long() if tails else None,
                               mtp_tail_inv_length=stats[3] if tails else None,
                               step_weight_by_depth=None if step_w is None else step_w.to(device))


def _row_stats(mb) -> torch.Tensor:
    """[4, N] float64 per-row weights of a microbatch: sample counts and inverse lengths (DSA's indexer-loss
    weights, `TreeMicrobatch.row_sample_stats`), the MTP tail rows' index and weights (`mtp_tail_stats`;
    zeros without tails)."""
    return torch.stack([*mb.row_sample_stats(), *(t.double() for t in mb.mtp_tail_stats())])


def _step_weights(mb) -> "Optional[torch.Tensor]":
    a = getattr(mb, "step_weight_by_depth", None)
    return None if a is None else torch.as_tensor(a, dtype=torch.float64)


def _broadcast_optional(t: "Optional[torch.Tensor]", ndim: int, dtype, src: int, group, cdev):
    """``t`` of the source rank (None there when absent) on every rank of ``group``, or None everywhere:
    its shape first (all -1 when absent), then the data."""
    mine = dist.get_rank() == src
    shape = torch.tensor(tuple(t.shape) if mine and t is not None else (-1,) * ndim, dtype=torch.int64, device=cdev)
    dist.broadcast(shape, src, group=group)
    if int(shape[0]) < 0:
        return None
    out = t.to(dtype).to(cdev) if mine else torch.empty(tuple(shape.tolist()), dtype=dtype, device=cdev)
    dist.broadcast(out, src, group=group)
    return out


# -------------------------------------------------------------------------------------------- step
def loss_func(loss_map: LossMap, output_tensor, *, loss_type: str = "sft", clip_eps: float = 0.2,
              clip_eps_high: Optional[float] = None, kl_coef: float = 0.0, check_for_nan: bool = False,
              entropy_coef: float = 0.0):
    """Megatron ``loss_func``: ``(loss_sum, num_tokens, report)`` from the [M] per-occurrence log-probs
    (or ``(logprobs, entropy)``) the last stage returns. ``report["lm loss"]`` is ``[loss_sum,
    num_tokens]`` (Megatron-LM sums it over microbatches and DP ranks and logs the ratio); policy
    losses add their metrics likewise, and ``report["entropy"]`` (``[sum of entropies, num_tokens]``:
    Megatron-LM logs the mean per-token entropy) when the entropy is there. ``entropy_coef``
    (``--tree-entropy-coef``): the loss minus ``entropy_coef`` x the entropy (`tree_loss_func`)."""
    from ..megatron.loss import tree_loss_func

    out = tree_loss_func(loss_map, output_tensor, loss_type=loss_type, clip_eps=clip_eps,
                         clip_eps_high=clip_eps_high, kl_coef=kl_coef, entropy_coef=entropy_coef)
    if check_for_nan:
        from megatron.core.rerun_state_machine import get_rerun_state_machine

        rsm = get_rerun_state_machine()
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            rsm.validate_result(result=out[0], rejection_func=reject, message=f"found {what} in local tree loss",
                                tolerance=0.0, fatal=True)
    return out


def forward_step(data_iterator, model, return_schedule_plan: bool = False, *, args=None):
    """Megatron ``forward_step_func``: ``(output, partial(loss_func, loss_map, ...))`` with the
    ``--tree-loss`` settings. Every pipeline stage reads the batch (see `get_batch`). The first call
    on each rank also guards Megatron-LM's checkpoint saves (`lm_saves.guard_saves`)."""
    if return_schedule_plan:
        raise ValueError("tree training does not support --overlap-moe-expert-parallel-comm schedule plans or "
                         "partial activation checkpointing per microbatch")
    from ..megatron.forward_step import context_parallel_params

    args = _args(args)
    guard_saves(args)  # the ranks that build no data (tensor-parallel rank > 0) too; a flag check after the first
    timers = _timers()
    if timers is not None:
        timers("batch-generator", log_level=2).start()
    if getattr(args, "tree_carry", False):
        return _carry_forward_step(data_iterator, model, args, timers)
    psp = get_batch(data_iterator, device=next(model.parameters()).device)
    # under CP each rank keeps its owned rows of the plan --tree-cp-planner makes (the same on every rank)
    psp = context_parallel_params(psp, model, strategy=args.tree_cp_planner)
    psp.return_entropy = True  # the mean entropy is logged (and --tree-entropy-coef may use it)
    if timers is not None:
        timers("batch-generator").stop()
    output = model(psp.input_ids.unsqueeze(0), psp.position_ids.unsqueeze(0), None, packed_seq_params=psp)
    return output, partial(loss_func, psp.loss_map, loss_type=args.tree_loss, clip_eps=args.tree_clip_eps,
                           clip_eps_high=args.tree_clip_eps_high, kl_coef=args.tree_kl_coef,
                           entropy_coef=float(getattr(args, "tree_entropy_coef", 0.0) or 0.0),
                           check_for_nan=bool(getattr(args, "check_for_nan_in_loss_and_grad", False)))


#: a tensor-parallel peer's carry items of the current step, made from the microbatches its source sent
_peer_items: deque = deque()


def _next_carry_item(data_iterator):
    """The next carry item of this rank's step. Without tensor parallelism: ``data_iterator``'s. With it,
    Megatron-LM builds the data on tensor-parallel rank 0 only: that rank reads its items and, at each
    step's first, sends the step's microbatches to its TP peers (one object broadcast per step), which
    make the same items from them (`carry_items`: the same order, each rank its own carry store of its
    own heads' state). Carry groups cut over DP ranks: the step's schedule goes with them (`carry_rank_items`)."""
    from megatron.core import parallel_state as ps

    from ..megatron.carry import CarryItem, carry_items, carry_rank_items

    group, src = _tp_source()
    if group is None or dist.get_world_size(group) == 1:
        item = next(data_iterator)
    elif dist.get_rank() == src:
        item = next(data_iterator)
        if isinstance(item, CarryItem) and item.position == 0:
            dist.broadcast_object_list([(item.store.microbatches, item.store.keep, item.store.rank_args)], src=src,
                                       group=group)
    else:
        if not _peer_items:
            box = [None]
            dist.broadcast_object_list(box, src=src, group=group)
            mbs, keep, rank_args = box[0]
            _peer_items.extend(carry_items(mbs, keep=keep) if rank_args is None else
                               carry_rank_items(*rank_args[:4], ps.get_data_parallel_group(), keep=rank_args[4]))
        item = _peer_items.popleft()
    if not isinstance(item, CarryItem):
        raise ValueError("--tree-carry: the data iterator must yield carry items (MicrobatchStream(carry=True))")
    return item


def _carry_forward_step(data_iterator, model, args, timers):
    """``--tree-carry``: the next carry item (fill, run or restore; `megatron.carry`) of this rank's
    step (`_next_carry_item`: under tensor parallelism the source's step reaches its peers). Under 1F1B
    pipelining every stage reads the step and runs the same items on its own layers' store; under tree
    CP every CP rank plans each item with ``--tree-cp-planner`` (`forward_step.carry_cp`); interleaved
    stages are refused (`arguments.validate_tree_args`)."""
    from ..megatron.forward_step import begin_carry_item, carry_forward, context_parallel_params

    item = _next_carry_item(data_iterator)
    if timers is not None:
        timers("batch-generator").stop()
    make_loss = lambda loss_map: partial(
        loss_func, loss_map, loss_type=args.tree_loss, clip_eps=args.tree_clip_eps,
        clip_eps_high=args.tree_clip_eps_high, kl_coef=args.tree_kl_coef,
        entropy_coef=float(getattr(args, "tree_entropy_coef", 0.0) or 0.0),
        check_for_nan=bool(getattr(args, "check_for_nan_in_loss_and_grad", False)))
    if item.mb.carry is None:  # a padding microbatch of the step
        begin_carry_item(item, model)  # (a sync of carry groups cut over DP ranks may begin here)
        from ..megatron.packed_seq import tree_packed_seq_params

        psp = tree_packed_seq_params(item.mb, next(model.parameters()).device, return_entropy=True)
        psp = context_parallel_params(psp, model, strategy=args.tree_cp_planner)
        out = model(psp.input_ids.unsqueeze(0), psp.position_ids.unsqueeze(0), None, packed_seq_params=psp)
        return out, make_loss(psp.loss_map)
    out, item_loss = carry_forward(item, model, make_loss, return_entropy=True, cp_strategy=args.tree_cp_planner)
    if item.phase in ("fill", "keep"):  # (a release hands on the keep's real loss function)
        return out, partial(_fill_report, item_loss, make_loss, item.mb.loss_map)
    return out, item_loss


def _fill_report(fill_loss, make_loss, loss_map, output):
    """A fill's (or keep's) ``(zero loss, 0 tokens, report)`` with every key a real item's report has, as zeros.
    Megatron-LM's ``train_step`` all-reduces one value per key of a step's first microbatch's report over DP: the
    ranks' first items must report the same keys, and carry over DP ranks may start one rank with a fill and another
    with a run or a padding microbatch."""
    loss, num, report = fill_loss(output)
    none = torch.zeros(0, dtype=torch.int64)
    empty = type(loss_map)(**{f.name: (None if getattr(loss_map, f.name) is None else getattr(loss_map, f.name)[none])
                              for f in dataclasses.fields(loss_map)})
    z = torch.zeros(0, dtype=output.dtype, device=output.device)
    _, _, full = make_loss(empty)((z, z))
    return loss, num, {**{k: torch.zeros_like(v) for k, v in full.items()}, **report}


# -------------------------------------------------------------------------------------------- data
class MicrobatchStream:
    """Iterator over a `TreeDataPipeline`'s microbatches, step after step (what Megatron-LM's
    ``--dataloader-type external`` hands to the schedule unchanged).

    ``pipeline`` the pipeline (its ``state_dict()`` tells the position); ``step`` the `TreeStep`
    being consumed (its statistics: tree_token_ratio, num_targets, ...).
    """

    def __init__(self, pipeline, name: str = "train", *, carry: bool = False, args=None):
        self.pipeline, self.name, self.carry = pipeline, name, carry
        self.args = args  # carry: the exporters kept (`megatron.carry.kept_exporters`: --tree-carry-memory)
        self.step = None
        self._steps = None
        self._pending: deque = deque()

    def __iter__(self):
        return self

    def __next__(self):
        while not self._pending:
            if self._steps is None:
                self._steps = iter(self.pipeline)
            try:
                self.step = next(self._steps)
            except ValueError as e:
                raise ValueError(f"{self.name} data: {e}. With Megatron-LM: microbatches per rank = "
                                 "--global-batch-size / data-parallel size; raise it, or "
                                 "--tree-max-tokens-per-mb, or lower --tree-global-batch-samples") from e
            if self.carry:  # fill / run, then restores, sharing the step's store (`megatron.carry`)
                from megatron.core import parallel_state as ps

                from ..megatron.carry import kept_exporters, step_carry_items

                mbs = self.step.microbatches
                keep = None if self.args is None else kept_exporters(mbs, self.args,
                                                                     getattr(self.args, "tree_carry_memory", None))
                self._pending.extend(step_carry_items(self.step, ps.get_data_parallel_group(), keep=keep))
            else:
                self._pending.extend(self.step.microbatches)
        return self._pending.popleft()

    def close(self) -> None:
        self.pipeline.close()


def _data_parallel() -> tuple[int, int]:
    if dist.is_initialized():
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    return 0, 1


def _skip_steps(pipeline, steps: int) -> None:
    """Position ``pipeline`` after ``steps`` optimizer steps from the start of its first epoch.

    Windows are a pure function of (dataset, seed, epoch, --tree-global-batch-samples): step k of an
    epoch is the window at cursor k * G. So Megatron-LM's iteration count is all the state a resume
    needs, provided the dataset, seed and G are unchanged (the DP size may change)."""
    if steps <= 0:
        return
    state = pipeline.state_dict()
    epoch, k = divmod(int(steps), pipeline.steps_per_epoch)
    state.update(epoch=epoch, cursor=k * pipeline.global_batch_samples, epoch_step=k, global_step=int(steps))
    pipeline.load_state_dict(state)


def user_vocab_size(args) -> Optional[int]:
    """The vocabulary token ids must lie below: the one the user chose, never ``padded_vocab_size``
    (Megatron-LM pads the embedding to a multiple of ``--make-vocab-size-divisible-by`` x TP; an id
    in the padding would train a row no tokenizer produces, silently).

    ``args.vocab_size`` (``--vocab-size``) when given: with the NullTokenizer the examples use it is
    the real tokenizer's vocabulary (the NullTokenizer's extra EOD id, ``--vocab-size`` itself, is
    no data token). Otherwise the size of the tokenizer Megatron-LM built (``get_tokenizer()``, e.g.
    a HuggingFace one), else None (no check)."""
    v = getattr(args, "vocab_size", None)
    if v:
        return int(v)
    try:
        from megatron.training import get_tokenizer  # Megatron-LM only

        return int(get_tokenizer().vocab_size) or None
    except Exception:  # noqa: BLE001 - not installed, no tokenizer built yet, or one without a size
        return None


def build_pipeline(paths, args, *, dp_rank: int, dp_size: int, shuffle: bool = True, start_step: int = 0):
    """A `TreeDataPipeline` for Megatron-LM: ``--global-batch-size / DP`` microbatches per rank and step.

    Token ids are checked against `user_vocab_size` while reading (an offending sample is named by
    ``file:line``; ``--tree-bad-sample skip`` drops it and ``pipe.read_report`` records it)."""
    from ..cp.planning.carry_ranks import rank_schedule
    from ..data.pipeline import TreeDataPipeline  # lazily: the data layer is optional for model-only use
    from ..megatron.mtp import mtp_tail_rows  # the args carry the config's MTP / DSA fields under the same names

    mbs = int(getattr(args, "micro_batch_size", 1) or 1)
    per_rank = int(args.global_batch_size) // (mbs * dp_size)
    if per_rank < 1:
        raise ValueError(f"--global-batch-size ({args.global_batch_size}) must be at least the data-parallel size "
                         f"({dp_size}): every rank runs the same number of microbatches")
    vocab = user_vocab_size(args)
    pipe = TreeDataPipeline.from_files(
        paths, vocab_size=vocab, bad_sample=args.tree_bad_sample, max_tokens_per_mb=args.tree_max_tokens_per_mb,
        global_batch_samples=args.tree_global_batch_samples, dp_rank=dp_rank, dp_size=dp_size,
        seed=int(getattr(args, "seed", 0) or 0), num_epochs=None, shuffle=shuffle,
        pad_to_multiple_of=args.tree_pad_to_multiple_of, microbatches_per_rank=per_rank,
        lookahead=args.tree_lookahead, share_prefixes=not getattr(args, "tree_flat_packing", False),
        mtp_tail=mtp_tail_rows(args), carry=bool(getattr(args, "tree_carry", False)),
        # a sync needs every earlier item's backward done: not under 1F1B
        carry_cut=("never" if int(getattr(args, "pipeline_model_parallel_size", 1) or 1) > 1
                   else getattr(args, "tree_carry_cut", "auto")),
        carry_schedule_fn=rank_schedule,
        loss_agg=getattr(args, "loss_agg", "token-mean"), loss_agg_norm=getattr(args, "loss_agg_norm", None),
        **_route_kwargs(args))
    _skip_steps(pipe, start_step)
    return pipe


def _route_kwargs(args) -> dict:
    """``--tree-routing-replay``: pack route-aware, records checked against the router's top-k and
    expert count (the MoE layer count is checked by the model when it replays)."""
    if not getattr(args, "tree_routing_replay", False):
        return {}
    from ..tree.routes import read_time_route_spec

    return dict(route_aware=True, route_spec=read_time_route_spec(args))


def train_valid_test_datasets_provider(train_val_test_num_samples=None, vp_stage: Optional[int] = None, *,
                                       args=None):
    """``(train, valid, test)`` microbatch iterators for ``--dataloader-type external``.

    train: ``--tree-data-path``, shuffled per epoch (``--seed``), cycling forever (Megatron-LM stops
    at ``--train-iters``), starting after ``args.iteration`` steps on resume. valid:
    ``--tree-valid-data-path`` in file order (or None). test: None. ``train_val_test_num_samples``
    and ``vp_stage`` are accepted for Megatron-LM's signature; every virtual stage gets its own copy.
    """
    args = _args(args)
    if not getattr(args, "tree_data_path", None):
        raise ValueError("set --tree-data-path (JSONL or Parquet files of samples)")
    if getattr(args, "tree_global_batch_samples", None) is None:
        raise ValueError("set --tree-global-batch-samples (samples per optimizer step over all DP ranks)")
    dp_rank, dp_size = _data_parallel()
    guard_saves(args)  # a failed save: one clear error, and torchrun's restarts do not retrain it
    start = int(getattr(args, "iteration", 0) or 0)
    train = MicrobatchStream(build_pipeline(args.tree_data_path, args, dp_rank=dp_rank, dp_size=dp_size,
                                            start_step=start), "train", carry=bool(getattr(args, "tree_carry", False)),
                             args=args)
    valid = None
    if getattr(args, "tree_valid_data_path", None):
        valid = MicrobatchStream(build_pipeline(args.tree_valid_data_path, args, dp_rank=dp_rank, dp_size=dp_size,
                                                shuffle=False), "valid", carry=bool(getattr(args, "tree_carry", False)),
                                 args=args)
    p = train.pipeline
    _print_rank_0(f"> tree data: {len(p.samples)} training samples, {p.global_batch_samples} per step in "
                  f"{p.microbatches_per_rank} microbatches/rank x {dp_size} DP ranks, budget {p.max_tokens_per_mb} "
                  f"rows, starting at step {start}")
    for name, stream in (("train", train), ("valid", valid)):
        if stream is not None and stream.pipeline.skipped:  # dropped data must not pass unnoticed
            _print_rank_0(f"> tree {name} data: {stream.pipeline.read_report.summary()}")
    return train, valid, None
