"""Qwen3-VL on a tree: Megatron-Bridge's ``Qwen3VLModel`` built as a `TreeVisionLanguageModel`.

The Bridge's ``Qwen3VLModelProvider.provide()`` builds ``Qwen3VLModel``: the Bridge's ``Qwen3VLVisionModel``
(ViT blocks with 2-D rotary, interpolated position embeddings, a 2 x 2 patch merger and DeepStack mergers)
and ``Qwen3VLGPTModel`` (a GPT with interleaved multimodal RoPE whose block adds the DeepStack features to the
image rows after its first K layers). While a tree provider builds (`provider._building_tree_models`) its
module resolves ``Qwen3VLModel`` to `tree_qwen3_vl_model`, which builds the same modules under the same
parameter names (so the Bridge's weight mapping loads and saves them):

* ``language_model``: `TreeGPTModel` from the provider's layer spec, treeified (tree core attention), with the
  Bridge's ``Qwen3VLMultimodalRotaryEmbedding`` (interleaved t / h / w sections) indexed by each row's
  (t, h, w) position on its path (`tree.images.mrope_positions`);
* ``vision_model``: the Bridge's ``Qwen3VLVisionModel`` itself, run once per microbatch on the distinct image
  occurrences of its rows (`megatron.vision_language.scatter_image_rows`);
* DeepStack: hooks on the first K language-model layers (`TreeVisionLanguageModel`).

Without transformer-engine the provider's ``get_gpt_layer_with_transformer_engine_spec`` resolves to
Megatron's local GPT layer (`local_layer_spec`: separate norms, whose names the weight mapping is taught,
`mapping.with_local_module_names`) and the vision tower gets Megatron's local ViT layer with the Bridge's
``Qwen3VLSelfAttention`` and `local_twins.PackedFullAttention` (full attention within each image).
"""
from __future__ import annotations

__all__ = ["tree_qwen3_vl_model", "local_layer_spec", "local_block_spec"]


def local_layer_spec(num_experts=None, moe_grouped_gemm=False, qk_layernorm=False, fp8=None, **kwargs):
    """Stands for ``get_gpt_layer_with_transformer_engine_spec`` in the Qwen3-VL provider's module: the
    transformer-engine spec where transformer-engine is installed, else Megatron's local GPT layer (same
    structure; the norms unfused)."""
    from megatron.core.models.gpt import gpt_layer_specs as gls

    from ..ops.backend import module_available

    if module_available("transformer_engine"):
        return gls.get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm,
                                                              qk_layernorm=qk_layernorm, fp8=fp8, **kwargs)
    return gls.get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=qk_layernorm,
                                        normalization="RMSNorm")


