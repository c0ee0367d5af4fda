"""Multi-token prediction (MTP) on trees: Megatron's ``MultiTokenPredictionBlock`` on the tree layout.

Per sample, stock MTP depth k at anchor position i combines the depth-(k-1) hidden state at i with
the embedding of token i+k, runs one transformer layer (causal over anchors 0..i, rotary position
i) and predicts token i+k+1 with the shared output head; the shifted inputs and labels are made by
rolling ``input_ids`` / labels / the loss mask left by one per depth (``roll_tensor``; per
``cu_seqlens`` segment when packed). On a tree "token i+k" is ambiguous at a fork, so a depth-k
position is indexed by the row ``l`` whose token it embeds (l = the anchor's k-th descendant on one
path):

* its input is the depth-(k-1) state at ``path_prev[l]`` (depth 0: the decoder's output) and the
  embedding of row ``l``'s own token (``input_ids`` are never rolled);
* it exists for rows of depth >= k; rows of depth < k stay in the sequence as isolated one-row
  segments (they attend only to themselves, feed nothing and reach no loss), so the row set, the
  TP/SP shapes and the CP ownership are the decoder's;
* it sees exactly the rows of depth >= k on its own path: `mtp_layout` cuts every path at depth k
  (rows of depth k become roots) and its ``position_ids`` are ``depth - k``, the anchor position
  stock's rotary table uses;
* it predicts what the main loss predicts from row ``l`` (each occurrence of the loss map whose
  source row has depth >= k), once per occurrence, weighted like the main loss (the loss map's
  weights are stock's loss mask), scaled like stock: ``mtp_loss_scaling_factor / mtp_num_layers``,
  attached to the main hidden states with stock's ``MTPLossAutoScaler`` (so the schedule's
  ``MTPLossAutoScaler.set_loss_scale`` applies), and, on Megatron-Core versions whose per-token MTP
  loss is multiplied by ``original_num_tokens / num_tokens`` (`compat.mtp
  .rescales_per_token_mtp_loss`), by that ratio of each occurrence's own sample (what stock computes
  for one sample per microbatch; under CP the per-sample sums are combined over the CP group), its
  ``num_tokens`` (the sample's weight sum over occurrences of depth >= k) clamped as stock clamps it
  (0.19: to at least 1, `compat.mtp.mtp_num_tokens_floor`; loss weights make it fractional).

DSA in the MTP layers: stock's depth k runs on all L anchors of a sample and its indexer loss covers
the k trailing ones (rolled-in token 0). The microbatch then carries each sample's MTP *tail rows*
(``pack(..., mtp_tail=K)``: K rows of token 0 after its last row, a chain, never shared); the
``path_prev`` gather feeds them like any row, `mtp_layout` isolates tail rows j > k, and `mtp_view`
weighs the indexer loss of depth k over rows of depth >= k and tail rows j <= k (`mtp_tail_rows` says
when a model needs them).

Parallelism: under sequence parallelism the ``path_prev`` gather all-gathers the hidden states over
TP, indexes and scatters them back (one all-gather per depth); under tree CP the parent row of an
owned row may live on another rank: a halo of one row per such edge, fetched with one all-to-all per
depth (`mtp_halo`, `megatron_tree.cp.execution.comm.fetch_rows`, whose backward adds the gradients back at the
owner), over the planner's ownership unchanged; each depth's attention runs on the plan with the
depth-k visibility (`dataclasses.replace` of the plan: same owners, new ``visible_until`` /
``position_ids``). MTP layers sit on the last pipeline stage, as stock places them.

Module classes keep stock's names: `TreeMultiTokenPredictionLayer` is a
``MultiTokenPredictionLayer`` (same parameters, so stock MTP checkpoints load) whose embeddings are
not rolled on a tree; `specs.get_tree_gpt_mtp_block_spec` (with the other spec builders) is the
tree counterpart of stock's ``get_gpt_mtp_block_spec`` (tree core attention inside the MTP layers).
`tree_mtp_postprocess` is what `TreeGPTModel` runs on the last stage.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MultiTokenPredictionLayer
from megatron.core.utils import make_viewless_tensor

from ..compat.mtp import mtp_num_tokens_floor, rescales_per_token_mtp_loss, save_mtp_metrics, tracks_acceptance
from ..cp.execution.comm import fetch_rows
from ..cp.planning.lru import lru_get
from ..tree.layout import TreeLayout
from .loss import vocab_parallel_logprobs
from .moe_balance import balancing_enabled
from .output_path import output_logits
from .packed_seq import TreePackedSeqParams

__all__ = ["TreeMultiTokenPredictionLayer", "mtp_layout", "mtp_view", "mtp_halo",
           "MTPHalo", "mtp_cp_figures", "tree_mtp_postprocess", "with_mtp_report",
           "logits_without_mtp", "mtp_tail_rows", "FAULTS"]

# Test-only fault switch (None in normal use), each a bug the stock oracle must catch:
#   "physical_roll"    depth-k input from the previous physical row (stock's roll) instead of path_prev
#   "shallow_visible"  a depth-k layer also sees the rows of depth < k on its path
#   "per_row_loss"     each source row's MTP loss counted once instead of once per occurrence
#   "no_tail"          the MTP tail rows left out of the depth-k layer (their indexer loss lost)
#   "carry_parent"     under carry, an own row whose parent is a carried row gets zeros, not its stored state
FAULTS = ("physical_roll", "shallow_visible", "per_row_loss", "no_tail", "carry_parent")
_FAULT = None


def _is_tree(psp) -> bool:
    return isinstance(psp, TreePackedSeqParams) and psp.layout is not None


# ------------------------------------------------------------------------------------ layouts
def mtp_layout(layout: TreeLayout, k: int, tail_index: Optional[torch.Tensor] = None) -> TreeLayout:
    """The layout MTP depth ``k`` attends over: the same rows, every root path cut at depth ``k``.

    Rows of depth >= k keep their segments (a row of depth k starts a new root segment), so a row
    sees exactly its ancestors of depth >= k; ``position_ids`` are ``depth - k`` (the anchor's
    position). Rows of depth < k (and padding) are one-row root segments: isolated. ``tail_index``
    [N] (`TreeMicrobatch.mtp_tail_stats`): MTP tail rows j > k are isolated too (stock's depth k has
    k trailing positions per sample). Host-side, vectorised; the result is on ``layout``'s device.
    """
    if k < 1:
        raise ValueError(f"MTP depth must be >= 1, got {k}")
    dev = layout.device
    cpu = layout if dev.type == "cpu" else layout.to("cpu")
    pos, prev = cpu.position_ids.numpy(), cpu.path_prev.numpy()
    n_real = cpu.num_real_rows
    if _FAULT == "shallow_visible":  # the stock visibility with the depth-k positions
        return dataclasses.replace(cpu, position_ids=torch.from_numpy(np.maximum(pos - k, 0))).to(dev)
    seg_start = np.zeros(n_real, bool)
    seg_start[cpu.segment_offsets.numpy()[:-1][cpu.segment_offsets.numpy()[:-1] < n_real]] = True
    root = pos[:n_real] <= k
    if tail_index is not None:  # a tail row past depth k: isolated (it follows its chain's rows, so a root)
        root |= tail_index.cpu().numpy()[:n_real] > k
    start = seg_start | root
    new_seg = np.cumsum(start) - 1
    first = np.nonzero(start)[0]
    lengths = np.bincount(new_seg, minlength=len(first)) if n_real else np.zeros(0, np.int64)
    parent = np.where(root[first], -1, new_seg[np.maximum(prev[first], 0)])
    pad_id = int(cpu.input_ids[n_real]) if layout.num_padding else 0
    out = TreeLayout.from_segments(lengths, parent, cpu.input_ids.numpy()[:n_real], num_padding=layout.num_padding,
                                   pad_id=pad_id)
    return out.to(dev)


def mtp_view(psp: TreePackedSeqParams, k: int) -> TreePackedSeqParams:
    """The packed-seq params MTP depth ``k``'s layer runs on: `mtp_layout` (and, under CP, the plan
    with the same owners and the depth-k visibility), no loss map, no GDN islands. Made once per
    microbatch view and depth (kept on ``psp``), so recomputation reuses it."""
    views = psp.__dict__.setdefault("_mtp_views", {})
    if k not in views:
        tail = None if _FAULT == "no_tail" else psp.mtp_tail_index
        layout = mtp_layout(psp.layout, k, tail)
        plan = psp.cp_plan
        if plan is not None:
            cpu = layout if layout.device.type == "cpu" else layout.to("cpu")
            plan = dataclasses.replace(plan, visible_until=cpu.visible_until.numpy().copy(),
                                       position_ids=cpu.position_ids.numpy().copy())
        carry = psp.carry
        if carry is not None:  # its layers' store keys apart from the decoder's; its own host work (cut layout)
            cp = carry.cp
            if cp is not None:  # under CP: the depth's plan (its visibility), the whole view scoped alike
                cp = dataclasses.replace(cp, plan=plan, whole=dataclasses.replace(cp.whole, scope=("mtp", k), memo={}))
            carry = dataclasses.replace(carry, scope=("mtp", k), memo={}, cp=cp)
        view = dataclasses.replace(psp, layout=layout, loss_map=None, cp_plan=plan, gdn_plan=None,
                                   gdn_local_rows=None, gdn_num_local_padding=0, in_island=False, attention_view=None,
                                   carry=carry, **_depth_weights(psp, k, tail))
        view.max_seqlen_q, view.max_seqlen_kv = psp.max_seqlen_q, psp.max_seqlen_kv
        view.__dict__["_capture_parent"] = psp  # debug captures file it under its microbatch's forward
        views[k] = view
    return views[k]


def _depth_weights(psp: TreePackedSeqParams, k: int, tail: Optional[torch.Tensor]) -> dict:
    """``row_samples`` / ``row_inv_length`` of MTP depth k (what weighs DSA's indexer loss per row): stock's
    depth-k positions of a sample are its rows of depth >= k and its first k tail rows (one per sample,
    ``1 / len(s)``); every other row (isolated) weighs 0."""
    if psp.row_inv_length is None:
        return {}
    depth = psp.layout.position_ids.to(psp.row_inv_length.device)
    real = depth >= k
    count, inv = psp.row_samples * real, psp.row_inv_length * real
    if tail is not None:
        mine = (tail > 0) & (tail <= k)
        count = torch.where(tail > 0, mine.to(count.dtype), count)
        inv = torch.where(tail > 0, psp.mtp_tail_inv_length * mine, inv)
    return {"row_samples": count, "row_inv_length": inv}


def mtp_tail_rows(config) -> int:
    """Tail rows per sample (``pack(..., mtp_tail=)``) the model's MTP layers need: ``mtp_num_layers`` where
    they run DeepSeek sparse attention with an indexer loss (stock's loss covers the k trailing positions
    of depth k, which embed a rolled-in token 0), or MoE with load balancing (stock's depth-k router counts
    those positions too: `moe_balance`), else 0. ``config``: a TransformerConfig or Megatron-LM's args."""
    K = int(getattr(config, "mtp_num_layers", None) or 0)
    dsa = getattr(config, "experimental_attention_variant", None) == "dsa"
    if dsa and (getattr(config, "dsa_indexer_loss_coeff", None) or 0) > 0:
        return K
    return K if balancing_enabled(config) else 0


def _path_prev(layout: TreeLayout) -> np.ndarray:
    cpu = layout if layout.device.type == "cpu" else layout.to("cpu")
    if _FAULT == "physical_roll":  # stock's roll: the previous physical row
        return np.arange(cpu.num_rows, dtype=np.int64) - 1
    return cpu.path_prev.numpy()


# ------------------------------------------------------------------------------------ CP halo
@dataclasses.dataclass(frozen=True)
class MTPHalo:
    """One rank's ``path_prev`` input of MTP depth k under tree CP.

    send_local   [n_send] local indices of owned rows other ranks need (grouped by destination rank)
    send_splits, recv_splits  [cp] rows sent to / received from each rank
    index        [n_local_total] row of ``cat(local rows, received rows, one zero row)`` that is the
                 input of each local row (the zero row for rows of depth < k and padding)
    """

    send_local: np.ndarray
    send_splits: tuple
    recv_splits: tuple
    index: np.ndarray


_HALOS: OrderedDict = OrderedDict()


def mtp_halo(plan, layout: TreeLayout, rank: int, k: int, num_padding: int = 0) -> MTPHalo:
    """`MTPHalo` of ``rank`` (cached per plan, rank, depth, padding, fault): every owned row of depth
    >= k reads its ``path_prev`` row; those owned elsewhere are fetched, once per (rank, row)."""
    return lru_get(_HALOS, (plan.hash, rank, k, num_padding, _FAULT),
                   lambda: _make_halo(plan, layout, rank, k, num_padding), 64)


def _halo_edges(plan, layout: TreeLayout, k: int, owner=None):
    """(dst rank, src row) of every cross-rank edge of depth k, unique, sorted by (dst, src). ``owner``
    [N] (default the plan's): the CP rank computing each row, -1 for a row no rank computes here (a
    carried row: it reaches its children from the carry store, not by a fetch)."""
    cpu = layout if layout.device.type == "cpu" else layout.to("cpu")
    pos, prev = cpu.position_ids.numpy(), _path_prev(cpu)
    owner = plan.owner.astype(np.int64) if owner is None else owner
    rows = np.nonzero((pos >= k) & (np.arange(cpu.num_rows) < cpu.num_real_rows) & (owner >= 0))[0]
    src = prev[rows]
    cross = (owner[src] >= 0) & (owner[src] != owner[rows])
    n = cpu.num_rows
    key = np.unique(owner[rows[cross]] * n + src[cross])
    return key // n, key % n


def _make_halo(plan, layout: TreeLayout, rank: int, k: int, num_padding: int, owner=None, mine=None,
               carried=None):
    """`MTPHalo` of ``rank`` under ``plan``. Carry (`megatron.carry`): ``owner`` [N] gives the rank computing
    each row (-1 for a carried row), ``mine`` this rank's rows, ``carried`` the carried rows (``plan``
    None without CP: one rank); the index then also points past the received rows at the carried
    parents, in the order of the returned positions in ``carried`` (their states come from the carry
    store). Returns the halo, or with ``carried`` ``(halo, positions)``."""
    cpu = layout if layout.device.type == "cpu" else layout.to("cpu")
    owner = plan.owner.astype(np.int64) if owner is None else owner
    cp_size = 1 if plan is None else plan.cp_size
    pos, prev = cpu.position_ids.numpy(), _path_prev(cpu)
    mine = plan.owner_rows(rank) if mine is None else mine
    dst, src = _halo_edges(plan, cpu, k, owner)
    send = owner[src] == rank  # (dst, src) sorted: grouped by destination, ascending row within
    send_local = np.searchsorted(mine, src[send])
    send_splits = np.bincount(dst[send], minlength=cp_size)
    recv = dst == rank
    r_src = src[recv]
    order = np.lexsort((r_src, owner[r_src]))  # grouped by source rank, ascending row within
    r_src = r_src[order]
    recv_splits = np.bincount(owner[r_src], minlength=cp_size)
    n_local = len(mine) + num_padding
    valid = (pos[mine] >= k) & (mine < cpu.num_real_rows)
    p = prev[mine[valid]]
    stored = owner[p] < 0  # a carried parent
    parents = np.unique(p[stored])
    index = np.full(n_local, n_local + len(r_src) + len(parents), np.int64)  # the zero row
    local = owner[p] == rank
    idx = np.empty(p.shape[0], np.int64)
    idx[local] = np.searchsorted(mine, p[local])
    remote = ~local & ~stored
    srt = np.argsort(r_src, kind="stable")  # r_src is grouped by owner: look rows up through a sorted copy
    idx[remote] = n_local + srt[np.searchsorted(r_src[srt], p[remote])]
    idx[stored] = n_local + len(r_src) + np.searchsorted(parents, p[stored])
    index[np.nonzero(valid)[0]] = idx
    halo = MTPHalo(send_local=send_local.astype(np.int64), send_splits=tuple(int(x) for x in send_splits),
                   recv_splits=tuple(int(x) for x in recv_splits), index=index)
    if carried is None:
        return halo
    at = np.searchsorted(carried, parents)
    if (at >= len(carried)).any() or (carried[np.minimum(at, len(carried) - 1)] != parents).any():
        raise RuntimeError("MTP under carry: an own row's parent is neither computed in the microbatch nor carried")
    return halo, at


def mtp_cp_figures(plan, layout: TreeLayout, num_layers: int, row_bytes: int) -> dict:
    """What MTP adds to CP traffic per microbatch: ``halo_rows`` [K] cross-rank parent rows per depth
    (summed over ranks), ``bytes`` forward + backward halo bytes of all depths (each row travels once
    forward and its gradient once back)."""
    rows = [int(_halo_edges(plan, layout, k)[0].size) for k in range(1, num_layers + 1)]
    return {"halo_rows": rows, "bytes": 2 * sum(rows) * int(row_bytes)}


# ------------------------------------------------------------------------------------ input shift
def _parent_states(hidden: torch.Tensor, psp: TreePackedSeqParams, k: int, config, pg) -> torch.Tensor:
    """[s(/tp), 1, h] -> the same shape: every row of depth >= k gets its ``path_prev`` row's state,
    every other row zeros."""
    sp = config.sequence_parallel and pg.tp.size() > 1
    if sp:  # backward: reduce-scatter of the (TP-identical) gradient slices
        hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False, group=pg.tp)
    layout = psp.layout
    if psp.carry is not None:
        out = _carry_parent_states(hidden, psp, k, pg)
    elif psp.is_context_parallel:
        halo = mtp_halo(psp.cp_plan, layout, psp.cp_rank, k, psp.num_local_padding)
        dev = hidden.device
        recv = fetch_rows(hidden, torch.from_numpy(halo.send_local).to(dev), halo.send_splits, halo.recv_splits,
                          pg.cp)
        buf = torch.cat([hidden, recv, hidden.new_zeros((1,) + tuple(hidden.shape[1:]))])
        out = buf.index_select(0, torch.from_numpy(halo.index).to(dev))
    else:
        cache = psp.__dict__.setdefault("_mtp_index", {})
        if (k, _FAULT) not in cache:
            cache[(k, _FAULT)] = _local_index(layout if layout.device.type == "cpu" else layout.to("cpu"), k)
        index = cache[(k, _FAULT)]
        buf = torch.cat([hidden, hidden.new_zeros((1,) + tuple(hidden.shape[1:]))])
        out = buf.index_select(0, index.to(hidden.device))
    if sp:
        out = scatter_to_sequence_parallel_region(out, group=pg.tp)
    return out


