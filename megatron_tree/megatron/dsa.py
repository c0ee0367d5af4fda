"""Tree DeepSeek Sparse Attention (DSA) modules: Megatron-Core's ``DSAIndexer`` / ``DSAttention`` on a
packed prefix forest.

Stock DSA (``experimental_attention_variant="dsa"``, MLA only) adds a *lightning indexer* to MLA's
core attention: per query row i it scores every visible key j,
``s(i,j) = sum_h w[i,h] relu(<q_I[i,h], k_I[j]>)``, keeps the ``dsa_indexer_topk`` best keys and runs
softmax attention over those only. The indexer sees detached inputs (``x`` = the layer's hidden
states, ``qr`` = MLA's query latent) and learns only from its KL loss to the head-summed attention
distribution, attached to the output with ``DSAIndexerLossAutoScaler``.

* `TreeDSAIndexer`: the stock ``DSAIndexer`` (same submodules / parameters: ``linear_wq_b``,
  ``linear_wk``, ``k_norm``, ``linear_weights_proj``) whose rotary is indexed by tree depth (as
  `TreeMLASelfAttention`'s). `TreeDSAIndexer.tree_inputs` gives ``index_q [s,Hi,Di]``,
  ``weights [s,Hi]`` and ``index_k [s,Di]`` (after ``rotate_activation``), by the stock code:
  megatron-core >= 0.19's ``forward_before_topk`` or, on 0.16, the same steps from 0.16's pieces.
* `TreeDSAttention`: the stock ``DSAttention``'s constructor and parameter layout (``indexer.*``);
  forward runs ``ops.dsa.tree_dsa`` (one device) or ``cp.execution.dsa.tree_dsa_cp`` (CP > 1): top-k over
  the row's tree-visible keys (its root path), ties by smaller canonical row id, which on one sample
  is stock's top-k with ties by position (the oracle makes stock's tie order stable:
  ``training.dsa_oracle.stable_topk``).

**Indexer loss weights.** Stock, run on one sample of ``L`` rows, adds
``loss_coeff * mean over the L query rows of KL_i``. A tree row i is shared by every sample
through it, so the tree loss is ``sum_i row_weight[i] * KL_i`` with
``row_weight[i] = loss_coeff * sum over samples s through row i of 1 / len(s)``: the sum over the
microbatch's samples of their stock losses (``len(s)`` is the sample's token count, its per-sample
sequence length). On megatron-core >= 0.19 with ``calculate_per_token_loss`` stock sums over the rows
instead of averaging them: the weight is then ``loss_coeff * (number of samples through row i)``.
Padding rows belong to no sample: weight 0. Both per-row sums come with the microbatch's packed-seq
params (``row_inv_length`` / ``row_samples`` [N], global rows, from `TreeMicrobatch.row_sample_stats`:
`tree_packed_seq_params` and the Megatron-LM hooks' ``get_batch`` fill them). The loss's backward scale is stock's
(``DSAIndexerLossAutoScaler.main_loss_backward_scale``, which Megatron's schedule sets).

**IndexShare** (megatron-core 0.19's fields ``dsa_indexer_topk_freq`` / ``dsa_indexer_skip_topk_offset``;
on 0.16 set them as attributes of the config; default 1 / 0 = off): a skip layer has no indexer
(no parameters, no loss) and reuses the canonical selections of its source layer
(`compat.dsa.source_topk_layer`). Selections are kept per forward pass in a dict on the microbatch's
packed-seq params keyed by layer number, so activation recomputation (full or selective) reuses them
exactly: a computing layer recomputed on one device takes its stored ids instead of a second top-k
(under CP it recomputes them, the same deterministic result: ``tree_dsa_cp`` computes no loss for
given selections).
A skip layer whose source layer ran on another pipeline stage stops with an error (not supported).

Debugging: `capture_selected` collects ``(layer_number, global_rows, ids)`` of every DSA layer.
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexer
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module

from ..compat import dsa as cdsa
from ..ops.dsa import sparse_attention, tree_dsa_indexer_loss, tree_dsa_topk
from .mla import _TREE_ROTARY
from .packed_seq import get_tree_layout

__all__ = ["TreeDSAIndexer", "TreeDSAttention", "capture_selected", "capture_token", "capture_layer",
           "DuplicatedLinear", "get_tree_dsa_module_spec", "prepare_stock_dsa"]

_SELECTED_KEY = "_tree_dsa_selected"  # per-forward dict on the packed-seq params: layer -> ids
_HOOKS: list = []


_TOKENS = iter(range(1 << 62))


def prepare_stock_dsa() -> None:
    """Make stock DSA's indexer run on this host, before a DSA model trains (idempotent; every entry
    point calls it: `megatron-tree train` / score, Megatron-LM's ``pretrain()`` through the hooks'
    model provider). On a CPU host, the CPU shims (`cpu.dsa.enable`: stock's rotation asserts bfloat16
    and needs the CUDA kernel, its loss tracker allocates on CUDA); on a GPU without
    ``fast_hadamard_transform``, the torch Hadamard rotation (`compat.dsa.use_torch_hadamard`)."""
    if not torch.cuda.is_available():
        from ..cpu import dsa as cpu_dsa

        cpu_dsa.enable()
    else:
        from ..ops.backend import module_available

        if not module_available("fast_hadamard_transform"):
            cdsa.use_torch_hadamard()


def capture_token(psp) -> int:
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


@contextlib.contextmanager
def capture_selected():
    """Inside: every `TreeDSAttention` forward appends ``(token, layer_number, rows [n], ids [n,topk])``
    (``token`` names the microbatch's forward, the same in its recomputation; CPU tensors: the global
    rows it computed and their canonical selections, NO_ROW = -1) to the yielded list. A debug / verification hook; no effect on the math."""
    store: list = []
    _HOOKS.append(store)
    try:
        yield store
    finally:
        _HOOKS.remove(store)


# ----------------------------------------------------------------------------------- row weights
# ----------------------------------------------------------------------------------- indexer
class TreeDSAIndexer(DSAIndexer):
    """Stock ``DSAIndexer`` whose rotary is looked up by tree depth (`tree_inputs`).

    Same constructor, submodules and parameters as stock; its ``forward`` / ``forward_with_scores``
    stay the stock ones (no tree): on a tree call `tree_inputs`."""

    def __init__(self, config, submodules, pg_collection: Optional[ProcessGroupCollection] = None):
        super().__init__(config=config, submodules=submodules, pg_collection=pg_collection)
        cls = _TREE_ROTARY.get(type(self.rotary_pos_emb))
        if cls is None:
            raise TypeError(f"TreeDSAIndexer: no depth-indexed variant of {type(self.rotary_pos_emb).__name__}")
        self.rotary_pos_emb.__class__ = cls  # same object and buffers: only lookups change

    def tree_inputs(self, x: torch.Tensor, qr: torch.Tensor, depths: torch.Tensor, table_rows: int):
        """Indexer tensors of the rows of ``x`` [s(/tp under SP),1,h] and ``qr`` [s(/tp),1,q_lora]:
        ``(index_q [s,Hi,Di], weights [s,Hi], index_k [s,Di])`` with the rotary part of row r rotated
        by ``depths[r]`` (``depths`` [s] covers all s rows; SP inputs are gathered as stock does)."""
        with self.rotary_pos_emb.at_depths(depths, table_rows):
            if hasattr(DSAIndexer, "forward_before_topk"):  # megatron-core >= 0.19
                q, k, w = self.forward_before_topk(x, qr, None)
            else:
                q, k, w = self._before_topk_016(x, qr)
        if q.shape[1] != 1:
            raise ValueError(f"tree DSA expects micro-batch size 1 (the tree is the batch), got {q.shape[1]}")
        return q[:, 0], w[:, 0], k[:, 0]

    def _before_topk_016(self, x, qr):
        """megatron-core 0.16's ``forward_with_scores`` up to (not including) the scores: its steps,
        its submodules, its ``_apply_rope`` and its module's ``rotate_activation``."""
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        rot = self.rotary_pos_emb(0, packed_seq=False)  # at_depths: the depth table, any length
        emb, mscale = (rot if isinstance(rot, tuple) else (rot, 1.0))
        if self.config.sequence_parallel and self.pg_collection.tp.size() > 1:
            x = gather_from_sequence_parallel_region(x, group=self.pg_collection.tp)
            qr = gather_from_sequence_parallel_region(qr, group=self.pg_collection.tp)
        s, b, _ = x.size()
        q, _ = self.linear_wq_b(qr)
        q = self._apply_rope(q.reshape(s, b, self.index_n_heads, self.index_head_dim), emb, mscale)
        k, _ = self.linear_wk(x)
        k = self._apply_rope(self.k_norm(k).reshape(s, b, 1, self.index_head_dim), emb, mscale)
        k = k.reshape(s, b, self.index_head_dim)
        rotate = cdsa.dsa_module().rotate_activation  # looked up now: the compat stand-in when enabled
        q, k = rotate(q), rotate(k)
        w, _ = self.linear_weights_proj(x)
        return q, k, w * (self.index_n_heads ** -0.5) * self.softmax_scale


