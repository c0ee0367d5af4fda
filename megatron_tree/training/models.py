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
# kind="mamba": Megatron's MambaModel, whose hybrid_override_pattern letters are M Mamba-2, * attention,
# - MLP, E MoE (no G: Gated DeltaNet layers are the qwen3next kind's, or our own hybrid stack's)
DEFAULT_MAMBA_PATTERN = "M*-E"
MAMBA_LETTERS = "M*-E"
# Small MLA shapes (kind="mla"): DeepSeek-V3's structure (q and kv latents, YaRN with a
# concentration factor != 1, so mscale matters) at toy sizes; query/key heads D = 8 + 4 (no-position +
# rotary part), value heads Dv = 6 != D
MLA_DEFAULTS = dict(q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6,
                    rope_type="yarn", rotary_scaling_factor=4.0, mscale=1.0, mscale_all_dim=0.5,
                    original_max_position_embeddings=16)
# DeepSeek sparse attention (kind="dsa"): MLA_DEFAULTS plus a lightning indexer of 2 heads of 8 (a
# power of two: the Hadamard rotation), top-4 keys per query (sparse on these small trees, and the
# first rows see fewer than 4 keys), dense KL indexer loss with coefficient 0.5
DSA_DEFAULTS = dict(experimental_attention_variant="dsa", dsa_indexer_n_heads=2, dsa_indexer_head_dim=8,
                    dsa_indexer_topk=4, dsa_indexer_loss_coeff=0.5, dsa_indexer_use_sparse_loss=False)
# IndexShare fields (megatron-core 0.19's TransformerConfig has them; on 0.16 they are set as attributes)
DSA_INDEX_SHARE_FIELDS = ("dsa_indexer_topk_freq", "dsa_indexer_skip_topk_offset")


# kind="vlm": multimodal RoPE sections of the t / h / w axes (head dim 8: four rotary frequencies) and the
# width of a processed patch the encoder reads (`megatron.vision_language.PatchMergeEncoder`)
VLM_MROPE_SECTION = [2, 1, 1]
VLM_PATCH_DIM = 24


