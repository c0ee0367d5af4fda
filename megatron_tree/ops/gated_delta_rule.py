"""Gated delta rule (Gated DeltaNet) on a prefix tree, plus batch-first chunked/recurrent forms.

Semantics are those of FLA's ``chunk_gated_delta_rule``. Per value head, with state ``S`` of shape
``[K,V]``::

    S_t = exp(g_t) * S_{t-1}                           (decay; g is a log decay, <= 0)
    S_t = S_t + k_t (beta_t (v_t - S_t^T k_t))^T       (delta rule on the decayed state)
    o_t = S_t^T (scale * q_t)                          (scale defaults to K**-0.5)

Grouped value heads (GVA): with ``HV = G*H`` value heads, value head ``h`` reads q/k head ``h // G``
(``repeat_interleave`` order, as Megatron's GatedDeltaNet does). A step with ``g = 0, beta = 0,
k = 0`` leaves the state unchanged, which is how every padded step below is made harmless.

Chunked (WY / UT) form used by the torch backend. Inside a chunk of C steps starting from state
``S0``, let ``Gc_t`` be the inclusive cumulative sum of ``g`` and ``D[t,s] = exp(Gc_t - Gc_s)``
(s <= t). The per-step corrections ``u_t = beta_t (v_t - S_t^T k_t)`` satisfy the unit lower
triangular system ``(I + A) U = diag(beta) V - diag(beta exp(Gc)) K S0`` with
``A[t,s] = beta_t D[t,s] k_t.k_s`` (s < t). Solving once for both right-hand sides gives
``U = U0 - W S0``, and then::

    O      = scale (diag(exp(Gc)) Q S0 + (D * Q K^T)_{s<=t} U)
    S_next = exp(Gc_C) S0 + (diag(exp(Gc_C - Gc)) K)^T U

Everything that does not involve ``S0`` is computed for all chunks at once; only the three
state products run sequentially, one chunk step at a time. Every exponent is <= 0, so nothing
overflows.

Tree: segments run level by level (``levels.level_schedule``); a segment starts from its parent's
final state (zero at a root) and siblings gather the same parent state, so autograd sums their
gradients into it.
"""
from __future__ import annotations

import torch

from ..tree.layout import TreeLayout
from .backend import select_backend
from .levels import level_schedule

__all__ = [
    "tree_gated_delta_rule",
    "chunk_gated_delta_rule_torch",
    "recurrent_gated_delta_rule_ref",
    "gated_delta_rule_state_map",
]

_OP = "tree_gated_delta_rule"
_GPU_BACKENDS = {"fla": "fla.ops.gated_delta_rule"}
# FLA >= 0.6 accepts float32 in chunk_gated_delta_rule (the kernel tier runs its real kernels on
# float32 CPU tensors through Triton's interpreter: tests_kernels/); float64 stays with the torch backend.
_FLA_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _pick_backend(op: str, backend: str, q: torch.Tensor) -> str:
    """``select_backend`` for the gated delta rule ops: "fla" only for the dtypes FLA takes ("auto"
    never picks a kernel that would refuse the inputs; an explicit "fla" then is an error)."""
    name = select_backend(op, backend, q, _GPU_BACKENDS)
    if name == "fla" and q.dtype not in _FLA_DTYPES:
        if backend != "auto":
            raise ValueError(f"{op}: backend 'fla' needs bfloat16/float16/float32 q, k, v; got {q.dtype}")
        name = "torch"
    return name


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays exact; everything else (fp32, bf16, fp16) accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_shapes(q, k, v, g, beta, lead: tuple) -> tuple[int, int, int, int]:
    """Validate ``q,k [*lead,H,K]``, ``v [*lead,HV,V]``, ``g,beta [*lead,HV]``; returns (H, K, HV, V)."""
    nl = len(lead)
    if q.dim() != nl + 2 or tuple(q.shape[:nl]) != lead:
        raise ValueError(f"q must have shape [{', '.join(map(str, lead))}, H, K]; got {tuple(q.shape)}")
    H, K = q.shape[nl:]
    if k.shape != q.shape:
        raise ValueError(f"k must match q's shape {tuple(q.shape)}; got {tuple(k.shape)}")
    if v.dim() != nl + 2 or tuple(v.shape[:nl]) != lead:
        raise ValueError(f"v must have shape [{', '.join(map(str, lead))}, HV, V]; got {tuple(v.shape)}")
    HV, V = v.shape[nl:]
    if H == 0 or HV % H:
        raise ValueError(f"value heads HV={HV} must be a multiple of q/k heads H={H}")
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != lead + (HV,):
            raise ValueError(f"{name} must have shape {list(lead + (HV,))}; got {tuple(t.shape)}")
    return int(H), int(K), int(HV), int(V)