# ----------------------------------------------------------------------------------- core attention
class TreeDSAttention(MegatronModule):
    """DSA core attention over a tree: ``query [s,1,np,D]``, ``key [s,1,np,D]``, ``value [s,1,np,Dv]``
    (np = heads of this TP rank), ``x`` / ``qr`` the indexer inputs (MLA passes them) -> ``[s,1,np*Dv]``.

    Constructor and ``indexer`` submodule as stock ``DSAttention`` (stock checkpoints load). See the
    module docstring for the loss weights and IndexShare."""

    requires_dsa_inputs = True  # megatron-core 0.19's MLA passes x / qr to core attentions that say so

    def __init__(self, config, submodules, layer_number: int, attn_mask_type=AttnMaskType.causal,
                 attention_type: str = "self", attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, k_channels: Optional[int] = None,
                 v_channels: Optional[int] = None, cp_comm_type: Optional[str] = None,
                 pg_collection: Optional[ProcessGroupCollection] = None, name: Optional[str] = None):
        super().__init__(config=config)
        if attention_type != "self":
            raise ValueError(f"TreeDSAttention supports self-attention only, got {attention_type!r}")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"tree DSA has no attention dropout (got {dropout}); set attention_dropout=0")
        self.layer_number = layer_number
        self.k_channels, self.v_channels = k_channels, v_channels  # per head (the carry store's widths)
        self.topk = int(config.dsa_indexer_topk)
        freq, offset = cdsa.index_share_settings(config)
        self.skip_topk = cdsa.is_skip_topk_layer(layer_number, offset, freq)
        self.source_layer = cdsa.source_topk_layer(layer_number, offset, freq)
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.pg_collection = pg_collection
        self.indexer = None if self.skip_topk else build_module(submodules.indexer, config=config,
                                                                pg_collection=pg_collection)
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(k_channels if k_channels is not None else config.kv_channels)
        self.softmax_scale = softmax_scale
        self.kl_form = cdsa.kl_form()
        # verify's planted faults ("dsa_tie_order", "dsa_loss_weight", "dsa_bf16_grad_sum")
        self.fault: Optional[str] = None

    # -- helpers
    def _loss_weight(self, psp, rows: torch.Tensor) -> torch.Tensor:
        # stock's per-sample reduction: mean over the sample's rows (0.16; 0.19 without per-token
        # loss) -> sum of 1/len(s); sum over them (0.19 with calculate_per_token_loss) -> sample count
        per_token = cdsa.indexer_loss_per_token(self.config)
        w = getattr(psp, "row_samples" if per_token else "row_inv_length", None)
        if w is None:
            raise ValueError("TreeDSAttention: the indexer loss needs the per-row sample weights of the microbatch "
                             "(packed_seq_params.row_inv_length / row_samples [N]): build the params with "
                             "megatron_tree.megatron.packed_seq.tree_packed_seq_params(mb) or fill them from "
                             "TreeMicrobatch.row_sample_stats()")
        w = w.to(device=rows.device, dtype=torch.float64)[rows]
        if self.fault == "dsa_loss_weight":  # planted bug: one weight per row, ignoring sharing / lengths
            w = (w > 0).to(w.dtype)
        return w * float(self.config.dsa_indexer_loss_coeff or 0.0)

    def forward(self, query, key, value, attention_mask=None, x=None, qr=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **kwargs):
        if attention_bias is not None:
            raise ValueError("TreeDSAttention does not take an attention_bias")
        psp = packed_seq_params
        layout = get_tree_layout(psp)
        s, b = query.shape[:2]
        if b != 1:
            raise ValueError(f"tree DSA expects micro-batch size 1 (the tree is the batch), got {b}")
        holder = psp.__dict__.setdefault(_SELECTED_KEY, {})
        cp = self.config.context_parallel_size > 1
        view = getattr(psp, "carry", None)
        if cp:
            n = psp.cp_owned_rows(s, type(self).__name__)
            rows = psp.local_rows.to(query.device).long()
        elif view is not None:
            if s != len(view.own):
                raise ValueError(f"carry: the input covers {s} rows but the microbatch owns {len(view.own)}")
            n, rows = s, torch.arange(layout.num_rows, device=query.device)
        else:
            if s != layout.num_rows:
                raise ValueError(f"sequence length {s} != tree layout rows {layout.num_rows}")
            n, rows = s, torch.arange(s, device=query.device)
        q, k, v = query[:n, 0], key[:n, 0], value[:n, 0]
        if view is not None:  # K / V through the carry phase (stored, or given the readers' gradient)
            k, v = view.state(("dsa", self.layer_number), [k, v])
        coeff = float(self.config.dsa_indexer_loss_coeff or 0.0)
        use_loss = not self.skip_topk and self.training and torch.is_grad_enabled() and coeff > 0
        tp = self.pg_collection.tp
        head_group = tp if tp is not None and tp.size() > 1 else None
        sparse = bool(getattr(self.config, "dsa_indexer_use_sparse_loss", False))

        selected = None
        iq = w = ik = None
        if self.skip_topk:
            if self.source_layer not in holder:
                raise RuntimeError(
                    f"IndexShare: DSA layer {self.layer_number} reuses the selections of layer {self.source_layer}, "
                    "which did not run before it in this pipeline stage; IndexShare across a pipeline stage "
                    "boundary is not supported: start every stage on a computing layer "
                    "(dsa_indexer_topk_freq / dsa_indexer_skip_topk_offset)")
            selected = holder[self.source_layer]
        else:
            if x is None or qr is None:
                raise ValueError("TreeDSAttention needs the indexer inputs x and qr (MLA passes them with "
                                 "experimental_attention_variant='dsa')")
            with torch.enable_grad() if use_loss else torch.no_grad():
                iq, w, ik = self.indexer.tree_inputs(x.detach(), qr.detach(), psp.position_ids, layout.num_rows)
            iq, w, ik = iq[:n], w[:n], ik[:n]
            if view is not None:
                (ik,) = view.state(("dsa", self.layer_number, "index_k"), [ik])
            if not cp and self.layer_number in holder:  # recomputation: the same selections, exactly
                selected = holder[self.layer_number]
        own_q = q
        at_own = None
        if view is not None and cp:  # the plan's rows: own ones and the carried ones it gives this rank
            from ..cp.execution.carry import carry_cp_rows  # the executor sits below this package

            at_own = carry_cp_rows(view)[1].to(query.device)
            q, k, v, iq, w, ik = _carry_full(view, None, self.layer_number, q, k, v, iq, w, ik, self.skip_topk)
        elif view is not None:  # the whole layout: carried rows' K / V / index keys from the store
            q, k, v, iq, w, ik = _carry_full(view, layout.num_rows, self.layer_number, q, k, v, iq, w, ik,
                                             self.skip_topk)

        if cp:
            from ..cp.execution.dsa import tree_dsa_cp  # the CP executor sits below this package

            rw = self._loss_weight(psp, rows) if use_loss else None
            if rw is not None and at_own is not None:  # carried rows' queries are their owners' (zero here)
                rw = rw.new_zeros(q.shape[0]).index_copy(0, at_own, rw)
            o, ids, loss = tree_dsa_cp(q, k, v, None if self.skip_topk else iq, None if self.skip_topk else w,
                                       None if self.skip_topk else ik, psp.cp_plan, self.pg_collection.cp,
                                       topk=self.topk, softmax_scale=self.softmax_scale, selected=selected,
                                       loss_row_weight=rw, sparse_loss=sparse, head_group=head_group,
                                       kl_form=self.kl_form)
            own_ids = ids
            if at_own is not None:
                o, own_ids = o[at_own], ids[at_own]
        else:
            if selected is None:
                _, ids = tree_dsa_topk(iq.detach(), w.detach(), ik.detach(), layout, self.topk)
                if self.fault == "dsa_tie_order":  # planted bug: ties broken by the larger row id
                    ids = _larger_id_ties(iq.detach(), w.detach(), ik.detach(), layout, self.topk)
            else:
                ids = selected
            own_ids = ids if view is None else ids[view.own]
            o, _ = sparse_attention(own_q, k, v, own_ids, softmax_scale=self.softmax_scale)
            loss = None
            if use_loss:
                rw = self._loss_weight(psp, rows)
                if view is not None:  # carried rows' queries are their owners' (zero here)
                    rw = torch.zeros_like(rw).index_copy(0, view.own, rw[view.own])
                loss = tree_dsa_indexer_loss(iq, w, ik, q.detach(), k.detach(), layout, ids, rw,
                                             softmax_scale=self.softmax_scale,
                                             sparse_loss=sparse, head_group=head_group, kl_form=self.kl_form,
                                             fp32_grad_sum=self.fault != "dsa_bf16_grad_sum")
        if not self.skip_topk:
            holder[self.layer_number] = ids
        if _HOOKS:
            token = capture_token(psp)
            got_rows, got_ids = rows, ids
            if view is not None:  # its own queries, rows and selections as step-global rows (carry spans mbs)
                keys = torch.as_tensor(view.keys, device=ids.device)
                got_rows = keys[view.own.to(ids.device)]
                got_ids = torch.where(own_ids >= 0, keys[own_ids.clamp_min(0)], own_ids)
            elif layout.num_padding == layout.num_rows:  # a padding microbatch: no row of any sample (a carry step's
                got_rows = torch.full_like(rows, -1)  # tables are by step-global row, which its rows are not)
            for store in _HOOKS:
                store.append((token, capture_layer(self), got_rows.detach().cpu(), got_ids.detach().cpu()))
        out = o.reshape(n, 1, o.shape[1] * o.shape[2]).to(query.dtype)  # n may be 0: a CP rank owning nothing
        if s > n:  # CP padding rows: attend to nothing
            out = torch.cat([out, out.new_zeros(s - n, 1, out.shape[-1])])
        if loss is not None:
            mod = cdsa.dsa_module()
            mod.DSAIndexerLossLoggingHelper.save_loss_to_tracker(loss=loss, layer_number=self.layer_number,
                                                                 num_layers=self.config.num_layers)
            out = mod.DSAIndexerLossAutoScaler.apply(out, loss)
        return out