@dataclass
class ModelArgs:
    """Size and kind of a model. ``kind`` is "gpt" or "hybrid" (layers from ``pattern``), or "mla"
    (GPT with Multi-Latent Attention: `MLATransformerConfig`, `MLA_DEFAULTS` unless ``extra`` overrides),
    or "dsa" (MLA with DeepSeek sparse attention: `DSA_DEFAULTS` over `MLA_DEFAULTS`, ``extra`` overrides),
    or "mamba" (Megatron's ``MambaModel`` as `TreeMambaModel`, layers from ``pattern``: M * - E,
    default `DEFAULT_MAMBA_PATTERN`), or "qwen3next" (``GPTModel`` with Megatron's experimental
    ``gated_delta_net`` attention variant: GDN layers with a gated, qk-normed attention layer every
    ``linear_attention_freq`` layers; MoE with a gated shared expert when ``num_experts``), or "vlm"
    (`TreeVisionLanguageModel`: a GPT with multimodal RoPE, ``mrope_section`` `VLM_MROPE_SECTION`, and a
    `PatchMergeEncoder` of ``VLM_PATCH_DIM``-wide patches on the first stage)."""

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
    rotary_base: int = 10000
    rotary_percent: float = 1.0  # GPTModel / MambaModel rotary (not MLA's, which builds its own from the config)
    rope_scaling: bool = False  # Llama 3.x frequency scaling (GPTModel only)
    rope_scaling_factor: float = 8.0
    extra: dict = field(default_factory=dict)  # more TransformerConfig fields
    linear_attention_freq: int = 2  # qwen3next: one standard attention layer every N layers
    mtp_pattern: str = "*-"  # mamba with extra["mtp_num_layers"] = K: each MTP depth's inner layers (0.19)

    def __post_init__(self):
        if self.kind == "mamba" and self.pattern == DEFAULT_HYBRID_PATTERN:
            self.pattern = DEFAULT_MAMBA_PATTERN

    def layers(self) -> int:
        if self.kind == "mamba":
            bad = sorted(set(self.pattern) - set(MAMBA_LETTERS))
            if bad or not self.pattern:
                raise ValueError(f"MambaModel pattern {self.pattern!r}: letters must be from {MAMBA_LETTERS!r} "
                                 f"(M Mamba-2, * attention, - MLP, E MoE); bad: {bad}. Gated DeltaNet layers: use the "
                                 "qwen3next model (experimental_attention_variant) or the hybrid stack")
            return len(self.pattern)
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
    if margs.kind in ("hybrid", "mamba", "qwen3next"):
        kw.update(linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                  linear_num_value_heads=4, mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=2,
                  mamba_num_heads=8, use_mamba_mem_eff_path=False)
        if margs.kind != "qwen3next" and "E" in margs.pattern and not margs.num_experts:
            margs.num_experts = 4
    if margs.kind == "qwen3next":
        # SwiGLU as Qwen3-Next has it; megatron-core 0.19's stock GDN also accepts only silu / swish
        kw.update(experimental_attention_variant="gated_delta_net", linear_attention_freq=margs.linear_attention_freq,
                  attention_output_gate=True, qk_layernorm=True, activation_func=torch.nn.functional.silu,
                  gated_linear_unit=True)
        if margs.num_experts:
            kw.update(moe_shared_expert_intermediate_size=margs.moe_ffn_hidden_size, moe_shared_expert_gate=True)
    if margs.kind == "mamba" and recompute == "full":
        raise ValueError("MambaModel has no full-layer recomputation in Megatron-Core 0.16.1 (MambaStack ignores "
                         "recompute_granularity='full'); use selective recomputation")
    if margs.num_experts:
        # balancing off unless asked for: ``margs.extra`` carries the flags (`arguments.moe_balancing_fields`;
        # on a tree every statistic counts flat tokens, `megatron.moe_balance`)
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
    if margs.kind in ("mla", "dsa"):
        # MLA: K/V from a low-rank latent, query/key heads (qk_head_dim + qk_pos_emb_head_dim) wider
        # than value heads; every head has its own K (num_query_groups plays no part)
        kw.update(MLA_DEFAULTS, num_query_groups=margs.num_attention_heads, rotary_base=margs.rotary_base)
        if margs.num_experts:  # DeepSeek-style: the first layer dense, MoE after it
            kw.update(moe_layer_freq=[0] + [1] * (margs.layers() - 1))
        if recompute == "selective":  # also MLA's own up-projection checkpoint (reuses the rotary table)
            # (DSA: megatron-core 0.16's MLA drops the indexer inputs in its core_attn checkpoint)
            kw.update(recompute_modules=["mla_up_proj"] if margs.kind == "dsa" else ["core_attn", "mla_up_proj"])
    if margs.kind == "dsa":
        kw.update(DSA_DEFAULTS)
    if margs.kind == "vlm":
        kw.update(mrope_section=list(VLM_MROPE_SECTION))
    kw.update(margs.extra)
    if margs.kind in ("mla", "dsa"):
        from megatron.core.transformer import MLATransformerConfig

        late = {}
        if kw.get("experimental_attention_variant") == "dsa":
            # fields this Megatron-Core lacks (IndexShare on 0.16) are set after construction, and
            # stock's "no CP with DSAttention" assertion (about stock's own CP) is kept off the tree
            # model, whose DSA has tree context parallelism: the variant is set after construction
            for f in DSA_INDEX_SHARE_FIELDS:
                if f in kw and f not in MLATransformerConfig.__dataclass_fields__:
                    late[f] = kw.pop(f)
            if cp > 1:
                late["experimental_attention_variant"] = kw.pop("experimental_attention_variant")
        config = MLATransformerConfig(**kw)
        for f, v in late.items():
            setattr(config, f, v)
        return config
    return TransformerConfig(**kw)


