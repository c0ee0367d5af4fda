"""Megatron-Core's stock DeepSeek Sparse Attention (DSA) module across versions: the differences
between megatron-core 0.16 and 0.19 the tree DSA modules follow, and the torch fallback for its
optional Hadamard kernel. Nothing here runs on import.

* Version differences: `kl_form` (0.16's ``log(p + 1e-10) - log(q + 1e-10)`` vs 0.19's
  ``log(max(p, 1e-10)) - log q``), `indexer_loss_per_token` (0.19 sums the indexer KL over a
  sample's rows under ``calculate_per_token_loss``, 0.16 always averages), `stock_dsa_mtp_runs`
  (0.19 numbers an MTP layer's DSA inside its indexer-loss tracker), and IndexShare
  (`index_share_settings`: ``dsa_indexer_topk_freq`` / ``dsa_indexer_skip_topk_offset``, 0.19's
  config fields, plain attributes set on a 0.16 config; `is_skip_topk_layer` / `source_topk_layer`:
  0.19's rule of which layer computes top-k and which reuses whose). 0.19's indexer
  (``forward_before_topk``, rope order, optional rotation / relu) is called as it is; 0.16's steps
  are mirrored from its own pieces in `megatron_tree.megatron.dsa.TreeDSAIndexer`.
* ``rotate_activation``: stock asserts bfloat16 input and needs the CUDA ``fast_hadamard_transform``
  package. `use_torch_hadamard` points the stock module's ``rotate_activation`` at
  `megatron_tree.ops.hadamard.hadamard_rotate` (any float dtype), on any machine that lacks the
  kernel. The tree indexer looks the function up in the stock module at call time, so tree and
  stock always rotate with the same function.

The CPU host's shims of the stock module live in `megatron_tree.cpu.dsa`; the float64 per-sample
oracle of ``megatron-tree verify --model dsa`` in `megatron_tree.training.dsa_oracle`.
"""
from __future__ import annotations

from ..ops.hadamard import hadamard_rotate

__all__ = ["dsa_module", "stock_dsa_mtp_runs", "kl_form", "indexer_loss_per_token", "use_torch_hadamard",
           "index_share_settings", "is_skip_topk_layer", "source_topk_layer"]


def dsa_module():
    """Megatron-Core's stock DSA module (``...experimental_attention_variant.dsa``)."""
    from megatron.core.transformer.experimental_attention_variant import dsa

    return dsa


def _has_index_share() -> bool:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return "dsa_indexer_topk_freq" in TransformerConfig.__dataclass_fields__


def stock_dsa_mtp_runs() -> bool:
    """Whether stock DSA runs inside an MTP layer. megatron-core 0.16 numbers the MTP layer's transformer
    layer ``num_layers + k``, past the end of the indexer-loss tracker it sizes by ``num_layers``
    (IndexError in training); 0.19 builds it as ``is_mtp_layer`` numbered k (its indexer loss is then
    logged with decoder layer k's)."""
    import inspect

    from megatron.core.transformer.transformer_layer import TransformerLayer

    return "is_mtp_layer" in inspect.signature(TransformerLayer.__init__).parameters


def kl_form() -> str:
    """The KL term stock's indexer loss uses in this Megatron-Core (``ops.dsa.KL_FORMS``): "eps" for
    0.16 (``log(p + 1e-10) - log(q + 1e-10)``), "log_softmax" for 0.19 (``log(max(p, 1e-10)) - log q``)."""
    return "log_softmax" if hasattr(dsa_module(), "FusedDSAIndexerLoss") else "eps"


def indexer_loss_per_token(config) -> bool:
    """True when stock's indexer loss is a *sum* over the sample's query rows rather than their mean:
    megatron-core >= 0.19 with ``calculate_per_token_loss`` (its ``reduce_indexer_kl_sum``); 0.16
    always takes the mean."""
    return bool(getattr(config, "calculate_per_token_loss", False)) and hasattr(dsa_module(), "FusedDSAIndexerLoss")


def _rotate_activation(x):
    """Stand-in for stock ``rotate_activation`` (any float dtype, torch Walsh-Hadamard)."""
    return hadamard_rotate(x)


def use_torch_hadamard() -> None:
    """Point the stock DSA module's ``rotate_activation`` at the torch Walsh-Hadamard transform
    (idempotent). For machines without ``fast_hadamard_transform`` (and CPU hosts)."""
    dsa_module().rotate_activation = _rotate_activation


# --------------------------------------------------------------------------------- IndexShare
def index_share_settings(config) -> tuple[int, int]:
    """``(topk_freq, skip_topk_offset)`` of IndexShare (1, 0 = off). Megatron-Core 0.19's config fields
    ``dsa_indexer_topk_freq`` / ``dsa_indexer_skip_topk_offset``; on 0.16 set them as plain attributes
    of the config (its dataclass has no such fields)."""
    freq = int(getattr(config, "dsa_indexer_topk_freq", 1) or 1)
    offset = int(getattr(config, "dsa_indexer_skip_topk_offset", 0) or 0)
    if freq < 1 or offset < 0:
        raise ValueError(f"dsa_indexer_topk_freq must be >= 1 and dsa_indexer_skip_topk_offset >= 0, got {freq}, "
                         f"{offset}")
    return freq, offset


def is_skip_topk_layer(layer_number: int, offset: int, freq: int) -> bool:
    """True when 1-indexed ``layer_number`` reuses an earlier layer's top-k (0.19's rule): layers up to
    ``max(offset, 1)`` compute, after that every ``freq``-th layer counted from it computes."""
    if layer_number < 1:
        raise ValueError(f"layer_number is 1-indexed, got {layer_number}")
    start = max(offset, 1)
    return freq > 1 and (max(layer_number - start, 0) % freq) != 0


def source_topk_layer(layer_number: int, offset: int, freq: int) -> int:
    """The computing layer whose top-k a skip layer reuses (itself for a computing layer)."""
    start = max(offset, 1)
    if freq <= 1 or layer_number <= start:
        return layer_number
    return layer_number - ((layer_number - start) % freq)