def _carry_full(view, N: Optional[int], layer: int, q, k, v, iq, w, ik, skip_topk: bool):
    """A carry microbatch's DSA tensors over its whole layout ([N, ...]): own rows from this forward,
    carried rows' K / V and index keys from the store (leaves whose gradient goes to their owner),
    zero queries and weights at carried rows (their queries are their owners'; their outputs and loss
    terms are dropped). Selection then runs on the layout as without carry, so a reader's top-k spans
    its carried rows exactly as the whole tree's does. ``N`` None (tree CP): over the rows the CP plan
    gives this rank instead (`cp.execution.carry.carry_cp_rows`: its own rows and the carried rows it
    holds), what `tree_dsa_cp` takes."""
    own, car, rows = view.own, view.carried, None
    if N is None:
        from ..cp.execution.carry import carry_cp_rows

        N, own, rows, car = carry_cp_rows(view)
        own, car = own.to(q.device), car.to(q.device)

    def full(x, carried=None):
        out = x.new_zeros((N,) + tuple(x.shape[1:])).index_copy(0, own, x)
        return out if carried is None else out.index_copy(0, car, carried.to(x.dtype))

    kv = view.carried_state(("dsa", layer), rows)  # None without carried rows (on this CP rank)
    ikc = None if skip_topk else view.carried_state(("dsa", layer, "index_k"), rows)
    kc, vc = kv if kv is not None else (None, None)
    q, k, v = full(q), full(k, kc), full(v, vc)
    if not skip_topk:
        iq, w, ik = full(iq), full(w), full(ik, None if ikc is None else ikc[0])
    return q, k, v, iq, w, ik