def build_model(config, margs: ModelArgs, *, pre_process: Optional[bool] = None,
                post_process: Optional[bool] = None, stock_dsa: bool = False, stock_mtp: bool = False) -> TreeGPTModel:
    """This pipeline stage's `TreeGPTModel` (GPT, hybrid, MLA, DSA or qwen3next stack) or `TreeMambaModel`
    (kind "mamba"), tree specs, local modules. ``stock_dsa`` (kind "dsa"): every DSA core attention
    is stock ``DSAttention`` run per sample (`dsa_oracle.stock_oracle_class`: verify's per-sample side).
    ``config.mtp_num_layers``: MTP layers on the last stage (`get_tree_gpt_mtp_block_spec`); ``stock_mtp``:
    stock ``MultiTokenPredictionLayer``s (rolling, verify's per-sample side, `verify_mtp`)."""
    from megatron.core import parallel_state as ps

    from ..megatron.specs import get_tree_gpt_decoder_block_spec, get_tree_hybrid_stack_spec

    pre = ps.is_pipeline_first_stage() if pre_process is None else pre_process
    post = ps.is_pipeline_last_stage() if post_process is None else post_process
    if margs.kind in ("gpt", "mla", "vlm"):  # MLA: Megatron's block spec builds MLA layers from the config
        spec = get_tree_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=margs.normalization)
    elif margs.kind == "hybrid":
        spec = get_tree_hybrid_stack_spec(margs.pattern, config, use_transformer_engine=False,
                                          qk_layernorm=bool(config.qk_layernorm))
    elif margs.kind in ("qwen3next", "dsa"):
        from ..megatron.family_specs import get_tree_transformer_block_with_experimental_attention_variant_spec

        spec = get_tree_transformer_block_with_experimental_attention_variant_spec(config, use_transformer_engine=False)
        if stock_dsa:
            from ..megatron.dsa import get_tree_dsa_module_spec
            from .dsa_oracle import stock_oracle_class

            for layer in spec.layer_specs:
                layer.submodules.self_attention = get_tree_dsa_module_spec(config, stock_core=stock_oracle_class())
    elif margs.kind == "mamba":
        from ..megatron.family_specs import get_tree_mamba_stack_spec
        from ..megatron.model import TreeMambaModel

        spec, pattern = get_tree_mamba_stack_spec(use_transformer_engine=False), margs.pattern
        K = int(getattr(config, "mtp_num_layers", None) or 0)
        if K:  # megatron-core >= 0.19's HybridModel: MTP depths from the pattern "main/mtp/mtp/..."
            from ..compat.mtp import hybrid_has_mtp

            if not hybrid_has_mtp():
                raise ValueError("multi-token prediction: this Megatron-Core's MambaModel has no MTP layers "
                                 "(megatron-core >= 0.19's HybridModel has them; GPTModel kinds: gpt, mla, dsa, "
                                 "qwen3next)")
            pattern = "/".join([pattern] + [margs.mtp_pattern] * K)
            if stock_mtp:  # verify's per-sample side: stock MTP layers (rolling) around the tree inner stack
                import dataclasses as dc

                block = spec.submodules.mtp_block_spec
                block = dc.replace(block, submodules=_stock_mtp_layers(block.submodules))
                spec = dc.replace(spec, submodules=dc.replace(spec.submodules, mtp_block_spec=block))
        model = TreeMambaModel(config, spec, vocab_size=margs.vocab_size, max_sequence_length=margs.max_position,
                               pre_process=pre, post_process=post, hybrid_override_pattern=pattern,
                               position_embedding_type=margs.position_embedding_type, rotary_base=margs.rotary_base,
                               rotary_percent=margs.rotary_percent, share_embeddings_and_output_weights=False)
    else:
        raise ValueError(f"model kind must be gpt, hybrid, mla, dsa, mamba, qwen3next or vlm, got {margs.kind!r}")
    mtp_spec = None
    if getattr(config, "mtp_num_layers", None) and margs.kind != "mamba":
        from ..megatron.specs import get_tree_gpt_mtp_block_spec

        mtp_spec = get_tree_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
        if stock_mtp and mtp_spec is not None:
            mtp_spec = _stock_mtp_layers(mtp_spec)
    if margs.kind != "mamba":
        vlm = margs.kind == "vlm"  # the images go into the whole local sequence, then it is SP-scattered
        model = TreeGPTModel(config, spec, vocab_size=margs.vocab_size, max_sequence_length=margs.max_position,
                             pre_process=pre, post_process=post,
                             position_embedding_type="mrope" if vlm else margs.position_embedding_type,
                             rotary_base=margs.rotary_base, rotary_percent=margs.rotary_percent,
                             rope_scaling=margs.rope_scaling, rope_scaling_factor=margs.rope_scaling_factor,
                             share_embeddings_and_output_weights=False, mtp_block_spec=mtp_spec,
                             **(dict(scatter_embedding_sequence_parallel=False) if vlm else {}))
        if vlm:
            from ..megatron.vision_language import PatchMergeEncoder, TreeVisionLanguageModel

            model = TreeVisionLanguageModel(config, model, PatchMergeEncoder(config, VLM_PATCH_DIM) if pre else None)
    if config.params_dtype == torch.float64:
        model.to(torch.float64)  # Megatron keeps Mamba's A_log / D in fp32 whatever params_dtype says
    return model


def _stock_mtp_layers(block_submodules):
    """An MTP block's submodules with every layer stock ``MultiTokenPredictionLayer`` (rolling; verify's
    per-sample side) in place of `TreeMultiTokenPredictionLayer`; same submodules and parameters."""
    import dataclasses as dc

    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

    return dc.replace(block_submodules, layer_specs=[dc.replace(s, module=MultiTokenPredictionLayer)
                                                     for s in block_submodules.layer_specs])


