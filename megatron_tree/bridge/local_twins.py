"""Local (no transformer-engine) twins of the transformer-engine modules a family's own layer spec names.

A Megatron-Bridge family whose layers differ from Megatron's (Gemma 3: post-norms after the attention
and MLP projections, zero-centred q / k norms, per-layer local / global core attention) builds its
spec from transformer-engine classes directly. On a host without transformer-engine `local_twin_spec`
rewrites such a spec module by module, keeping the structure and every parameter name the Bridge's
weight mapping reads:

==================================  ============================================================
transformer-engine module            local twin
==================================  ============================================================
``TELayerNormColumnParallelLinear``  ``ColumnParallelLinear``; its fused norm becomes the layer's
  (a layer's ``linear_qkv`` /        ``input_layernorm`` / ``pre_mlp_layernorm`` (the names
  ``linear_fc1``)                    `mapping.with_local_module_names` maps, and the checkpoint keys
                                     of the fused ones, as Megatron's local spec keeps them)
``TELayerNormColumnParallelLinear``  `LayerNormColumnParallelLinear`: the norm and the linear in one
  (anywhere else: Falcon-H1's        module, under the fused module's parameter names
  MLP, a Mamba mixer's ``in_proj``)  (``layer_norm_weight`` [, ``layer_norm_bias``], ``weight``)
``TEColumnParallelLinear``           ``ColumnParallelLinear``
``TERowParallelLinear``              ``RowParallelLinear``
``TERowParallelLinearLayerNorm``     `RowParallelLinearLayerNorm` (``weight``, ``post_layernorm.weight``)
``TENorm``                           the local norm of ``config.normalization`` (zero-centred where
                                     the config says so), constructed with the same arguments
``TEDotProductAttention``            ``DotProductAttention`` (tree attention replaces it)
``TEDotProductAttention`` (a vision  `PackedFullAttention`: full attention within each THD-packed
  tower's, no mask, THD)             sequence (`bridge.qwen3_vl` builds it)
==================================  ============================================================

Any other transformer-engine class left in the spec is refused by name: it would otherwise be built
as an empty stand-in, or replaced by something that does less.
"""
from __future__ import annotations

import copy
import dataclasses

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from ..megatron.family_cores import TREE_CORES, is_stand_in, stand_in_name

__all__ = ["RowParallelLinearLayerNorm", "LayerNormColumnParallelLinear", "PackedFullAttention", "local_twin_spec",
           "local_norm", "LocalTwinError"]


class LocalTwinError(ValueError):
    """A family spec's transformer-engine module with no local twin."""