def _carry_parent_states(hidden: torch.Tensor, psp: TreePackedSeqParams, k: int, pg) -> torch.Tensor:
    """`_parent_states` of a carry microbatch (`megatron.carry`): ``hidden`` holds this rank's own rows
    (``view.own``, then any CP padding). A parent that another CP rank computes arrives by the halo
    fetch (`_make_halo` over the rows the microbatch computes); a carried parent (the first own row
    under the cut hangs off it) takes its depth-(k-1) state from the step's store: the owner's fill
    stores the state of its state rows (exactly the rows a later microbatch's own row hangs off; under
    CP every rank's, gathered) under key ``("mtp", k)``, its restore receives their gradient."""
    view = psp.carry
    (hidden,) = view.state(("mtp", k), [hidden], rows="state")
    memo = view.memo.setdefault("mtp_halo", {})
    cp = view.cp
    if k not in memo:
        whole = (view if cp is None else cp.whole).own.cpu().numpy()
        owner = np.full(psp.layout.num_rows, -1, np.int64)
        owner[whole] = 0 if cp is None else cp.plan.owner[whole]
        memo[k] = _make_halo(None if cp is None else cp.plan, psp.layout, 0 if cp is None else cp.rank, k,
                             psp.num_local_padding, owner=owner, mine=view.own.cpu().numpy(),
                             carried=view.carried.cpu().numpy())
    halo, at = memo[k]
    dev = hidden.device
    parts = [hidden]
    if cp is not None:
        parts.append(fetch_rows(hidden, torch.from_numpy(halo.send_local).to(dev), halo.send_splits,
                                halo.recv_splits, pg.cp))
    if len(at):
        (carried_h,) = view.carried_state(("mtp", k), at)
        if _FAULT == "carry_parent":
            carried_h = torch.zeros_like(carried_h)
        parts.append(carried_h.to(hidden.dtype))
    parts.append(hidden.new_zeros((1,) + tuple(hidden.shape[1:])))
    return torch.cat(parts).index_select(0, torch.from_numpy(halo.index).to(dev))