def _larger_id_ties(iq, w, ik, layout, topk):
    """The ``dsa_tie_order`` fault: top-k with ties broken by the *larger* row id (dense, test sizes)."""
    from ..ops.dsa import NO_ROW, dsa_index_scores

    n = layout.num_rows
    s = dsa_index_scores(iq, w, ik)
    r = torch.arange(n, device=s.device)
    vis = (r[None, :] <= r[:, None]) & (r[:, None] < layout.visible_until.to(s.device)[None, :])
    s = s.masked_fill(~vis, -math.inf)
    order = torch.sort(s.flip(-1), dim=-1, descending=True, stable=True).indices[:, :topk]
    ids = (n - 1 - order)
    top = s.gather(-1, ids)
    ids = ids.masked_fill(top == -math.inf, NO_ROW)
    if ids.shape[1] < topk:
        ids = torch.cat([ids, ids.new_full((n, topk - ids.shape[1]), NO_ROW)], 1)
    return ids


# ----------------------------------------------------------------------------------- spec
class DuplicatedLinear(torch.nn.Module):
    """The local spec's ``TELinear(parallel_mode="duplicated")`` (the indexer's projections without
    transformer-engine): y = x W^T (+ b), the same on every TP rank. Same checkpoint key as TE.

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


def get_tree_dsa_module_spec(config=None, *, use_transformer_engine: bool = False, qk_layernorm: bool = False,
                             normalization: Optional[str] = None, stock_core: Optional[type] = None):
    """MLA self-attention spec with DSA core attention, tree version: `TreeMLASelfAttention` with
    `TreeDSAttention` / `TreeDSAIndexer` (the stock ``get_dsa_module_spec_for_backend`` structure and
    parameter names). Local modules: Megatron's local MLA layer spec, the indexer's duplicated linears
    as `DuplicatedLinear` (TE: ``TELinear``), its ``k_norm`` the backend's LayerNorm.

    ``stock_core``: a stock ``DSAttention`` class to use as core attention instead, with stock
    ``DSAIndexer`` (verify's per-sample side passes `training.dsa_oracle.stock_oracle_class()`; stock
    ``MLASelfAttention`` is kept as `TreeMLASelfAttention`, which is stock on a chain)."""
    from megatron.core.models.gpt import gpt_layer_specs as gls
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAIndexerSubmodules,
        DSAttentionSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec

    from .mla import TreeMLASelfAttention

    if config is not None:
        qk_layernorm = qk_layernorm or config.qk_layernorm
        normalization = normalization or config.normalization
    if use_transformer_engine:
        base = gls.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm, multi_latent_attention=True)
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        backend = TESpecProvider()
        linear = backend.linear()
    else:
        base = gls.get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, multi_latent_attention=True,
                                            normalization=normalization)
        backend = gls.LocalSpecProvider()
        linear = DuplicatedLinear
    attn = base.submodules.self_attention
    indexer_sub = DSAIndexerSubmodules(linear_wq_b=linear, linear_wk=linear,
                                       k_norm=backend.layer_norm(rms_norm=False, for_qk=True),
                                       linear_weights_proj=linear)
    if stock_core is not None:
        from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexer as StockIndexer

        core = ModuleSpec(module=stock_core,
                          submodules=DSAttentionSubmodules(indexer=ModuleSpec(module=StockIndexer,
                                                                              submodules=indexer_sub)))
    else:
        core = ModuleSpec(module=TreeDSAttention,
                          submodules=DSAttentionSubmodules(indexer=ModuleSpec(module=TreeDSAIndexer,
                                                                              submodules=indexer_sub)))
    attn.module = TreeMLASelfAttention
    attn.params = dict(attn.params or {}, attn_mask_type=AttnMaskType.causal)
    attn.submodules.core_attention = core
    return attn
