"""Building and stepping tree models with Megatron-Core's public training APIs.

Shared by ``megatron-tree verify`` and ``megatron-tree train``: model configs for small GPT /
hybrid models, the per-stage model builder, the DDP wrapper and one forward-backward over a list of
`TreeMicrobatch`es through ``get_forward_backward_func`` (variable sequence lengths between
pipeline stages) with the extension's ``tree_forward_step``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Iterable, Optional

import torch

from ..megatron.forward_step import tree_forward_step
from ..megatron.model import TreeGPTModel

DEFAULT_HYBRID_PATTERN = "MG*-*E"  # Mamba-2, GDN, attention, MLP, attention, MoE


@dataclass
class ModelArgs:
    """Size and kind of a model. ``kind`` is "gpt" or "hybrid" (layers from ``pattern``)."""

    kind: str = "gpt"
    pattern: str = DEFAULT_HYBRID_PATTERN
    num_layers: int = 4
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_query_groups: int = 2
    ffn_hidden_size: int = 64
    vocab_size: int = 128
    max_position: int = 4096
    num_experts: Optional[int] = None
    moe_ffn_hidden_size: int = 32
    moe_router_topk: int = 2
    window_size: Optional[int] = None  # sliding window (left context) on attention layers
    sinks: bool = False  # learned softmax sinks ("learnable" softmax offset)
    normalization: str = "RMSNorm"
    position_embedding_type: str = "rope"
    extra: dict = field(default_factory=dict)  # more TransformerConfig fields

    def layers(self) -> int:
        if self.kind == "hybrid":
            from ..megatron.specs import parse_hybrid_pattern

            return len(parse_hybrid_pattern(self.pattern))
        return self.num_layers


def make_config(margs: ModelArgs, *, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1, sp: bool = False,
                recompute: str = "none", dtype: torch.dtype = torch.float32, cpu: bool = True):
    """A `TransformerConfig` for ``margs`` under the given parallel layout (fusions off on CPU)."""
    from megatron.core.transformer import TransformerConfig

    kw = dict(
        num_layers=margs.layers(), hidden_size=margs.hidden_size, num_attention_heads=margs.num_attention_heads,
        num_query_groups=margs.num_query_groups, ffn_hidden_size=margs.ffn_hidden_size,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        context_parallel_size=cp, sequence_parallel=sp and tp > 1,
        params_dtype=dtype, pipeline_dtype=dtype, use_cpu_initialization=cpu,
        hidden_dropout=0.0, attention_dropout=0.0, normalization=margs.normalization, add_bias_linear=False,
        calculate_per_token_loss=True, variable_seq_lengths=True, batch_p2p_sync=not cpu,
        moe_token_dispatcher_type="alltoall",  # Megatron rejects allgather with variable sequence lengths
        bias_activation_fusion=not cpu, masked_softmax_fusion=not cpu, bias_dropout_fusion=not cpu,
        apply_rope_fusion=not cpu, gradient_accumulation_fusion=False, persist_layer_norm=not cpu,
    )
    if margs.kind == "hybrid":
        kw.update(linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                  linear_num_value_heads=4, mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=2,
                  mamba_num_heads=8, use_mamba_mem_eff_path=False)
        if "E" in margs.pattern and not margs.num_experts:
            margs.num_experts = 4
    if margs.num_experts:
        kw.update(num_moe_experts=margs.num_experts, moe_ffn_hidden_size=margs.moe_ffn_hidden_size,
                  moe_router_topk=margs.moe_router_topk,
                  moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_grouped_gemm=False,
                  moe_router_dtype="fp64" if dtype == torch.float64 else "fp32")
    if margs.window_size is not None:
        kw.update(window_size=(margs.window_size, 0))
    if margs.sinks:
        kw.update(softmax_type="learnable")
    if recompute == "full":
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif recompute == "selective":
        kw.update(recompute_granularity="selective")
    elif recompute != "none":
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    kw.update(margs.extra)
    return TransformerConfig(**kw)


def build_model(config, margs: ModelArgs, *, pre_process: Optional[bool] = None,
                post_process: Optional[bool] = None) -> TreeGPTModel:
    """This pipeline stage's `TreeGPTModel` (GPT or hybrid stack, tree specs, local modules)."""
    from megatron.core import parallel_state as ps

    from ..megatron.specs import get_tree_gpt_decoder_block_spec, get_tree_hybrid_stack_spec

    pre = ps.is_pipeline_first_stage() if pre_process is None else pre_process
    post = ps.is_pipeline_last_stage() if post_process is None else post_process
    if margs.kind == "gpt":
        spec = get_tree_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=margs.normalization)
    elif margs.kind == "hybrid":
        spec = get_tree_hybrid_stack_spec(margs.pattern, config, use_transformer_engine=False)
    else:
        raise ValueError(f"model kind must be gpt or hybrid, got {margs.kind!r}")
    model = TreeGPTModel(config, spec, vocab_size=margs.vocab_size, max_sequence_length=margs.max_position,
                         pre_process=pre, post_process=post, position_embedding_type=margs.position_embedding_type,
                         share_embeddings_and_output_weights=False)
    if config.params_dtype == torch.float64:
        model.to(torch.float64)  # Megatron keeps Mamba's A_log / D in fp32 whatever params_dtype says
    return model


def wrap_ddp(model, config, *, use_distributed_optimizer: bool = False):
    """Megatron DDP around ``model`` (grads in ``main_grad``), with ``finalize_model_grads`` wired."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    config.finalize_model_grads_func = finalize_model_grads
    ddp = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(
        overlap_grad_reduce=False, use_distributed_optimizer=use_distributed_optimizer), module=model)
    config.no_sync_func = ddp.no_sync
    return ddp


def forward_backward(model, microbatches: list, *, forward_only: bool = False, **loss_kwargs) -> list[dict]:
    """One forward(-backward) over ``microbatches`` (`TreeMicrobatch`es, or ``(microbatch, CPPlan)``
    pairs under context parallelism) through Megatron's schedule. Returns the loss reports of the
    last pipeline stage (empty elsewhere)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    seq = max((mb[0] if isinstance(mb, tuple) else mb).num_rows for mb in microbatches)
    return get_forward_backward_func()(
        forward_step_func=partial(tree_forward_step, **loss_kwargs), data_iterator=iter(list(microbatches)),
        model=[model], num_microbatches=len(microbatches), seq_length=seq, micro_batch_size=1,
        forward_only=forward_only)


def report_totals(reports: Iterable[dict], key: str = "lm loss") -> Optional[torch.Tensor]:
    """Sum of ``[loss_sum, num_tokens]`` pairs over microbatch reports (None if there are none)."""
    vals = [r[key] for r in reports if key in r]
    return torch.stack(vals).sum(0) if vals else None