def _sample_sums(weights: torch.Tensor, sample_index: torch.Tensor, depth: torch.Tensor, num_layers: int):
    """``(ids, slot, [S, K+1] sums)`` of occurrences: per sample (``ids``; ``slot`` each occurrence's)
    the sum of the weights and, per depth k, of those of source depth >= k."""
    w = weights.to(torch.float64)
    ids, slot = torch.unique(sample_index, return_inverse=True)
    cols = [w] + [w * (depth >= k).to(w) for k in range(1, num_layers + 1)]
    sums = torch.zeros(len(ids), num_layers + 1, dtype=torch.float64, device=w.device)
    return ids, slot, sums.index_add_(0, slot, torch.stack(cols, 1))


def _carry_sample_sums(store, num_layers: int):
    """`_sample_sums` over the step (``store.microbatches``, every microbatch its occurrences live in):
    ``(ids, sums)``. Carry routes an occurrence to its source row's owner, so a sample's occurrences
    spread over microbatches and stock's per-sample ratio needs the step's sums (once per step)."""
    memo = store.__dict__.setdefault("_mtp_sample_sums", {})
    if num_layers not in memo:
        parts = [(mb.loss_map.weights.cpu(), mb.loss_map.sample_index.cpu(),
                  mb.layout.position_ids.cpu()[mb.loss_map.source_rows.cpu()])
                 for mb in store.microbatches if mb.loss_map is not None]
        w, index, depth = (torch.cat(p) for p in zip(*parts)) if parts else (torch.zeros(0, dtype=torch.int64),) * 3
        ids, _, sums = _sample_sums(w, index, depth, num_layers)
        memo[num_layers] = (ids, sums)
    return memo[num_layers]


