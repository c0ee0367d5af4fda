"""Explicit shims that let Megatron-Core's stock DeepSeek Sparse Attention (DSA) run on a CPU host in
float64 (the per-sample oracle of the tree DSA modules), and the small version differences between
megatron-core 0.16 and 0.19 that the tree modules need. Nothing here runs on import: call `enable()`.

* ``rotate_activation``: stock asserts bfloat16 input and needs the CUDA ``fast_hadamard_transform``
  package. `hadamard_rotate` is a torch Walsh-Hadamard transform (any float dtype, scale
  ``dim ** -0.5``, power-of-two ``dim``); `enable` points the stock module's ``rotate_activation``
  at it. The tree indexer looks the function up in the stock module at call time, so tree and
  stock always rotate with the same function (the CUDA kernel on GPU when it is installed and
  `enable` was not called).
* ``DSAIndexerLossLoggingHelper.save_loss_to_tracker`` allocates its buffer on
  ``torch.cuda.current_device()``: `enable` makes it allocate on the loss's device.
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
  under it too. For float32 / bf16 tensors nothing changes.
* Version differences the tree modules follow: `kl_form` (0.16's ``log(p + 1e-10) - log(q + 1e-10)``
  vs 0.19's ``log(max(p, 1e-10)) - log q``) and `indexer_loss_per_token` (0.19 sums the indexer KL
  over a sample's rows under ``calculate_per_token_loss``, 0.16 always averages). 0.19's indexer
  (``forward_before_topk``, rope order, optional rotation / relu) is called as it is; 0.16's steps
  are mirrored from its own pieces in `megatron_tree.megatron.dsa.TreeDSAIndexer`.
* `DuplicatedLinear`: the CPU stand-in for transformer-engine's ``TELinear`` with
  ``parallel_mode="duplicated"`` (the indexer's projections): a plain ``weight`` [out, in], the same
  on every TP rank, returning ``(y, bias)`` like Megatron's linears. Same checkpoint key as TE.
* `index_share_settings`: IndexShare (``dsa_indexer_topk_freq`` / ``dsa_indexer_skip_topk_offset``,
  megatron-core 0.19's config fields; plain attributes set on a 0.16 config) and the 0.19 rule of
  which layer computes top-k and which reuses whose.
* `stock_oracle_class`: stock ``DSAttention`` run on one unpacked sample from inside a tree model (the
  per-sample side of ``megatron-tree verify --model dsa``); on 0.16, which has no IndexShare, it
  adds 0.19's IndexShare semantics around the stock forward.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

__all__ = ["hadamard_rotate", "enable", "stable_topk", "float64_oracle", "DuplicatedLinear", "index_share_settings",
           "is_skip_topk_layer", "source_topk_layer", "stock_oracle_class", "capture_stock_selected",
           "stock_dsa_mtp_runs", "capture_layer",
           "indexer_loss_per_token",
           "dsa_module", "kl_form"]


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


# --------------------------------------------------------------------------------- Hadamard rotation
def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """``x @ H / sqrt(d)`` over the last dim (H the Sylvester Hadamard matrix of order d): what
    ``fast_hadamard_transform.hadamard_transform(x, scale=d ** -0.5)`` computes, in x's dtype.

    d must be a power of two (the kernel pads otherwise; DSA's indexer head dims are powers of two,
    so anything else is refused rather than guessed). Differentiable (linear butterflies)."""
    if not x.is_floating_point():
        raise TypeError(f"hadamard_rotate needs a floating point tensor, got {x.dtype}")
    d = x.shape[-1]
    if d < 1 or d & (d - 1):
        raise ValueError(f"hadamard_rotate: the last dimension must be a power of two (DSA indexer head dim), got {d}")
    lead = x.shape[:-1]
    y = x.reshape(-1, d)
    h = 1
    while h < d:  # log2(d) butterfly stages, each over the whole tensor
        y = y.view(-1, d // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return (y.reshape(*lead, d) * d ** -0.5).to(x.dtype)


def _rotate_activation(x: torch.Tensor) -> torch.Tensor:
    """Stand-in for stock ``rotate_activation`` (any float dtype, torch Walsh-Hadamard)."""
    return hadamard_rotate(x)


def _save_loss_to_tracker(loss, layer_number, num_layers, reduce_group=None, avg_group=None):
    """Stock ``DSAIndexerLossLoggingHelper.save_loss_to_tracker`` with its buffer on ``loss.device``."""
    if layer_number is None:
        return
    helper = dsa_module().DSAIndexerLossLoggingHelper
    tracker = helper.tracker
    if "values" not in tracker or tracker["values"].device != loss.device or tracker["values"].numel() != num_layers:
        tracker["values"] = torch.zeros(num_layers, device=loss.device, dtype=torch.float64)
    tracker["values"][layer_number - 1] += loss.detach().to(tracker["values"].dtype)
    tracker["reduce_group"] = reduce_group
    tracker["avg_group"] = avg_group


_ENABLED = False


def enable() -> None:
    """Install the CPU shims on the stock DSA module (idempotent): `hadamard_rotate` as its
    ``rotate_activation`` and a device-agnostic indexer-loss tracker. Call it explicitly (tests,
    verify, CPU demos); a GPU run with ``fast_hadamard_transform`` installed does not need it."""
    global _ENABLED
    if _ENABLED:
        return
    mod = dsa_module()
    mod.rotate_activation = _rotate_activation
    mod.DSAIndexerLossLoggingHelper.save_loss_to_tracker = staticmethod(_save_loss_to_tracker)
    fused = getattr(mod, "FusedDSAIndexerLoss", None)  # megatron-core >= 0.19: the loss has its own backward
    if fused is not None:
        stock_backward = fused.backward

        def backward(ctx, *grads):
            # the float64 oracle's numerics hold in the backward too (float64 stays float64); for
            # other dtypes `float64_oracle` changes nothing
            with float64_oracle():
                return stock_backward(ctx, *grads)

        fused.backward = staticmethod(backward)
    _ENABLED = True


# --------------------------------------------------------------------------------- stable top-k
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


# --------------------------------------------------------------------------------- duplicated linear
class DuplicatedLinear(torch.nn.Module):
    """CPU stand-in for ``TELinear(parallel_mode="duplicated")``: y = x W^T (+ b), same on every TP rank.

    Constructor keywords as Megatron's spec builders pass them; forward returns ``(y, bias)``
    (``bias`` is returned apart when ``skip_bias_add``)."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method=None, bias: bool = False,
                 skip_bias_add: bool = False, skip_weight_param_allocation: bool = False,
                 parallel_mode: Optional[str] = "duplicated", tp_comm_buffer_name=None, is_expert: bool = False,
                 **_unused):
        super().__init__()
        if parallel_mode not in (None, "duplicated"):
            raise ValueError(f"DuplicatedLinear is the duplicated (not TP-split) linear, got parallel_mode={parallel_mode!r}")
        if skip_weight_param_allocation:
            raise ValueError("DuplicatedLinear always owns its weight")
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, device=device, dtype=config.params_dtype))
        if config.perform_initialization and init_method is not None:
            init_method(self.weight)
        self.bias = (torch.nn.Parameter(torch.zeros(output_size, device=device, dtype=config.params_dtype))
                     if bias else None)
        self.skip_bias_add = skip_bias_add
        # the same parameters on every TP rank: Megatron all-reduces such grads over TP when asked
        for p in self.parameters():
            setattr(p, "sequence_parallel", False)

    def forward(self, x):
        if self.bias is not None and not self.skip_bias_add:
            return torch.nn.functional.linear(x, self.weight, self.bias), None
        return torch.nn.functional.linear(x, self.weight), self.bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, {}, sharded_offsets)


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


# --------------------------------------------------------------------------------- stock oracle
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
            token = _capture_token(packed_seq_params)
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
_TOKENS = iter(range(1 << 62))


def _capture_token(psp) -> int:
    """A number naming one microbatch's forward (stored on its packed-seq params; recomputation sees
    the same one)."""
    if psp is None:
        return -1
    while "_capture_parent" in psp.__dict__:  # a view made for one layer (an MTP depth): its microbatch's forward
        psp = psp.__dict__["_capture_parent"]
    tok = psp.__dict__.get("_dsa_capture_token")
    if tok is None:
        tok = psp.__dict__["_dsa_capture_token"] = next(_TOKENS)
    return tok


def capture_layer(module) -> int:
    """The layer number a DSA core attention's captured selections are filed under: its
    ``layer_number``, or ``capture_layer_number`` where one was set (an MTP layer's, whose own number
    repeats a decoder layer's on 0.19: `verify_mtp.number_mtp_captures`)."""
    return getattr(module, "capture_layer_number", module.layer_number)


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

