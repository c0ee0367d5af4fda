"""The per-sample oracle of the tree DSA modules: Megatron-Core's stock DeepSeek Sparse Attention
run on one unpacked sample at float64 (the per-sample side of ``megatron-tree verify --model dsa``
and of the DSA tests). Nothing here runs on import: call `enable()`.

* `stock_oracle_class`: stock ``DSAttention`` run on one unpacked sample from inside a tree model;
  on 0.16, which has no IndexShare, it adds 0.19's IndexShare semantics around the stock forward.
  `capture_stock_selected` records its top-k selections (filed like the tree's,
  `megatron.dsa.capture_token` / `capture_layer`).
* Stock top-k tie order. ``Tensor.topk`` leaves the order of equal scores unspecified. Our tie rule
  (the contract of ``megatron_tree.ops.dsa``) is score descending, then canonical row id ascending;
  along one sample's path that is "score descending, then position ascending", which a *stable*
  descending sort gives. `stable_topk` (a context manager) makes ``Tensor.topk`` that stable sort
  for the per-sample oracle. This fixes the order among exact ties only: the selected values and the
  math are unchanged (every result of a stable sort is also a valid top-k).
* Float64. Stock computes in float32 on purpose for its bf16 inputs (``.float()`` before its score
  and attention matmuls, float32 softmaxes; 0.16 also asserts its float32 mask matches the scores'
  dtype). `float64_oracle` (a context manager, which also enters `stable_topk`) keeps float64
  tensors float64 for the oracle's forward; `enable` runs 0.19's ``FusedDSAIndexerLoss.backward``
  under it too (and the CPU host's shims, `megatron_tree.cpu.dsa`). For float32 / bf16 tensors
  nothing changes.
"""
from __future__ import annotations

import contextlib

import torch

from ..compat.dsa import _has_index_share, dsa_module, index_share_settings, is_skip_topk_layer, source_topk_layer
from ..cpu import dsa as cpu_dsa
from ..megatron.dsa import capture_layer, capture_token

__all__ = ["enable", "stable_topk", "float64_oracle", "stock_oracle_class", "capture_stock_selected"]

_ENABLED = False


def enable() -> None:
    """The oracle's shims (idempotent): the CPU host's (`cpu.dsa.enable`) and 0.19's
    ``FusedDSAIndexerLoss.backward`` under `float64_oracle`."""
    global _ENABLED
    if _ENABLED:
        return
    cpu_dsa.enable()
    fused = getattr(dsa_module(), "FusedDSAIndexerLoss", None)  # megatron-core >= 0.19: the loss has its own backward
    if fused is not None:
        stock_backward = fused.backward

        def backward(ctx, *grads):
            # the float64 oracle's numerics hold in the backward too (float64 stays float64); for
            # other dtypes `float64_oracle` changes nothing
            with float64_oracle():
                return stock_backward(ctx, *grads)

        fused.backward = staticmethod(backward)
    _ENABLED = True