# ---------------------------------------------------------------------------------------- core
def _chunk_scan(q, k, v, g, beta, S0, steps: list[int], scale: float):
    """Chunked gated delta rule over a step-major pack of chunks.

    q, k [Cn,C,H,K]; v [Cn,C,HV,V]; g, beta [Cn,C,HV]; S0 [n,HV,K,V]. ``steps[j]`` is the number of
    sequences that have a j-th chunk; it must be non-increasing with ``steps[0] == n`` and
    ``sum(steps) == Cn``. Chunks are ordered step-major (all first chunks, then all second chunks,
    ...), and within a step by sequence index, so the sequences still running at step j are the
    first ``steps[j]``. A sequence's final state is its state after its last chunk; padded steps
    inside a chunk must carry g = beta = k = 0.

    Returns (o [Cn,C,HV,V], final [n,HV,K,V]), all in the inputs' dtype.
    """
    Cn, C, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G = HV // H
    n = S0.shape[0]
    # Heads split as [H, G] so q.k products are computed once per q/k head and broadcast over G.
    qh = q.permute(0, 2, 1, 3)                                   # [Cn,H,C,K]
    kh = k.permute(0, 2, 1, 3)                                   # [Cn,H,C,K]
    vh = v.permute(0, 2, 1, 3).reshape(Cn, H, G, C, V)
    gh = g.permute(0, 2, 1).reshape(Cn, H, G, C)
    bh = beta.permute(0, 2, 1).reshape(Cn, H, G, C)

    Gc = gh.cumsum(-1)                                           # [Cn,H,G,C]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # Mask before exp: above the diagonal Gc_t - Gc_s is >= 0 and may overflow.
    D = (Gc.unsqueeze(-1) - Gc.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    kk = (kh @ kh.transpose(-1, -2)).unsqueeze(2)                # [Cn,H,1,C,C]
    qk = (qh @ kh.transpose(-1, -2)).unsqueeze(2)
    A = (bh.unsqueeze(-1) * D * kk).tril(-1)                     # strictly lower: unit solve below
    eG = Gc.exp()
    rhs = torch.cat([(bh * eG).unsqueeze(-1) * kh.unsqueeze(2), bh.unsqueeze(-1) * vh], dim=-1)
    X = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
    W, U0 = X.split([K, V], dim=-1)                              # [Cn,H,G,C,K], [Cn,H,G,C,V]
    Qg = (scale * eG).unsqueeze(-1) * qh.unsqueeze(2)            # [Cn,H,G,C,K]
    Aqk = scale * D * qk                                         # [Cn,H,G,C,C], diagonal included
    g_last = Gc[..., -1]                                         # [Cn,H,G]
    KdT = ((g_last.unsqueeze(-1) - Gc).exp().unsqueeze(-1) * kh.unsqueeze(2)).transpose(-1, -2)
    L = g_last.exp()[..., None, None]                            # [Cn,H,G,1,1]

    # W and Qg both multiply the incoming state: one matmul per step for the two.
    WQ = torch.cat([W, Qg], dim=-2)                              # [Cn,H,G,2C,K]
    # split (not slicing) so backward concatenates each gradient once instead of per step.
    parts = [t.split(steps) for t in (WQ, U0, Aqk, KdT, L)]
    S = S0.reshape(n, H, G, K, V)
    finished = []  # final states of sequences that stopped, last-index block first
    outs = []
    for j, nj in enumerate(steps):
        if nj < S.shape[0]:
            finished.append(S[nj:])
            S = S[:nj]
        WQj, U0j, Aj, KdTj, Lj = (p[j] for p in parts)
        WS, QS = (WQj @ S).split([C, C], dim=-2)
        U = U0j - WS
        outs.append(QS + Aj @ U)
        S = Lj * S + KdTj @ U
    finished.append(S)
    final = torch.cat(finished[::-1], dim=0).reshape(n, HV, K, V)
    o = torch.cat(outs, dim=0).reshape(Cn, HV, C, V).transpose(1, 2)
    return o, final


def _step_counts(num_chunks: torch.Tensor) -> list[int]:
    """``steps[j]`` = number of sequences with more than j chunks (``num_chunks`` sorted descending)."""
    J = int(num_chunks[0].item())
    j = torch.arange(J, device=num_chunks.device)
    return (num_chunks.unsqueeze(0) > j.unsqueeze(1)).sum(1).tolist()


# ---------------------------------------------------------------------------- batch-first API
def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6, output_dtype=None) -> torch.Tensor:
    """FLA's ``l2norm`` (how callers normalise q and k): ``x * rsqrt(sum(x^2) + eps)`` over ``dim``,
    computed in float32 (float64 for float64 inputs), returned in ``output_dtype`` or x's dtype."""
    xf = x if x.dtype == torch.float64 else x.float()
    return (xf * torch.rsqrt((xf * xf).sum(dim=dim, keepdim=True) + eps)).to(output_dtype or x.dtype)


