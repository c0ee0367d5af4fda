"""Falcon-H1 on a tree: Megatron-Bridge's ``FalconH1Model`` with the tree mixers.

A Falcon-H1 layer runs a Mamba-2 mixer and self-attention side by side on the same normed input, each
with its own MuP multipliers, adds them to the residual, then a SwiGLU MLP (Megatron-Bridge's
``FalconH1Layer``)::

    h = norm(x)
    x = x + mamba(h * ssm_in) * ssm_out + attention(h * attn_in) * attn_out
    x = x + mlp(x)                                   # linear_fc1 holds the pre-MLP norm

The mixer scales ``in_proj``'s ``z | x | B | C | dt`` parts by ``ssm_multipliers`` (transformers' MuP
vector), attention scales its keys by ``key_multiplier``, the MLP its gate and output by
``mlp_multipliers``; the model scales its embeddings by ``embedding_multiplier`` and its logits by
``lm_head_multiplier``.

The Bridge builds this as its own ``FalconH1Model`` / ``FalconH1Stack`` / ``FalconH1Layer``, whose forwards
pass no ``packed_seq_params`` to the mixers. The tree classes here are subclasses (same constructor, module
tree, parameter names, sharded state dict, weight mapping) whose tree forward does pass them:

* `TreeFalconH1Model`: embedding x multiplier, the stack with the rotary table indexed by depth, then
  the tree's per-occurrence log-probs (`TreeLanguageModelMixin`; ``_scale_logits`` is the lm-head
  multiplier, which the shared output path applies);
* `TreeFalconH1Stack` / `TreeFalconH1Layer`: the layers above with the tree layout;
* the mixer: `megatron.mamba.tree_mamba_mixer_over` the Bridge's ``FalconH1MambaMixer`` (its MuP vector
  applied to ``in_proj``'s output, before the tree conv / SSD);
* attention: the Bridge's ``FalconH1SelfAttention`` with tree core attention (`treeify_spec`).

Any other input (no tree params) runs the Bridge's forward unchanged. `tree_falcon_h1_stack_spec` rewrites
the Bridge's stack spec: the local twins of its transformer-engine modules where there is no
transformer-engine (`local_twins`), then the tree classes.
"""
from __future__ import annotations

import functools

import torch

__all__ = ["tree_falcon_h1_stack_spec", "tree_falcon_h1_model", "tree_falcon_h1_classes"]


def _is_tree(psp) -> bool:
    from ..megatron.packed_seq import TreePackedSeqParams

    return isinstance(psp, TreePackedSeqParams) and psp.layout is not None


class _FalconScale:
    """The MuP vector of Falcon-H1's mixer on ``in_proj``'s output (this TP rank's widths: the tree mixer
    scales before any context-parallel exchange, so never the CP-sharded widths)."""

    def scale_projection(self, zxBCdt: torch.Tensor) -> torch.Tensor:
        return self._scale_zxbc_dt(zxBCdt, use_context_parallel_dims=False)


def _residual(x: torch.Tensor, in_fp32: bool) -> torch.Tensor:
    """The residual stream at fp32 or wider: the Bridge's layer casts it to fp32 (``residual_in_fp32``, which its
    stack sets for every parallel layer), which would narrow a float64 model's (and then stop at its float64 output
    layer); bf16 / fp16 / fp32 models get exactly the Bridge's fp32."""
    return x.to(torch.promote_types(x.dtype, torch.float32)) if in_fp32 else x


