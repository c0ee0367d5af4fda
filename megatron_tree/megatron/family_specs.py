"""Tree variants of Megatron-Core's stock model-family specs: the structure is Megatron's, only the
sequence mixers change.

* **MambaModel** (Nemotron-H: ``hybrid_override_pattern`` letters ``M`` Mamba-2, ``*`` attention,
  ``-`` MLP, ``E`` MoE): `get_tree_mamba_stack_spec` is ``mamba_stack_spec`` with `TreeMambaMixer`
  in the mixer slots and `TreeDotProductAttention` as core attention; build `TreeMambaModel` with it.
* **GPT with Gated DeltaNet** (Qwen3-Next: ``experimental_attention_variant="gated_delta_net"``,
  ``linear_attention_freq``): `get_tree_transformer_block_with_experimental_attention_variant_spec`
  is ``get_transformer_block_with_experimental_attention_variant_spec`` with `TreeGatedDeltaNet` in
  the linear-attention layers and tree core attention in the others; build `TreeGPTModel` with it.
* **GPT with DeepSeek sparse attention** (DeepSeek-V3.2: ``experimental_attention_variant="dsa"``,
  MLA): the same function gives MLA layers (`TreeMLASelfAttention`) with `TreeDSAttention` /
  `TreeDSAIndexer` core attention (`megatron_tree.megatron.dsa`), stock parameter names.

Same module tree, parameter names and sharded state dict as the stock model, so a stock checkpoint
loads unchanged and back. The swap is one line::

    # model = MambaModel(config, mamba_stack_spec, ...)
    model = TreeMambaModel(config, get_tree_mamba_stack_spec(), ...)
    # model = GPTModel(config, get_transformer_block_with_experimental_attention_variant_spec(config), ...)
    model = TreeGPTModel(config, get_tree_transformer_block_with_experimental_attention_variant_spec(config), ...)

Megatron-Core 0.16.1 builds both families only with transformer-engine (``mamba_layer_specs``
imports TE modules, the experimental block asserts ``transformer_impl == "transformer_engine"``).
Where TE is installed the tree specs are the stock specs treeified. Without TE (CPU hosts, tests)
`get_local_mamba_stack_spec` / `get_local_transformer_block_with_experimental_attention_variant_spec`
give the same structure with Megatron's local modules (norms as separate modules where TE fuses them
into the following linear) and map those norms to TE's checkpoint keys
(``sharded_state_dict_keys_map``, as Megatron's ``get_gpt_layer_local_spec`` does), so the sharded
state dict keys are the TE ones. ``MambaStack`` hard-codes ``TENorm`` as its final norm: on a CPU
host ``megatron_tree.cpu.enable(kernels=True)`` swaps it for Megatron's torch norm.
"""
from __future__ import annotations

from typing import Optional

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt import gpt_layer_specs as gls
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from ..compat.mixers import stock_kwargs
from .specs import te_available, treeify_spec

__all__ = ["get_tree_mamba_stack_spec", "get_local_mamba_stack_spec",
           "get_tree_transformer_block_with_experimental_attention_variant_spec",
           "get_local_transformer_block_with_experimental_attention_variant_spec"]