def chunk_gated_delta_rule_torch(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                                 chunk_size: int = 64):
    """Chunked gated delta rule in FLA's batch-first layout (torch, differentiable, any device).

    q, k [B,T,H,K]; v [B,T,HV,V] (HV a multiple of H); g, beta [B,T,HV]; initial_state [B,HV,K,V]
    or None (zeros). Returns ``(o [B,T,HV,V] in q's dtype, final_state [B,HV,K,V] or None)``;
    the state is float64 for float64 inputs and float32 otherwise. Gradients flow to every input,
    ``initial_state`` included. T need not be a multiple of ``chunk_size``.
    """
    if q.dim() != 4:
        raise ValueError(f"q must have shape [B,T,H,K]; got {tuple(q.shape)}")
    B, T = int(q.shape[0]), int(q.shape[1])
    H, K, HV, V = _check_shapes(q, k, v, g, beta, (B, T))
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive; got {chunk_size}")
    scale = K ** -0.5 if scale is None else float(scale)
    cdt = _compute_dtype(q.dtype)
    if initial_state is None:
        S0 = q.new_zeros(B, HV, K, V, dtype=cdt)
    else:
        if tuple(initial_state.shape) != (B, HV, K, V):
            raise ValueError(f"initial_state must have shape {[B, HV, K, V]}; got {tuple(initial_state.shape)}")
        S0 = initial_state.to(cdt)
    if T == 0:
        return v.new_zeros(B, 0, HV, V, dtype=q.dtype), (S0 if output_final_state else None)
    C = min(chunk_size, T)
    nc = -(-T // C)
    pad = nc * C - T

    def chunks(x):
        x = x.to(cdt)
        if pad:  # zero steps (g = beta = k = 0) leave the state unchanged
            x = torch.cat([x, x.new_zeros((B, pad) + tuple(x.shape[2:]))], dim=1)
        # [B, nc*C, ...] -> step-major [nc*B, C, ...]
        return x.reshape((B, nc, C) + tuple(x.shape[2:])).transpose(0, 1).reshape((nc * B, C) + tuple(x.shape[2:]))

    o, final = _chunk_scan(*(chunks(x) for x in (q, k, v, g, beta)), S0, [B] * nc, scale)
    o = o.reshape(nc, B, C, HV, V).transpose(0, 1).reshape(B, nc * C, HV, V)[:, :T]
    return o.to(q.dtype), (final if output_final_state else None)


def recurrent_gated_delta_rule_ref(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                                   chunk_size: int = 64):
    """Token-by-token reference with the signature of :func:`chunk_gated_delta_rule_torch`.

    For tests only (a Python loop over T); ``chunk_size`` is accepted and ignored.
    """
    if q.dim() != 4:
        raise ValueError(f"q must have shape [B,T,H,K]; got {tuple(q.shape)}")
    B, T = int(q.shape[0]), int(q.shape[1])
    H, K, HV, V = _check_shapes(q, k, v, g, beta, (B, T))
    scale = K ** -0.5 if scale is None else float(scale)
    cdt = _compute_dtype(q.dtype)
    G = HV // H
    qe = q.to(cdt).repeat_interleave(G, dim=2)
    ke = k.to(cdt).repeat_interleave(G, dim=2)
    ve, ge, be = v.to(cdt), g.to(cdt), beta.to(cdt)
    S = q.new_zeros(B, HV, K, V, dtype=cdt) if initial_state is None else initial_state.to(cdt)
    outs = []
    for t in range(T):
        S = S * ge[:, t].exp()[..., None, None]
        kt = ke[:, t]
        u = be[:, t, :, None] * (ve[:, t] - torch.einsum("bhkv,bhk->bhv", S, kt))
        S = S + kt[..., None] * u[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, qe[:, t] * scale))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, HV, V, dtype=cdt)
    return o.to(q.dtype), (S if output_final_state else None)