def build_hf_model(args, dtype, on_cpu: bool, *, recompute: Optional[str] = None, hf_weights: bool = True,
                   **overrides):
    """``(bridge, config, model)`` of ``args.hf_model``: the Megatron-Bridge provider of that Hugging
    Face checkpoint as a tree provider (`megatron_tree.bridge.hf_provider`) under ``args``' parallel
    layout, ``dtype`` and tree-training settings (variable sequence lengths, per-token loss), built and
    (``hf_weights``) loaded with every parameter checked (`bridge.load_hf_weights`). The provider is
    the config."""
    from .. import bridge as tb

    if recompute == "full":
        overrides.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif recompute == "selective":
        overrides.update(recompute_granularity="selective")
    if getattr(args, "routing_replay", False):
        overrides["moe_enable_routing_replay"] = True
    if getattr(args, "freeze_vision", False):  # the vision-language provider's own switch (`bridge.qwen3_vl`)
        overrides.update(freeze_vision_model=True, freeze_vision_projection=True)
    hf, provider = tb.hf_provider(
        args.hf_model, load_weights=False, trust_remote_code=bool(getattr(args, "trust_remote_code", False)),
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size, context_parallel_size=args.context_parallel_size,
        sequence_parallel=bool(args.sequence_parallel), params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16, variable_seq_lengths=True, calculate_per_token_loss=True,
        hidden_dropout=0.0, attention_dropout=0.0, **overrides)
    model = provider.provide().to(dtype)
    if not on_cpu:
        model = model.cuda()
    if hf_weights:
        tb.load_hf_weights(hf, [model])
    return hf, provider, model


def hf_vision_input(args):
    """A vision-language ``--hf-model`` checkpoint's `data.images.VisionInput` (its image processor, placeholder
    token and merge size: records' ``images`` are read with it, and its pixel table travels with ``args`` to every
    rank), else None (no ``--hf-model``, or a text checkpoint)."""
    path = getattr(args, "hf_model", None)
    if path is None:
        return None
    from ..bridge.hf_config import local_config

    data = local_config(path)
    if data is None:  # a hub id
        from transformers import AutoConfig

        has_vision = getattr(AutoConfig.from_pretrained(str(path), trust_remote_code=bool(
            getattr(args, "trust_remote_code", False))), "vision_config", None) is not None
    else:
        has_vision = data.get("vision_config") is not None
    if not has_vision:
        return None
    from ..data.images import VisionInput

    return VisionInput.from_hf(path)


def wrap_ddp(model, config, *, use_distributed_optimizer: bool = False, grad_reduce_in_fp32: bool = False):
    """Megatron DDP around ``model`` (grads in ``main_grad``), with ``finalize_model_grads`` wired.
    ``grad_reduce_in_fp32``: ``main_grad`` in float32 whatever the parameters' dtype (Megatron-LM's
    default under ``--bf16``: ``accumulate_allreduce_grads_in_fp32``)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    config.finalize_model_grads_func = finalize_model_grads
    ddp = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(
        overlap_grad_reduce=False, use_distributed_optimizer=use_distributed_optimizer,
        grad_reduce_in_fp32=grad_reduce_in_fp32), module=model)
    config.no_sync_func = ddp.no_sync
    return ddp


def forward_backward(model, microbatches: list, *, forward_only: bool = False, wrap_step=None,
                     **loss_kwargs) -> list[dict]:
    """One forward(-backward) over ``microbatches`` (`TreeMicrobatch`es, or ``(microbatch, CPPlan)``
    pairs under context parallelism) through Megatron's schedule. Returns the loss reports of the
    last pipeline stage (empty elsewhere). ``wrap_step``: optional ``wrap_step(step) -> step`` around
    the forward-step function (verify's per-sample routing replay feeds stock RouterReplay there)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    seq = max((mb[0] if isinstance(mb, tuple) else mb).num_rows for mb in microbatches)
    step = partial(tree_forward_step, **loss_kwargs)
    if wrap_step is not None:
        step = wrap_step(step)
    return get_forward_backward_func()(
        forward_step_func=step, data_iterator=iter(list(microbatches)),
        model=[model], num_microbatches=len(microbatches), seq_length=seq, micro_batch_size=1,
        forward_only=forward_only)


def report_totals(reports: Iterable[dict], key: str = "lm loss") -> Optional[torch.Tensor]:
    """Sum of ``[loss_sum, num_tokens]`` pairs over microbatch reports (None if there are none)."""
    vals = [r[key] for r in reports if key in r]
    return torch.stack(vals).sum(0) if vals else None