@functools.lru_cache(maxsize=None)
def tree_falcon_h1_classes() -> dict:
    """{Bridge class name: tree class} for Falcon-H1 (made once, after the Bridge imports)."""
    from megatron.bridge.models.falcon_h1.modeling_falconh1 import falconh1_block, falconh1_layer, falconh1_model
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from megatron.core.transformer.utils import sharded_state_dict_default
    from megatron.core.utils import make_viewless_tensor

    from ..megatron.mamba import tree_mamba_mixer_over
    from ..megatron.model import TreeLanguageModelMixin

    FalconH1Layer = falconh1_layer.FalconH1Layer

    class TreeFalconH1Layer(FalconH1Layer):
        """``FalconH1Layer`` passing the tree layout (``packed_seq_params``) to both mixers."""

        def forward(self, hidden_states, attention_mask=None, inference_context=None, rotary_pos_emb=None,
                    *args, packed_seq_params=None, **kwargs):
            if not _is_tree(packed_seq_params):
                return super().forward(hidden_states, attention_mask, inference_context, rotary_pos_emb,
                                       *args, packed_seq_params=packed_seq_params, **kwargs)
            if inference_context is not None:
                raise ValueError("TreeFalconH1Layer is a training module: inference over a tree is not supported")
            cfg = self.config
            residual = _residual(hidden_states, self.residual_in_fp32)
            h = self.norm(hidden_states.to(dtype=cfg.params_dtype))
            outputs, biases = [], []
            if self.use_mamba and self.mamba_mixer is not None:
                out, bias = self.mamba_mixer(h * cfg.ssm_in_multiplier, packed_seq_params=packed_seq_params)
                outputs.append(out * cfg.ssm_out_multiplier)
                biases += [bias] if bias is not None else []
            if self.use_attention and self.self_attention is not None:
                out, bias = self.self_attention(h * cfg.attention_in_multiplier, attention_mask=attention_mask,
                                                rotary_pos_emb=rotary_pos_emb, packed_seq_params=packed_seq_params)
                outputs.append(out * cfg.attention_out_multiplier)
                biases += [bias] if bias is not None else []
            combined = sum(outputs) if outputs else h
            with self.bias_dropout_add_exec_handler():
                hidden_states = self.falconh1_bda(training=self.training, fused=cfg.bias_dropout_fusion)(
                    (combined, sum(biases) if biases else None), residual, self.hidden_dropout)
            if self.use_mlp and self.mlp is not None:
                mlp_residual = _residual(hidden_states, self.residual_in_fp32)
                with self.bias_dropout_add_exec_handler():
                    hidden_states = self.mlp_bda(training=self.training, fused=cfg.bias_dropout_fusion)(
                        self.mlp(hidden_states.to(dtype=cfg.params_dtype)), mlp_residual, self.hidden_dropout)
            return hidden_states

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            """The Bridge's keys, with replicated tensors (the norm) told the TP group: the Bridge's layer leaves
            it out, so every TP rank claimed the main replica and a TP > 1 checkpoint save stopped."""
            return {k: v for name in ("norm", "mamba_mixer", "self_attention", "mlp")
                    if getattr(self, name, None) is not None
                    for k, v in sharded_state_dict_default(getattr(self, name), f"{prefix}{name}.", sharded_offsets,
                                                           metadata, tp_group=self.pg_collection.tp).items()}

    class TreeFalconH1Stack(falconh1_block.FalconH1Stack):
        """``FalconH1Stack`` passing the tree layout to every layer. Its final norm is built from the spec's
        ``final_norm`` param (the Bridge's stack builds transformer-engine's ``TENorm`` directly: its local
        twin where transformer-engine is absent)."""

        def __init__(self, config, submodules, *args, final_norm=None, post_layer_norm: bool = True,
                     **kwargs):
            super().__init__(config, submodules, *args, post_layer_norm=False, **kwargs)
            self.tp_group = kwargs["pg_collection"].tp
            self.post_layer_norm = post_layer_norm
            if self.post_process and post_layer_norm:
                self.final_norm = build_module(final_norm or falconh1_block.TENorm, config=config,
                                               hidden_size=config.hidden_size, eps=config.layernorm_epsilon)

        def forward(self, hidden_states, attention_mask, inference_context=None, rotary_pos_emb=None, *,
                    inference_params=None, packed_seq_params=None, **kwargs):
            if not _is_tree(packed_seq_params):
                return super().forward(hidden_states, attention_mask, inference_context, rotary_pos_emb,
                                       inference_params=inference_params)
            if not self.pre_process:
                hidden_states = self.input_tensor
            for layer in self.layers:
                if isinstance(layer, (TransformerLayer, FalconH1Layer)):
                    hidden_states = layer(hidden_states=hidden_states, attention_mask=attention_mask,
                                          rotary_pos_emb=rotary_pos_emb, packed_seq_params=packed_seq_params)
                else:  # MambaLayer
                    hidden_states = layer(hidden_states=hidden_states, attention_mask=attention_mask,
                                          packed_seq_params=packed_seq_params)
                if isinstance(hidden_states, tuple):
                    hidden_states = hidden_states[0]
            if self.post_process and self.post_layer_norm:
                hidden_states = self.final_norm(hidden_states)
            return make_viewless_tensor(inp=hidden_states, requires_grad=hidden_states.requires_grad,
                                        keep_graph=True)

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
            if getattr(self, "final_norm", None) is not None:  # as in TreeFalconH1Layer: the TP group told
                out.update(sharded_state_dict_default(self.final_norm, f"{prefix}final_norm.", sharded_offsets,
                                                      metadata, tp_group=self.tp_group))
            return out

    class TreeFalconH1Model(TreeLanguageModelMixin, falconh1_model.FalconH1Model):
        """Megatron-Bridge's ``FalconH1Model`` for tree microbatches (see the module doc); any other input
        runs the Bridge's forward."""

        def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                    inference_context=None, runtime_gather_output=None, *, inference_params=None,
                    packed_seq_params=None, padding_mask=None):
            if not _is_tree(packed_seq_params):
                if packed_seq_params is not None:
                    raise ValueError("FalconH1Model takes no packed sequences other than a tree's")
                return super().forward(input_ids, position_ids, attention_mask, decoder_input=decoder_input,
                                       labels=labels, inference_context=inference_context,
                                       runtime_gather_output=runtime_gather_output, inference_params=inference_params)
            if inference_context is not None or inference_params is not None:
                raise ValueError("TreeFalconH1Model is a training model: inference over a tree is not supported")
            return self.tree_stack_forward(input_ids, position_ids, attention_mask, packed_seq_params,
                                           decoder_input=decoder_input, labels=labels,
                                           runtime_gather_output=runtime_gather_output)

        def tree_embedding(self, input_ids, position_ids):
            return super().tree_embedding(input_ids, position_ids) * self.config.embedding_multiplier

        def _scale_logits(self, logits):
            return logits * self.config.lm_head_multiplier  # what FalconH1Model.forward applies, MuP or not

    mixer = tree_mamba_mixer_over(falconh1_layer.FalconH1MambaMixer, "TreeFalconH1MambaMixer",
                                  mixins=(_FalconScale,), module=__name__)
    return {"FalconH1Layer": TreeFalconH1Layer, "FalconH1Stack": TreeFalconH1Stack,
            "FalconH1Model": TreeFalconH1Model, "FalconH1MambaMixer": mixer}