def gated_delta_rule_state_map(k, v, g, beta, *, chunk_size: int = 64):
    """Affine summary of a sequence's effect on the state: ``S_out = M @ S_in + E``.

    k [B,T,H,K]; v [B,T,HV,V]; g, beta [B,T,HV]. Returns ``M [B,HV,K,K]`` and ``E [B,HV,K,V]``
    (float32, or float64 for float64 inputs), differentiable. Used by context parallelism to compose
    shards: the recurrence is linear in the state column by column, so running the chunked op from
    the state ``[I | 0]`` with values ``[0 | v]`` yields ``[M | E]`` in one pass.
    """
    if k.dim() != 4:
        raise ValueError(f"k must have shape [B,T,H,K]; got {tuple(k.shape)}")
    B, T, H, K = k.shape
    HV = v.shape[2]
    cdt = _compute_dtype(k.dtype)
    v_aug = torch.cat([v.new_zeros(B, T, HV, K, dtype=cdt), v.to(cdt)], dim=-1)
    eye = torch.eye(K, dtype=cdt, device=k.device).expand(B, HV, K, K)
    S0 = torch.cat([eye, eye.new_zeros(B, HV, K, v.shape[3])], dim=-1)
    _, final = chunk_gated_delta_rule_torch(torch.zeros_like(k, dtype=cdt), k.to(cdt), v_aug, g, beta,
                                            initial_state=S0, output_final_state=True, chunk_size=chunk_size)
    return final[..., :K], final[..., K:]


# ----------------------------------------------------------------------------------- tree op
def tree_gated_delta_rule(q, k, v, g, beta, layout: TreeLayout, *, scale=None, backend: str = "auto"):
    """Gated delta rule over the prefix forest ``layout`` (token-major, no batch dimension).

    q, k [N,H,K] (already normalised); v [N,HV,V] with HV a multiple of H; g [N,HV] log decay
    (<= 0); beta [N,HV]; N = ``layout.num_rows``. Returns o [N,HV,V] in q's dtype.

    Every row's output equals what the plain recurrence gives on the row's root path, started from
    the zero state; gradients are exact sums over all paths through a shared row. Padding rows are
    one-row roots and get that same (closed-form) value.

    backend: "torch" (chunked, runs anywhere, exact in float64), "fla" (FLA Triton kernel per level,
    CUDA with bf16/fp16/fp32 inputs), or "auto" (FLA for CUDA bf16/fp16/fp32 tensors when it imports,
    else torch; float32 included since FLA 0.6 accepts it, its matmuls may then run in TF32 on GPU).
    """
    N = layout.num_rows
    H, K, HV, V = _check_shapes(q, k, v, g, beta, (N,))
    name = _pick_backend(_OP, backend, q)
    scale = K ** -0.5 if scale is None else float(scale)
    if N == 0:
        return v.new_zeros(0, HV, V, dtype=q.dtype)
    layout = layout if layout.device == q.device else layout.to(q.device)
    if name == "fla":
        return _tree_fla(q, k, v, g, beta, layout, scale)
    return _tree_torch(q, k, v, g, beta, layout, scale)


def _real_levels(layout: TreeLayout):
    """Level schedule without the padding segments (they are one-row roots, handled in closed form).

    Yields (segments, parent, lengths) per level, skipping empty levels.
    """
    for lv in level_schedule(layout, include_padding=False):
        yield lv.segments, lv.parent, lv.lengths


def _padding_output(q, k, v, g, beta, layout, scale, cdt):
    """o at the padding rows: a one-row root from the zero state gives scale * beta (q.k) v."""
    P = layout.num_padding
    G = v.shape[1] // q.shape[1]
    qp, kp = (x[-P:].to(cdt).repeat_interleave(G, dim=1) for x in (q, k))
    return (scale * beta[-P:].to(cdt) * (qp * kp).sum(-1)).unsqueeze(-1) * v[-P:].to(cdt)


def _assemble(pieces_rows, pieces_o, N):
    """Rows are covered exactly once across pieces: invert the permutation with one gather."""
    rows = torch.cat(pieces_rows)
    o = torch.cat(pieces_o)
    inv = torch.empty_like(rows)
    inv[rows] = torch.arange(N, device=rows.device)
    return o.index_select(0, inv)