# TE fuses these norms into the next linear; the local modules keep them apart under these names
_QKV_NORM = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
_GDN_NORM = {"input_layernorm.": "self_attention.in_proj.layer_norm_"}
_FC1_NORM = {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def _use_te(use_transformer_engine: Optional[bool]) -> bool:
    return te_available() if use_transformer_engine is None else use_transformer_engine


# ----------------------------------------------------------------------------------------- MambaModel
def get_local_mamba_stack_spec(moe_grouped_gemm: bool = False) -> ModuleSpec:
    """Megatron's ``mamba_stack_spec`` structure with Megatron's local modules (stock classes).

    ``MambaStack`` of ``MambaLayer`` (norm, ``MambaMixer`` with column/row-parallel linears),
    attention ``TransformerLayer`` (input norm, ``SelfAttention`` with ``DotProductAttention``),
    ``MLPLayer`` (pre-MLP norm, ``MLP``) and ``MoETransformerLayer`` (pre-MLP norm, ``MoELayer``).
    Norms follow ``config.normalization``; checkpoint keys are those of the TE spec. Needs the
    stock ``mamba_mixer`` module to import (on CPU: ``cpu.enable(kernels=True)`` first).
    """
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.transformer_layer import MoETransformerLayer

    from .mamba import mamba_mixer_module

    stock = mamba_mixer_module()
    backend = LocalSpecProvider()
    norm = WrappedTorchNorm  # LayerNorm or RMSNorm as config.normalization says (as TENorm does)
    attention = gls.get_gpt_layer_local_spec().submodules.self_attention
    return ModuleSpec(module=MambaStack, submodules=MambaStackSubmodules(
        mamba_layer=ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
            norm=norm,
            mixer=ModuleSpec(module=stock.MambaMixer, submodules=stock.MambaMixerSubmodules(
                in_proj=backend.column_parallel_linear(), out_proj=backend.row_parallel_linear())),
            mamba_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={"norm.": "mixer.in_proj.layer_norm_"})),
        attention_layer=ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=norm, self_attention=attention, self_attn_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=dict(_QKV_NORM))),
        mlp_layer=ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=norm, mlp=gls.get_mlp_module_spec_for_backend(backend, num_experts=None),
            mlp_bda=get_bias_dropout_add, sharded_state_dict_keys_map=dict(_FC1_NORM))),
        moe_layer=ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=norm,
            # the expert count comes from config.num_moe_experts; the spec only needs "some"
            mlp=get_moe_module_spec(use_te=False, num_experts=1, moe_grouped_gemm=moe_grouped_gemm),
            mlp_bda=get_bias_dropout_add)),
        **_local_hybrid_mtp_block(norm, backend),
    ))


def _local_hybrid_mtp_block(norm, backend) -> dict:
    """``{"mtp_block_spec": ...}`` where the stack takes one (megatron-core >= 0.19's HybridModel: MTP
    depths from the ``main/mtp/...`` pattern, each MTP layer's inner stack built from this stack's
    own layer specs), with stock's structure and local modules; else nothing."""
    from ..compat.mtp import hybrid_has_mtp

    if not hybrid_has_mtp():
        return {}
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlock,
        MultiTokenPredictionBlockSubmodules,
        MultiTokenPredictionLayer,
        MultiTokenPredictionLayerSubmodules,
    )

    layer = ModuleSpec(module=MultiTokenPredictionLayer, submodules=MultiTokenPredictionLayerSubmodules(
        enorm=norm, hnorm=norm, eh_proj=backend.column_parallel_linear(), mtp_model_layer=None, layer_norm=norm))
    return {"mtp_block_spec": ModuleSpec(module=MultiTokenPredictionBlock,
                                         submodules=MultiTokenPredictionBlockSubmodules(layer_specs=[layer]))}


def get_tree_mamba_stack_spec(use_transformer_engine: Optional[bool] = None, moe_grouped_gemm: bool = False
                              ) -> ModuleSpec:
    """The tree variant of Megatron's ``mamba_stack_spec`` for `TreeMambaModel`.

    ``use_transformer_engine`` (default: whether TE imports): the stock TE ``mamba_stack_spec``
    treeified, else `get_local_mamba_stack_spec` treeified (``moe_grouped_gemm`` applies to the
    local one; the TE spec fixes its own). Mixers become `TreeMambaMixer`, core attention
    `TreeDotProductAttention`, MTP layers (megatron-core >= 0.19's ``mtp_block_spec``)
    `TreeMultiTokenPredictionLayer`; everything else, and every parameter name, stays.
    """
    if _use_te(use_transformer_engine):
        from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec  # imports TE modules

        return treeify_spec(mamba_stack_spec)  # copies what it changes: the stock spec stays as it is
    return treeify_spec(get_local_mamba_stack_spec(moe_grouped_gemm=moe_grouped_gemm))


# ----------------------------------------------------------------------------------------- GPT + GDN
def _check_variant(config) -> None:
    variant = config.experimental_attention_variant
    if variant not in (None, "gated_delta_net", "dsa"):
        raise ValueError(f"tree training supports experimental_attention_variant='gated_delta_net' or 'dsa' (or None), "
                         f"not {variant!r}")


