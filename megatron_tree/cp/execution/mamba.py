"""Mamba-2 over a context-parallel group: `tree_mamba_cp`, a transpose from token shards to head shards.

Mamba's heads are independent recurrences, so instead of splitting a head's recurrence over ranks
(what Gated DeltaNet's state summaries do) each CP rank runs the whole tree for ``H / cp`` of this
TP rank's heads:

1. **token-local** (caller): ``in_proj`` on the rows a rank owns gives, per row, the channels
   ``[z | x (H*P) | B (G*S) | C (G*S) | dt (H)]``; ``z`` (the gate) never leaves its owner.
2. **forward transpose** (one ``all_to_all_single``): owner ``s`` sends rank ``j`` its rows'
   channels of ``j``'s heads: their ``x`` channels, their ``dt`` and the ``B`` / ``C`` groups they
   read. Rank ``j`` places the rows by global row id and holds every row of the tree, in global
   order, for its heads. When fewer groups than ranks exist (or a head shard straddles a group
   boundary) a group goes to every rank that reads it; the transpose of that replication is a sum,
   which autograd of the sender's channel gather performs (``index_select`` backward adds).
3. **local**: the tree causal conv over this rank's ``xBC`` channels (``x`` of its heads + its
   groups' ``B`` / ``C``: Mamba's depthwise conv runs on the concatenated channels, so the conv
   weight is sliced with exactly the same channel indices), SiLU, ``dt = softplus(dt + dt_bias)``,
   `tree_ssd` with the whole layout, the ``D`` skip. Everything here is exact per head: no state
   crosses a rank.
4. **inverse transpose** (one ``all_to_all_single``): every row's ``y`` of rank ``j``'s heads
   returns to the row's owner, which concatenates the head slices; gate and norm follow there.

Autograd: both moves are one small `torch.autograd.Function` each whose backward is the inverse
exchange, so backward runs exactly two collectives per layer, in the reverse order (the second
transpose's backward, then the first's), on every rank, also on ranks that own no rows: a rank
with nothing to send still enters each collective with zero-length splits, and a rank that owns no
rows still computes its heads over the whole tree.

Parameters: the caller passes this TP rank's *whole* conv weight / bias, ``dt_bias``, ``A`` and
``D``; each rank reads (and gives gradient to) only its heads' slice. Summing parameter gradients
over the CP group (Megatron reduces over DP x CP) gives the full gradient.

Plans where one rank owns every row need no exchange at all: that rank runs every head locally
and the others return empty outputs (still attached to the parameters' graph). This keeps
``verify``'s per-sample side (all rows on CP rank 0) free of cross-rank code.
"""
from __future__ import annotations

from collections import OrderedDict
from functools import lru_cache, partial

import numpy as np
import torch
import torch.nn.functional as F

from ...ops.causal_conv1d import tree_causal_conv1d
from ...ops.ssd import CHUNK_SIZE, tree_ssd
from ...tree.layout import TreeLayout
from ..planning.lru import lru_get
from ..planning.mamba_heads import MambaHeadShards, mamba_head_shards
from ..planning.plan import CPPlan
from .carry import carried_conv, carried_mamba_ssd, own_rank_of
from .comm import group_rank, start_exchange

__all__ = ["tree_mamba_cp"]

#: TEST-ONLY fault switch for the sensitivity tests (tests/test_cp_mamba.py). Always None in real
#: use. Each value plants one known executor bug the equivalence tests must catch:
#: "no_bc_grad_sum" (a B/C group replicated to several ranks gets only its first copy's gradient),
#: "y_wrong_rows" (y returns to its owners with the rows permuted), "param_slice" (every rank
#: reads rank 0's slice of dt_bias / A). Collectives still run.
_FAULT: str | None = None


# --------------------------------------------------------------------------------------- rows
# Plans are immutable and identified by their hash (`lru.lru_get` bounds these caches):
# every Mamba layer of a microbatch reuses one plan's row order and its device copies.
_ROWS_CACHE: OrderedDict = OrderedDict()
_DEV_CACHE: OrderedDict = OrderedDict()


def _row_order(plan: CPPlan, device) -> tuple:
    """(by_owner [N], to_global [N], counts [cp]) for ``plan``: ``by_owner`` lists global rows grouped
    by owner rank (ascending within: each rank's local order), so the concatenation of what ranks
    send is ``by_owner``; ``to_global`` is its inverse (``buf[to_global]`` is in global row order)."""
    def make():
        by_owner = np.argsort(plan.owner, kind="stable").astype(np.int64)
        to_global = np.empty_like(by_owner)
        to_global[by_owner] = np.arange(by_owner.shape[0], dtype=np.int64)
        return by_owner, to_global, plan.rows_per_rank()

    by_owner, to_global, counts = lru_get(_ROWS_CACHE, plan.hash, make)
    return (_on(by_owner, device, ("rows", plan.hash, 0)), _on(to_global, device, ("rows", plan.hash, 1)), counts)


