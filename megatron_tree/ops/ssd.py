"""Tree SSD (Mamba-2 state-space duality) on a prefix forest.

Per head ``h`` (state ``[P,S]``), with ``a_t = dt_t * A_h`` (<= 0):

    h_t = exp(a_t) * h_{t-1} + dt_t * x_t B_t^T        y_t = h_t C_t + D_h * x_t

Head ``h`` reads group ``h // (H // G)`` of ``B``/``C`` (mamba's convention).

On a tree every segment starts from its parent's final state (zero at a root), so the forest runs
one segment-tree level at a time (`levels.level_schedule`): all segments of a level form one batch
whose rows carry per-segment initial states, and the final states of a level seed the next one.
Siblings index the same parent state, so autograd adds their state gradients.

Backends: ``"torch"`` (chunked SSD below, exact in float64, runs everywhere) and ``"mamba"``
(mamba-ssm's Triton ``mamba_chunk_scan_combined``; CUDA only, imported inside the function).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..tree.layout import TreeLayout
from .backend import select_backend
from .levels import level_schedule

CHUNK_SIZE = 64
# Chunk-to-chunk state passing uses a dense (n+1)x(n+1) decay matrix up to this many chunks and a
# recursive blocked scan beyond it, so its cost stays linear in the number of chunks (small blocks
# keep the matrix work a few state updates per chunk).
_SCAN_BLOCK = 8
_GPU_BACKENDS = {"mamba": "mamba_ssm"}


# ---------------------------------------------------------------------------------------------
# batch-first chunked SSD (torch)
# ---------------------------------------------------------------------------------------------
def _segsum_exp(a: torch.Tensor) -> torch.Tensor:
    """``a[..., T]`` log-decays -> ``L[..., T, T]`` with ``L[t,s] = exp(a_{s+1} + ... + a_t)`` for
    ``s <= t`` and 0 above the diagonal.

    Each entry is a direct sum of the log-decays between s and t (masked cumulative sum), not a
    difference of two running sums: differences cancel catastrophically once the running sum is
    large, which float32 cannot afford.
    """
    T = a.shape[-1]
    strict = torch.ones(T, T, dtype=torch.bool, device=a.device).tril(-1)
    lower = torch.ones(T, T, dtype=torch.bool, device=a.device).tril()
    terms = torch.where(strict, a.unsqueeze(-1), a.new_zeros(()))  # [t, s] = a_t for t > s
    return torch.where(lower, torch.exp(terms.cumsum(dim=-2)), a.new_zeros(()))


def _chain_states(log_decay: torch.Tensor, inputs: torch.Tensor, init: torch.Tensor | None) -> torch.Tensor:
    """All prefix states of the affine chain ``h_0 = init``, ``h_{c+1} = exp(log_decay_c) h_c + inputs_c``.

    log_decay [*,n], inputs [*,n,P,S], init [*,P,S] or None (zero); ``*`` are batch dims.
    Returns [*,n+1,P,S] (``h_0 .. h_n``). Up to ``_SCAN_BLOCK`` steps: one decay-matrix product.
    Beyond: blocks of ``_SCAN_BLOCK`` steps are solved from a zero start in parallel, the block entry
    states come from the (recursive) chain over block totals, and each block adds its entry state
    times its decay. Work stays O(n * _SCAN_BLOCK) instead of O(n^2).
    """
    n = log_decay.shape[-1]
    P, S = inputs.shape[-2:]
    if n <= _SCAN_BLOCK:
        w = _segsum_exp(F.pad(log_decay, (1, 0)))                  # [*,n+1,n+1]: step 0 has no decay
        h = (w[..., 1:] @ inputs.flatten(-2)).unflatten(-1, (P, S))
        if init is not None:
            h = h + w[..., 0, None, None] * init.unsqueeze(-3).to(inputs.dtype)
        return h
    K = _SCAN_BLOCK
    nb = -(-n // K)
    pad = nb * K - n
    ld = F.pad(log_decay, (0, pad)).unflatten(-1, (nb, K))           # padded steps: no decay, no input
    u = F.pad(inputs, (0, 0, 0, 0, 0, pad)).unflatten(-3, (nb, K))   # [*,nb,K,P,S]
    local = _chain_states(ld, u, None)                               # [*,nb,K+1,P,S]
    entry = _chain_states(ld.sum(-1), local[..., K, :, :], init)     # [*,nb+1,P,S]
    before = F.pad(ld.cumsum(-1), (1, 0))[..., :K]                   # log-decay from block start to step i
    h = local[..., :K, :, :] + torch.exp(before)[..., None, None] * entry[..., :nb, None, :, :]
    return torch.cat([h.flatten(-4, -3), entry[..., nb:, :, :]], dim=-3)[..., : n + 1, :, :]


def _check_batch_first(x, dt, A, B, C, D, initial_state):
    if x.dim() != 4:
        raise ValueError(f"x must be [b,T,H,P], got {tuple(x.shape)}")
    b, T, H, P = x.shape
    if B.dim() != 4 or B.shape[:2] != (b, T) or C.shape != B.shape:
        raise ValueError(f"B and C must be [b,T,G,S] matching x {tuple(x.shape)}; got {tuple(B.shape)}, {tuple(C.shape)}")
    G, S = B.shape[2:]
    if G == 0 or H % G:
        raise ValueError(f"number of heads {H} must be a multiple of the number of groups {G}")
    if dt.shape != (b, T, H):
        raise ValueError(f"dt must be [b,T,H] = {(b, T, H)}, got {tuple(dt.shape)}")
    if A.shape != (H,):
        raise ValueError(f"A must be [H] = ({H},), got {tuple(A.shape)}")
    if D is not None and D.shape not in ((H,), (H, P)):
        raise ValueError(f"D must be [H] = ({H},) or [H,P] = {(H, P)}, got {tuple(D.shape)}")
    if initial_state is not None and initial_state.shape != (b, H, P, S):
        raise ValueError(f"initial_state must be [b,H,P,S] = {(b, H, P, S)}, got {tuple(initial_state.shape)}")


def _skip_weight(D: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """D as a [H,P] (or broadcastable [H,1]) multiplier of x."""
    D = D.to(dtype)
    return D[:, None] if D.dim() == 1 else D


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half precisions accumulate decays and states in float32, like the GPU kernels do.
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def ssd_chunked_torch(x, dt, A, B, C, *, D=None, initial_state=None, chunk_size: int = CHUNK_SIZE,
                      return_final_state: bool = False):
    """Chunked SSD, batch-first, differentiable (autograd) and exact in float64.

    x [b,T,H,P], dt [b,T,H] (> 0), A [H] (< 0), B/C [b,T,G,S] with H % G == 0, D [H] (or [H,P]) or None,
    initial_state [b,H,P,S] or None (zero). Returns y [b,T,H,P] (x's dtype), and with
    ``return_final_state`` also the state after step T-1, [b,H,P,S] (float32 for half inputs).

    Within a chunk of ``chunk_size`` steps the output is the quadratic form
    ``y_t = sum_{s<=t} exp(a_{s+1..t}) (C_t.B_s) dt_s x_s``; chunk states (from a zero start) are
    chained across chunks and each chunk adds ``exp(a_{start..t}) C_t h_in`` for its entry state.
    T need not be a multiple of the chunk size: the tail is padded with dt = 0, x = 0 steps, which
    leave the state unchanged.
    """
    _check_batch_first(x, dt, A, B, C, D, initial_state)
    b, T, H, P = x.shape
    G, S = B.shape[2:]
    R = H // G
    out_dtype = x.dtype
    cdt = _compute_dtype(x.dtype)
    x, dt, A, B, C = (t.to(cdt) for t in (x, dt, A, B, C))
    if T == 0:
        y = x.new_zeros(b, 0, H, P).to(out_dtype)
        if not return_final_state:
            return y
        final = x.new_zeros(b, H, P, S) if initial_state is None else initial_state.to(cdt)
        return y, final
    Q = max(1, min(int(chunk_size), T))
    nc = -(-T // Q)
    pad = nc * Q - T
    # Head-major layout [b,G,R,nc,Q,...]: contractions are batched matmuls and the chunk states
    # come out ordered [b,H,nc] for the chunk-to-chunk chain without a transpose.
    xh = F.pad(x, (0, 0, 0, 0, 0, pad)).reshape(b, nc, Q, G, R, P).permute(0, 3, 4, 1, 2, 5)
    dth = F.pad(dt, (0, 0, 0, pad)).reshape(b, nc, Q, G, R).permute(0, 3, 4, 1, 2)
    Bg = F.pad(B, (0, 0, 0, 0, 0, pad)).reshape(b, nc, Q, G, S).permute(0, 3, 1, 2, 4)   # [b,G,nc,Q,S]
    Cg = F.pad(C, (0, 0, 0, 0, 0, pad)).reshape(b, nc, Q, G, S).permute(0, 3, 1, 2, 4)

    a = dth * A.reshape(G, R, 1, 1)                                     # [b,G,R,nc,Q] log-decays
    L = _segsum_exp(a)                                                  # [b,G,R,nc,Q,Q]
    xdt = xh * dth.unsqueeze(-1)                                        # [b,G,R,nc,Q,P]

    # intra-chunk: C.B is per group and shared by the group's heads
    CB = Cg @ Bg.transpose(-1, -2)                                      # [b,G,nc,Q,Q]
    y = (L * CB.unsqueeze(2)) @ xdt                                     # [b,G,R,nc,Q,P]

    # state at the end of each chunk from a zero start: L's last row is exp(a_{s+1..Q-1})
    to_end = L[..., -1, :].unsqueeze(-1)                                # [b,G,R,nc,Q,1]
    states = torch.einsum("bgrcqp,bgcqn->bgrcpn", xdt * to_end, Bg).reshape(b, H, nc, P, S)
    acs = a.cumsum(dim=-1)                                              # within a chunk
    init = None if initial_state is None else initial_state.to(cdt)
    h = _chain_states(acs[..., -1].reshape(b, H, nc), states, init)     # [b,H,nc+1,P,S]

    # inter-chunk: the chunk's entry state decayed to step t and read out by C_t
    h_in = h.unflatten(1, (G, R))[:, :, :, :nc]                         # [b,G,R,nc,P,S]
    y = y + torch.einsum("bgcqn,bgrcpn->bgrcqp", Cg, h_in) * torch.exp(acs).unsqueeze(-1)
    y = y.permute(0, 3, 4, 1, 2, 5).reshape(b, nc * Q, H, P)[:, :T]
    if D is not None:
        y = y + x * _skip_weight(D, cdt)
    y = y.to(out_dtype)
    return (y, h[:, :, nc]) if return_final_state else y


def ssd_recurrent_ref(x, dt, A, B, C, *, D=None, initial_state=None, chunk_size: int = CHUNK_SIZE,
                      return_final_state: bool = False):
    """Token-by-token SSD recurrence with :func:`ssd_chunked_torch`'s signature (tests only: one
    Python step per token). ``chunk_size`` is accepted and ignored."""
    del chunk_size
    _check_batch_first(x, dt, A, B, C, D, initial_state)
    b, T, H, P = x.shape
    G, S = B.shape[2:]
    out_dtype = x.dtype
    cdt = _compute_dtype(x.dtype)
    x, dt, A, B, C = (t.to(cdt) for t in (x, dt, A, B, C))
    Bh = B.repeat_interleave(H // G, dim=2)                               # [b,T,H,S]
    Ch = C.repeat_interleave(H // G, dim=2)
    h = x.new_zeros(b, H, P, S) if initial_state is None else initial_state.to(cdt)
    ys = []
    for t in range(T):
        decay = torch.exp(dt[:, t] * A)[..., None, None]
        h = decay * h + (dt[:, t, :, None] * x[:, t]).unsqueeze(-1) * Bh[:, t].unsqueeze(-2)
        ys.append(torch.einsum("bhpn,bhn->bhp", h, Ch[:, t]))
    y = torch.stack(ys, dim=1) if ys else x.new_zeros(b, 0, H, P)
    if D is not None:
        y = y + x * _skip_weight(D, cdt)
    y = y.to(out_dtype)
    return (y, h) if return_final_state else y


# ---------------------------------------------------------------------------------------------
# tree SSD
# ---------------------------------------------------------------------------------------------
def _run_torch(x, dt, A, B, C, init, chunk_size):
    return ssd_chunked_torch(x, dt, A, B, C, initial_state=init, chunk_size=chunk_size, return_final_state=True)


def _run_mamba(x, dt, A, B, C, init, chunk_size):
    # Segments are batch rows with their own initial states: the packed (seq_idx / cu_seqlens)
    # path of the kernel hands an initial state to the first sequence only.
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    if init is not None:
        init = init.float().contiguous()
    y, final = mamba_chunk_scan_combined(
        x.contiguous(), dt.contiguous(), A.float().contiguous(), B.contiguous(), C.contiguous(), chunk_size,
        D=None, initial_states=init, return_final_states=True)
    return y, final


def _gather(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``t[rows]`` for a row-index matrix; index_select's backward is a dense index_add."""
    return t.index_select(0, rows.flatten()).reshape(*rows.shape, *t.shape[1:])