def _local_index(layout: TreeLayout, k: int) -> torch.Tensor:
    pos, prev = layout.position_ids.numpy(), _path_prev(layout)
    valid = (pos >= k) & (np.arange(layout.num_rows) < layout.num_real_rows)
    return torch.from_numpy(np.where(valid, prev, layout.num_rows))


# ------------------------------------------------------------------------------------ module
class TreeMultiTokenPredictionLayer(MultiTokenPredictionLayer):
    """Stock ``MultiTokenPredictionLayer`` (same submodules and parameters); on a tree its
    embeddings are not rolled: the row a depth-k position is indexed by embeds its own token, and
    the caller (`tree_mtp_postprocess`) has already moved the depth-(k-1) states along ``path_prev``.
    Any other input takes the stock path."""

    def _get_embeddings(self, input_ids, position_ids, embedding, hidden_states, packed_seq_params=None, **kwargs):
        if not _is_tree(packed_seq_params):
            return super()._get_embeddings(input_ids=input_ids, position_ids=position_ids, embedding=embedding,
                                           hidden_states=hidden_states, packed_seq_params=packed_seq_params, **kwargs)
        decoder_input = embedding(input_ids=input_ids, position_ids=position_ids)
        if getattr(self.config, "mtp_detach_heads", False):
            decoder_input = decoder_input.detach()
        hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
        if not hidden_states.requires_grad:
            hidden_states.requires_grad_(True)
        if "padding_mask" in kwargs:  # megatron-core 0.19's signature
            return input_ids, position_ids, kwargs["padding_mask"], decoder_input, hidden_states
        return input_ids, position_ids, decoder_input, hidden_states


    def _checkpointed_forward(self, *args, **kwargs):
        """Full recomputation. megatron-core 0.16's version hands every keyword (``packed_seq_params``
        included) to ``tensor_parallel.checkpoint`` as a saved input, which takes tensors only; here the
        non-tensor ones ride in the closure, as 0.19's version (and ``TransformerBlock``) does."""
        if not (args and callable(args[0])):  # 0.19's signature: (hidden_states, decoder_input, ...)
            return super()._checkpointed_forward(*args, **kwargs)
        from megatron.core import tensor_parallel

        if self.config.fp8 or self.config.recompute_method != "uniform":
            return super()._checkpointed_forward(*args, **kwargs)
        forward_func = args[0]
        names = [k for k, v in kwargs.items() if v is None or torch.is_tensor(v)]
        fixed = {k: v for k, v in kwargs.items() if k not in names}

        def custom_forward(*tensors):
            return forward_func(**dict(zip(names, tensors)), **fixed)

        return tensor_parallel.checkpoint(custom_forward, self.config.distribute_saved_activations,
                                          *[kwargs[k] for k in names])


