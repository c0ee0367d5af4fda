"""DeepSeek Sparse Attention (DSA) on a packed prefix forest, single device.

Per query row i, over the keys j it sees on the tree (``j <= i < visible_until[j]``, i.e. its root
path; see `ops.attention`)::

    index_score(i, j) = sum_h weights[i, h] * relu(<index_q[i, h], index_k[j]>)
    selected(i)       = the ``topk`` visible keys of highest score, ties broken by the smaller
                        canonical row id; fewer visible keys -> all of them, the remaining slots
                        hold NO_ROW (-1) with score -inf
    o(i)              = softmax attention of query i over selected(i) only

The canonical row id is the row's global index in the packed layout (under CP the global row, never
a local index). Along one sample's path canonical ids grow with the position, so "score desc, then
id asc" is per-sample "score desc, then position asc": the tie rule depends only on ids, never on
the rank, stage or block order in which candidates arrive (`merge_topk` is associative and
commutative).

Public API (token-major, no batch dimension; the tree is the batch):

* ``dsa_index_scores(index_q [Nq,Hi,Di], weights [Nq,Hi], index_k [Nk,Di]) -> [Nq,Nk]``: dense,
  unmasked scores (small inputs and test oracles only).
* ``merge_topk(scores_a, ids_a, scores_b, ids_b, topk) -> (scores, ids)``: best ``topk`` of the
  union by (score desc, id asc).
* ``tree_dsa_topk_partial(index_q, weights, index_k, q_rows, k_rows, k_visible_until, topk)``: one
  stage (queries against one subset of keys); merging the stages of a split of the keys with
  `merge_topk` gives exactly ``tree_dsa_topk`` (the whole forest).
* ``sparse_attention(q, k, v, index, softmax_scale=...) -> (o, lse)``: attention of each query over
  its own list of rows of a KV buffer.
* Indexer loss: ``dsa_indexer_loss_partial_stats`` / ``dsa_indexer_loss_partial_terms`` (staged) and
  ``tree_dsa_indexer_loss`` (one device).
* ``tree_dsa(...) -> (o, selected_ids, indexer_loss or None)``: the one-device composition.

Indexer loss (stock Megatron ``compute_dsa_indexer_loss``, per physical query row). With S_i the
visible keys of row i (dense loss) or selected(i) (``sparse_loss``), H the number of main heads (all
TP ranks together), a_h(i,j) = softmax_scale * <query[i,h], key[j,h']> and s(i,j) the index score::

    p_ij = sum_h exp(a_h(i,j) - L_ih) / H,   L_ih = logsumexp_{j in S_i} a_h(i,j)
    q_ij = exp(s(i,j) - Z_i),                Z_i  = logsumexp_{j in S_i} s(i,j)
    loss = sum_i row_weight[i] * sum_{j in S_i} p_ij * (log(p_ij + 1e-10) - log(q_ij + 1e-10))

This is megatron-core 0.16's term; core >= 0.19 writes it p_ij * (log(max(p_ij, 1e-10)) - log q_ij):
pass ``kl_form="log_softmax"`` there (`KL_FORMS`). Stock normalises the head-summed probabilities
by their sum, which is exactly H. On a tree, ``row_weight[i] = sum over the samples s through row i
of loss_coeff / len(s)``, so the tree loss equals the sum of the per-sample stock losses. The
gradient reaches index_q, weights and index_k only (query and key are constants, as stock detaches
the indexer from the main model).

**Staged (CP) use of the loss.** A caller holding only some key rows per stage computes, for its
queries, in two passes over its stages:

1. ``zi, la = dsa_indexer_loss_partial_stats(...)`` per stage (``zi`` [Nq] the index LSE over the
   stage's keys, differentiable; ``la`` [Nq,H] the per-head attention LSE, a constant); merge the
   stages with ``torch.logaddexp`` (a query that sees no key of a stage gets -inf there, which the
   merge ignores; the NaN gradient that logaddexp(-inf, -inf) sends back to such an entry is
   dropped). Sparse loss: pass ``selected_ids`` (canonical ids); each stage uses the selected ids
   that are among its ``k_rows``.
2. ``loss = sum over stages of dsa_indexer_loss_partial_terms(..., index_lse=Z, attn_lse=L, ...)``
   with the merged Z and L (and the queries' row weights). Each stage's term is differentiable in
   its index_q / weights / index_k and in Z, so autograd through the logaddexp merge of pass 1
   gives the exact gradient of the whole loss (dZ_i collects sum_j r_ij over all stages, with
   r = p q / (q + 1e-10), or r = p for the log-softmax form).

Both passes are blockwise: the relevant (query block, key block) tiles come from `ops.blocks`'s
closed form, and they are processed in bounded batches (never an Nq x Nk matrix beyond one batch).
Pass 1's backward recomputes each batch from the saved inputs; pass 2 (a scalar) computes its
gradients during forward and backward only scales them.

Exactness note: ties are decided on exactly equal scores. Scores of the same (query, key) pair
computed in batches of different shapes (e.g. one device vs CP stages) can differ in the last bit
(matmul blocking), which can only matter for pairs whose scores differ by a rounding error.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..tree.layout import TreeLayout
from .backend import select_backend
from .blocks import BIG_ROW, block_pairs

__all__ = [
    "NO_ROW",
    "dsa_index_scores",
    "merge_topk",
    "tree_dsa_topk_partial",
    "tree_dsa_topk",
    "sparse_attention",
    "dsa_indexer_loss_partial_stats",
    "dsa_indexer_loss_partial_terms",
    "tree_dsa_indexer_loss",
    "tree_dsa",
    "KL_FORMS",
    "DEFAULT_BLOCK_SIZE",
]

#: Empty top-k slot / unused index entry.
NO_ROW = -1
#: Rows per query / key block of the blockwise scans.
DEFAULT_BLOCK_SIZE = 128
#: Score elements (rows x heads x candidate keys) per batch: bounds the memory of every scan.
DEFAULT_BATCH_ELEMENTS = 1 << 21
DEFAULT_BATCH_ELEMENTS_CUDA = 1 << 26
#: stock's epsilon of the KL divergence
KL_EPS = 1e-10
#: The two forms of stock's KL term (``kl_form=``; the caller picks its Megatron-Core's):
#: "eps"         p * (log(p + 1e-10) - log(q + 1e-10))          megatron-core 0.16 (the pinned tier)
#: "log_softmax" p * (log(max(p, 1e-10)) - log_softmax(s))      megatron-core >= 0.19
KL_FORM_EPS, KL_FORM_LOG_SOFTMAX = "eps", "log_softmax"
KL_FORMS = (KL_FORM_EPS, KL_FORM_LOG_SOFTMAX)

# No GPU kernel is wired yet; "auto" resolves to the torch reference on every device.
_GPU_BACKENDS: dict[str, str] = {}


def _cdt(*ts) -> torch.dtype:
    """Compute dtype: float64 if any input is float64, else float32."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in ts) else torch.float32