class RowParallelLinearLayerNorm(RowParallelLinear):
    """``RowParallelLinear`` followed by a norm of its output (``post_layernorm``): the local twin of
    Megatron-Bridge's ``TERowParallelLinearLayerNorm`` (Gemma 2 / 3's post-attention and post-MLP norms),
    built the same way (``post_norm``, ``TENorm``'s local counterpart, over ``output_size``) except for its
    epsilon: the Bridge's ``TENorm(config, output_size)`` gets TENorm's default 1e-5, where the checkpoint's
    post-norms use its ``rms_norm_eps`` (transformers' Gemma 2 / 3); this twin uses ``config.layernorm_epsilon``
    (the Bridge's ``rms_norm_eps``), and the tree provider's ``provide()`` sets the transformer-engine module's
    to it.
    On a tiny random Gemma 3 the two epsilons move transformers' own log-probs by 0.02."""

    def __init__(self, input_size: int, output_size: int, *, config, post_norm, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.post_layernorm = post_norm(config, output_size, eps=config.layernorm_epsilon)

    def forward(self, x):
        output, bias = super().forward(x)
        if bias is not None:  # as the transformer-engine module: a post-norm before a deferred bias is wrong
            raise ValueError("RowParallelLinearLayerNorm assumes add_bias_linear=False")
        return self.post_layernorm(output), bias


class LayerNormColumnParallelLinear(ColumnParallelLinear):
    """A norm of the input, then ``ColumnParallelLinear``: the local twin of transformer-engine's
    ``TELayerNormColumnParallelLinear`` where a spec has no layer norm slot to move its norm to (Falcon-H1's
    parallel layer: its MLP's ``linear_fc1``). Parameters as the fused module names them: ``layer_norm_weight``
    (and ``layer_norm_bias`` for LayerNorm; replicated over TP, reduced over TP under sequence parallelism as
    Megatron's norms are), ``weight`` (and ``bias``) column-parallel. The norm is ``config.normalization`` over
    the last dimension with ``config.layernorm_epsilon``, gain ``1 + w`` where ``zero_centered``."""

    def __init__(self, input_size: int, output_size: int, *, config, zero_centered: bool = False, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        if config.normalization not in ("RMSNorm", "LayerNorm"):
            raise LocalTwinError(f"LayerNormColumnParallelLinear: normalization {config.normalization!r} is neither "
                                 "RMSNorm nor LayerNorm")
        self.zero_centered = zero_centered
        self.eps = config.layernorm_epsilon
        init = torch.zeros if zero_centered else torch.ones
        dtype = config.params_dtype
        self.layer_norm_weight = torch.nn.Parameter(init(input_size, dtype=dtype))
        self.layer_norm_bias = (torch.nn.Parameter(torch.zeros(input_size, dtype=dtype))
                                if config.normalization == "LayerNorm" else None)
        for p in (self.layer_norm_weight, self.layer_norm_bias):
            if p is not None:
                p.sequence_parallel = config.sequence_parallel

    def forward(self, x):
        import torch.nn.functional as F

        w = 1 + self.layer_norm_weight if self.zero_centered else self.layer_norm_weight
        if self.layer_norm_bias is None:
            x = F.rms_norm(x, (x.shape[-1],), w, self.eps)
        else:
            x = F.layer_norm(x, (x.shape[-1],), w, self.layer_norm_bias, self.eps)
        return super().forward(x)


def local_norm(zero_centered: bool):
    """``TENorm``'s local counterpart: ``WrappedTorchNorm`` (it reads ``config.normalization``), or
    `ZeroCenteredRMSNorm` where the config asks for a zero-centred gain (torch's norm refuses one)."""
    if zero_centered:
        from ..cpu.bridge import ZeroCenteredRMSNorm

        return ZeroCenteredRMSNorm
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return WrappedTorchNorm


def _name(obj) -> str:
    return obj.__name__ if isinstance(obj, type) else (stand_in_name(obj) or "")


def local_twin_spec(spec, zero_centered: bool):
    """Copy of a layer / block spec with every transformer-engine module replaced by its local twin (the
    table above), and a family core attention the tree knows (`family_cores.TREE_CORES`) by its tree class.
    Raises `LocalTwinError` naming any transformer-engine class it has no twin for, and any entry that is
    not a class at all. Without transformer-engine the Bridge binds each TE class it cannot import to a
    ``MagicMock`` stand-in: such an entry is known by the name a module binds it to
    (`family_cores.stand_in_name`)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.spec_utils import ModuleSpec

    norm = local_norm(zero_centered)
    family_cores = {k: v for k, v in TREE_CORES.items() if k not in ("DotProductAttention", "TEDotProductAttention")}
    simple = {**family_cores, "TENorm": norm, "TEColumnParallelLinear": ColumnParallelLinear,
              "TERowParallelLinear": RowParallelLinear, "TEDotProductAttention": DotProductAttention,
              "TERowParallelLinearLayerNorm": ModuleSpec(module=RowParallelLinearLayerNorm, params={"post_norm": norm}),
              # reached only where _unfuse_layer_norms found no layer slot for its norm
              "TELayerNormColumnParallelLinear": ModuleSpec(module=LayerNormColumnParallelLinear,
                                                            params={"zero_centered": zero_centered})}
    return _walk(spec, simple, norm, "spec")


def _walk(spec, simple: dict, norm, where: str):
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    if isinstance(spec, type) or is_stand_in(spec):
        name = _name(spec) or "an unnamed stand-in"
        if name in simple:
            return simple[name]
        if name.startswith("TE"):
            raise LocalTwinError(f"{where} is transformer-engine's {name}, which has no local twin")
        if not isinstance(spec, type):
            raise LocalTwinError(f"{where} is {name}, which the Bridge could not import here (no transformer-engine) "
                                 "and which has no local twin")
        return spec
    if isinstance(spec, ModuleSpec):
        spec = copy.copy(spec)
        module = _walk(spec.module, simple, norm, where)
        if isinstance(module, ModuleSpec):  # a twin that takes parameters of its own
            spec.module, spec.params = module.module, {**module.params, **(spec.params or {})}
        else:
            spec.module = module
        if isinstance(spec.submodules, TransformerLayerSubmodules):
            spec.submodules = _unfuse_layer_norms(spec.submodules, norm)
        if spec.submodules is not None:
            spec.submodules = _walk(spec.submodules, simple, norm, f"{where}.{_name(spec.module) or 'module'}")
        return spec
    if isinstance(spec, list):
        return [_walk(s, simple, norm, f"{where}[{i}]") for i, s in enumerate(spec)]
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        spec = copy.copy(spec)
        for f in dataclasses.fields(spec):
            setattr(spec, f.name, _walk(getattr(spec, f.name), simple, norm, f"{where}.{f.name}"))
        return spec
    return spec


def _unfuse_layer_norms(sub, norm):
    """A layer whose ``linear_qkv`` / ``linear_fc1`` is ``TELayerNormColumnParallelLinear`` gets the norm as
    its ``input_layernorm`` / ``pre_mlp_layernorm`` and a plain ``ColumnParallelLinear``; its checkpoint keys
    stay the fused module's (Megatron's local spec does the same)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    sub = copy.copy(sub)
    keys = dict(sub.sharded_state_dict_keys_map or {})
    for block, linear, norm_field, fused_key in (("self_attention", "linear_qkv", "input_layernorm",
                                                  "self_attention.linear_qkv.layer_norm_"),
                                                 ("mlp", "linear_fc1", "pre_mlp_layernorm", "mlp.linear_fc1.layer_norm_")):
        outer = getattr(sub, block)
        if not isinstance(outer, ModuleSpec) or outer.submodules is None:
            continue
        if _name(getattr(outer.submodules, linear, None)) != "TELayerNormColumnParallelLinear":
            continue
        if _name(getattr(sub, norm_field)) != "IdentityOp":
            raise LocalTwinError(f"a layer has both {norm_field} and a fused norm in {block}.{linear}")
        outer = copy.copy(outer)
        outer.submodules = copy.copy(outer.submodules)
        setattr(outer.submodules, linear, ColumnParallelLinear)
        setattr(sub, block, outer)
        setattr(sub, norm_field, norm)
        keys[f"{norm_field}."] = fused_key
    sub.sharded_state_dict_keys_map = keys
    return sub


class PackedFullAttention(torch.nn.Module):
    """transformer-engine's ``DotProductAttention`` with no mask over THD-packed sequences, in torch: the local
    twin a vision tower's attention gets (Qwen3-VL's: every image frame, one ``cu_seqlens`` segment, attends to
    itself in full). ``query`` [T, heads, d] (key / value may have fewer heads: grouped), ``packed_seq_params``
    with ``cu_seqlens_q`` (None: one sequence); softmax at float32 or wider; returns [T, heads * d]. A loop per
    segment (per image), never per token."""

    def __init__(self, config, layer_number=None, attn_mask_type=None, attention_type="self", softmax_scale=None,
                 **kwargs):
        super().__init__()
        from megatron.core.transformer.enums import AttnMaskType

        if attn_mask_type not in (None, AttnMaskType.no_mask):
            raise LocalTwinError(f"PackedFullAttention: attention mask {attn_mask_type} (only no_mask: a vision tower's "
                                 "full attention within each packed sequence)")
        self.config = config
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        if query.dim() == 4:  # [s, 1, h, d]
            query, key, value = (x.squeeze(1) for x in (query, key, value))
        T, h, d = query.shape
        if key.shape[1] != h:
            key, value = (x.repeat_interleave(h // x.shape[1], dim=1) for x in (key, value))
        cu = getattr(packed_seq_params, "cu_seqlens_q", None)
        bounds = [0, T] if cu is None else [int(x) for x in cu.tolist()]
        scale = self.softmax_scale if self.softmax_scale is not None else d ** -0.5
        wide = torch.promote_types(query.dtype, torch.float32)
        outs = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            s = torch.einsum("qhd,khd->hqk", query[a:b].to(wide), key[a:b].to(wide)) * scale
            outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), value[a:b].to(wide)).to(query.dtype))
        return torch.cat(outs).reshape(T, h * d)