# ------------------------------------------------------------------------------------ loss
def _sample_ratios(lm, depth: torch.Tensor, num_layers: int, cp_group, step_sums=None) -> torch.Tensor:
    """[M, K] per occurrence: its sample's ``sum(w) / max(sum(w over occurrences of depth >= k), floor)``
    (stock's ``original_num_tokens / num_tokens`` for a microbatch of that sample alone, ``num_tokens``
    clamped as the installed stock clamps it: `compat.mtp.mtp_num_tokens_floor`, 1 on 0.19; 0 where the
    denominator is 0), over every CP rank. ``step_sums`` (carry: `_carry_sample_sums`) gives the sums
    over the step's microbatches instead of this one's."""
    ids, slot, sums = _sample_sums(lm.weights, lm.sample_index, depth, num_layers)
    dev = sums.device
    if step_sums is not None:
        uid, table = step_sums
        sums = table[torch.searchsorted(uid, ids.cpu())].to(dev)
    elif cp_group is not None and dist.get_world_size(cp_group) > 1:
        cp = dist.get_world_size(cp_group)
        size = torch.tensor([len(ids)], dtype=torch.int64, device=dev)
        sizes = [torch.zeros_like(size) for _ in range(cp)]
        dist.all_gather(sizes, size, group=cp_group)
        m = int(max(int(s) for s in sizes))
        pad_ids = torch.full((m,), -1, dtype=torch.int64, device=dev)
        pad_ids[: len(ids)] = ids
        pad_sums = torch.zeros(m, num_layers + 1, dtype=torch.float64, device=dev)
        pad_sums[: len(ids)] = sums
        all_ids = [torch.empty_like(pad_ids) for _ in range(cp)]
        all_sums = [torch.empty_like(pad_sums) for _ in range(cp)]
        dist.all_gather(all_ids, pad_ids, group=cp_group)
        dist.all_gather(all_sums, pad_sums, group=cp_group)
        g_ids, g_sums = torch.cat(all_ids), torch.cat(all_sums)
        keep = g_ids >= 0
        g_ids, g_sums = g_ids[keep], g_sums[keep]
        pos = torch.searchsorted(ids, g_ids).clamp(max=max(len(ids) - 1, 0))
        hit = (ids[pos] == g_ids) if len(ids) else torch.zeros_like(g_ids, dtype=torch.bool)
        sums = torch.zeros_like(sums).index_add_(0, pos[hit], g_sums[hit])
    num = sums[:, 1:].clamp(min=mtp_num_tokens_floor())
    ratio = torch.where(num > 0, sums[:, :1] / torch.where(num > 0, num, 1.0), 0.0)
    return ratio[slot]