def upcast_for_accumulation(t: torch.Tensor) -> torch.Tensor:
    """``t`` in its accumulation dtype (float64 stays, anything else float32); differentiable."""
    return t if t.dtype in (torch.float64, torch.float32) else t.float()


def _budget(t: torch.Tensor) -> int:
    return DEFAULT_BATCH_ELEMENTS_CUDA if t.is_cuda else DEFAULT_BATCH_ELEMENTS


# ====================================================================== scores
def _scores_grouped(iq: torch.Tensor, w: torch.Tensor, ik: torch.Tensor) -> torch.Tensor:
    """iq [G,R,Hi,Di], w [G,R,Hi], ik [G,C,Di] -> [G,R,C]: the R queries of a group share C keys."""
    g, r, hi, di = iq.shape
    c = ik.shape[1]
    u = torch.relu(torch.matmul(iq.reshape(g, r * hi, di), ik.transpose(1, 2)))  # [G,R*Hi,C]
    return torch.matmul(w.reshape(g * r, 1, hi), u.view(g * r, hi, c)).view(g, r, c)


def _attn_grouped(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """q [G,R,H,D], k [G,C,Hk,D] -> scaled logits [G,R,H,C] (query head h uses kv head h // (H/Hk))."""
    g, r, h, d = q.shape
    c, hk = k.shape[1], k.shape[2]
    grp = h // hk
    qh = q.reshape(g, r, hk, grp, d).permute(0, 2, 1, 3, 4).reshape(g, hk, r * grp, d)
    s = torch.matmul(qh, k.permute(0, 2, 3, 1)) * scale  # [G,Hk,R*grp,C]
    return s.view(g, hk, r, grp, c).permute(0, 2, 1, 3, 4).reshape(g, r, h, c)


def dsa_index_scores(index_q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor) -> torch.Tensor:
    """Dense lightning-indexer scores, no mask: index_q [Nq,Hi,Di], weights [Nq,Hi], index_k [Nk,Di]
    -> [Nq,Nk] with ``s[i,j] = sum_h weights[i,h] * relu(<index_q[i,h], index_k[j]>)``.

    float64 for float64 inputs, else float32; differentiable. Materialises Nq x Hi x Nk: for small
    inputs and oracles (the tree scans use the blockwise path)."""
    _check_index(index_q, weights, index_k)
    cdt = _cdt(index_q, weights, index_k)
    return _scores_grouped(index_q.to(cdt)[None], weights.to(cdt)[None], index_k.to(cdt)[None])[0]


def _check_index(index_q, weights, index_k):
    if index_q.dim() != 3 or weights.dim() != 2 or index_k.dim() != 2:
        raise ValueError(f"index_q must be [Nq,Hi,Di], weights [Nq,Hi], index_k [Nk,Di]; got "
                         f"{tuple(index_q.shape)}, {tuple(weights.shape)}, {tuple(index_k.shape)}")
    if weights.shape != index_q.shape[:2] or index_k.shape[1] != index_q.shape[2]:
        raise ValueError(f"inconsistent indexer shapes: index_q {tuple(index_q.shape)}, weights "
                         f"{tuple(weights.shape)}, index_k {tuple(index_k.shape)}")


# ====================================================================== top-k merge
def merge_topk(scores_a: torch.Tensor, ids_a: torch.Tensor, scores_b: torch.Tensor, ids_b: torch.Tensor,
               topk: int):
    """Best ``topk`` of the union of two candidate sets, per query.

    scores_x [..., Ka], ids_x [..., Ka] int64 (canonical ids; NO_ROW = empty, its score is ignored).
    Returns (scores [..., topk], ids [..., topk]) ordered by (score desc, id asc); empty slots are
    (-inf, NO_ROW). The order depends only on (score, id), so merging is associative and
    commutative: any split of the keys into stages, merged in any order, gives the same result.
    Candidate ids of one query must be distinct across the two sets. Not differentiable.
    """
    scores = torch.cat([scores_a, scores_b.to(scores_a.dtype)], -1)
    ids = torch.cat([ids_a.long(), ids_b.long()], -1)
    return _select_topk(scores, ids, topk)


_ID_BITS = 32  # canonical ids below 2**32 fit the packed key of `_select_topk_packed`


def _select_topk(scores: torch.Tensor, ids: torch.Tensor, topk: int):
    """(scores [..., C], ids [..., C]) -> the best ``topk`` by (score desc, id asc); see `merge_topk`."""
    empty = ids == NO_ROW
    width = scores.shape[-1]
    if scores.dtype != torch.float64 and width > 0 and (width <= topk or int(ids.max()) < (1 << _ID_BITS) - 1):
        s, i = _select_topk_packed(scores.float().masked_fill(empty, -math.inf), ids, min(topk, width))
        s = s.to(scores.dtype)
    else:
        s, i = _select_topk_sorted(scores.masked_fill(empty, -math.inf), ids, topk)
    if s.shape[-1] < topk:
        pad = topk - s.shape[-1]
        s = torch.cat([s, s.new_full((*s.shape[:-1], pad), -math.inf)], -1)
        i = torch.cat([i, i.new_full((*i.shape[:-1], pad), NO_ROW)], -1)
    return s, i.masked_fill(s == -math.inf, NO_ROW)


def _select_topk_sorted(scores, ids, topk):
    """Any float dtype: lexicographic (score desc, id asc) by two stable sorts (by id, then by
    score). Empty slots carry id NO_ROW = -1 and score -inf: they sort after every real candidate."""
    order = torch.sort(ids, dim=-1, stable=True).indices
    scores, ids = scores.gather(-1, order), ids.gather(-1, order)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :topk]
    return scores.gather(-1, order), ids.gather(-1, order)


def _select_topk_packed(scores, ids, topk):
    """float32 scores: one ``torch.topk`` over unique int64 keys packing (score, id).

    The high 32 bits are the score's bit pattern made order-preserving (negative floats have their
    magnitude bits flipped; -0.0 is first turned into +0.0 so that equal scores pack equally), the
    low 32 bits are ``2**32 - 1 - id`` (smaller id = larger key). Keys are unique, so the selection
    is exactly (score desc, id asc), independent of topk's internal tie handling.
    """
    key = _order_bits(scores).long().bitwise_left_shift_(_ID_BITS)
    key += ((1 << _ID_BITS) - 1) - ids.clamp_min(0)
    order = torch.topk(key, topk, dim=-1, largest=True, sorted=True).indices
    return scores.gather(-1, order), ids.gather(-1, order)


