"""Layer specs for tree training: Megatron's own specs with the sequence mixers swapped.

Everything except the sequence mixer stays Megatron's: linear layers, norms, MLP/MoE, TP/SP, PP
slicing, recomputation. Swapping into an existing config is one line::

    # before: layer_spec = get_gpt_layer_local_spec(num_experts, moe_grouped_gemm, qk_layernorm)
    layer_spec = get_tree_gpt_layer_spec(num_experts, moe_grouped_gemm, qk_layernorm)
    model = TreeGPTModel(config, layer_spec, vocab_size, max_seq_len, position_embedding_type="rope")

Hybrid stacks follow Megatron's ``hybrid_override_pattern`` letters: ``M`` Mamba-2, ``G`` Gated
DeltaNet, ``*`` attention, ``-`` MLP, ``E`` MoE. Each letter is one ``TransformerLayer``: mixer
letters fill ``self_attention`` (with its pre-norm), MLP letters fill ``mlp`` (with its pre-norm),
so the whole stack is an ordinary ``TransformerBlock`` inside a `TreeGPTModel`.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Optional

from megatron.core.models.gpt import gpt_layer_specs as gls
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from ..ops.backend import module_available
from .hybrid_pattern import HYBRID_LETTERS, parse_hybrid_pattern  # (also importable from here, as before)


def te_available() -> bool:
    return module_available("transformer_engine")


class _UnsupportedAbsorbedMLA:
    """Stands where a stock spec names ``AbsorbedMLASelfAttention``: building it is a clear error."""

    def __init__(self, *args, **kwargs):
        raise ValueError("AbsorbedMLASelfAttention (megatron-core 0.19's DSA spec) has no tree variant: build DSA "
                         "layers with megatron_tree.megatron.dsa.get_tree_dsa_module_spec (MLASelfAttention + "
                         "TreeDSAttention, the same parameter names)")


def treeify_spec(spec):
    """Copy of a layer / block spec with every ``core_attention`` replaced by `TreeDotProductAttention`,
    every stock GDN mixer by `TreeGatedDeltaNet` and every stock ``MambaMixer`` by `TreeMambaMixer`
    (subclasses: same parameters), every ``MLASelfAttention`` by `TreeMLASelfAttention` (rotary
    by depth; its core attention is tree attention too; a stock ``DSAttention`` core becomes
    `TreeDSAttention` with a `TreeDSAIndexer`), and every ``MultiTokenPredictionLayer`` by
    `TreeMultiTokenPredictionLayer`. Anything else is left as it is."""
    spec = copy.copy(spec)
    if isinstance(spec, TransformerBlockSubmodules):
        spec.layer_specs = [treeify_spec(s) for s in spec.layer_specs]
        return spec
    if isinstance(spec, ModuleSpec):
        if getattr(spec.module, "__name__", "") == "GatedDeltaNet":
            from .gdn import TreeGatedDeltaNet

            spec.module = TreeGatedDeltaNet
        elif getattr(spec.module, "__name__", "") == "MambaMixer":
            from .mamba import TreeMambaMixer  # the stock mixer's module is imported already

            spec.module = TreeMambaMixer
        elif getattr(spec.module, "__name__", "") == "AbsorbedMLASelfAttention":
            # megatron-core 0.19's DSA spec: a different attention class (matrix absorption), not
            # MLASelfAttention; no tree variant is verified for it. Stock specs list it among other
            # layer kinds (e.g. the Mamba stack), so the error comes when such a layer is built.
            spec.module = _UnsupportedAbsorbedMLA
        elif getattr(spec.module, "__name__", "") == "MLASelfAttention":
            from .mla import TreeMLASelfAttention  # MLA: rotary by depth (Megatron computes it inside)

            spec.module = TreeMLASelfAttention
        elif getattr(spec.module, "__name__", "") == "MultiTokenPredictionLayer":
            from .mtp import TreeMultiTokenPredictionLayer  # an MTP block inside a hybrid stack spec

            spec.module = TreeMultiTokenPredictionLayer
        if spec.submodules is not None and dataclasses.is_dataclass(spec.submodules):
            spec.submodules = treeify_spec(spec.submodules)
        return spec
    if isinstance(spec, SelfAttentionSubmodules) or type(spec).__name__ == "MLASelfAttentionSubmodules":
        core = spec.core_attention
        core_cls = core.module if isinstance(core, ModuleSpec) else core
        if getattr(core_cls, "__name__", "") == "DSAttention":
            # DeepSeek sparse attention: tree DSA core attention and indexer, same submodules
            from .dsa import TreeDSAIndexer, TreeDSAttention

            core = copy.copy(core)
            core.module = TreeDSAttention
            core.submodules = copy.copy(core.submodules)
            core.submodules.indexer = copy.copy(core.submodules.indexer)
            core.submodules.indexer.module = TreeDSAIndexer
            spec.core_attention = core
            return spec
        if not getattr(core_cls, "requires_dsa_inputs", False):  # a DSA core (tree or oracle) stays
            from .family_cores import tree_core_for

            spec.core_attention = tree_core_for(core_cls)
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        for f in dataclasses.fields(spec):
            v = getattr(spec, f.name)
            if isinstance(v, (ModuleSpec, TransformerBlockSubmodules)) or (
                    dataclasses.is_dataclass(v) and not isinstance(v, type)):
                setattr(spec, f.name, treeify_spec(v))
            elif isinstance(v, list) and any(isinstance(x, ModuleSpec) for x in v):  # e.g. an MTP block's layers
                setattr(spec, f.name, [treeify_spec(x) if isinstance(x, ModuleSpec) else x for x in v])
    return spec


def get_tree_gpt_layer_spec(num_experts: Optional[int] = None, moe_grouped_gemm: bool = False,
                            qk_layernorm: bool = False, normalization: Optional[str] = None,
                            use_transformer_engine: Optional[bool] = None, **kwargs) -> ModuleSpec:
    """GPT layer spec (Megatron's TE spec when transformer-engine is installed, else its local spec)
    with tree core attention. Extra kwargs go to Megatron's builder.

    ``experimental_attention_variant="dsa"``: DeepSeek sparse attention, MLA self-attention with
    `TreeDSAttention` core attention (`megatron_tree.megatron.dsa.get_tree_dsa_module_spec`, stock
    DSA structure and parameter names; local modules)."""
    use_te = te_available() if use_transformer_engine is None else use_transformer_engine
    variant = kwargs.pop("experimental_attention_variant", None)
    if variant not in (None, "dsa"):
        raise ValueError(f"get_tree_gpt_layer_spec: experimental_attention_variant must be None or 'dsa', got {variant!r}")
    if variant == "dsa":
        from .dsa import get_tree_dsa_module_spec

        kwargs.pop("multi_latent_attention", None)
        base = gls.get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm,
                                            qk_layernorm=qk_layernorm, normalization=normalization,
                                            multi_latent_attention=True, **kwargs)
        base.submodules.self_attention = get_tree_dsa_module_spec(qk_layernorm=qk_layernorm,
                                                                  normalization=normalization)
        return treeify_spec(base)
    if use_te:
        base = gls.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm, qk_layernorm=qk_layernorm, **kwargs)
    else:
        base = gls.get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm,
                                            qk_layernorm=qk_layernorm, normalization=normalization, **kwargs)
    return treeify_spec(base)


def get_tree_gpt_decoder_block_spec(config, use_transformer_engine: Optional[bool] = None,
                                    normalization: Optional[str] = None, qk_l2_norm: bool = False,
                                    vp_stage: Optional[int] = None, pp_rank: Optional[int] = None
                                    ) -> TransformerBlockSubmodules:
    """Megatron's ``get_gpt_decoder_block_spec`` (MoE layer frequency, PP slicing) with tree attention."""
    use_te = te_available() if use_transformer_engine is None else use_transformer_engine
    block = gls.get_gpt_decoder_block_spec(config, use_te, normalization=normalization, qk_l2_norm=qk_l2_norm,
                                           vp_stage=vp_stage, pp_rank=pp_rank)
    return treeify_spec(block)


def get_tree_gpt_mtp_block_spec(config, spec, use_transformer_engine: Optional[bool] = None,
                                vp_stage: Optional[int] = None, pp_rank: Optional[int] = None):
    """Tree counterpart of Megatron's ``get_gpt_mtp_block_spec``: stock's MTP block spec built from the
    (treeified) decoder ``spec`` (a block spec: its last layer; or a layer spec), with every MTP layer
    a `TreeMultiTokenPredictionLayer` and its core attention tree attention. None where stock returns
    None (no MTP layers on this pipeline stage)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    from .mtp import TreeMultiTokenPredictionLayer

    use_te = te_available() if use_transformer_engine is None else use_transformer_engine
    block = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=use_te, vp_stage=vp_stage,
                                   pp_rank=pp_rank)
    if block is None:
        return None
    block = dataclasses.replace(block, layer_specs=[
        dataclasses.replace(treeify_spec(s), module=TreeMultiTokenPredictionLayer) for s in block.layer_specs])
    return block


def _backend(use_te: bool):
    return gls.TESpecProvider() if use_te else gls.LocalSpecProvider()


def _hybrid_layer(letter: str, use_te: bool, normalization: Optional[str], num_experts: Optional[int],
                  moe_grouped_gemm: bool, qk_layernorm: bool) -> ModuleSpec:
    backend = _backend(use_te)
    rms = normalization == "RMSNorm"
    norm = backend.layer_norm(rms_norm=rms, for_qk=False)
    kind = HYBRID_LETTERS[letter]
    sub = TransformerLayerSubmodules()
    if kind == "attention":
        attn = gls.get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization=normalization) if not use_te \
            else gls.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
        sub.input_layernorm = attn.submodules.input_layernorm
        sub.self_attention = treeify_spec(attn.submodules.self_attention)
        sub.self_attn_bda = gls.get_bias_dropout_add
    elif kind in ("gdn", "mamba"):
        if kind == "gdn":
            from .gdn import tree_gdn_module_spec as mixer_spec
        else:
            from .mamba import tree_mamba_module_spec as mixer_spec
        sub.input_layernorm = norm
        sub.self_attention = mixer_spec(use_transformer_engine=use_te, normalization=normalization)
        sub.self_attn_bda = gls.get_bias_dropout_add
    else:
        if kind == "moe" and not num_experts:
            raise ValueError("pattern letter 'E' (MoE) needs num_experts (config.num_moe_experts)")
        sub.pre_mlp_layernorm = norm
        sub.mlp = gls.get_mlp_module_spec_for_backend(backend=backend, num_experts=num_experts if kind == "moe" else None,
                                                      moe_grouped_gemm=moe_grouped_gemm)
        sub.mlp_bda = gls.get_bias_dropout_add
    return ModuleSpec(module=TransformerLayer, submodules=sub)


def get_tree_hybrid_stack_spec(pattern: str, config=None, *, use_transformer_engine: Optional[bool] = None,
                               normalization: Optional[str] = None, num_experts: Optional[int] = None,
                               moe_grouped_gemm: bool = False, qk_layernorm: bool = False,
                               vp_stage: Optional[int] = None, pp_rank: Optional[int] = None
                               ) -> TransformerBlockSubmodules:
    """Block spec of a hybrid stack, one layer per pattern letter (``config.num_layers`` must equal
    the number of letters). With ``config`` and pipeline parallelism, only this stage's layers are
    returned (Megatron's layer offset rules)."""
    letters = parse_hybrid_pattern(pattern)
    use_te = te_available() if use_transformer_engine is None else use_transformer_engine
    if config is not None:
        if config.num_layers != len(letters):
            raise ValueError(f"hybrid pattern {pattern!r} has {len(letters)} layers but config.num_layers="
                             f"{config.num_layers}")
        num_experts = num_experts or config.num_moe_experts
        normalization = normalization or config.normalization
    specs = [_hybrid_layer(c, use_te, normalization, num_experts, moe_grouped_gemm, qk_layernorm) for c in letters]
    if config is not None:
        from megatron.core.transformer.transformer_block import get_num_layers_to_build
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
        specs = specs[offset: offset + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)]
    layer_norm = _backend(use_te).layer_norm(rms_norm=normalization == "RMSNorm", for_qk=False)
    block = TransformerBlockSubmodules(layer_specs=specs, layer_norm=layer_norm)
    # Layers differ in structure: checkpoints must key them per layer, not stacked (TreeGPTModel
    # reads this flag in sharded_state_dict, so Megatron-LM's checkpointing gets it too).
    block.non_homogeneous_layers = True
    return block