def _head(model, hidden: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, counted: Optional[torch.Tensor]):
    """Shared output head on ``rows`` of [s(/tp), 1, h]: (log-probs of ``targets`` [m], correct, total)
    with the TP vocab shards never gathered (as `TreeLanguageModelMixin.tree_logprobs`). ``counted``
    [m] bool: the targets the acceptance counts cover (stock: ``loss_mask.bool()``, so a weight-0 target
    is not counted); None: no acceptance counts."""
    tp = model.pg_collection.tp
    if model.config.sequence_parallel:
        h = gather_from_sequence_parallel_region(hidden, group=tp)
    else:
        h = copy_to_tensor_model_parallel_region(hidden, group=tp)
    uniq, inverse = torch.unique(rows, return_inverse=True)
    weight = (model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights
              else model.output_layer.weight)
    if getattr(model.config, "mtp_detach_heads", False):
        weight = weight.detach()
    logits = output_logits(model, h[uniq, 0], weight)  # stock's output path (soft-cap, MuP scaling)
    v_local = weight.shape[0]
    group = tp if tp.size() > 1 else None
    logp = vocab_parallel_logprobs(logits, inverse, targets, vocab_start=tp.rank() * v_local, group=group)
    correct = total = None
    if counted is not None:
        with torch.no_grad():
            best, arg = logits.max(dim=-1) if logits.shape[0] else (logits.new_zeros(0), inverse.new_zeros(0))
            gid = arg + tp.rank() * v_local
            if group is not None:
                top = best.clone()
                dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
                gid = torch.where(best == top, gid, torch.full_like(gid, torch.iinfo(torch.int64).max))
                dist.all_reduce(gid, op=dist.ReduceOp.MIN, group=group)  # first rank, first id: stock's tie rule
            correct = ((gid[inverse] == targets) & counted).sum().float()
            total = counted.sum().float()
    return logp, correct, total