# ====================================================================== blockwise batches
@dataclass(frozen=True)
class _Batches:
    """Query x candidate-key batches of one scan (built once, reused by backward).

    Query arrays are padded to ``nq_pad`` rows (padding rows have row id -1: they see nothing), key
    arrays to ``nk_pad`` rows (padding rows: row BIG, visible_until -BIG: never seen); the last key
    block is all padding, the stand-in for "no tile". Each batch is (qidx [G,R], kidx [G,C]): G
    groups of R query positions sharing C candidate key positions (dense: one query block against
    its relevant key blocks; sparse: one query against its own selected keys).
    """

    q_rows: torch.Tensor  # [nq_pad]
    k_rows: torch.Tensor  # [nk_pad]
    k_vis: torch.Tensor  # [nk_pad]
    sel_pos: torch.Tensor | None  # sparse: [nq_pad, topk] key positions (pad position where unused)
    batches: tuple
    nq: int
    nk: int
    nq_pad: int
    nk_pad: int

    def mask(self, qidx: torch.Tensor, kidx: torch.Tensor) -> torch.Tensor:
        """[G,R,C] tree visibility of the batch (padding and unused slots are invisible)."""
        qr = self.q_rows[qidx].unsqueeze(-1)
        kr, kv = self.k_rows[kidx].unsqueeze(1), self.k_vis[kidx].unsqueeze(1)
        return (kr <= qr) & (qr < kv)


def _pad_rows(x: torch.Tensor, n: int, fill) -> torch.Tensor:
    if x.shape[0] == n:
        return x
    return torch.cat([x, x.new_full((n - x.shape[0], *x.shape[1:]), fill)])


