"""Tree DeepSeek Sparse Attention (DSA) over a context-parallel group: `tree_dsa_cp`.

Same meaning as single-device ``ops.tree_dsa``; each rank holds the rows ``plan.owner_rows(rank)``
(ascending global rows) and keeps its queries, outputs and index queries. Per layer:

1. **Candidate stages** (not with IndexShare): the plan's dense-attention schedule
   (`schedule.build_schedule`, the same remote rows in the same waves) brings each wave's remote
   *index keys* (``index_k`` rows; plus the main ``key`` rows when the indexer loss is requested,
   which its attention distribution needs). The local stage scores the owned queries against the
   owned index keys, each wave stage against the fetched ones (``ops.tree_dsa_topk_partial`` with
   the global rows, so visibility and ids are canonical); every stage yields ``(score, id)``
   candidates merged into the query's global top-k with ``ops.merge_topk``. The merge orders by
   (score desc, canonical id asc) only, never by rank, stage or arrival, so the selected ids are the
   single-device ones bit for bit (given bit-equal scores: each score is the same dot products
   computed by the same op). Wave ``w + 1`` is fetched while wave ``w`` is scored.
2. **Winners' K/V**: the rows among the selected ids that other ranks own (their union ``U``,
   ascending) are requested from their owners in three all-to-alls (counts, ids, packed K|V). Only
   winners move, never more than the visible remote rows dense attention fetches: fewer when the
   indexer's choices concentrate (recent tokens, a shared prefix), as many when they spread over
   every visible remote row (random scores do; `tools/bench_cp_dsa.py` measures it). This fetch
   depends on the scores, so it follows the last stage instead of overlapping it. With IndexShare
   (``selected=`` given) nothing else moves: no stage fetch, no scoring; the given ids' K/V rows
   are fetched the same way. Alternative, ``kv_fetch="stages"``: the K|V of every stage row
   travels with the candidates in the waves (dense-sized, but overlapped with the scoring and
   without a data-dependent collective or host sync; with IndexShare the stages then move K|V only).
3. **One combined KV buffer** ``[owned rows ; U]`` (``"stages"``: ``[owned rows ; every fetched
   row]``, the waves' rows concatenated, which is ascending) and ONE ``ops.sparse_attention`` call
   with the selected ids remapped to buffer positions.
4. **Indexer loss** (``loss_row_weight`` given, no IndexShare): the two-pass partial functions of
   ``ops.dsa`` over the same stages (local + waves): pass 1 per stage, LSEs merged with
   ``logaddexp`` (the local stage first: a query always sees itself, so with the dense loss every
   merge has a finite side; a stage without any key of a query gives -inf there, whose NaN
   gradient the stats function drops), pass 2 summed. The value returned is this rank's share (its
   queries' terms): the sum over the CP ranks is the single-device loss, and backpropagating each
   rank's share gives the single-device gradients.

Autograd: the whole layer is ONE ``torch.autograd.Function`` with outputs ``(o, loss)``. Its
backward issues every collective itself in a fixed order (the winners' dK/dV return, then one
return per wave that moves rows, carrying the fetched rows' index-key gradients and, with
``"stages"``, their dK/dV), identical on every rank, whatever it owns, and
whichever of ``o`` / ``loss`` received a gradient (a missing one counts as zero). Fetched rows'
gradients go back to their owners by the reverse all-to-all and are ADDED there (``index_add``): a
row read by several ranks collects every contribution. Forward keeps each stage's graph (no
recomputation); the fetched blocks stay held until backward.

Every rank of the group must call with the same plan, ``topk``, and the same choice of IndexShare /
loss / ``sparse_loss`` / ``kv_fetch`` (those decide which collectives run), and must backpropagate
whenever any rank does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...ops.dsa import (NO_ROW, dsa_indexer_loss_partial_stats, dsa_indexer_loss_partial_terms, merge_topk,
                       sparse_attention, tree_dsa_topk_partial, upcast_for_accumulation)
from ..planning.plan import CPPlan
from ..planning.schedule import CPSchedule, build_schedule
from .comm import group_rank, received, start_exchange, start_fetch

__all__ = ["tree_dsa_cp"]

#: TEST-ONLY fault switch for the sensitivity tests (tests/test_cp_dsa.py); always None in real use.
#: "stage_order_ties": candidates are merged with ties broken by (stage, local index) instead of the
#: canonical id (a rank-dependent rule); "no_dkv_return": returned winners' dK / dV are not added
#: by their owners; "no_dik_return": returned index-key gradients are not added by their owners.
_FAULT: str | None = None


@dataclass(frozen=True, eq=False)
class _Cfg:
    sched: CPSchedule
    plan: CPPlan
    group: object
    rank: int
    topk: int
    scale: float
    score: bool  # compute index scores (no IndexShare)
    loss: bool  # compute the indexer loss
    sparse_loss: bool
    kv_stages: bool  # kv_fetch="stages": K|V of every stage row travels with the candidates
    head_group: object
    kl_form: str
    block_size: int
    build_graph: bool
    fault: str | None


def _pack(*ts: torch.Tensor) -> torch.Tensor:
    """Row blocks [n, ...] of one dtype -> one [n, F] block (explicit sizes: n may be 0)."""
    n = ts[0].shape[0]
    return torch.cat([t.reshape(n, math.prod(t.shape[1:])) for t in ts], 1)


def _stage_order_topk(parts, topk: int):
    """FAULT "stage_order_ties": merge stage candidates with ties broken by stage then local slot
    (what a careless implementation does), returned as canonical ids."""
    scores = torch.cat([p[0] for p in parts], -1)
    ids = torch.cat([p[1] for p in parts], -1)
    pseudo = torch.arange(ids.shape[-1], device=ids.device).expand_as(ids).clone()
    pseudo[ids == NO_ROW] = NO_ROW
    s, pid = merge_topk(scores, pseudo, scores[:, :0], pseudo[:, :0], topk)
    out = torch.where(pid == NO_ROW, NO_ROW, ids.gather(-1, pid.clamp_min(0)))
    return s, out


class _Winners:
    """The remote rows among the selected ids and the three-collective fetch of their K|V."""

    def __init__(self, ids: torch.Tensor, cfg: _Cfg, owned: torch.Tensor, owner: torch.Tensor):
        cp, dev = cfg.plan.cp_size, ids.device
        flat = ids[ids >= 0]
        rem = flat[owner[flat] != cfg.rank] if flat.numel() else flat
        self.rows = torch.unique(rem)  # U: sorted ascending, distinct
        src = owner[self.rows]
        self.recv_order = torch.argsort(src, stable=True)  # request / receive slots grouped by source
        self.sorted_from_recv = torch.empty_like(self.recv_order)
        self.sorted_from_recv[self.recv_order] = torch.arange(self.recv_order.numel(), device=dev)
        counts = torch.bincount(src, minlength=cp).to(torch.int64)
        self.recv_splits = counts.tolist()  # rows we receive from each rank
        # collective 1: how many rows each rank asks of us
        self.cp = cp
        got = _exchange(counts.view(cp, 1), [1] * cp, [1] * cp, cfg.group, cp)
        self.send_splits = got.view(-1).tolist()
        # collective 2: which rows (global ids, grouped by destination = requester)
        req = _exchange(self.rows[self.recv_order].view(-1, 1), self.recv_splits, self.send_splits, cfg.group,
                        cp).view(-1)
        self.send_local = torch.searchsorted(owned, req)
        if req.numel() and not bool((owned[self.send_local.clamp_max(max(owned.numel() - 1, 0))] == req).all()):
            raise RuntimeError(f"tree_dsa_cp: rank {cfg.rank} was asked for rows it does not own")
        self.group = cfg.group

    def fetch(self, pack: torch.Tensor) -> torch.Tensor:
        """Collective 3: the K|V rows of U, in U's (ascending) order."""
        got = _exchange(pack.index_select(0, self.send_local), self.send_splits, self.recv_splits, self.group,
                        self.cp)
        return got.index_select(0, self.sorted_from_recv)

    def give_back(self, dblock: torch.Tensor) -> torch.Tensor:
        """The reverse move: gradients of U's rows (U order) back to their owners; returns what we
        received for our own rows, aligned with ``send_local``."""
        return _exchange(dblock.index_select(0, self.recv_order), self.recv_splits, self.send_splits, self.group,
                         self.cp)