def tree_mtp_postprocess(model, hidden_states: torch.Tensor, psp: TreePackedSeqParams, *, input_ids, position_ids,
                         attention_mask=None) -> torch.Tensor:
    """Run ``model.mtp``'s layers on the tree and attach every depth's loss to ``hidden_states`` with
    stock's ``MTPLossAutoScaler`` (returned: feed it to the main head). Records, on ``psp``,
    ``mtp_loss_sums`` [K]: each depth's summed loss ``sum w * CE`` (unscaled, detached, this rank's
    occurrences) and ``mtp_num_tokens`` [K] (their weight sums); in training, the stock tracker gets
    each depth's mean (and acceptance counts where stock records them)."""
    from megatron.core.transformer.multi_token_prediction import get_mtp_layer_offset

    cfg = model.config
    K = int(cfg.mtp_num_layers)
    if get_mtp_layer_offset(cfg, getattr(model, "vp_stage", None)) != 0:
        raise ValueError("tree MTP needs every MTP layer on the last pipeline stage (no custom pipeline layout "
                         "that splits them)")
    if attention_mask is not None:
        raise ValueError("tree MTP takes no attention_mask: visibility comes from the tree layout")
    need = mtp_tail_rows(cfg)
    if need and int(getattr(cfg, "dsa_indexer_topk_freq", None) or 1) > 1:
        raise ValueError("tree MTP with DSA IndexShare (dsa_indexer_topk_freq > 1) is not supported: an MTP layer "
                         "would reuse a decoder layer's top-k, made over other rows (set dsa_indexer_topk_freq 1)")
    have = 0 if psp.mtp_tail_index is None else int(psp.mtp_tail_index.max())
    # a padding microbatch (no sample, so no tail rows: a DP rank with nothing left to score) needs none
    if psp.loss_map is not None and psp.loss_map.sample_index.numel() and have < need:
        why = ("run DeepSeek sparse attention, whose indexer loss covers" if getattr(
            cfg, "experimental_attention_variant", None) == "dsa" else "route with MoE load balancing, whose router "
            "statistics count")
        raise ValueError(f"tree MTP: the MTP layers {why} the {need} trailing positions stock's depth {need} adds "
                         f"after every sample, but the microbatch has {have} tail rows per sample: pack it with "
                         f"megatron_tree.tree.pack(..., mtp_tail={need}) (megatron_tree.megatron.mtp.mtp_tail_rows)")
    layers = model.mtp.layers
    repeated = bool(getattr(cfg, "mtp_use_repeated_layer", False))
    h = hidden_states.detach() if getattr(cfg, "mtp_detach_heads", False) else hidden_states
    outs = []
    for d in range(K):
        k = d + 1
        view = mtp_view(psp, k)
        h_in = _parent_states(h, psp, k, cfg, model.pg_collection)
        out = layers[0 if repeated else d](input_ids=input_ids, position_ids=position_ids, hidden_states=h_in,
                                          attention_mask=None, rotary_pos_emb=model.tree_rotary_pos_emb(view),
                                          packed_seq_params=view, embedding=model.embedding)
        h = out[0] if isinstance(out, tuple) else out
        outs.append(h)

    lm = psp.loss_map
    depth = psp.position_ids[lm.source_rows]
    cp_group = model.pg_collection.cp if psp.is_context_parallel else None
    carry = psp.carry
    step_sums = None if carry is None else _carry_sample_sums(carry.store, K)
    ratios = _sample_ratios(lm, depth, K, cp_group, step_sums) if rescales_per_token_mtp_loss() else None
    scale = cfg.mtp_loss_scaling_factor / K
    # a carry fill computes its rows' MTP state for later readers; its restore logs their losses
    logging = model.training and not (carry is not None and carry.phase == "fill")
    acceptance = logging and tracks_acceptance()
    sums, counts = [], []
    for k, h_k in enumerate(outs, 1):
        sel = torch.nonzero(depth >= k).squeeze(1)
        if _FAULT == "per_row_loss":  # one occurrence per source row
            rows = lm.source_rows[sel]
            first = torch.full((int(rows.max()) + 1 if rows.numel() else 1,), sel.numel(), dtype=torch.long,
                               device=rows.device).scatter_reduce(0, rows, torch.arange(sel.numel(), device=rows.device),
                                                                  reduce="amin")
            sel = sel[first[first < sel.numel()].sort().values]
        w = lm.weights[sel]
        counted = (w != 0) if acceptance else None  # stock counts loss_mask.bool()
        logp, correct, total = _head(model, h_k, lm.source_rows[sel], lm.targets[sel], counted)
        w = w.to(logp.dtype)
        loss = -logp * w
        s, n = loss.sum(), w.sum()
        sums.append(s.detach())
        counts.append(n.detach())
        if logging:
            save_mtp_metrics(_logged_loss(s.detach(), n, psp.step_weight_by_depth, k), correct, total, k - 1, K,
                             avg_group=_dp_cp_group())
        if ratios is not None:
            loss = loss * ratios[sel, k - 1].to(loss.dtype)
        hidden_states = MTPLossAutoScaler.apply(hidden_states, scale * loss)
    psp.__dict__["mtp_loss_sums"] = torch.stack(sums) if sums else None
    psp.__dict__["mtp_num_tokens"] = torch.stack(counts) if counts else None
    return hidden_states