def _dense_batches(q_rows, k_rows, k_vis, block: int, per_pair: int, budget: int) -> _Batches:
    """Blockwise plan: query block b against its relevant key blocks (closed form, `block_pairs`)."""
    dev = q_rows.device
    nq, nk = q_rows.shape[0], k_rows.shape[0]
    nbq, nbk = -(-nq // block), -(-nk // block)
    nq_pad, nk_pad = nbq * block, (nbk + 1) * block
    pairs = block_pairs(q_rows, k_rows, k_vis, block_q=block, block_k=block)
    max_tiles = max(1, budget // (block * block * max(1, per_pair)))
    batches = []
    if pairs.num_pairs:
        counts = torch.bincount(pairs.q_block, minlength=nbq).tolist()
        kb_all = pairs.k_block  # sorted by (q_block, k_block)
        ar = torch.arange(block, device=dev)
        # Python loop over query *blocks* (not rows): group consecutive blocks into batches of at
        # most max_tiles tiles (padded to the batch's widest block with the all-padding key block).
        cur_q, cur_k, width, start = [], [], 0, 0
        def flush():
            if cur_q:
                kbs = torch.full((len(cur_q), width), nbk, dtype=torch.long, device=dev)
                for i, kb in enumerate(cur_k):
                    kbs[i, :kb.shape[0]] = kb
                qb = torch.tensor(cur_q, dtype=torch.long, device=dev)
                batches.append(((qb[:, None] * block + ar).contiguous(),
                                (kbs[:, :, None] * block + ar).reshape(len(cur_q), width * block)))
        for qb, cnt in enumerate(counts):
            kb = kb_all[start:start + cnt]
            start += cnt
            if cnt == 0:
                continue
            if cnt > max_tiles:  # one block alone, in several batches
                flush()
                cur_q, cur_k, width = [], [], 0
                for a in range(0, cnt, max_tiles):
                    cur_q, cur_k, width = [qb], [kb[a:a + max_tiles]], min(max_tiles, cnt - a)
                    flush()
                cur_q, cur_k, width = [], [], 0
                continue
            if (len(cur_q) + 1) * max(width, cnt) > max_tiles:
                flush()
                cur_q, cur_k, width = [], [], 0
            cur_q.append(qb)
            cur_k.append(kb)
            width = max(width, cnt)
        flush()
    return _Batches(q_rows=_pad_rows(q_rows.long(), nq_pad, -1), k_rows=_pad_rows(k_rows.long(), nk_pad, BIG_ROW),
                    k_vis=_pad_rows(k_vis.long(), nk_pad, -BIG_ROW), sel_pos=None, batches=tuple(batches),
                    nq=nq, nk=nk, nq_pad=nq_pad, nk_pad=nk_pad)


def _sparse_batches(q_rows, k_rows, k_vis, selected_ids, per_pair: int, budget: int) -> _Batches:
    """Per-query plan over the selected ids that are among ``k_rows`` (sorted)."""
    dev = q_rows.device
    nq, nk = q_rows.shape[0], k_rows.shape[0]
    nk_pad = nk + 1  # one padding key: the stand-in for unused slots
    sel = selected_ids.to(dev).long()
    pos = torch.searchsorted(k_rows.long(), sel.clamp_min(0))
    hit = (sel >= 0) & (pos < nk)
    hit &= k_rows.long()[pos.clamp_max(max(nk - 1, 0))] == sel if nk else torch.zeros_like(hit)
    pos = torch.where(hit, pos, torch.full_like(pos, nk))
    topk = sel.shape[1]
    rows_per_batch = max(1, budget // max(1, topk * per_pair))
    ar = torch.arange(nq, device=dev)
    batches = tuple((ar[a:a + rows_per_batch, None], pos[a:a + rows_per_batch]) for a in range(0, nq, rows_per_batch))
    return _Batches(q_rows=q_rows.long(), k_rows=_pad_rows(k_rows.long(), nk_pad, BIG_ROW),
                    k_vis=_pad_rows(k_vis.long(), nk_pad, -BIG_ROW), sel_pos=pos, batches=batches,
                    nq=nq, nk=nk, nq_pad=nq, nk_pad=nk_pad)


def _check_rows(q_rows, k_rows, k_visible_until, nq, nk):
    if q_rows.shape != (nq,) or k_rows.shape != (nk,) or k_visible_until.shape != (nk,):
        raise ValueError(f"q_rows must be [{nq}], k_rows and k_visible_until [{nk}]; got {tuple(q_rows.shape)}, "
                         f"{tuple(k_rows.shape)}, {tuple(k_visible_until.shape)}")
    for name, r in (("q_rows", q_rows), ("k_rows", k_rows)):
        if r.shape[0] > 1 and bool((r[1:] <= r[:-1]).any()):
            raise ValueError(f"{name} must be strictly ascending global rows (canonical ids)")


# ====================================================================== top-k
@torch.no_grad()
def tree_dsa_topk_partial(index_q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor, q_rows: torch.Tensor,
                          k_rows: torch.Tensor, k_visible_until: torch.Tensor, topk: int, *,
                          block_size: int = DEFAULT_BLOCK_SIZE):
    """Top-k of queries against one subset of keys (one stage of a staged computation).

    index_q [Nq,Hi,Di], weights [Nq,Hi] of the queries at global rows ``q_rows`` [Nq] (ascending);
    index_k [Nk,Di] of the keys at global rows ``k_rows`` [Nk] (ascending) with their
    ``k_visible_until`` [Nk]. Returns (scores [Nq,topk], ids [Nq,topk] int64): the query's best
    visible keys of this subset by (score desc, canonical id asc), ids being values of ``k_rows``;
    empty slots (-inf, NO_ROW). For any split of the keys into subsets, `merge_topk` of the
    partial results equals the result over the union. Blockwise with a running merge per query
    block: memory O(Nq*topk + one batch). Not differentiable.
    """
    _check_index(index_q, weights, index_k)
    nq, nk = index_q.shape[0], index_k.shape[0]
    dev = index_q.device
    q_rows, k_rows, k_visible_until = q_rows.to(dev).long(), k_rows.to(dev).long(), k_visible_until.to(dev).long()
    _check_rows(q_rows, k_rows, k_visible_until, nq, nk)
    if topk <= 0:
        raise ValueError(f"topk must be positive, got {topk}")
    cdt = _cdt(index_q, weights, index_k)
    plan = _dense_batches(q_rows, k_rows, k_visible_until, int(block_size), index_q.shape[1], _budget(index_q))
    iq = _pad_rows(index_q.to(cdt), plan.nq_pad, 0)
    w = _pad_rows(weights.to(cdt), plan.nq_pad, 0)
    ik = _pad_rows(index_k.to(cdt), plan.nk_pad, 0)
    best_s = iq.new_full((plan.nq_pad, topk), -math.inf)
    best_i = torch.full((plan.nq_pad, topk), NO_ROW, dtype=torch.long, device=dev)
    for qidx, kidx in plan.batches:
        vis = plan.mask(qidx, kidx)
        s = _scores_grouped(iq[qidx], w[qidx], ik[kidx]).masked_fill_(~vis, -math.inf)
        # The batch's own best: its candidate keys are in ascending row order along C (sorted keys,
        # ascending key blocks), so (score desc, position asc) is (score desc, id asc). Only these
        # k survivors meet the running state: the merge stays 2k wide.
        bs, pos = _best_by_position(s, min(topk, s.shape[-1]))
        bi = torch.gather(plan.k_rows[kidx].unsqueeze(1).expand(s.shape), -1, pos)
        ms, mi = merge_topk(best_s[qidx], best_i[qidx], bs, bi.masked_fill_(bs == -math.inf, NO_ROW), topk)
        best_s[qidx], best_i[qidx] = ms, mi
    return best_s[:nq], best_i[:nq]


def _best_by_position(s: torch.Tensor, k: int):
    """s [..., C] -> (values, positions) [..., k] of the k best by (score desc, position asc)."""
    if s.dtype == torch.float64:
        pos = torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :k]
    else:  # packed (score, position) keys as in `_select_topk_packed`; the position part broadcasts
        key = _order_bits(s.float()).long().bitwise_left_shift_(_ID_BITS)
        key += ((1 << _ID_BITS) - 1) - torch.arange(s.shape[-1], device=s.device)
        pos = torch.topk(key, k, dim=-1, largest=True, sorted=True).indices
    return s.gather(-1, pos), pos


def _order_bits(x: torch.Tensor) -> torch.Tensor:
    """float32 -> int32 with the same order (-0.0 and +0.0 equal): negative floats get their
    magnitude bits flipped."""
    b = (x + 0.0).view(torch.int32)  # + 0.0 maps -0.0 to +0.0
    return b ^ ((b >> 31) & 0x7FFFFFFF)


def tree_dsa_topk(index_q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor, layout: TreeLayout,
                  topk: int, *, block_size: int = DEFAULT_BLOCK_SIZE):
    """Top-k visible keys of every row of the forest: (scores [N,topk], ids [N,topk]) with ids the
    canonical rows (see `tree_dsa_topk_partial`; index_q [N,Hi,Di], weights [N,Hi], index_k [N,Di])."""
    n = layout.num_rows
    if index_q.shape[0] != n or index_k.shape[0] != n:
        raise ValueError(f"index_q and index_k must have layout.num_rows={n} rows")
    rows = torch.arange(n, device=index_q.device)
    return tree_dsa_topk_partial(index_q, weights, index_k, rows, rows, layout.visible_until.to(index_q.device),
                                 topk, block_size=block_size)


# ====================================================================== sparse attention
# Head-major layout: k, v as [Hk, M, D] (one contiguous copy), q as [Hk, Nq, G, D] (G = H // Hk query
# heads per kv head). Per batch of B queries, one of two exact formulations:
# * union: the batch's distinct selected rows U are gathered once, [Hk, U, D], and the batch runs
#   as dense matmuls [B*G, D] x [D, U] under a [B, U] selection mask. Neighbouring rows of a tree
#   select largely the same keys (a shared prompt), so U is small and the work is GEMM, not GEMV;
# * per query: each query's own T rows are gathered, [Hk, B, T, D], one batched mat-vec per query;
#   used when the union is wide (U > UNION_MAX_FACTOR * T: little sharing).
# Both compute the softmax over exactly the selected rows; dK/dV are accumulated with index_add.
UNION_MAX_FACTOR = 4


class _SparseBatch:
    """One query batch of sparse attention: its gathered keys and the selection mask."""

    def __init__(self, idx: torch.Tensor, invalid: torch.Tensor, t: int):
        # idx [B,T] rows (clamped), invalid [B,T] unused slots
        uniq, inv = torch.unique(idx, return_inverse=True)
        self.union = uniq.shape[0] <= UNION_MAX_FACTOR * t
        if self.union:
            b, u = idx.shape[0], uniq.shape[0]
            sel = torch.zeros(b, u + 1, dtype=torch.bool, device=idx.device)
            sel.scatter_(1, torch.where(invalid, u, inv), True)  # unused slots land in a spare column
            self.rows, self.masked = uniq, ~sel[:, :u]  # [U], [B,U]
        else:
            self.rows, self.masked = idx, invalid  # [B,T], [B,T]

    def logits(self, qb: torch.Tensor, kh: torch.Tensor):
        """qb [Hk,B,G,D] (scaled) -> (kg, s): s [Hk,B,G,C] masked to -inf outside the selection."""
        kg = kh[:, self.rows]
        if self.union:  # kg [Hk,U,D]
            hk, b, g, d = qb.shape
            s = torch.matmul(qb.reshape(hk, b * g, d), kg.transpose(-1, -2)).view(hk, b, g, -1)
        else:  # kg [Hk,B,T,D]
            s = torch.matmul(qb, kg.transpose(-1, -2))
        return kg, s.masked_fill_(self.masked[None, :, None, :], -math.inf)

    def pv(self, p: torch.Tensor, vg: torch.Tensor) -> torch.Tensor:
        """p [Hk,B,G,C] x values -> [Hk,B,G,Dv]."""
        if self.union:
            hk, b, g, c = p.shape
            return torch.matmul(p.reshape(hk, b * g, c), vg).view(hk, b, g, -1)
        return torch.matmul(p, vg)

    def key_grads(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """sum over the queries (and their G heads) of x^T y: x [Hk,B,G,C], y [Hk,B,G,D] ->
        [Hk, C (union) or B*T (per query), D], rows matching `self.rows` flattened."""
        hk, b, g, c = x.shape
        if self.union:
            return torch.matmul(x.reshape(hk, b * g, c).transpose(-1, -2), y.reshape(hk, b * g, -1))
        return torch.matmul(x.transpose(-1, -2), y).reshape(hk, b * c, -1)


class _SparseAttentionFn(torch.autograd.Function):
    """(q, k, v) -> (o, lse) over per-query row lists; saves q, k, v, o, lse and the index only."""

    @staticmethod
    def forward(ctx, q, k, v, index, scale: float, rows_per_batch: int):
        ctx.set_materialize_grads(False)
        cdt = _cdt(q, k, v)
        nq, h, d = q.shape
        hk, dv = k.shape[1], v.shape[2]
        grp = h // hk
        qh = (q.to(cdt) * scale).view(nq, hk, grp, d).transpose(0, 1)  # [Hk,Nq,G,D]
        kh, vh = k.to(cdt).transpose(0, 1).contiguous(), v.to(cdt).transpose(0, 1).contiguous()
        oh = qh.new_zeros(hk, nq, grp, dv)
        lse = qh.new_full((hk, nq, grp), -math.inf)
        invalid = index < 0
        idx = index.clamp_min(0)
        t = index.shape[1]
        for a in range(0, nq if t else 0, rows_per_batch):
            sl = slice(a, a + rows_per_batch)
            bt = _SparseBatch(idx[sl], invalid[sl], t)
            _, s = bt.logits(qh[:, sl], kh)
            m = torch.logsumexp(s, -1)  # -inf for a query without any valid slot
            s.sub_(_finite_or(m, 0.0).unsqueeze(-1)).exp_()
            oh[:, sl] = bt.pv(s, vh[:, bt.rows])
            lse[:, sl] = m
        o = oh.transpose(0, 1).reshape(nq, h, dv)
        lse = lse.transpose(0, 1).reshape(nq, h)
        ctx.save_for_backward(q, k, v, index, o, lse)
        ctx.scale, ctx.rows_per_batch = scale, rows_per_batch
        return o.to(q.dtype), lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, index, o, lse = ctx.saved_tensors
        if do is None and dlse is None:
            return None, None, None, None, None, None
        scale, rpb = ctx.scale, ctx.rows_per_batch
        cdt = o.dtype
        nq, h, d = q.shape
        hk, dv = k.shape[1], v.shape[2]
        grp = h // hk
        do = o.new_zeros(o.shape) if do is None else do.to(cdt)
        # dS = P * (dP - rowsum(dO * O) + dlse): the lse cotangent shifts delta.
        delta = (do * o).sum(-1)
        if dlse is not None:
            delta = delta - dlse.to(cdt)
        qh = (q.to(cdt) * scale).view(nq, hk, grp, d).transpose(0, 1)
        kh, vh = k.to(cdt).transpose(0, 1).contiguous(), v.to(cdt).transpose(0, 1).contiguous()
        doh = do.view(nq, hk, grp, dv).transpose(0, 1)
        delta_h = delta.view(nq, hk, grp).transpose(0, 1).unsqueeze(-1)
        neg_lse = torch.where(lse == -math.inf, -math.inf, -lse).view(nq, hk, grp).transpose(0, 1).unsqueeze(-1)
        dqh = qh.new_zeros(hk, nq, grp, d)
        dkh, dvh = torch.zeros_like(kh), torch.zeros_like(vh)
        invalid = index < 0
        idx = index.clamp_min(0)
        t = index.shape[1]
        for a in range(0, nq if t else 0, rpb):
            sl = slice(a, a + rpb)
            bt = _SparseBatch(idx[sl], invalid[sl], t)
            kg, s = bt.logits(qh[:, sl], kh)
            vg = vh[:, bt.rows]
            p = s.add_(neg_lse[:, sl]).exp_()  # probabilities; 0 in unselected slots and empty rows
            # dP = dO V^T, as the transpose of the value product
            dp = bt.pv(doh[:, sl], vg.transpose(-1, -2))
            ds = dp.sub_(delta_h[:, sl]).mul_(p)
            dqh[:, sl] = bt.pv(ds, kg)
            flat = bt.rows.reshape(-1)
            # unselected entries have p = ds = 0: they add exact zeros (unused slots point at row 0)
            _accumulate_rows(dkh, flat, bt.key_grads(ds, qh[:, sl]))
            _accumulate_rows(dvh, flat, bt.key_grads(p, doh[:, sl]))
        dq = dqh.transpose(0, 1).reshape(nq, h, d) * scale
        return (dq.to(q.dtype), dkh.transpose(0, 1).to(k.dtype), dvh.transpose(0, 1).to(v.dtype),
                None, None, None)


def _accumulate_rows(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    """dst[:, rows] += src (dst [Hk,M,D], src [Hk,len(rows),D]) with repeated rows summed, never
    assigned: a shared-prefix key is selected by every branch below it, and its dK/dV is the sum."""
    dst.index_add_(1, rows, src)


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, *,
                     softmax_scale: float | None = None, backend: str = "auto"):
    """Softmax attention of each query over its own rows of a KV buffer.

    q [Nq,H,D], k [M,Hk,D], v [M,Hk,Dv] (H a multiple of Hk: query head h uses kv head
    ``h // (H // Hk)``), index [Nq,T] int64 rows of the k/v buffer, NO_ROW for an unused slot; the
    rows of one query must be distinct. Returns o [Nq,H,Dv] (q's dtype) and lse [Nq,H] (natural log
    of the scaled softmax denominator; float64 for float64 inputs, else float32). A query with no
    valid slot gets o = 0, lse = -inf (zero gradients). Differentiable in q, k, v; dk / dv of a row
    chosen by many queries are accumulated (index_add). ``softmax_scale`` defaults to D**-0.5.

    ``backend``: "torch" (the exact reference: gathers the selected rows per bounded query batch;
    memory O(batch)), or "auto" (the torch reference; no GPU kernel is wired yet).
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or index.dim() != 2:
        raise ValueError(f"q, k, v must be [N,H,D] and index [Nq,T]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}, {tuple(index.shape)}")
    if k.shape[:2] != v.shape[:2] or q.shape[2] != k.shape[2] or index.shape[0] != q.shape[0]:
        raise ValueError(f"incompatible q {tuple(q.shape)} / k {tuple(k.shape)} / v {tuple(v.shape)} / "
                         f"index {tuple(index.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})")
    select_backend("sparse_attention", backend, q, _GPU_BACKENDS)
    index = index.to(q.device).long()
    if index.numel() and (int(index.max()) >= k.shape[0] or int(index.min()) < NO_ROW):
        raise ValueError(f"index entries must be rows of the k/v buffer [0, {k.shape[0]}) or NO_ROW")
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[2] ** -0.5
    t = max(1, index.shape[1])
    rows = max(1, _budget(q) // (t * q.shape[1] * max(q.shape[2], v.shape[2])))
    return _SparseAttentionFn.apply(q, k, v, index, scale, rows)


# ====================================================================== indexer loss
def _plan_loss(q_rows, k_rows, k_vis, selected_ids, index_q, index_k, query, key, block, budget) -> _Batches:
    heads = max(index_q.shape[1], query.shape[1])
    if selected_ids is None:  # a block of keys is shared by a block of queries: scores dominate
        return _dense_batches(q_rows, k_rows, k_vis, block, heads, budget)
    # per-query candidates: each (query, slot) also gathers its key's features
    per_pair = max(heads, index_k.shape[1], key.shape[1] * key.shape[2])
    return _sparse_batches(q_rows, k_rows, k_vis, selected_ids, per_pair, budget)


def _loss_inputs(plan: _Batches, index_q, weights, index_k, query, key):
    cdt = _cdt(index_q, weights, index_k, query, key)
    return (_pad_rows(index_q.detach().to(cdt), plan.nq_pad, 0), _pad_rows(weights.detach().to(cdt), plan.nq_pad, 0),
            _pad_rows(index_k.detach().to(cdt), plan.nk_pad, 0), _pad_rows(query.detach().to(cdt), plan.nq_pad, 0),
            _pad_rows(key.detach().to(cdt), plan.nk_pad, 0))


def _finite_or(x: torch.Tensor, fill: float) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, fill)


def _score_grads(iq, w, ik, qidx, kidx, ds, giq, gw, gik):
    """Accumulate the gradients of sum(ds * scores(batch)) into giq / gw / gik (padded layouts)."""
    with torch.enable_grad():
        a = iq[qidx].requires_grad_(True)
        b = w[qidx].requires_grad_(True)
        c = ik[kidx].requires_grad_(True)
        s = _scores_grouped(a, b, c)
        da, db, dc = torch.autograd.grad(s, (a, b, c), ds)
    giq.index_add_(0, qidx.reshape(-1), da.reshape(-1, *giq.shape[1:]))
    gw.index_add_(0, qidx.reshape(-1), db.reshape(-1, *gw.shape[1:]))
    gik.index_add_(0, kidx.reshape(-1), dc.reshape(-1, *gik.shape[1:]))


class _LossStatsFn(torch.autograd.Function):
    """Pass 1: (index_q, weights, index_k) -> (index LSE [Nq] (differentiable), attention LSE [Nq,H])."""

    @staticmethod
    def forward(ctx, index_q, weights, index_k, query, key, plan: _Batches, scale: float):
        ctx.set_materialize_grads(False)
        iq, w, ik, q, k = _loss_inputs(plan, index_q, weights, index_k, query, key)
        z = iq.new_full((plan.nq_pad,), -math.inf)
        la = iq.new_full((plan.nq_pad, q.shape[1]), -math.inf)
        for qidx, kidx in plan.batches:
            vis = plan.mask(qidx, kidx)
            s = _scores_grouped(iq[qidx], w[qidx], ik[kidx]).masked_fill_(~vis, -math.inf)
            z[qidx] = torch.logaddexp(z[qidx], torch.logsumexp(s, -1))
            a = _attn_grouped(q[qidx], k[kidx], scale).masked_fill_(~vis.unsqueeze(2), -math.inf)
            la[qidx] = torch.logaddexp(la[qidx], torch.logsumexp(a, -1))
        ctx.save_for_backward(iq, w, ik, z)
        ctx.plan = plan
        ctx.shapes = (index_q.dtype, weights.dtype, index_k.dtype)
        zo, lo = z[:plan.nq], la[:plan.nq]
        ctx.mark_non_differentiable(lo)
        return zo, lo

    @staticmethod
    def backward(ctx, dz, _dla):
        if dz is None:
            return (None,) * 7
        iq, w, ik, z = ctx.saved_tensors
        plan = ctx.plan
        dz = _pad_rows(dz.to(iq.dtype), plan.nq_pad, 0)
        # A query without keys in this stage (Z = -inf) has no score to differentiate; its incoming
        # gradient may be NaN (torch.logaddexp(-inf, -inf) backward), which must not leak.
        dz = torch.where(torch.isfinite(z), dz, 0.0)
        giq, gw, gik = torch.zeros_like(iq), torch.zeros_like(w), torch.zeros_like(ik)
        zf = _finite_or(z, math.inf)  # a query without keys: every softmax weight is 0
        for qidx, kidx in plan.batches:
            vis = plan.mask(qidx, kidx)
            s = _scores_grouped(iq[qidx], w[qidx], ik[kidx]).masked_fill_(~vis, -math.inf)
            ds = torch.exp(s - zf[qidx].unsqueeze(-1)) * dz[qidx].unsqueeze(-1)  # dZ/ds = softmax(s)
            _score_grads(iq, w, ik, qidx, kidx, ds, giq, gw, gik)
        dt = ctx.shapes
        n, m = plan.nq, plan.nk
        return giq[:n].to(dt[0]), gw[:n].to(dt[1]), gik[:m].to(dt[2]), None, None, None, None


def _head_probs(q, k, qidx, kidx, vis, la, scale, heads_total, head_group):
    """p [G,R,C]: head-summed attention probabilities over S_i / total heads (all-reduced over TP)."""
    a = _attn_grouped(q[qidx], k[kidx], scale)
    lf = _finite_or(la[qidx], math.inf).unsqueeze(-1)
    p = torch.exp(a - lf).masked_fill_(~vis.unsqueeze(2), 0.0).sum(2)
    if head_group is not None and torch.distributed.get_world_size(head_group) > 1:
        torch.distributed.all_reduce(p, group=head_group)
    return p / heads_total


class _LossTermsFn(torch.autograd.Function):
    """Pass 2: sum_i row_weight[i] * sum_j KL term, differentiable in index_q, weights, index_k and Z.

    The output is a scalar, so its gradient is known up to the incoming factor already in forward:
    one pass computes the terms and (when a gradient is needed) the gradients for dloss = 1, which
    backward scales. This saves a recompute pass and keeps the TP all-reduce out of backward.
    """

    @staticmethod
    def forward(ctx, index_q, weights, index_k, index_lse, query, key, attn_lse, row_weight, plan: _Batches,
                scale: float, heads_total: int, head_group, kl_form: str):
        ctx.set_materialize_grads(False)
        iq, w, ik, q, k = _loss_inputs(plan, index_q, weights, index_k, query, key)
        cdt = iq.dtype
        z = _pad_rows(index_lse.detach().to(cdt), plan.nq_pad, -math.inf)
        la = _pad_rows(attn_lse.detach().to(cdt), plan.nq_pad, -math.inf)
        rw = _pad_rows(row_weight.detach().to(cdt), plan.nq_pad, 0)
        want_grad = any(ctx.needs_input_grad[:4])
        if want_grad:
            giq, gw, gik = torch.zeros_like(iq), torch.zeros_like(w), torch.zeros_like(ik)
            gz = torch.zeros_like(z)
        total = iq.new_zeros(())
        zf = _finite_or(z, math.inf)  # a query without keys: every term is 0
        for qidx, kidx in plan.batches:
            vis = plan.mask(qidx, kidx)
            s = _scores_grouped(iq[qidx], w[qidx], ik[kidx]).masked_fill_(~vis, -math.inf)
            p = _head_probs(q, k, qidx, kidx, vis, la, scale, heads_total, head_group)
            logq = s - zf[qidx].unsqueeze(-1)
            qp = torch.exp(logq)
            if kl_form == KL_FORM_EPS:
                term = p * (torch.log(p + KL_EPS) - torch.log(qp + KL_EPS))
            else:
                term = p * (torch.log(p.clamp_min(KL_EPS)) - logq)
            total = total + (term.masked_fill_(~vis, 0.0).sum(-1) * rw[qidx]).sum()
            if want_grad:
                # d term / d s = -r, d term / d Z = +r (log q = s - Z), with r = p q / (q + eps) for
                # the eps-inside form and r = p for the log-softmax form
                r = p * qp / (qp + KL_EPS) if kl_form == KL_FORM_EPS else p
                r = r.masked_fill_(~vis, 0.0) * rw[qidx].unsqueeze(-1)
                gz.index_add_(0, qidx.reshape(-1), r.sum(-1).reshape(-1))
                _score_grads(iq, w, ik, qidx, kidx, r.neg_(), giq, gw, gik)
        if want_grad:
            n, m = plan.nq, plan.nk
            ctx.save_for_backward(giq[:n].to(index_q.dtype), gw[:n].to(weights.dtype), gik[:m].to(index_k.dtype),
                                  gz[:n].to(index_lse.dtype))
        return total.to(_cdt(index_q, weights, index_k))

    @staticmethod
    def backward(ctx, dloss):
        if dloss is None:
            return (None,) * 13
        giq, gw, gik, gz = (g * dloss.to(g.dtype) for g in ctx.saved_tensors)
        return (giq, gw, gik, gz, None, None, None, None, None, None, None, None, None)


def _check_loss_inputs(index_q, weights, index_k, query, key):
    _check_index(index_q, weights, index_k)
    if query.dim() != 3 or key.dim() != 3 or query.shape[2] != key.shape[2]:
        raise ValueError(f"query must be [Nq,H,D] and key [Nk,Hk,D]; got {tuple(query.shape)}, {tuple(key.shape)}")
    if key.shape[1] == 0 or query.shape[1] % key.shape[1]:
        raise ValueError(f"query heads ({query.shape[1]}) must be a multiple of key heads ({key.shape[1]})")
    if query.shape[0] != index_q.shape[0] or key.shape[0] != index_k.shape[0]:
        raise ValueError("query / index_q and key / index_k must have the same rows")


def dsa_indexer_loss_partial_stats(index_q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor,
                                   query: torch.Tensor, key: torch.Tensor, q_rows: torch.Tensor,
                                   k_rows: torch.Tensor, k_visible_until: torch.Tensor, *, softmax_scale: float,
                                   selected_ids: torch.Tensor | None = None,
                                   block_size: int = DEFAULT_BLOCK_SIZE):
    """Pass 1 of the indexer loss over one subset of keys.

    index_q [Nq,Hi,Di], weights [Nq,Hi], query [Nq,H,D] of the queries at global rows q_rows
    (ascending); index_k [Nk,Di], key [Nk,Hk,D] of the keys at global rows k_rows (ascending) with
    k_visible_until. ``selected_ids`` [Nq,topk] canonical ids (sparse loss: S_i = the selected ids
    that are among k_rows) or None (dense loss: S_i = the visible keys among k_rows).

    Returns (index_lse [Nq], attn_lse [Nq,H]): logsumexp over S_i of the index scores (differentiable
    in index_q, weights, index_k) and of ``softmax_scale * <query_h, key>`` per main head (constant).
    -inf where S_i is empty. Stages merge with ``torch.logaddexp``; see the module docstring.
    """
    _check_loss_inputs(index_q, weights, index_k, query, key)
    dev = index_q.device
    q_rows, k_rows, k_visible_until = q_rows.to(dev).long(), k_rows.to(dev).long(), k_visible_until.to(dev).long()
    _check_rows(q_rows, k_rows, k_visible_until, index_q.shape[0], index_k.shape[0])
    plan = _plan_loss(q_rows, k_rows, k_visible_until, selected_ids, index_q, index_k, query, key, int(block_size),
                      _budget(index_q))
    return _LossStatsFn.apply(index_q, weights, index_k, query, key, plan, float(softmax_scale))


def dsa_indexer_loss_partial_terms(index_q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor,
                                   query: torch.Tensor, key: torch.Tensor, q_rows: torch.Tensor,
                                   k_rows: torch.Tensor, k_visible_until: torch.Tensor, index_lse: torch.Tensor,
                                   attn_lse: torch.Tensor, row_weight: torch.Tensor, *, softmax_scale: float,
                                   selected_ids: torch.Tensor | None = None, head_group=None,
                                   kl_form: str = "eps", block_size: int = DEFAULT_BLOCK_SIZE) -> torch.Tensor:
    """Pass 2 of the indexer loss over one subset of keys: a scalar, summed over the stages.

    Same inputs as `dsa_indexer_loss_partial_stats`, plus the *merged* (all stages) ``index_lse``
    [Nq] (keep it differentiable: its gradient carries the softmax normaliser's share) and
    ``attn_lse`` [Nq,H], and ``row_weight`` [Nq] (loss_coeff / len(sample) summed over the samples
    through each row). Returns sum_i row_weight[i] * sum_{j in S_i among k_rows} p_ij (log(p_ij +
    1e-10) - log(q_ij + 1e-10)), differentiable in index_q, weights, index_k and index_lse.
    ``head_group``: process group over which the main heads are split (TP); the head-summed
    probabilities are all-reduced over it (every rank of the group must make the same call) and the
    normaliser counts the heads of the whole group. ``kl_form``: see `KL_FORMS`.
    """
    if kl_form not in KL_FORMS:
        raise ValueError(f"kl_form must be one of {sorted(KL_FORMS)}, got {kl_form!r}")
    _check_loss_inputs(index_q, weights, index_k, query, key)
    dev = index_q.device
    q_rows, k_rows, k_visible_until = q_rows.to(dev).long(), k_rows.to(dev).long(), k_visible_until.to(dev).long()
    _check_rows(q_rows, k_rows, k_visible_until, index_q.shape[0], index_k.shape[0])
    nq, h = query.shape[:2]
    if index_lse.shape != (nq,) or attn_lse.shape != (nq, h) or row_weight.shape != (nq,):
        raise ValueError(f"index_lse must be [{nq}], attn_lse [{nq},{h}], row_weight [{nq}]; got "
                         f"{tuple(index_lse.shape)}, {tuple(attn_lse.shape)}, {tuple(row_weight.shape)}")
    tp = 1 if head_group is None else torch.distributed.get_world_size(head_group)
    plan = _plan_loss(q_rows, k_rows, k_visible_until, selected_ids, index_q, index_k, query, key, int(block_size),
                      _budget(index_q))
    return _LossTermsFn.apply(index_q, weights, index_k, index_lse, query, key, attn_lse, row_weight.to(dev), plan,
                              float(softmax_scale), h * tp, head_group, kl_form)


def tree_dsa_indexer_loss(index_q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor, query: torch.Tensor,
                          key: torch.Tensor, layout: TreeLayout, selected_ids: torch.Tensor | None,
                          row_weight: torch.Tensor, *, softmax_scale: float, sparse_loss: bool = False,
                          head_group=None, kl_form: str = "eps", block_size: int = DEFAULT_BLOCK_SIZE,
                          fp32_grad_sum: bool = True) -> torch.Tensor:
    """The indexer KL loss of the whole forest on one device (module docstring): a scalar.

    index_q [N,Hi,Di], weights [N,Hi], index_k [N,Di] (gradients flow here), query [N,H,D],
    key [N,Hk,D] (constants; detached here), ``selected_ids`` [N,topk] canonical ids (used when
    ``sparse_loss``), ``row_weight`` [N]. Equals the sum over samples of stock
    ``compute_dsa_indexer_loss`` on each sample alone when row_weight is loss_coeff / len(sample)
    summed over the samples through each row. ``fp32_grad_sum=False`` (bf16 / fp16 inputs; verify's
    planted fault ``dsa_bf16_grad_sum`` only) rounds each pass's gradient to the input dtype before
    they are summed: the accuracy bug the default avoids (below).
    """
    n = layout.num_rows
    if index_q.shape[0] != n or index_k.shape[0] != n:
        raise ValueError(f"inputs must have layout.num_rows={n} rows")
    if sparse_loss and selected_ids is None:
        raise ValueError("sparse_loss needs selected_ids")
    dev = index_q.device
    rows = torch.arange(n, device=dev)
    vis = layout.visible_until.to(dev)
    sel = selected_ids if sparse_loss else None
    query, key = query.detach(), key.detach()
    # bf16 / fp16: the indexer inputs' gradient is the sum of pass 1's (softmax normaliser) and pass
    # 2's (KL terms) parts, which nearly cancel (d KL / d s = q - p); each pass rounding its part to
    # the input dtype before autograd adds them loses the difference. Upcast once here, so the sum
    # is formed in float32 and rounded once (the cast's backward), as stock's one-graph loss does.
    if fp32_grad_sum:
        index_q, weights, index_k = (upcast_for_accumulation(t) for t in (index_q, weights, index_k))
    zi, la = dsa_indexer_loss_partial_stats(index_q, weights, index_k, query, key, rows, rows, vis,
                                            softmax_scale=softmax_scale, selected_ids=sel, block_size=block_size)
    return dsa_indexer_loss_partial_terms(index_q, weights, index_k, query, key, rows, rows, vis, zi, la, row_weight,
                                          softmax_scale=softmax_scale, selected_ids=sel, head_group=head_group,
                                          kl_form=kl_form, block_size=block_size)


# ====================================================================== composition
def tree_dsa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, index_q: torch.Tensor | None,
             weights: torch.Tensor | None, index_k: torch.Tensor | None, layout: TreeLayout, *, topk: int,
             softmax_scale: float, selected: torch.Tensor | None = None, loss_row_weight: torch.Tensor | None = None,
             sparse_loss: bool = False, head_group=None, kl_form: str = "eps",
             block_size: int = DEFAULT_BLOCK_SIZE):
    """DSA over the whole forest on one device.

    query [N,H,D], key [N,Hk,D], value [N,Hk,Dv]; index_q [N,Hi,Di], weights [N,Hi], index_k [N,Di]
    (the indexer's inputs, detached from the main model by the caller as stock does).
    Returns (o [N,H,Dv], selected_ids [N,topk] canonical rows (NO_ROW in empty slots), indexer_loss):
    ``selected`` given = IndexShare: those ids are reused and no index score is computed (the
    indexer inputs may be None and the loss is None). Otherwise the loss is computed when
    ``loss_row_weight`` [N] is given (`tree_dsa_indexer_loss`, with query/key detached), else None.
    """
    n = layout.num_rows
    if query.shape[0] != n or key.shape[0] != n or value.shape[0] != n:
        raise ValueError(f"query, key, value must have layout.num_rows={n} rows")
    if selected is None:
        if index_q is None or weights is None or index_k is None:
            raise ValueError("tree_dsa: without `selected` (IndexShare) the indexer inputs are required")
        _, ids = tree_dsa_topk(index_q.detach(), weights.detach(), index_k.detach(), layout, topk,
                               block_size=block_size)
    else:
        ids = selected.to(query.device).long()
        if ids.shape != (n, topk):
            raise ValueError(f"selected must be [N={n}, topk={topk}], got {tuple(ids.shape)}")
        # IndexShare reuses canonical rows: each must be NO_ROW or a key its query sees on the tree
        rows = torch.arange(n, device=ids.device)[:, None]
        vis_until = layout.visible_until.to(ids.device)[ids.clamp(0, max(n - 1, 0))]
        ok = (ids == NO_ROW) | ((ids >= 0) & (ids <= rows) & (rows < vis_until))
        if not bool(ok.all()):
            bad = int(torch.nonzero(~ok)[0, 0])
            raise ValueError(f"selected[{bad}] holds a row that query row {bad} does not see on the tree "
                             f"(IndexShare ids must be canonical rows visible to their query, or NO_ROW)")
    o, _ = sparse_attention(query, key, value, ids, softmax_scale=softmax_scale)
    loss = None
    if selected is None and loss_row_weight is not None:
        loss = tree_dsa_indexer_loss(index_q, weights, index_k, query.detach(), key.detach(), layout, ids,
                                     loss_row_weight, softmax_scale=softmax_scale, sparse_loss=sparse_loss,
                                     head_group=head_group, kl_form=kl_form, block_size=block_size)
    return o, ids, loss