def _length_buckets(lengths: torch.Tensor) -> list[torch.Tensor]:
    """Split a level's segments into groups of similar length (next power of two), so a short
    segment is never padded to a long sibling's length (at most 2x padding per group).
    Returns index tensors into ``lengths``."""
    key = torch.ceil(torch.log2(lengths.double())).long()
    return [torch.nonzero(key == k).flatten() for k in torch.unique(key).tolist()]


def _check_tree(x, dt, A, B, C, D, layout):
    if x.dim() != 3:
        raise ValueError(f"x must be [N,H,P], got {tuple(x.shape)}")
    N, H, P = x.shape
    if N != layout.num_rows:
        raise ValueError(f"x has {N} rows but the layout has {layout.num_rows}")
    if B.dim() != 3 or B.shape[0] != N or C.shape != B.shape:
        raise ValueError(f"B and C must be [N,G,S] with N={N}; got {tuple(B.shape)}, {tuple(C.shape)}")
    G = B.shape[1]
    if G == 0 or H % G:
        raise ValueError(f"number of heads {H} must be a multiple of the number of groups {G}")
    if dt.shape != (N, H):
        raise ValueError(f"dt must be [N,H] = {(N, H)}, got {tuple(dt.shape)}")
    if A.shape != (H,):
        raise ValueError(f"A must be [H] = ({H},), got {tuple(A.shape)}")
    if D is not None and D.shape not in ((H,), (H, P)):
        raise ValueError(f"D must be [H] = ({H},) or [H,P] = {(H, P)}, got {tuple(D.shape)}")