def _tree_torch(q, k, v, g, beta, layout, scale, chunk_size: int = 64):
    N = layout.num_rows
    H, K = q.shape[1:]
    HV, V = v.shape[1:]
    cdt = _compute_dtype(q.dtype)
    dev = q.device
    # One extra zero row: padded chunk steps gather it, and zeros leave the state unchanged.
    ext = [torch.cat([x.to(cdt), x.new_zeros((1,) + tuple(x.shape[1:]), dtype=cdt)]) for x in (q, k, v, g, beta)]
    offsets = layout.segment_offsets
    pos = torch.full((layout.num_segments,), -1, dtype=torch.long, device=dev)  # index in its level's states
    prev_final = None
    rows_out, o_out = [], []
    for segs, parent, lens in _real_levels(layout):
        n = segs.numel()
        C = min(chunk_size, int(lens.max().item()))
        nch = -(-lens // C)
        # Longest first: the sequences still running at chunk step j are then a prefix.
        nch, order = torch.sort(nch, descending=True, stable=True)
        segs, parent, lens = segs[order], parent[order], lens[order]
        if prev_final is None:
            S0 = q.new_zeros(n, HV, K, V, dtype=cdt)
        else:
            S0 = prev_final[pos[parent]]  # siblings gather one state: autograd sums into it
        pos[segs] = torch.arange(n, device=dev)
        steps = _step_counts(nch)
        st = torch.tensor(steps, device=dev)
        j_of = torch.repeat_interleave(torch.arange(len(steps), device=dev), st)          # [Cn]
        i_of = torch.arange(j_of.numel(), device=dev) - (torch.cumsum(st, 0) - st)[j_of]  # [Cn]
        t_in_seg = j_of.unsqueeze(1) * C + torch.arange(C, device=dev)                    # [Cn,C]
        valid = t_in_seg < lens[i_of].unsqueeze(1)
        rows = torch.where(valid, offsets[segs[i_of]].unsqueeze(1) + t_in_seg, torch.full_like(t_in_seg, N))
        flat = rows.flatten()
        # index_select: its backward is index_add_, much cheaper on CPU than indexing's index_put.
        o, prev_final = _chunk_scan(*(x.index_select(0, flat).unflatten(0, rows.shape) for x in ext), S0, steps, scale)
        keep = valid.flatten().nonzero().squeeze(1)
        rows_out.append(flat[keep])
        o_out.append(o.flatten(0, 1).index_select(0, keep))
    if layout.num_padding:
        rows_out.append(torch.arange(N - layout.num_padding, N, device=dev))
        o_out.append(_padding_output(q, k, v, g, beta, layout, scale, cdt))
    return _assemble(rows_out, o_out, N).to(q.dtype)


def _tree_fla(q, k, v, g, beta, layout, scale):
    """FLA backend: one varlen ``chunk_gated_delta_rule`` call per level, one initial state per segment."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # GPU-only package: import on use

    N = layout.num_rows
    H, K = q.shape[1:]
    HV, V = v.shape[1:]
    dev = q.device
    G = HV // H
    # This FLA kernel takes equal q/k and v head counts; expand as Megatron's GatedDeltaNet does.
    qe = q.repeat_interleave(G, dim=1) if G > 1 else q
    ke = k.repeat_interleave(G, dim=1) if G > 1 else k
    g32 = g.float()  # FLA accumulates the decay (and its gradient) in float32
    beta_q = beta.to(q.dtype)  # the dtype combination FLA tests and Megatron's GatedDeltaNet passes
    offsets = layout.segment_offsets
    pos = torch.full((layout.num_segments,), -1, dtype=torch.long, device=dev)
    prev_final = None
    rows_out, o_out = [], []
    for segs, parent, lens in _real_levels(layout):
        n = segs.numel()
        cu = torch.zeros(n + 1, dtype=torch.long, device=dev)
        cu[1:] = torch.cumsum(lens, 0)
        total = int(cu[-1].item())
        # Rows of the level's segments, concatenated in segment order.
        rows = torch.arange(total, device=dev) + torch.repeat_interleave(offsets[segs] - cu[:-1], lens)
        if prev_final is None:
            h0 = torch.zeros(n, HV, K, V, dtype=torch.float32, device=dev)
        else:
            h0 = prev_final[pos[parent]]
        pos[segs] = torch.arange(n, device=dev)
        o, prev_final = chunk_gated_delta_rule(
            qe[rows].unsqueeze(0), ke[rows].unsqueeze(0), v[rows].unsqueeze(0), g32[rows].unsqueeze(0),
            beta_q[rows].unsqueeze(0), scale=scale, initial_state=h0, output_final_state=True, cu_seqlens=cu)
        rows_out.append(rows)
        o_out.append(o[0].to(q.dtype))
    if layout.num_padding:
        rows_out.append(torch.arange(N - layout.num_padding, N, device=dev))
        o_out.append(_padding_output(q, k, v, g, beta, layout, scale, torch.float32).to(q.dtype))
    return _assemble(rows_out, o_out, N)


# ------------------------------------------------------------------- explicit forests (for CP)
# Context parallelism runs the recurrence on the pieces of the tree one rank owns. Those pieces are
# a forest that is not a `TreeLayout` (a rank's pieces need not be in DFS preorder: a remote piece
# between a parent and its child cuts that edge) and whose roots may start from a state computed
# elsewhere. These two ops take the forest explicitly.
__all__ += ["gated_delta_rule_forest", "gated_delta_rule_summary"]


def _host_i64(x, name: str):
    import numpy as np

    a = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D; got shape {tuple(a.shape)}")
    return a.astype(np.int64, copy=False)


def _check_forest(n: int, seg_start, seg_len, seg_parent):
    """Host copies of the forest description, validated. Returns (start, length, parent, level)."""
    import numpy as np

    from ..tree.layout import _levels

    start, length, parent = (_host_i64(x, nm) for x, nm in
                             ((seg_start, "seg_start"), (seg_len, "seg_len"), (seg_parent, "seg_parent")))
    S = start.shape[0]
    if length.shape != (S,) or parent.shape != (S,):
        raise ValueError(f"seg_start, seg_len and seg_parent must have one length; got {S}, {length.shape[0]}, "
                         f"{parent.shape[0]}")
    if S and ((length < 1).any() or (start < 0).any() or (start + length > n).any()):
        raise ValueError(f"every segment needs >= 1 row inside the {n} input rows")
    if S and ((parent >= np.arange(S)) | (parent < -1)).any():
        raise ValueError("seg_parent[s] must be -1 or an earlier segment (< s)")
    order = np.argsort(start, kind="stable")
    if S > 1 and (start[order][1:] < (start + length)[order][:-1]).any():
        raise ValueError("segments must not overlap")
    return start, length, parent, _levels(parent)


def gated_delta_rule_forest(q, k, v, g, beta, seg_start, seg_len, seg_parent, *, initial_state=None,
                            initial_index=None, final_segments=None, scale=None, chunk_size: int = 64,
                            backend: str = "torch"):
    """Gated delta rule over an explicitly described forest of row runs (differentiable).

    q, k [n,H,K]; v [n,HV,V]; g, beta [n,HV]  (the op's conventions: ``tree_gated_delta_rule``).
    seg_start, seg_len, seg_parent [S] (host or device ints): segment ``s`` is the rows
    ``seg_start[s] : seg_start[s] + seg_len[s]`` in order; segments are disjoint; ``seg_parent[s]``
    is ``-1`` (a root) or an earlier segment whose final state ``s`` starts from.
    initial_state [B,HV,K,V] and initial_index [S]: a root ``s`` with ``initial_index[s] >= 0``
    starts from ``initial_state[initial_index[s]]`` (several roots may share one), every other root
    from zero; non-roots ignore it. final_segments [F]: segments whose final state is returned.

    Returns ``(o [n,HV,V] in q's dtype, final [F,HV,K,V] or None)``; rows no segment covers get 0;
    states are float64 for float64 inputs, float32 otherwise. Gradients reach every input,
    ``initial_state`` included (summed over the roots that share a state).

    backend: "torch" (the default: chunked, exact in float64), "fla" (FLA's varlen
    ``chunk_gated_delta_rule`` once per forest level, each segment starting from its initial or its
    parent's final state: CUDA, or CPU float32 through Triton's interpreter in the kernel tier) or
    "auto" (FLA for CUDA bf16/fp16/fp32 tensors when it imports, else torch).
    """
    import numpy as np

    n = int(q.shape[0])
    H, K, HV, V = _check_shapes(q, k, v, g, beta, (n,))
    start, length, parent, level = _check_forest(n, seg_start, seg_len, seg_parent)
    name = _pick_backend("gated_delta_rule_forest", backend, q)
    S = start.shape[0]
    fin, idx0 = _forest_states(S, (HV, K, V), initial_state, initial_index, final_segments)
    scale = K ** -0.5 if scale is None else float(scale)
    if name == "fla":
        return _forest_fla(q, k, v, g, beta, start, length, parent, level, initial_state, idx0, fin, scale)
    cdt = _compute_dtype(q.dtype)
    dev = q.device
    init = q.new_zeros((1, HV, K, V), dtype=cdt)
    if initial_state is not None:
        init = torch.cat([initial_state.to(cdt), init])
    B = init.shape[0] - 1
    o = v.new_zeros((n, HV, V), dtype=cdt)
    if S == 0:
        final = init.new_zeros((0 if fin is None else fin.size, HV, K, V))
        return o.to(q.dtype), (None if fin is None else final)
    # One extra zero row (index n): padded chunk steps read it and leave the state unchanged.
    ext = [torch.cat([x.to(cdt), x.new_zeros((1,) + tuple(x.shape[1:]), dtype=cdt)]) for x in (q, k, v, g, beta)]
    want = np.zeros(S, bool)
    if fin is not None:
        want[fin] = True
    pos = np.full(S, -1, np.int64)  # index of a segment among its level's final states
    prev_final = None
    rows_out, o_out, fin_segs, fin_states = [], [], [], []
    for lv in range(int(level.max()) + 1):
        # A level mixes long pieces and short ones (a CP rank's level 0 holds both its roots and the
        # children of remote parents): one chunk size for all would pad every short segment to it.
        # Segments are bucketed by chunk size (a power of two up to chunk_size): padding <= 2x.
        level_segs = np.flatnonzero(level == lv)
        bucket = np.minimum(chunk_size, 1 << np.ceil(np.log2(length[level_segs])).astype(np.int64))
        finals, done = [], 0
        for C in np.unique(bucket)[::-1]:
            segs = level_segs[bucket == C]
            lens = length[segs]
            C = int(min(C, int(lens.max())))
            nch = -(-lens // C)
            order = np.argsort(-nch, kind="stable")  # longest first: running sequences are a prefix
            segs, lens, nch = segs[order], lens[order], nch[order]
            if lv == 0:
                sel = np.where(idx0[segs] >= 0, idx0[segs], B)
                S0 = init.index_select(0, torch.as_tensor(sel, device=dev))
            else:
                S0 = prev_final.index_select(0, torch.as_tensor(pos[parent[segs]], device=dev))
            steps = [int(x) for x in (nch[None, :] > np.arange(int(nch[0]))[:, None]).sum(1)]
            st = np.asarray(steps)
            j_of = np.repeat(np.arange(st.size), st)
            i_of = np.arange(j_of.size) - (np.cumsum(st) - st)[j_of]
            t_in = j_of[:, None] * C + np.arange(C)
            valid = t_in < lens[i_of][:, None]
            rows = np.where(valid, start[segs][i_of][:, None] + t_in, n)
            flat = torch.as_tensor(rows.reshape(-1), device=dev)
            oc, fin_c = _chunk_scan(*(x.index_select(0, flat).unflatten(0, rows.shape) for x in ext), S0, steps,
                                    scale)
            keep = torch.as_tensor(np.flatnonzero(valid.reshape(-1)), device=dev)
            rows_out.append(flat.index_select(0, keep))
            o_out.append(oc.flatten(0, 1).index_select(0, keep))
            w = np.flatnonzero(want[segs])
            if w.size:
                fin_segs.append(segs[w])
                fin_states.append(fin_c.index_select(0, torch.as_tensor(w, device=dev)))
            finals.append(fin_c)
            pos[segs] = done + np.arange(segs.size)
            done += segs.size
        prev_final = finals[0] if len(finals) == 1 else torch.cat(finals)
    o = o.index_copy(0, torch.cat(rows_out), torch.cat(o_out))
    if fin is None:
        return o.to(q.dtype), None
    if not fin.size:
        return o.to(q.dtype), init.new_zeros((0, HV, K, V))
    got = np.concatenate(fin_segs)
    where = np.empty(S, np.int64)
    where[got] = np.arange(got.size)
    final = torch.cat(fin_states).index_select(0, torch.as_tensor(where[fin], device=dev))
    return o.to(q.dtype), final


def _forest_states(S: int, shape: tuple, initial_state, initial_index, final_segments):
    """`gated_delta_rule_forest`'s state arguments checked: ``(final_segments, initial_index)`` as host
    int64 arrays (None / all -1 when not given)."""
    import numpy as np

    fin = None if final_segments is None else _host_i64(final_segments, "final_segments")
    if fin is not None and fin.size and ((fin < 0) | (fin >= S)).any():
        raise ValueError(f"final_segments must index the {S} segments")
    idx0 = np.full(S, -1, np.int64) if initial_index is None else _host_i64(initial_index, "initial_index")
    if idx0.shape != (S,):
        raise ValueError(f"initial_index must have shape [{S}]; got {tuple(idx0.shape)}")
    if initial_state is None:
        if (idx0 >= 0).any():
            raise ValueError("initial_index is set but initial_state is None")
    elif initial_state.dim() != 4 or tuple(initial_state.shape[1:]) != tuple(shape):
        raise ValueError(f"initial_state must have shape [B,{','.join(map(str, shape))}]; got "
                         f"{tuple(initial_state.shape)}")
    elif (idx0 >= initial_state.shape[0]).any():
        raise ValueError("initial_index points past initial_state")
    return fin, idx0


def _forest_fla(q, k, v, g, beta, start, length, parent, level, initial_state, idx0, fin, scale):
    """`gated_delta_rule_forest` through FLA: per level one varlen ``chunk_gated_delta_rule`` call whose
    sequences are the level's segments, started from their initial states (roots) or their parents'
    final states (as `_tree_fla` runs a layout's levels)."""
    import numpy as np
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # GPU-only package: import on use

    n, H, K = q.shape
    HV, V = v.shape[1:]
    S = start.shape[0]
    dev = q.device
    G = HV // H
    qe = q.repeat_interleave(G, dim=1) if G > 1 else q  # the kernel takes equal q/k and v head counts
    ke = k.repeat_interleave(G, dim=1) if G > 1 else k
    g32, beta_q = g.float(), beta.to(q.dtype)
    zero = torch.zeros(1, HV, K, V, dtype=torch.float32, device=dev)
    init = zero if initial_state is None else torch.cat([initial_state.float(), zero])
    B = init.shape[0] - 1
    o = v.new_zeros((n, HV, V), dtype=q.dtype)
    finals = torch.zeros(0, HV, K, V, dtype=torch.float32, device=dev)  # every segment's, in ``order`` below
    slot = np.full(S, -1, np.int64)
    rows_out, o_out = [], []
    for lv in range(int(level.max()) + 1 if S else 0):
        segs = np.flatnonzero(level == lv)
        lens = length[segs]
        cu = torch.from_numpy(np.concatenate([[0], np.cumsum(lens)])).to(dev)
        rows = torch.from_numpy(np.concatenate([np.arange(a, a + b) for a, b in zip(start[segs], lens)])).to(dev)
        if lv == 0:
            h0 = init.index_select(0, torch.from_numpy(np.where(idx0[segs] >= 0, idx0[segs], B)).to(dev))
        else:
            h0 = finals.index_select(0, torch.from_numpy(slot[parent[segs]]).to(dev))
        out, last = chunk_gated_delta_rule(qe[rows].unsqueeze(0), ke[rows].unsqueeze(0), v[rows].unsqueeze(0),
                                           g32[rows].unsqueeze(0), beta_q[rows].unsqueeze(0), scale=scale,
                                           initial_state=h0, output_final_state=True, cu_seqlens=cu)
        rows_out.append(rows)
        o_out.append(out[0].to(q.dtype))
        slot[segs] = finals.shape[0] + np.arange(segs.size)
        finals = torch.cat([finals, last.float()])
    if rows_out:
        o = o.index_copy(0, torch.cat(rows_out), torch.cat(o_out))
    if fin is None:
        return o, None
    return o, finals.index_select(0, torch.from_numpy(slot[fin]).to(dev))


def gated_delta_rule_summary(k, v, g, beta, seg_start, seg_len, seg_parent, summary_segments, *,
                             chunk_size: int = 64):
    """Affine summaries ``S_out[f] = M[f] @ S_in + E[f]`` over an explicit forest (torch, differentiable).

    Inputs as `gated_delta_rule_forest` (no q: summaries have no outputs). ``S_in`` is the unknown
    state entering the root of ``summary_segments[f]``'s tree; ``S_out[f]`` is that segment's final
    state. Returns ``M [F,HV,K,K]`` and ``E [F,HV,K,V]`` (float64 for float64 inputs, else float32):
    ``M`` is how the path transforms any incoming state, ``E`` what it writes from zero. They come
    from one run: the recurrence acts on each state column alone, so running it from ``[I | 0]``
    with values ``[0 | v]`` (``K + V`` columns) ends in ``[M | E]``.
    """
    n = int(k.shape[0])
    if k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"k must be [n,H,K] and v [n,HV,V]; got {tuple(k.shape)} and {tuple(v.shape)}")
    K, HV = int(k.shape[2]), int(v.shape[1])
    cdt = _compute_dtype(k.dtype)
    roots = _host_i64(seg_parent, "seg_parent") < 0
    import numpy as np

    v_aug = torch.cat([v.new_zeros((n, HV, K), dtype=cdt), v.to(cdt)], dim=-1)
    eye = torch.eye(K, dtype=cdt, device=k.device).expand(1, HV, K, K)
    S0 = torch.cat([eye, eye.new_zeros((1, HV, K, int(v.shape[2])))], dim=-1)
    _, final = gated_delta_rule_forest(torch.zeros_like(k, dtype=cdt), k.to(cdt), v_aug, g, beta, seg_start, seg_len,
                                       seg_parent, initial_state=S0, initial_index=np.where(roots, 0, -1),
                                       final_segments=summary_segments, chunk_size=chunk_size)
    return final[..., :K], final[..., K:]