def _exchange(send: torch.Tensor, send_splits, recv_splits, cfg_or_group, cp: int) -> torch.Tensor:
    """Blocking all-to-all of row blocks; at CP size 1 nothing moves (no process group needed)."""
    if cp == 1:
        return send.clone()
    return start_exchange(send, send_splits, recv_splits, cfg_or_group).wait()


def _buffer_index(ids: torch.Tensor, owned: torch.Tensor, winners: torch.Tensor) -> torch.Tensor:
    """Canonical ids -> rows of the buffer ``[owned ; winners]`` (NO_ROW stays)."""
    n_local = owned.numel()
    valid = ids >= 0
    safe = ids.clamp_min(0)
    loc = torch.searchsorted(owned, safe)
    is_local = valid & (loc < n_local)
    if n_local:
        is_local &= owned[loc.clamp_max(n_local - 1)] == safe
    rem = torch.searchsorted(winners, safe) + n_local
    out = torch.where(is_local, loc, rem)
    return torch.where(valid, out, torch.full_like(out, NO_ROW))


class _DSACPFn(torch.autograd.Function):
    """(q, k, v, index_q, weights, index_k[, selected]) -> (o, loss, selected_ids) for the owned rows."""

    @staticmethod
    def forward(ctx, q, k, v, iq, w, ik, selected, row_weight, cfg: _Cfg):
        sched, nw = cfg.sched, cfg.sched.num_waves
        dev = q.device
        idx = sched.device_indices(dev)
        owned = idx["owned"]
        n = owned.numel()
        owner = torch.as_tensor(cfg.plan.owner, dtype=torch.int64, device=dev)
        hk, d, dv = k.shape[1], k.shape[2], v.shape[2]
        keep = cfg.build_graph

        # ---- 1. stages over the plan's waves: candidates (index keys; + main keys for the loss) and,
        # with kv_fetch="stages", the K|V of every stage row, in one buffer of their common dtype
        di = ik.shape[1] if cfg.score else 0
        kcols = hk * d if (cfg.loss or cfg.kv_stages) else 0  # main keys: after the index keys
        parts = ([ik] if cfg.score else []) + ([k] if kcols else []) + ([v] if cfg.kv_stages else [])
        blocks = []  # with the loss or stage K|V, per wave: the received [m, F] block (m may be 0)
        cands, ids = [], None
        if parts:
            pdt = parts[0].dtype
            for t in parts[1:]:
                pdt = torch.promote_types(pdt, t.dtype)
            pack = _pack(*[t.detach().to(pdt) for t in parts])
            fetch = start_fetch(cfg.sched, pack, 0, cfg.group) if nw else None
            if cfg.score:  # the local stage scores while wave 0 moves
                cands.append(tree_dsa_topk_partial(iq.detach(), w.detach(), ik.detach(), owned, owned,
                                                   idx["owned_visible_until"], cfg.topk, block_size=cfg.block_size))
                best = cands[0]
            for wv in range(nw):
                nxt = start_fetch(cfg.sched, pack, wv + 1, cfg.group) if wv + 1 < nw else None
                blk = received(cfg.sched, fetch, pack, wv)
                fetch = nxt
                if cfg.loss or cfg.kv_stages:  # reused by the loss / the attention buffer (held until backward)
                    blocks.append(blk)
                if blk.shape[0] == 0 or not cfg.score:
                    continue
                wi = idx["waves"][wv]
                c = tree_dsa_topk_partial(iq.detach(), w.detach(), blk[:, :di].to(ik.dtype), owned,
                                          wi["rows"], wi["visible_until"], cfg.topk, block_size=cfg.block_size)
                cands.append(c)
                best = merge_topk(best[0], best[1], c[0], c[1], cfg.topk)
        if cfg.score:
            ids = _stage_order_topk(cands, cfg.topk)[1] if cfg.fault == "stage_order_ties" else best[1]
        else:
            ids = selected.clone()

        # ---- 2. remote K / V: the winners' (three collectives, every rank), or every stage row's
        kv = _pack(k.detach(), v.detach())
        if cfg.kv_stages:
            win = None
            remote_kv = (torch.cat([b[:, di:] for b in blocks], 0) if blocks else kv.new_empty((0, pack.shape[1] - di)))
            remote_rows = torch.cat([wi["rows"] for wi in idx["waves"]], 0)  # the waves split the sorted needs
        else:
            win = _Winners(ids, cfg, owned, owner)
            remote_kv = win.fetch(kv)
            remote_rows = win.rows

        # ---- 3. one combined buffer, one sparse attention call
        buf = torch.cat([kv, remote_kv.to(kv.dtype)], 0)
        index = _buffer_index(ids, owned, remote_rows)
        qa = q.detach()
        if keep:
            qa, buf = qa.requires_grad_(True), buf.requires_grad_(True)
        with torch.set_grad_enabled(keep):
            m = buf.shape[0]
            kb, vb = buf[:, :hk * d].view(m, hk, d), buf[:, hk * d:].view(m, hk, dv)
            o, _ = sparse_attention(qa, kb, vb, index, softmax_scale=cfg.scale)

        # ---- 4. indexer loss over the same stages
        loss_graph = None
        loss = torch.zeros((), dtype=iq.dtype if iq is not None else q.dtype, device=dev)
        leaves = None
        if cfg.loss:
            # float32 leaves (bf16 / fp16 inputs): each input's gradient is a sum over pass 1 and pass 2
            # and over the stages, whose parts nearly cancel (d KL / d s = q - p); it is formed in
            # float32 and rounded once, on return
            liq, lw, lik = (upcast_for_accumulation(t.detach()) for t in (iq, w, ik))
            if keep:
                liq, lw, lik = (t.requires_grad_(True) for t in (liq, lw, lik))
            bleaves = []
            with torch.set_grad_enabled(keep):
                query, key = q.detach(), k.detach()
                sel = ids if cfg.sparse_loss else None
                stages = [(lik, key, owned, idx["owned_visible_until"])]
                for wv, blk in enumerate(blocks):
                    if blk.shape[0] == 0:
                        bleaves.append(None)
                        continue
                    bik = upcast_for_accumulation(blk[:, :di].detach())
                    if keep:
                        bik.requires_grad_(True)
                    bleaves.append(bik)
                    bkey = blk[:, di:di + kcols].reshape(blk.shape[0], hk, d).to(key.dtype)
                    wi = idx["waves"][wv]
                    stages.append((bik, bkey, wi["rows"], wi["visible_until"]))
                z = la = None
                for sik, skey, rows, vis in stages:  # pass 1, merged over the stages
                    zs, ls = dsa_indexer_loss_partial_stats(liq, lw, sik, query, skey, owned, rows, vis,
                                                            softmax_scale=cfg.scale, selected_ids=sel,
                                                            block_size=cfg.block_size)
                    z, la = (zs, ls) if z is None else (torch.logaddexp(z, zs), torch.logaddexp(la, ls))
                loss_graph = None
                for sik, skey, rows, vis in stages:  # pass 2, summed
                    t = dsa_indexer_loss_partial_terms(liq, lw, sik, query, skey, owned, rows, vis, z, la, row_weight,
                                                       softmax_scale=cfg.scale, selected_ids=sel,
                                                       head_group=cfg.head_group, kl_form=cfg.kl_form,
                                                       block_size=cfg.block_size)
                    loss_graph = t if loss_graph is None else loss_graph + t
            loss = loss_graph.detach().clone()
            leaves = (liq, lw, lik, bleaves)

        ctx.cfg = cfg
        ctx.graph = (qa, buf, o, loss_graph, leaves, win) if keep else None
        ctx.shapes = (n, hk, d, dv)
        ctx.dtypes = (q.dtype, k.dtype, v.dtype)
        ctx.index_dtypes = tuple(None if t is None else t.dtype for t in (iq, w, ik))
        ctx.mark_non_differentiable(ids)
        return o.detach(), loss, ids

    @staticmethod
    def backward(ctx, do, dloss, _dids):
        cfg = ctx.cfg
        if ctx.graph is None:
            raise RuntimeError("tree_dsa_cp: a second backward through the same call is not supported (its "
                               "stage graphs are freed by the first, retain_graph or not)")
        qa, buf, o, loss_graph, leaves, win = ctx.graph
        ctx.graph = None
        n, hk, d, dv = ctx.shapes
        idx = cfg.sched.device_indices(qa.device)

        # attention: winners' dK / dV go back first (one collective), then local dK / dV
        g = torch.zeros_like(o) if do is None else do.to(o.dtype)
        gq, gbuf = torch.autograd.grad(o, (qa, buf), g, allow_unused=True)
        gq = torch.zeros_like(qa) if gq is None else gq
        gbuf = torch.zeros_like(buf) if gbuf is None else gbuf
        # local dK | dV plus the winners' returned parts: summed in float32 (bf16 / fp16), rounded once
        dkv = upcast_for_accumulation(gbuf[:n]).clone()
        if win is not None:
            back = win.give_back(gbuf[n:].contiguous())
            if back.shape[0] and cfg.fault != "no_dkv_return":
                dkv.index_add_(0, win.send_local, back.to(dkv.dtype))

        giq = gw = gik = None
        wave_ik = [None] * cfg.sched.num_waves  # per wave: the fetched index keys' gradients [m, Di]
        if cfg.loss:
            liq, lw, lik, bleaves = leaves
            present = [b for b in bleaves if b is not None]
            gl = torch.zeros_like(loss_graph) if dloss is None else dloss.to(loss_graph.dtype)
            ins = [liq, lw, lik] + present
            grads = torch.autograd.grad(loss_graph, ins, gl, allow_unused=True)
            grads = [torch.zeros_like(t) if gr is None else gr for t, gr in zip(ins, grads)]
            giq, gw, gik = grads[0], grads[1], grads[2].clone()
            got = iter(grads[3:])
            di = lik.shape[1]
            for wv, b in enumerate(bleaves):
                wave_ik[wv] = next(got) if b is not None else gik.new_zeros((cfg.sched.waves[wv].rows.shape[0], di))
        if cfg.loss or cfg.kv_stages:
            # per wave, in wave order: the fetched rows' gradients ([dIk | dK dV] as fetched) go back
            # to their owners in one all-to-all and are added there
            off = n
            for wv in range(cfg.sched.num_waves):
                wave = cfg.sched.waves[wv]
                m = wave.rows.shape[0]
                if wave.global_rows == 0:
                    continue
                parts = ([wave_ik[wv]] if cfg.loss else []) + ([gbuf[off:off + m]] if cfg.kv_stages else [])
                off += m
                gdt = parts[0].dtype
                for t in parts[1:]:
                    gdt = torch.promote_types(gdt, t.dtype)
                send = torch.cat([t.to(gdt) for t in parts], 1).index_select(0, idx["waves"][wv]["recv_order"])
                ret = start_exchange(send.contiguous(), wave.recv_splits, wave.send_splits, cfg.group).wait()
                if not ret.shape[0]:
                    continue
                local = idx["waves"][wv]["send_local"]
                c = 0
                if cfg.loss:
                    c = gik.shape[1]
                    if cfg.fault != "no_dik_return":
                        gik.index_add_(0, local, ret[:, :c].to(gik.dtype))
                if cfg.kv_stages and cfg.fault != "no_dkv_return":
                    dkv.index_add_(0, local, ret[:, c:].to(dkv.dtype))
        dk = dkv[:, :hk * d].reshape(n, hk, d).to(ctx.dtypes[1])
        dv_ = dkv[:, hk * d:].reshape(n, hk, dv).to(ctx.dtypes[2])
        if giq is not None:  # the float32 sums of the indexer inputs' gradients, rounded once
            giq, gw, gik = (g.to(dt) for g, dt in zip((giq, gw, gik), ctx.index_dtypes))
        return (gq.to(ctx.dtypes[0]), dk, dv_, giq, gw, gik, None, None, None)