def _dp_cp_group():
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group(with_context_parallel=True) \
        if parallel_state.model_parallel_is_initialized() else None


def _logged_loss(loss_sum: torch.Tensor, num: torch.Tensor, by_depth: Optional[torch.Tensor], k: int):
    """What one microbatch adds to stock's tracker for depth k. Megatron-LM logs ``mean over the R = DP x CP
    ranks of (sum over the rank's M microbatches) / M``; stock adds each microbatch's mean, which is the
    step's per-token mean only when every microbatch holds as many targets (a tree step's microbatches do
    not; padding ones hold none). With the step's target weights by source depth (``by_depth``, all ranks;
    W = their sum over depths >= k) it adds ``loss_sum * M * R / W``: the logged value is exactly
    ``sum of loss / W``, the step's per-token mean (W exact, as Megatron-LM's training step divides ``lm
    loss``: a step's weights may sum below 1; ``tiny`` only keeps W = 0 finite). Without them (a microbatch
    not from the data pipeline) it adds what stock adds, the microbatch's ``loss_sum / num``, ``num``
    clamped as stock clamps it (`compat.mtp.mtp_num_tokens_floor`: ``max(num, 1)`` on 0.19, exact on 0.16;
    0 where ``num`` is 0, as 0.19 logs, where 0.16 logs 0 / 0)."""
    if by_depth is None:
        num = num.clamp(min=mtp_num_tokens_floor())
        return torch.where(num > 0, loss_sum / torch.where(num > 0, num, 1.0), 0.0)
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    group = _dp_cp_group()
    ranks = dist.get_world_size(group) if group is not None else 1
    w = by_depth[k:].sum().to(loss_sum)
    return loss_sum * (get_num_microbatches() * ranks) / w.clamp(min=torch.finfo(w.dtype).tiny)


def with_mtp_report(loss_func, psp: TreePackedSeqParams, output):
    """``loss_func(output)`` with each MTP depth's ``[loss_sum, num_tokens]`` added to its report as
    ``"mtp_<k> loss"`` (from ``psp.mtp_loss_sums`` / ``mtp_num_tokens``, set by the forward): summed over
    microbatches and DP x CP like ``"lm loss"``, the per-token mean is stock's logged ``mtp_<k> loss``."""
    loss, num_tokens, report = loss_func(output)
    sums, counts = psp.__dict__.get("mtp_loss_sums"), psp.__dict__.get("mtp_num_tokens")
    if sums is not None:
        acc = report["lm loss"].dtype
        for k in range(sums.shape[0]):
            report[f"mtp_{k + 1} loss"] = torch.stack([sums[k].to(acc), counts[k].to(acc)])
    return loss, num_tokens, report


def logits_without_mtp(model, hidden_states: torch.Tensor, runtime_gather_output=None) -> torch.Tensor:
    """Logits ``[1, s, V/tp]`` of every row from the main head alone: a tree forward with no loss map
    (nothing for the MTP layers to predict; stock's ``_postprocess`` would need ``labels``)."""
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    logits, _ = model.output_layer(hidden_states, weight=weight, runtime_gather_output=runtime_gather_output)
    return logits.transpose(0, 1).contiguous()