def tree_ssd(x, dt, A, B, C, layout: TreeLayout, *, D=None, backend: str = "auto",
             chunk_size: int = CHUNK_SIZE, initial_state=None, initial_index=None, final_segments=None):
    """Mamba-2 SSD over a prefix forest, token-major.

    x [N,H,P], dt [N,H] (already positive: after bias and softplus), A [H] (negative),
    B/C [N,G,S] (head h reads group h // (H//G)), D [H] (or [H,P]) or None. Returns y [N,H,P] in x's dtype.

    Row r of y equals the SSD output at r of the sequence formed by r's root path: each segment
    starts from its parent's final state (zero at a root). Padding rows (one-row root segments at the
    end of the layout) get the exact one-step output from a zero state, computed in closed form so
    they never enter a level batch. ``backend``: "auto" (mamba-ssm on CUDA when it imports, else
    torch), "torch" or "mamba". ``chunk_size`` is the SSD chunk length of either backend.

    Segments of a level are grouped by length (next power of two) and each group runs as one batch
    ``[n_segments, T_group, ...]`` padded with dt = 0 steps, so padding never exceeds 2x per group.

    ``initial_state`` [b,H,P,S] with ``initial_index`` [num_segments] (host ints): a root segment ``s`` with
    ``initial_index[s] >= 0`` starts from ``initial_state[initial_index[s]]`` instead of zero (the
    state a previous computation ended with; carry). ``final_segments`` [F]: then returns
    ``(y, final [F,H,P,S])``, the state after each of those segments (float32 for half inputs).
    Both differentiable.
    """
    _check_tree(x, dt, A, B, C, D, layout)
    name = select_backend("tree_ssd", backend, x, _GPU_BACKENDS)
    run = _run_mamba if name == "mamba" else _run_torch
    N, H, P = x.shape
    G = B.shape[1]
    cdt = _compute_dtype(x.dtype)
    layout = layout.to(x.device) if layout.device != x.device else layout
    if N == 0:  # an empty shard still returns a result attached to every input's graph
        y0 = x.new_zeros(0, H, P) + 0 * (dt.sum() + A.sum() + B.sum() + C.sum())
        return y0 if final_segments is None else (y0, x.new_zeros(0, H, P, B.shape[2], dtype=cdt))
    idx0 = None
    if initial_state is not None:
        idx0 = torch.as_tensor(np.asarray(initial_index, dtype=np.int64), device=x.device)
        if idx0.shape != (layout.num_segments,):
            raise ValueError(f"initial_index must have shape [{layout.num_segments}]; got {tuple(idx0.shape)}")
        init_ext = torch.cat([initial_state.to(cdt), initial_state.new_zeros((1,) + tuple(initial_state.shape[1:]),
                                                                             dtype=cdt)])
        idx0 = torch.where(idx0 >= 0, idx0, initial_state.shape[0])
    want = None if final_segments is None else torch.as_tensor(np.asarray(final_segments, dtype=np.int64),
                                                               device=x.device)
    got_segs, got_states = [], []

    # Padded steps (row index N) get dt = 0 from a sentinel row: no decay, no input, so the state
    # passes through unchanged. x, B and C there are read from any real row (dt = 0 cancels them,
    # and the outputs at padded steps are dropped), which spares copying them.
    dtz = torch.cat([dt, dt.new_zeros(1, H)])

    slot = torch.full((layout.num_segments,), -1, dtype=torch.long, device=x.device)
    prev_final = None
    out_rows, out_vals = [], []
    for depth, level in enumerate(level_schedule(layout, include_padding=False)):
        segs, parent, lengths, rows = level.segments, level.parent, level.lengths, level.rows
        init_all = None if depth == 0 else prev_final[slot[parent]]
        if depth == 0 and idx0 is not None:
            init_all = init_ext[idx0[segs]]
        finals, order = [], []
        for idx in _length_buckets(lengths):
            T = int(lengths[idx].max().item())
            r = rows[idx, :T]
            init = None if init_all is None else init_all[idx]
            rc = r.clamp(max=N - 1)
            y, final = run(_gather(x, rc), _gather(dtz, r), A, _gather(B, rc), _gather(C, rc), init, chunk_size)
            flat_r = r.flatten()
            keep_pos = torch.nonzero(flat_r != level.pad_row).flatten()
            out_rows.append(flat_r[keep_pos])
            out_vals.append(y.reshape(-1, H, P).index_select(0, keep_pos).to(cdt))
            finals.append(final.to(cdt))
            order.append(idx)
        order = torch.cat(order)
        slot[segs[order]] = torch.arange(order.numel(), device=x.device)
        prev_final = torch.cat(finals)
        if want is not None:
            hit = torch.isin(segs[order], want)
            got_segs.append(segs[order][hit])
            got_states.append(prev_final[hit])

    if layout.num_padding:
        # A padding row is a one-step sequence from a zero state: y = dt (C.B) x.
        p = torch.arange(N - layout.num_padding, N, device=x.device)
        cb = (C[p].to(cdt) * B[p].to(cdt)).sum(-1).repeat_interleave(H // G, dim=1)   # [n_pad,H]
        out_rows.append(p)
        out_vals.append((dt[p].to(cdt) * cb).unsqueeze(-1) * x[p].to(cdt))

    y = torch.zeros(N, H, P, dtype=cdt, device=x.device).index_copy(0, torch.cat(out_rows), torch.cat(out_vals))
    if D is not None:
        y = y + x.to(cdt) * _skip_weight(D, cdt)
    if want is None:
        return y.to(x.dtype)
    segs_all = torch.cat(got_segs) if got_segs else want.new_zeros(0)
    states = torch.cat(got_states) if got_states else y.new_zeros((0, H, P, B.shape[2]))
    pos = torch.full((layout.num_segments,), -1, dtype=torch.long, device=x.device)
    pos[segs_all] = torch.arange(segs_all.numel(), device=x.device)
    if (pos[want] < 0).any():
        raise ValueError("final_segments must name real (non-padding) segments")
    return y.to(x.dtype), states[pos[want]]