def tree_dsa_cp(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, index_q: torch.Tensor | None,
                weights: torch.Tensor | None, index_k: torch.Tensor | None, plan: CPPlan, group=None, *, topk: int,
                softmax_scale: float, selected: torch.Tensor | None = None,
                loss_row_weight: torch.Tensor | None = None, sparse_loss: bool = False, head_group=None,
                kl_form: str = "eps", block_size: int = 128, kv_fetch: str = "winners"):
    """DSA of this rank's owned rows over the CP ``group`` under ``plan`` (autograd).

    query [n,H,D], key [n,Hk,D], value [n,Hk,Dv], index_q [n,Hi,Di], weights [n,Hi], index_k [n,Di]:
    the rows ``plan.owner_rows(rank)`` in that order (ascending global rows), ``rank`` this
    process's rank in ``group`` (None: the default group). Returns ``(o [n,H,Dv], selected_ids
    [n,topk] int64, indexer_loss or None)``: rows ``owner_rows(rank)`` of single-device
    ``ops.tree_dsa`` on the whole layout; ids are canonical global rows (NO_ROW in empty slots).

    ``selected`` [n,topk] canonical ids = IndexShare: reused, no index scores, only their K / V rows
    move; the indexer inputs may be None and the loss is None. Otherwise ``loss_row_weight`` [n]
    (the owned rows' weights) requests the indexer loss: the returned scalar is THIS RANK's share
    (its queries' terms); summed over the CP ranks it is the single-device loss, and each rank's
    backward through its own share gives the single-device gradients of index_q, weights and
    index_k (fetched index keys' gradients are returned to their owners). query / key enter the
    loss as constants (stock detaches the indexer). ``sparse_loss``, ``head_group``, ``kl_form``:
    as in ``ops.tree_dsa``.

    ``kv_fetch``: "winners" (default) fetches only the remote selected rows' K|V after the top-k
    (three all-to-alls, a host sync for their counts, not overlapped; never more rows than the
    visible remote ones); "stages" lets the K|V of every visible remote row travel with the
    candidates in the plan's waves (dense attention's K/V traffic, overlapped with the scoring, no
    data-dependent collective or host sync), the buffer then holding all fetched rows.

    Every rank must make the same call (plan, topk, IndexShare or not, loss or not, sparse_loss)
    and backpropagate whenever any rank does (the backward runs collectives), also a rank owning
    no rows.
    """
    if not isinstance(plan, CPPlan):
        raise TypeError(f"plan must be a CPPlan, got {type(plan).__name__}")
    rank = group_rank(plan, group, "tree_dsa_cp")
    sched = build_schedule(plan, rank)
    n = sched.owned.shape[0]
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 3 or t.shape[0] != n:
            raise ValueError(f"rank {rank} owns {n} rows under plan {plan.hash}: {name} must be [{n},H,D] "
                             f"(the rows plan.owner_rows(rank), in order), got {tuple(t.shape)}")
    if key.shape[:2] != value.shape[:2] or query.shape[2] != key.shape[2]:
        raise ValueError(f"incompatible query {tuple(query.shape)} / key {tuple(key.shape)} / value {tuple(value.shape)}")
    if key.dtype != value.dtype:
        raise ValueError(f"key and value must share a dtype (they travel in one buffer); got {key.dtype}, {value.dtype}")
    if int(topk) < 1:
        raise ValueError(f"topk must be positive, got {topk}")
    if kv_fetch not in ("winners", "stages"):
        raise ValueError(f"kv_fetch must be 'winners' or 'stages', got {kv_fetch!r}")
    topk = int(topk)
    dev = query.device
    score = selected is None
    if score:
        if index_q is None or weights is None or index_k is None:
            raise ValueError("tree_dsa_cp: without `selected` (IndexShare) the indexer inputs are required")
        if index_q.shape[0] != n or weights.shape[0] != n or index_k.shape[0] != n:
            raise ValueError(f"index_q, weights, index_k must have the {n} owned rows of rank {rank}")
        sel = None
    else:
        sel = selected.to(dev).long()
        if sel.shape != (n, topk):
            raise ValueError(f"selected must be [n_local={n}, topk={topk}], got {tuple(sel.shape)}")
        if sel.numel() and (int(sel.max()) >= plan.num_rows or int(sel.min()) < NO_ROW):
            raise ValueError(f"selected ids must be canonical global rows [0, {plan.num_rows}) or NO_ROW")
    loss = score and loss_row_weight is not None
    if loss and loss_row_weight.shape != (n,):
        raise ValueError(f"loss_row_weight must be [n_local={n}], got {tuple(loss_row_weight.shape)}")
    ins = (query, key, value) + ((index_q, weights, index_k) if loss else ())
    build = torch.is_grad_enabled() and any(t.requires_grad for t in ins)
    cfg = _Cfg(sched=sched, plan=plan, group=group, rank=rank, topk=topk, scale=float(softmax_scale), score=score,
               loss=loss, sparse_loss=bool(sparse_loss), kv_stages=kv_fetch == "stages", head_group=head_group, kl_form=kl_form,
               block_size=int(block_size), build_graph=build, fault=_FAULT)
    rw = loss_row_weight.to(dev) if loss else None
    o, lval, ids = _DSACPFn.apply(query, key, value, index_q if score else None, weights if score else None,
                                  index_k if score else None, sel, rw, cfg)
    return o, ids, (lval if loss else None)