def local_block_spec(config, vp_stage=None, pp_rank=None):
    """Stands for ``get_transformer_block_with_experimental_attention_variant_spec`` in the Qwen3.5 provider's module
    (Gated DeltaNet + gated attention layers): transformer-engine's where it is installed, else Megatron's structure
    with local modules (`megatron.family_specs`), zero-centred norms where the config asks (Qwen3.5's)."""
    from ..ops.backend import module_available

    if module_available("transformer_engine"):
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
            get_transformer_block_with_experimental_attention_variant_spec as te_spec)

        return te_spec(config, vp_stage=vp_stage, pp_rank=pp_rank)
    from ..cpu.bridge import ZeroCenteredRMSNorm, swap_norms
    from ..megatron.family_specs import get_local_transformer_block_with_experimental_attention_variant_spec

    spec = get_local_transformer_block_with_experimental_attention_variant_spec(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return swap_norms(spec, ZeroCenteredRMSNorm) if getattr(config, "layernorm_zero_centered_gamma", False) else spec


def _stock_attention(spec):
    """``spec`` with the Bridge's ``Qwen3VLSelfAttention`` (Qwen3.5's attention layers; its forward takes the THD
    path whenever packed_seq_params are given) back to Megatron's ``SelfAttention``, which the tree's layout
    reaches through its core attention; the same parameters."""
    import copy
    import dataclasses

    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(spec, ModuleSpec):
        spec = copy.copy(spec)
        if isinstance(spec.module, type) and spec.module.__name__ == "Qwen3VLSelfAttention":
            spec.module = SelfAttention
        spec.submodules = _stock_attention(spec.submodules)
        return spec
    if isinstance(spec, list):
        return [_stock_attention(s) for s in spec]
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        spec = copy.copy(spec)
        for f in dataclasses.fields(spec):
            setattr(spec, f.name, _stock_attention(getattr(spec, f.name)))
    return spec


def _vision_model(hf_vision, config, pg_collection):
    """The Bridge's ``Qwen3VLVisionModel`` as ``Qwen3VLModel`` builds it (its own config from the HF vision
    config and the language config), with local modules where there is no transformer-engine."""
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.attention import Qwen3VLSelfAttention
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.transformer_config import get_vision_model_config
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.utils import PatchMergerSubmodules
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.vision_model import Qwen3VLVisionModel
    from megatron.core.models.vision import vit_layer_specs as vit
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from ..ops.backend import module_available
    from .local_twins import PackedFullAttention, local_norm

    vcfg = get_vision_model_config(hf_vision, megatron_config=config)
    vcfg.pipeline_model_parallel_size = 1
    vcfg.first_pipeline_num_layers = None
    # the language model's precision and host settings (the Bridge's helper starts from defaults)
    for name in ("params_dtype", "pipeline_dtype", "use_cpu_initialization", "bf16", "fp16", "gradient_accumulation_fusion",
                 "masked_softmax_fusion", "persist_layer_norm"):
        if hasattr(config, name):
            setattr(vcfg, name, getattr(config, name))
    vcfg.sequence_parallel = False
    if module_available("transformer_engine"):
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TENorm, TERowParallelLinear

        spec = vit.get_vit_layer_with_transformer_engine_spec()
        merger = PatchMergerSubmodules(patch_norm=TENorm, linear_fc1=TEColumnParallelLinear,
                                       linear_fc2=TERowParallelLinear)
    else:
        spec = vit.get_vit_layer_with_local_spec()
        spec.submodules.self_attention.submodules.core_attention = PackedFullAttention
        merger = PatchMergerSubmodules(patch_norm=local_norm(False), linear_fc1=ColumnParallelLinear,
                                       linear_fc2=RowParallelLinear)
    spec.submodules.self_attention.module = Qwen3VLSelfAttention
    vision = Qwen3VLVisionModel(vcfg, spec, merger, pre_process=True, post_process=True, pg_collection=pg_collection)
    # transformers' patch mergers (the main one and DeepStack's) apply the exact GELU (``nn.GELU()``); the
    # Bridge's (0.6.2) take the tower's tanh approximation from the config: 1.5e-4 relative on the image
    # embeddings of a tiny random checkpoint. The mergers get transformers' activation.
    import torch.nn.functional as F

    for module in vision.modules():
        if type(module).__name__ == "Qwen3VLVisionPatchMerger":
            module.activation_func = F.gelu
    return vision


def _cpu_view() -> None:
    """On a host without CUDA (the CPU layer enabled) the Bridge's Qwen3-VL modules place tensors with
    ``torch.cuda.current_device()``: they get the CPU layer's view of torch, as its conversion modules do."""
    import sys

    import torch

    from ..cpu.megatron_core import is_enabled, patch_module

    if torch.cuda.is_available() or not is_enabled():
        return
    for name in [n for n in sys.modules if n.startswith("megatron.bridge.models.qwen_vl.modelling_qwen3_vl.")]:
        patch_module(sys.modules[name])


def tree_qwen3_vl_model(language_transformer_config, language_transformer_layer_spec, vision_transformer_config,
                        parallel_output: bool = True, pre_process: bool = True, post_process: bool = True,
                        pg_collection=None, add_encoder: bool = True, add_decoder: bool = True, vp_stage=None,
                        **kwargs):
    """Stands where the Qwen3-VL provider calls ``Qwen3VLModel``: the same call, the tree model."""
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.rope import Qwen3VLMultimodalRotaryEmbedding
    from megatron.bridge.utils.vocab_utils import calculate_padded_vocab_size
    from megatron.core.transformer.enums import AttnBackend

    from ..megatron.model import TreeGPTModel
    from ..megatron.specs import treeify_spec
    from ..megatron.vision_language import TreeVisionLanguageModel

    _cpu_view()
    cfg = language_transformer_config
    if not add_decoder:
        raise ValueError("Qwen3-VL on a tree: an encoder-only stage (add_decoder=False) is not supported")
    if kwargs.get("mtp_block_spec") is not None:
        raise ValueError("Qwen3-VL / Qwen3.5 on a tree: multi-token prediction layers are not supported yet")
    if getattr(getattr(cfg, "dist_train", None), "use_dist_train", False) is True:
        raise ValueError("Qwen3-VL on a tree: dist_train (the vision tower on its own ranks) is not supported")
    if pre_process is None or post_process is None:  # provide() without arguments: this pipeline stage's
        from megatron.core import parallel_state as ps

        pre_process = ps.is_pipeline_first_stage() if pre_process is None else pre_process
        post_process = ps.is_pipeline_last_stage() if post_process is None else post_process
    cfg.attention_backend = AttnBackend.local  # every core attention of the language model is tree attention
    vocab = cfg.vocab_size
    if cfg.should_pad_vocab:
        vocab = calculate_padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by,
                                            cfg.tensor_model_parallel_size)
    lm = TreeGPTModel(cfg, treeify_spec(_stock_attention(language_transformer_layer_spec)), vocab, cfg.language_max_sequence_length,
                      pre_process=pre_process, post_process=post_process, parallel_output=parallel_output,
                      share_embeddings_and_output_weights=cfg.share_embeddings_and_output_weights,
                      position_embedding_type="mrope", rotary_percent=cfg.rotary_percent, rotary_base=cfg.rotary_base,
                      scatter_embedding_sequence_parallel=False, vp_stage=vp_stage, pg_collection=pg_collection)
    rope = Qwen3VLMultimodalRotaryEmbedding(kv_channels=cfg.kv_channels, rotary_percent=cfg.rotary_percent,
                                            rotary_interleaved=cfg.rotary_interleaved, rotary_base=cfg.rotary_base,
                                            cp_group=lm.pg_collection.cp)
    rope.is_thd_format = True  # a tree view's rows are this rank's already: no zigzag slicing
    lm.rotary_pos_emb = rope
    vision = _vision_model(vision_transformer_config, cfg, lm.pg_collection) if pre_process and add_encoder else None
    deep = len(getattr(vision_transformer_config, "deepstack_visual_indexes", None) or [])
    # (the provider then applies its freeze_* settings through `TreeVisionLanguageModel.freeze`)
    model = TreeVisionLanguageModel(cfg, lm, vision, deepstack_layers=deep if pre_process else 0)
    model.image_token_id = getattr(cfg, "image_token_id", None)
    return model