def tree_falcon_h1_stack_spec(spec):
    """The Bridge's Falcon-H1 stack spec (a ``ModuleSpec`` of ``FalconH1Stack``) with the tree classes: local
    twins of its transformer-engine modules where transformer-engine is absent (the final norm's too),
    Falcon's stack / layer / Mamba mixer by their tree subclasses, core attention by tree attention."""
    import copy

    from ..megatron.specs import te_available, treeify_spec
    from .local_twins import local_norm, local_twin_spec

    classes = tree_falcon_h1_classes()
    spec = copy.copy(spec)
    if not te_available():
        spec = local_twin_spec(spec, zero_centered=False)
        spec.params = {**(spec.params or {}), "final_norm": local_norm(False)}
    spec = treeify_spec(spec)
    return _swap_classes(spec, classes)


def _swap_classes(spec, classes: dict):
    import copy
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(spec, ModuleSpec):
        spec = copy.copy(spec)
        spec.module = classes.get(getattr(spec.module, "__name__", None), spec.module)
        if spec.submodules is not None:
            spec.submodules = _swap_classes(spec.submodules, classes)
        return spec
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        spec = copy.copy(spec)
        for f in dataclasses.fields(spec):
            setattr(spec, f.name, _swap_classes(getattr(spec, f.name), classes))
    return spec


def tree_falcon_h1_model(config=None, falconh1_stack_spec=None, *args, **kwargs):
    """Stands where the Bridge's ``FalconH1ModelProvider.provide`` calls ``FalconH1Model``: the same call,
    `TreeFalconH1Model` with `tree_falcon_h1_stack_spec`."""
    from megatron.core.transformer.enums import AttnBackend

    config.attention_backend = AttnBackend.local  # see provider._family_cores_kept
    model_cls = tree_falcon_h1_classes()["FalconH1Model"]
    return model_cls(config, falconh1_stack_spec=tree_falcon_h1_stack_spec(falconh1_stack_spec), *args, **kwargs)