@lru_cache(maxsize=64)
def _shard_index(H: int, P: int, G: int, S: int, cp: int, device: torch.device) -> tuple:
    """Per rank ``(channels, conv channels, head_group)`` of `mamba_head_shards` as int64 tensors on
    ``device`` (a handful of shapes per model: cached without eviction pressure from plans)."""
    sh = mamba_head_shards(H, P, G, S, cp)

    def dev(a):
        return torch.from_numpy(a).to(device)

    return tuple((dev(sh.channels[j]), dev(sh.channels[j][:sh.conv_width[j]]), dev(sh.head_group[j]))
                 for j in range(cp))


def _index(sh: MambaHeadShards, j: int, device) -> tuple:
    return _shard_index(sh.num_heads, sh.head_dim, sh.num_groups, sh.d_state, sh.cp_size, torch.device(device))[j]


def _on(a: np.ndarray, device, key) -> torch.Tensor:
    """The int64 numpy array ``a`` on ``device`` (cached: the same plan serves every Mamba layer)."""
    return lru_get(_DEV_CACHE, key + (str(device),), lambda: torch.from_numpy(a).to(device))


# --------------------------------------------------------------------------------------- exchange
class _Transpose(torch.autograd.Function):
    """``all_to_all_single`` of a flat buffer with element splits; backward is the inverse move."""

    @staticmethod
    def forward(ctx, send, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        return start_exchange(send, send_splits, recv_splits, group, async_op=False).wait()

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        back = start_exchange(grad.contiguous(), recv_splits, send_splits, ctx.group, async_op=False).wait()
        return back, None, None, None


def _transpose(send: torch.Tensor, send_splits, recv_splits, group) -> torch.Tensor:
    return _Transpose.apply(send, tuple(int(s) for s in send_splits), tuple(int(s) for s in recv_splits), group)


# --------------------------------------------------------------------------------------- local math
def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp32 like the mamba-ssm kernels (the stock layer's `.float()`), fp64 for a float64 model:
    # the same rule as TreeMambaMixer's single-device path, so CP and CP1 round alike.
    return torch.float64 if dtype == torch.float64 else torch.float32


def _head_shard_ssm(xBCdt, j, sh: MambaHeadShards, conv_weight, conv_bias, dt_bias, A, D, layout, backend,
                    chunk_size, slice_rank=None, carry=None):
    """Conv + SSD + D skip of rank ``j``'s heads over every row of ``layout``.

    xBCdt [N, F_j] (the channels ``sh.channels[j]``, rows in global order); conv_weight [H*P+2*G*S, W],
    conv_bias, dt_bias [H], A [H], D [H] / [H*P] / None: the TP rank's whole parameters, sliced
    here. Returns y [N, H/cp, P] in the conv output's dtype. ``carry``: ``(view, key)``, the rows are
    the view's own rows and the conv / SSD continue carried rows (`cp.execution.carry`).
    """
    if carry is not None:
        view, key = carry
        conv = partial(carried_conv, layout=layout, view=view, key=key)
        ssd = partial(carried_mamba_ssd, layout=layout, view=view, key=key, backend=backend, chunk_size=chunk_size)
    else:
        conv = partial(tree_causal_conv1d, layout=layout)
        ssd = partial(tree_ssd, layout=layout, backend=backend, chunk_size=chunk_size)
    N = xBCdt.shape[0]
    Hc, P, S = sh.heads_per_rank, sh.head_dim, sh.d_state
    cw = sh.conv_width[j]
    dev = xBCdt.device
    conv_idx = _index(sh, j, dev)[1]
    h0, h1 = sh.heads[slice_rank if slice_rank is not None else j]
    gl = sh.groups[j][1] - sh.groups[j][0]
    xBC = conv(xBCdt[:, :cw], conv_weight.index_select(0, conv_idx),
               None if conv_bias is None else conv_bias.index_select(0, conv_idx), activation="silu")
    x, B, C = torch.split(xBC, [Hc * P, gl * S, gl * S], dim=-1)
    x, B, C = x.reshape(N, Hc, P), B.reshape(N, gl, S), C.reshape(N, gl, S)
    if sh.expand[j]:  # the shard straddles a group boundary unevenly: one group per head
        hg = _index(sh, j, dev)[2]
        B, C = B.index_select(1, hg), C.index_select(1, hg)
    cdt = _compute_dtype(x.dtype)
    dt = F.softplus(xBCdt[:, cw:].to(cdt) + dt_bias[h0:h1].to(cdt))
    A_j = A[h0:h1]
    hj0, hj1 = sh.heads[j]
    if D is not None and D.shape[0] == sh.num_heads * P:  # D_has_hdim: added after the scan, like the module
        y = ssd(x, dt, A_j, B, C)
        y = (y.to(cdt) + x.to(cdt) * D[hj0 * P:hj1 * P].to(cdt).reshape(Hc, P)).to(x.dtype)
    else:
        y = ssd(x, dt, A_j, B, C, D=None if D is None else D[hj0:hj1])
    return y


def _check_args(xBCdt, conv_weight, conv_bias, dt_bias, A, D, layout, plan, sh, n_local, rank):
    if xBCdt.dim() != 2 or xBCdt.shape[1] != sh.row_width:
        raise ValueError(f"xBCdt must be [n_local, H*P + 2*G*S + H] = [n_local, {sh.row_width}] (H={sh.num_heads}, "
                         f"P={sh.head_dim}, G={sh.num_groups}, S={sh.d_state}); got {tuple(xBCdt.shape)}")
    if xBCdt.shape[0] != n_local:
        raise ValueError(f"rank {rank} owns {n_local} rows under plan {plan.hash}, but xBCdt has {xBCdt.shape[0]} "
                         "rows (they must be plan.owner_rows(rank), in order)")
    conv_dim = sh.row_width - sh.num_heads
    if conv_weight.dim() != 2 or conv_weight.shape[0] != conv_dim:
        raise ValueError(f"conv_weight must be [H*P + 2*G*S, W] = [{conv_dim}, W]; got {tuple(conv_weight.shape)}")
    if conv_bias is not None and conv_bias.shape != (conv_dim,):
        raise ValueError(f"conv_bias must be [{conv_dim}], got {tuple(conv_bias.shape)}")
    H = sh.num_heads
    if dt_bias.shape != (H,) or A.shape != (H,):
        raise ValueError(f"dt_bias and A must be [H] = [{H}]; got {tuple(dt_bias.shape)}, {tuple(A.shape)}")
    if D is not None and D.shape not in ((H,), (H * sh.head_dim,)):
        raise ValueError(f"D must be [H] = [{H}] or [H*P] = [{H * sh.head_dim}], got {tuple(D.shape)}")
    if layout.num_rows != plan.num_rows:
        raise ValueError(f"the CP plan covers {plan.num_rows} rows but the layout has {layout.num_rows}")


def tree_mamba_cp(xBCdt: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                  dt_bias: torch.Tensor, A: torch.Tensor, D: torch.Tensor | None, layout: TreeLayout, plan: CPPlan,
                  group=None, *, head_dim: int, num_groups: int, d_state: int, backend: str = "auto",
                  chunk_size: int = CHUNK_SIZE, carry=None, key=None) -> torch.Tensor:
    """Mamba-2's conv + SSD of this rank's owned rows over the CP ``group`` under ``plan`` (autograd).

    xBCdt [n_local, H*P + 2*G*S + H]: the ``in_proj`` output without ``z`` (channels
    ``[x | B | C | dt]``, ``dt`` before bias and softplus) of rows ``plan.owner_rows(rank)``, in
    that order (``rank`` = this process's rank in ``group``; None is the default group).
    conv_weight [H*P + 2*G*S, W], conv_bias [H*P + 2*G*S] or None, dt_bias [H], A [H] (negative),
    D [H] (per-head skip, inside `tree_ssd`) or [H*P] (per channel, added after it) or None: the
    whole parameters of this TP rank (``H`` heads, ``G`` groups); each rank uses its heads' slice.

    Returns y [n_local, H, P] in the conv output's dtype: rows ``owner_rows(rank)`` of the
    single-device ``tree_ssd(silu(tree_causal_conv1d(xBC)), softplus(dt + dt_bias), A, B, C) + D x``
    on the whole layout (computed in fp32, fp64 for fp64 inputs), before the gate and norm.

    ``carry`` / ``key`` (carry, `cp.execution.carry`): the microbatch's whole `CarryView` and the layer's
    store key. The rows are then this rank's own rows (``plan.owner_rows(rank)`` among ``carry.own``);
    each rank holds every own row of its heads, runs the carried conv and SSD there (its store holds its
    heads' state) and the transposes always run (every rank stores its heads, whoever owns the rows).

    Raises ValueError, before any collective and identically on every rank, when the CP size does
    not divide ``H`` (naming both) or shapes disagree. Every rank of the group must call this with
    the same plan and shapes apart from n_local, and must backpropagate through its output whenever
    any rank does (the backward runs two collectives), including ranks that own no rows.
    """
    if not isinstance(plan, CPPlan):
        raise TypeError(f"plan must be a CPPlan, got {type(plan).__name__}")
    rank = group_rank(plan, group, "tree_mamba_cp")
    cp = plan.cp_size
    if A.dim() != 1:
        raise ValueError(f"A must be [H] (one decay per head of this TP rank), got {tuple(A.shape)}")
    H = int(A.shape[0])
    sh = mamba_head_shards(H, head_dim, num_groups, d_state, cp)
    if carry is None:
        by_owner, to_global, counts = _row_order(plan, xBCdt.device)
        N = plan.num_rows
    else:  # the own rows only, in ``carry.own`` order (made once per microbatch view)
        if "mamba_rows" not in carry.memo:
            owner = own_rank_of(carry, plan)
            by = np.argsort(owner, kind="stable").astype(np.int64)
            to = np.empty_like(by)
            to[by] = np.arange(by.shape[0], dtype=np.int64)
            carry.memo["mamba_rows"] = (torch.from_numpy(by).to(xBCdt.device), torch.from_numpy(to).to(xBCdt.device),
                                        np.bincount(owner, minlength=cp).astype(np.int64))
        by_owner, to_global, counts = carry.memo["mamba_rows"]
        N = int(by_owner.shape[0])
    _check_args(xBCdt, conv_weight, conv_bias, dt_bias, A, D, layout, plan, sh, int(counts[rank]), rank)
    layout = layout.to(xBCdt.device) if layout.device != xBCdt.device else layout
    P = head_dim
    fault = _FAULT

    if carry is None and (cp == 1 or int(counts.max()) == N):
        # One rank owns every row: it runs all heads itself, nothing moves. The others return an
        # empty result that still reaches every parameter (their gradients exist, as zeros).
        if int(counts[rank]) == N:
            one = mamba_head_shards(H, head_dim, num_groups, d_state, 1)
            return _head_shard_ssm(xBCdt, 0, one, conv_weight, conv_bias, dt_bias, A, D, layout, backend,
                                   chunk_size).reshape(N, H, P)
        touch = xBCdt.sum() + conv_weight.sum() + dt_bias.sum() + A.sum()
        touch = touch + (0 if conv_bias is None else conv_bias.sum()) + (0 if D is None else D.sum())
        return xBCdt.new_zeros(0, H, P) + 0 * touch

    dev = xBCdt.device
    n = int(counts[rank])
    width = [int(c.shape[0]) for c in sh.channels]
    # forward transpose: my rows' channels of rank j's heads, grouped by destination, flat (widths
    # differ per destination when a shard straddles groups unevenly)
    blocks = []
    for j in range(cp):
        blk = xBCdt.index_select(1, _index(sh, j, dev)[0])
        if fault == "no_bc_grad_sum" and sh.groups[j][0] < (sh.groups[j - 1][1] if j else 0):
            # planted bug: the replicated B/C copy carries no gradient back
            bc = torch.zeros(width[j], dtype=torch.bool, device=dev)
            bc[sh.heads_per_rank * P: sh.conv_width[j]] = True
            blk = torch.where(bc, blk.detach(), blk)
        blocks.append(blk.reshape(-1))
    recv = _transpose(torch.cat(blocks), [n * w for w in width], [int(c) * width[rank] for c in counts], group)
    mine = recv.reshape(N, width[rank]).index_select(0, to_global)     # every row, global order

    slice_rank = 0 if fault == "param_slice" else None
    y = _head_shard_ssm(mine, rank, sh, conv_weight, conv_bias, dt_bias, A, D, layout, backend, chunk_size,
                        slice_rank, carry=None if carry is None else (carry, key))  # [N, H/cp, P]
    Hc = sh.heads_per_rank
    # inverse transpose: each owner's rows (in its local order) of my heads go back to it
    send_rows = by_owner.flip(0) if fault == "y_wrong_rows" else by_owner
    back = _transpose(y.reshape(N, Hc * P).index_select(0, send_rows).reshape(-1),
                      [int(c) * Hc * P for c in counts], [n * Hc * P] * cp, group)
    # [cp (head shard), n, Hc, P] -> [n, H, P]: head shards in rank order are heads in order
    return back.reshape(cp, n, Hc, P).permute(1, 0, 2, 3).reshape(n, H, P)
