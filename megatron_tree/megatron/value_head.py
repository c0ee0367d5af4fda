"""A scalar head for value models (PPO critics) on a tree.

A critic reads one value per state: ``V(s_t)``, the value of the prefix that predicts target t, i.e. the final
hidden state of row ``t - 1``, the loss occurrence's source row. On a tree each row is computed once, so the
values of every rollout sharing a prefix come from the same rows (and their gradients add up there), as the
policy's log-probs do.

`add_value_head` puts a `TreeValueHead` on the last pipeline stage of a `TreeGPTModel` / `TreeMambaModel`
(before DDP wraps it); from then on the model's tree forward returns ``[M]`` values where it returned
per-occurrence log-probs (``(values, zeros)`` where the entropy is asked for), and its LM head is not used.
The head is ``v = h . w + b`` on the final (normed) hidden state, computed in float32 or wider.

Tensor parallelism: the hidden state is whole on every TP rank, so the head is replicated and every TP rank
computes every value and the same gradients (no all-reduce: unlike the vocab-sharded LM head, whose partial
input gradients are summed over TP). Under sequence parallelism each TP rank holds a slice of the rows: they are
gathered with a backward that keeps each rank's own slice of the gradient (not a reduce-scatter of copies).
The head's parameters are in the sharded state dict (``value_head.weight``, ``value_head.bias``), replicated.
"""
from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule

__all__ = ["TreeValueHead", "add_value_head", "value_head_of"]


class TreeValueHead(MegatronModule):
    """``values(hidden [n, h]) -> [n]`` = ``hidden . weight + bias`` (float32 or wider). ``weight`` [h] starts from
    ``config.init_method`` 's distribution (normal, ``init_method_std``), ``bias`` [1] at 0."""

    def __init__(self, config, bias: bool = True):
        super().__init__(config)
        self.weight = torch.nn.Parameter(torch.empty(config.hidden_size, dtype=config.params_dtype))
        with torch.no_grad():
            self.weight.normal_(0.0, float(getattr(config, "init_method_std", 0.02)))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=config.params_dtype)) if bias else None

    def values(self, hidden: torch.Tensor) -> torch.Tensor:
        dt = torch.promote_types(hidden.dtype, torch.float32)
        v = hidden.to(dt) @ self.weight.to(dt)
        return v + self.bias.to(dt) if self.bias is not None else v

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.values(hidden)


def add_value_head(model, bias: bool = True):
    """Give ``model`` (a `TreeGPTModel` / `TreeMambaModel`, not yet wrapped in DDP) a value head on its last
    pipeline stage; returns the model. Refused with MTP layers (a critic predicts no tokens)."""
    if getattr(model, "mtp_process", False) or getattr(model.config, "mtp_num_layers", None):
        raise ValueError("add_value_head: a value model takes no MTP layers (it predicts no tokens)")
    if getattr(model, "post_process", False):
        model.value_head = TreeValueHead(model.config, bias=bias)
    return model


def value_head_of(model):
    """The `TreeValueHead` of ``model`` (unwrapping DDP / Float16Module: each holds it as ``.module``), or None."""
    while hasattr(model, "module"):
        model = model.module
    return getattr(model, "value_head", None)


def occurrence_values(model, hidden_states: torch.Tensor, loss_map) -> torch.Tensor:
    """[M] values of ``loss_map``'s occurrences (their source rows) from the final hidden states [s, 1, h] of this
    TP rank (a slice of the rows under sequence parallelism)."""
    if model.config.sequence_parallel:
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        # backward: each rank keeps its own rows' gradient (every rank computed the whole, identical gradient)
        hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False,
                                                             group=model.pg_collection.tp)
    rows, inverse = torch.unique(loss_map.source_rows, return_inverse=True)
    return model.value_head.values(hidden_states[rows, 0])[inverse]