def get_local_transformer_block_with_experimental_attention_variant_spec(
        config, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None) -> TransformerBlockSubmodules:
    """Megatron's ``get_transformer_block_with_experimental_attention_variant_spec`` structure with
    Megatron's local modules (stock classes): per layer, ``GatedDeltaNet`` where
    ``linear_attention_freq`` puts linear attention, else the local ``SelfAttention`` (MLA when
    ``config.multi_latent_attention``); MoE where ``moe_layer_freq`` says, else the dense MLP; only
    this pipeline stage's layers. Input / pre-MLP norms are separate modules mapped to the TE keys.
    """
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_linear_attention_pattern,
        get_moe_layer_pattern,
        is_linear_attention_variant,
    )
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.transformer.enums import LayerType

    _check_variant(config)
    backend = LocalSpecProvider()
    n = config.num_layers
    linear = (get_linear_attention_pattern(config) if is_linear_attention_variant(config.experimental_attention_variant)
              else [0] * n)
    moe = get_moe_layer_pattern(config) if config.num_moe_experts is not None else [0] * n
    norm = backend.layer_norm(rms_norm=config.normalization == "RMSNorm", for_qk=False)
    gdn = ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=backend.column_parallel_linear(), out_norm=norm, out_proj=backend.row_parallel_linear()))
    if config.experimental_attention_variant == "dsa":
        # DeepSeek sparse attention in every layer (stock: the pattern is all ones for a non-linear
        # variant): MLA with DSA core attention, local modules (the stock structure and names)
        from .dsa import get_tree_dsa_module_spec

        if not config.multi_latent_attention:
            raise ValueError("experimental_attention_variant='dsa' needs multi_latent_attention=True (as stock)")
        attention = get_tree_dsa_module_spec(config, use_transformer_engine=False)
    else:
        attention = gls.get_gpt_layer_local_spec(
            qk_layernorm=config.qk_layernorm, multi_latent_attention=config.multi_latent_attention,
            normalization=config.normalization, qk_l2_norm=config.qk_l2_norm).submodules.self_attention
    dense = gls.get_mlp_module_spec_for_backend(backend, num_experts=None)
    # 0.19 dropped the legacy grouped GEMM (config field and keyword): pass it only where it exists
    legacy = getattr(config, "moe_use_legacy_grouped_gemm", None) or None
    experts = (get_moe_module_spec_for_backend(**stock_kwargs(
        get_moe_module_spec_for_backend, backend=backend, num_experts=config.num_moe_experts,
        moe_grouped_gemm=config.moe_grouped_gemm, moe_use_legacy_grouped_gemm=legacy)) if 1 in moe else None)
    specs = []
    for i in range(n):
        keys = dict(_GDN_NORM if linear[i] else ({} if config.multi_latent_attention else _QKV_NORM))
        if not moe[i]:
            keys.update(_FC1_NORM)  # TE fuses the dense MLP's norm into fc1, never the MoE's
        specs.append(ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=norm, self_attention=gdn if linear[i] else attention, self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm, mlp=experts if moe[i] else dense, mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=keys)))
    if config.pipeline_model_parallel_layout is not None:
        ids = config.pipeline_model_parallel_layout.get_layer_id_list(layer_type=LayerType.decoder, vp_stage=vp_stage,
                                                                     pp_rank=pp_rank)
    else:
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
        ids = range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank))
    return TransformerBlockSubmodules(layer_specs=[specs[i] for i in ids], layer_norm=norm)


def get_tree_transformer_block_with_experimental_attention_variant_spec(
        config, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None, *,
        use_transformer_engine: Optional[bool] = None) -> TransformerBlockSubmodules:
    """The tree variant of Megatron's ``get_transformer_block_with_experimental_attention_variant_spec``
    (same arguments) for `TreeGPTModel`: `TreeGatedDeltaNet` in the linear-attention layers, tree core
    attention in the others, MoE / dense MLPs and pipeline slicing as Megatron's.

    ``use_transformer_engine`` (default: whether TE imports and ``config.transformer_impl`` is
    "transformer_engine"): the stock TE block treeified, else the local structure
    (`get_local_transformer_block_with_experimental_attention_variant_spec`) treeified. Only the
    ``gated_delta_net`` and ``dsa`` variants are supported (``dsa``: every layer MLA + tree DSA, always
    the local structure: stock DSA's indexer is a local implementation on TE too, and megatron-core
    0.16's TE block builder has no DSA).
    """
    _check_variant(config)
    if config.experimental_attention_variant == "dsa":
        use_transformer_engine = False
    if use_transformer_engine is None:
        use_transformer_engine = te_available() and config.transformer_impl == "transformer_engine"
    if use_transformer_engine:
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
            get_transformer_block_with_experimental_attention_variant_spec,
        )

        block = get_transformer_block_with_experimental_attention_variant_spec(config, vp_stage=vp_stage,
                                                                               pp_rank=pp_rank)
    else:
        block = get_local_transformer_block_with_experimental_attention_variant_spec(config, vp_stage=vp_stage,
                                                                                     pp_rank=pp_rank)
    return treeify_spec(block)