def _stable_topk(self, k, dim=-1, largest=True, sorted=True, *, out=None):
    if out is not None:
        raise TypeError("stable_topk: out= is not supported")
    order = torch.sort(self, dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
    return torch.return_types.topk((self.gather(dim, order), order))


@contextlib.contextmanager
def stable_topk():
    """Inside: ``Tensor.topk`` returns ties in ascending index order (a stable descending sort).

    Our tie rule, not a change of the math: see the module docstring. Restores the stock method on
    exit. Used around the stock per-sample DSA forward, where every index is a position of one
    sample, so the rule is "score desc, then position asc"."""
    saved = torch.Tensor.topk
    torch.Tensor.topk = _stable_topk
    try:
        yield
    finally:
        torch.Tensor.topk = saved


_F_SOFTMAX = torch.nn.functional.softmax


def _softmax_keep_f64(input, dim=None, _stacklevel=3, dtype=None):
    if dtype == torch.float32 and input.dtype == torch.float64:
        dtype = torch.float64
    return _F_SOFTMAX(input, dim=dim, _stacklevel=_stacklevel, dtype=dtype)


_TENSOR_FLOAT = torch.Tensor.float


def _float_keep_f64(self, *args, **kwargs):
    return self if self.dtype == torch.float64 else _TENSOR_FLOAT(self, *args, **kwargs)


@contextlib.contextmanager
def float64_oracle():
    """Inside: stock DSA runs at float64 end to end for a float64 model. Stock computes in float32 on
    purpose for its bf16 inputs (``x.float()`` before every score / attention matmul, ``softmax(...,
    dtype=torch.float32)``): those are upcasts, so here a float64 tensor stays float64 (``.float()``
    returns it unchanged, a float32 softmax of a float64 input is float64). Together with
    `stable_topk` (entered too) this is the per-sample oracle's numerics; the math is unchanged.
    Scoped: the stock methods are restored on exit."""
    saved = torch.nn.functional.softmax, torch.Tensor.float
    torch.nn.functional.softmax = _softmax_keep_f64
    torch.Tensor.float = _float_keep_f64
    try:
        with stable_topk():
            yield
    finally:
        torch.nn.functional.softmax, torch.Tensor.float = saved


class _NoIndexer(torch.nn.Module):
    """Placeholder indexer of an IndexShare skip layer in the 0.16 oracle (no parameters)."""

    def __init__(self, config=None, pg_collection=None, **_unused):
        super().__init__()


def _oracle_cls():
    mod = dsa_module()

    class _StockDSAOracle(mod.DSAttention):
        """Stock ``DSAttention`` on one unpacked sample inside a tree model (verify's per-sample side).

        The tree model hands it ``packed_seq_params`` of a one-sample chain; the stock module gets
        ``packed_seq_params=None`` and a causal mask (the chain's rows are positions 0..L-1). On
        megatron-core 0.16 IndexShare (0.19's rule, `index_share_settings`) is added here: skip layers
        build no indexer and run stock ``unfused_dsa_fn`` on the source layer's stock top-k.
        """

        requires_dsa_inputs = True  # 0.19's MLA passes x / qr to core attentions that say so

        def __init__(self, config, submodules, layer_number, attn_mask_type=None, attention_type="self",
                     attention_dropout=None, softmax_scale=None, k_channels=None, v_channels=None,
                     cp_comm_type="p2p", pg_collection=None, name=None):
            freq, offset = index_share_settings(config)
            emulate = freq > 1 and not _has_index_share()
            if emulate and is_skip_topk_layer(layer_number, offset, freq):
                # build no indexer at all (not build-then-delete: its initialisation would draw from the
                # RNG and shift every later layer's initial weights)
                submodules = type(submodules)(indexer=_NoIndexer)
            super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                             attn_mask_type=attn_mask_type, attention_type=attention_type,
                             attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                             k_channels=k_channels, v_channels=v_channels, cp_comm_type=cp_comm_type,
                             pg_collection=pg_collection)
            self._emulate_share = emulate
            self._skip = emulate and is_skip_topk_layer(layer_number, offset, freq)
            self._source = source_topk_layer(layer_number, offset, freq)
            if self._skip:
                self.indexer = None  # a skip layer has no indexer parameters (as on 0.19)

        def forward(self, query, key, value, attention_mask=None, x=None, qr=None, attn_mask_type=None,
                    attention_bias=None, packed_seq_params=None, **kwargs):
            from megatron.core.transformer.enums import AttnMaskType

            layout = getattr(packed_seq_params, "layout", None)
            if layout is not None and not bool((layout.visible_until == layout.num_rows).all()):
                raise ValueError("the stock DSA oracle runs one unpacked sample (a single chain): got a packed tree")
            holder = None
            if self._emulate_share:  # per forward, on its packed-seq params (else the config, as 0.19 does)
                carrier = packed_seq_params if packed_seq_params is not None else self.config
                holder = carrier.__dict__.setdefault("_stock_dsa_topk", {})
            token = capture_token(packed_seq_params)
            if self._skip:
                if self._source not in holder:
                    raise RuntimeError(f"IndexShare layer {self.layer_number} needs the top-k of layer {self._source}")
                with float64_oracle():
                    out = mod.unfused_dsa_fn(query, key, value, holder[self._source], self.softmax_scale)
                _record(token, capture_layer(self), holder[self._source])
                return out
            # the top-k stock uses: 0.16 through the indexer's forward_with_scores, 0.19 (its own
            # IndexShare too) through the module's sparse attention function
            seen = []
            indexer = getattr(self, "indexer", None)
            legacy = not _has_index_share()
            saved_fn = mod.unfused_dsa_fn
            if legacy:
                orig = indexer.forward_with_scores

                def capture(x_, qr_, mask=None, packed_seq_params=None):
                    if mask is not None and x_.dtype == torch.float64:
                        mask = mask.to(torch.float64)  # 0 / -inf: exact; stock asserts the scores' dtype
                    out = orig(x_, qr_, mask, packed_seq_params)
                    seen.append(out[1])
                    return out

                indexer.forward_with_scores = capture
            else:
                def sparse_fn(q_, k_, v_, topk_indices, *a, **k):
                    seen.append(topk_indices)
                    return saved_fn(q_, k_, v_, topk_indices, *a, **k)

                mod.unfused_dsa_fn = sparse_fn
            try:
                with float64_oracle():
                    out = super().forward(query, key, value, None, x, qr, attn_mask_type=AttnMaskType.causal,
                                          packed_seq_params=None)
            finally:
                if legacy:
                    del indexer.forward_with_scores
                mod.unfused_dsa_fn = saved_fn
            if holder is not None:
                holder[self.layer_number] = seen[-1]
            _record(token, capture_layer(self), seen[-1])
            return out

    return _StockDSAOracle


_ORACLE = None
_CAPTURES: list = []
def _record(token: int, layer: int, topk_indices: torch.Tensor) -> None:
    """Stock selections of one sample [L, k'] as positions, NO_ROW (-1) where stock's slot holds no
    visible key (0.16 returns future positions with score -inf there, 0.19 returns -1)."""
    if not _CAPTURES:
        return
    ids = topk_indices.detach()[0].long().cpu()  # [L, k']
    pos = torch.arange(ids.shape[0])[:, None]
    ids = torch.where((ids >= 0) & (ids <= pos), ids, torch.full_like(ids, -1))
    for store in _CAPTURES:
        store.append((token, layer, ids))


@contextlib.contextmanager
def capture_stock_selected():
    """Inside: every oracle (`stock_oracle_class`) forward appends ``(token, layer_number, ids [L, k'])`` (positions
    in the sample, -1 = no key) to the yielded list; ``token`` names the microbatch's forward."""
    store: list = []
    _CAPTURES.append(store)
    try:
        yield store
    finally:
        _CAPTURES.remove(store)


def stock_oracle_class():
    """The per-sample oracle core attention: a subclass of stock ``DSAttention`` whose forward is the
    stock one (plus the float64 / tie / IndexShare shims of this module); usable as a ``ModuleSpec.module``."""
    global _ORACLE
    if _ORACLE is None:
        _ORACLE = _oracle_cls()
    return _ORACLE
