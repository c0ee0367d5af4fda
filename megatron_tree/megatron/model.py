"""`TreeGPTModel` / `TreeMambaModel`: Megatron's ``GPTModel`` / ``MambaModel`` with depth RoPE and
per-occurrence log-prob output.

Two things a model must do differently on a tree, both confined here (`TreeLanguageModelMixin`,
shared by both models; everything else, including the module tree, is the stock model's):

* **Depth RoPE.** ``GPTModel`` builds rotary embeddings for physical rows 0..s-1. On a tree a row's
  position is its depth on its root path (``layout.position_ids``): the rotary table is built with
  Megatron's own ``RotaryEmbedding`` and indexed by depth. This happens in ``_preprocess``
  (``TreeGPTModel``) or ``forward`` (``TreeMambaModel``, whose stock ``forward`` has no such hook),
  on every pipeline stage (and the table is an input, so recomputation reuses it). Learned
  absolute position embeddings get depth ``position_ids`` from the caller.
* **Loss rows.** With a `TreePackedSeqParams` carrying a loss map (and no ``labels``), the last
  stage returns per-occurrence target log-probs ``[M]`` instead of logits (float32, or float64 when
  the model runs in float64: softmax is never taken in a lower precision than float32): the output
  layer runs on the distinct source rows only, and `vocab_parallel_logprobs` handles the TP vocab
  shards. Without a loss map it returns ordinary logits for every row.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.models.mamba.mamba_model import MambaModel
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from .loss import vocab_parallel_logprobs
from .packed_seq import TreePackedSeqParams


def _is_tree(psp) -> bool:
    return isinstance(psp, TreePackedSeqParams) and psp.layout is not None


class TreeLanguageModelMixin:
    """What a tree changes in a Megatron language model, for `TreeGPTModel` and `TreeMambaModel`.

    Mixed in before the stock model class; uses only attributes every Megatron ``LanguageModule``
    language model has (``config``, ``pg_collection``, ``post_process``, ``position_embedding_type``,
    ``rotary_pos_emb``, ``output_layer``, ``share_embeddings_and_output_weights``).
    """

    def tree_rotary_pos_emb(self, packed_seq_params) -> "torch.Tensor | None":
        """Rotary table ``[n, 1, 1, dim]`` indexed by the depth of each of this rank's ``n`` rows
        (``packed_seq_params.position_ids``); None for learned-absolute or no position embedding
        (learned absolute embeddings get depth ``position_ids`` from the caller)."""
        if getattr(self.config, "multi_latent_attention", False):
            return None  # MLA builds its rotary inside attention: TreeMLASelfAttention indexes it by depth
        if self.position_embedding_type == "rope":
            # depth < number of rows, so a table of num_rows positions covers every depth; under CP
            # the rank's rows are indexed by their own depths (no zigzag slicing of the table)
            table = self.rotary_pos_emb(packed_seq_params.layout.num_rows, packed_seq=True)  # [N, 1, 1, dim]
            return table[packed_seq_params.position_ids]
        if self.position_embedding_type in ("learned_absolute", "none"):
            return None
        raise ValueError(f"tree training supports rope, learned_absolute or none position embeddings, "
                         f"not {self.position_embedding_type!r}")

    def wants_tree_logprobs(self, packed_seq_params, labels=None) -> bool:
        """True when this (last) stage must return per-occurrence log-probs instead of logits/loss."""
        return (self.post_process and _is_tree(packed_seq_params) and packed_seq_params.loss_map is not None
                and labels is None)

    def tree_logprobs(self, hidden_states: torch.Tensor, loss_map) -> torch.Tensor:
        """[M] log-probs of every loss occurrence from final hidden states [s(/tp), 1, h].

        float64 for a float64 model, float32 otherwise (bf16 / fp16 / fp32 logits are upcast).
        """
        tp_group = self.pg_collection.tp
        if self.config.sequence_parallel:
            # backward: reduce-scatter = sum of every rank's partial (vocab-shard) input gradient
            h = gather_from_sequence_parallel_region(hidden_states, group=tp_group)
        else:
            # backward: all-reduce of the partial input gradients, as ColumnParallelLinear does
            h = copy_to_tensor_model_parallel_region(hidden_states, group=tp_group)
        rows, inverse = torch.unique(loss_map.source_rows, return_inverse=True)
        h_u = h[rows, 0]
        weight = (self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights
                  else self.output_layer.weight)
        logits = F.linear(h_u, weight, getattr(self.output_layer, "bias", None))
        v_local = weight.shape[0]
        return vocab_parallel_logprobs(logits, inverse, loss_map.targets, vocab_start=tp_group.rank() * v_local,
                                       group=tp_group if tp_group.size() > 1 else None)


class TreeGPTModel(TreeLanguageModelMixin, GPTModel):
    """``GPTModel`` for tree microbatches (identical to ``GPTModel`` for any other input)."""

    def __init__(self, config, transformer_layer_spec, *args, **kwargs):
        super().__init__(config, transformer_layer_spec, *args, **kwargs)
        self._non_homogeneous_layers = bool(getattr(transformer_layer_spec, "non_homogeneous_layers", False))

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """Megatron's sharded state dict; hybrid stacks are always keyed per layer (a Mamba layer
        and an attention layer cannot be stacked into one tensor)."""
        if self._non_homogeneous_layers:
            metadata = dict(metadata or {}, non_homogeneous_layers=True)
        return super().sharded_state_dict(prefix, sharded_offsets, metadata)

    def _preprocess(self, input_ids, position_ids, decoder_input=None, inference_context=None,
                    packed_seq_params=None, padding_mask=None):
        out = super()._preprocess(input_ids=input_ids, position_ids=position_ids, decoder_input=decoder_input,
                                  inference_context=inference_context, packed_seq_params=packed_seq_params,
                                  padding_mask=padding_mask)
        if _is_tree(packed_seq_params):
            rotary = self.tree_rotary_pos_emb(packed_seq_params)
            if rotary is not None:
                out = (out[0], rotary) + tuple(out[2:])
        return out

    def _postprocess(self, hidden_states, **kwargs):
        psp = kwargs.get("packed_seq_params")
        if self.wants_tree_logprobs(psp, kwargs.get("labels")) and not kwargs.get("mtp_in_postprocess"):
            return self.tree_logprobs(hidden_states, psp.loss_map)
        return super()._postprocess(hidden_states=hidden_states, **kwargs)


class TreeMambaModel(TreeLanguageModelMixin, MambaModel):
    """Megatron's ``MambaModel`` (the Nemotron-H family: Mamba-2 / attention / MLP / MoE layers of
    ``hybrid_override_pattern``) for tree microbatches.

    Same constructor, module tree, parameter names and sharded state dict as ``MambaModel``; build
    it with `get_tree_mamba_stack_spec` in place of ``mamba_stack_spec``. With a
    `TreePackedSeqParams` input the attention layers get the rotary table indexed by depth, and the
    last stage returns ``[M]`` per-occurrence log-probs when the params carry a loss map (and no
    ``labels``), else logits ``[1, N, V/tp]`` (or the loss with ``labels``), as ``MambaModel``.
    Any other input runs ``MambaModel.forward`` unchanged.
    """

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                inference_context=None, runtime_gather_output=None, *, inference_params=None,
                packed_seq_params=None, padding_mask=None):
        if not _is_tree(packed_seq_params):
            return super().forward(input_ids, position_ids, attention_mask, decoder_input=decoder_input, labels=labels,
                                   inference_context=inference_context, runtime_gather_output=runtime_gather_output,
                                   inference_params=inference_params, packed_seq_params=packed_seq_params,
                                   padding_mask=padding_mask)
        if inference_context is not None or inference_params is not None:
            raise ValueError("TreeMambaModel is a training model: inference over a tree is not supported")
        psp = packed_seq_params
        if decoder_input is None and self.pre_process:
            decoder_input = self.embedding(input_ids=input_ids, position_ids=position_ids)
        # (a later pipeline stage passes None: the stack reads the tensor set by set_input_tensor)
        hidden_states = self.decoder(hidden_states=decoder_input, attention_mask=attention_mask,
                                     rotary_pos_emb=self.tree_rotary_pos_emb(psp), packed_seq_params=psp,
                                     padding_mask=padding_mask)
        if not self.post_process:
            return hidden_states
        if self.wants_tree_logprobs(psp, labels):
            return self.tree_logprobs(hidden_states, psp.loss_map)
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(hidden_states, weight=weight, runtime_gather_output=runtime_gather_output)
        if labels is None:
            return logits.transpose(0, 1).contiguous()  # [s, b, v] -> [b, s, v], as MambaModel
        return self.compute_language_model_loss(labels, logits)
