"""Torch stand-ins for the GPU kernels that Megatron-Core's stock SSM layers import.

``megatron.core.ssm.gated_delta_net.GatedDeltaNet`` needs FLA (``chunk_gated_delta_rule``,
``l2norm``); ``megatron.core.ssm.mamba_mixer.MambaMixer`` needs mamba-ssm
(``mamba_chunk_scan_combined``, ``mamba_split_conv1d_scan_combined``, the gated ``RMSNorm``),
einops, and imports Triton inference kernels at module import time. None of these import on a
CPU-only host, so the stock layers refuse to construct. ``megatron.core.ssm.mamba_block.MambaStack``
builds its final norm with transformer-engine's ``TENorm`` whatever its spec says; without TE that
name is pointed at Megatron's torch norm (same parameter names).

:func:`install` (called by ``megatron_tree.cpu.enable(kernels=True)``) sets module
attributes of those two Megatron modules to the adapters below, which call this project's torch
references (``megatron_tree.ops.gated_delta_rule.chunk_gated_delta_rule_torch`` and
``megatron_tree.ops.ssd.ssd_chunked_torch``). No fake ``fla``/``mamba_ssm``/``triton`` package is
put in ``sys.modules``, so ``megatron_tree.ops.backend.module_available("fla")`` stays honest.
The only ``sys.modules`` entry added is a stand-in for Megatron's own inference-only Triton module
``...attention_context.triton.tensor_ops`` when Triton is absent (its functions raise).

The adapters keep the kernels' calling conventions (batch-first ``[b, L, ...]``) so the stock
layer code runs unchanged: ``dt_bias``/``dt_softplus``/``dt_limit``, ``D`` skip (``[H]`` or
``[H, P]``), ``z`` gating, ``seq_idx`` packing (one independent sequence per run of equal ids,
batch 1) and FLA's ``cu_seqlens`` are handled here.
"""
from __future__ import annotations

import importlib
import importlib.util
import math
import re
import sys
import types
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..ops.gated_delta_rule import l2norm  # FLA's l2norm, shared with TreeGatedDeltaNet

_TENSOR_OPS = "megatron.core.inference.contexts.attention_context.triton.tensor_ops"


# ----------------------------------------------------------------------------------------------
# FLA stand-ins
# ----------------------------------------------------------------------------------------------
def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, **unused):
    """FLA ``chunk_gated_delta_rule`` calling convention on top of the torch reference.

    q, k [B,T,H,K]; v [B,T,HV,V]; g (log decay), beta [B,T,HV]; initial_state [N,HV,K,V] where N is
    B, or the number of packed sequences when ``cu_seqlens`` (int [N+1], needs B == 1) is given.
    Returns ``(o [B,T,HV,V] in v's dtype, final_state [N,HV,K,V] or None)``.
    """
    from megatron_tree.ops.gated_delta_rule import chunk_gated_delta_rule_torch

    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if cu_seqlens is None:
        o, final = chunk_gated_delta_rule_torch(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                                output_final_state=output_final_state)
        return o.to(v.dtype), final
    if q.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs batch size 1; got {q.shape[0]}")
    bounds = [int(b) for b in cu_seqlens.tolist()]
    outs, finals = [], []
    for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):  # one call per packed sequence
        s0 = None if initial_state is None else initial_state[i:i + 1]
        o, final = chunk_gated_delta_rule_torch(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi],
                                                scale=scale, initial_state=s0, output_final_state=output_final_state)
        outs.append(o)
        finals.append(final)
    o = torch.cat(outs, dim=1).to(v.dtype)
    return o, (torch.cat(finals, dim=0) if output_final_state else None)


# ----------------------------------------------------------------------------------------------
# mamba-ssm stand-ins
# ----------------------------------------------------------------------------------------------
def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                   z: Optional[torch.Tensor] = None, *, eps: float = 1e-6, group_size: Optional[int] = None,
                   norm_before_gate: bool = True) -> torch.Tensor:
    """mamba-ssm's gated RMSNorm: RMS over groups of ``group_size`` channels of the last dim,
    scaled by ``weight`` (+ ``bias``); gate ``silu(z)`` applied after the norm when
    ``norm_before_gate`` else to the input before it. Float32 inside for half inputs."""
    dtype = x.dtype
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    x = x.to(cdt)
    gate = None if z is None else F.silu(z.to(cdt))
    if gate is not None and not norm_before_gate:
        x = x * gate
    d = x.shape[-1]
    gs = d if group_size is None else int(group_size)
    if d % gs:
        raise ValueError(f"group_size {gs} does not divide {d}")
    xg = x.reshape(*x.shape[:-1], d // gs, gs)
    y = (xg * torch.rsqrt(xg.pow(2).mean(-1, keepdim=True) + eps)).reshape(x.shape)
    y = y * weight.to(cdt)
    if bias is not None:
        y = y + bias.to(cdt)
    if gate is not None and norm_before_gate:
        y = y * gate
    return y.to(dtype)


class RMSNormGated(torch.nn.Module):
    """Module form of :func:`gated_rms_norm` with mamba-ssm's constructor
    ``(hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None)``."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: Optional[int] = None,
                 norm_before_gate: bool = True, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, z: Optional[torch.Tensor] = None) -> torch.Tensor:
        return gated_rms_norm(x, self.weight, self.bias, z, eps=self.eps, group_size=self.group_size,
                              norm_before_gate=self.norm_before_gate)


class ExtendedRMSNorm(RMSNormGated):
    """:class:`RMSNormGated` with a Megatron sharded state dict (``weight`` split over TP on axis 0),
    standing in for ``mamba_mixer.ExtendedRMSNorm``."""

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        tp_group = getattr(self, "tp_group", None) or parallel_state.get_tensor_model_parallel_group()
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0},
                                                   sharded_offsets, tp_group=tp_group,
                                                   dp_cp_group=(metadata or {}).get("dp_cp_group"))


def _runs(seq_idx: Optional[torch.Tensor], length: int) -> list[tuple[int, int]]:
    """[(start, end)] of the packed sequences along L (``seq_idx`` [1, L], runs of equal ids)."""
    if seq_idx is None:
        return [(0, length)]
    if seq_idx.dim() != 2 or seq_idx.shape[0] != 1:
        raise ValueError(f"seq_idx must have shape [1, L]; got {tuple(seq_idx.shape)}")
    ids = seq_idx[0]
    cuts = (torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1).tolist()
    bounds = [0] + cuts + [length]
    return list(zip(bounds[:-1], bounds[1:]))


def _scan(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, dt_softplus, dt_limit, want_final):
    """One packed sequence (or a plain batch) of the chunk-scan contract; see the public adapter."""
    from megatron_tree.ops.ssd import ssd_chunked_torch

    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    dt = dt.to(cdt)
    if dt_bias is not None:
        dt = dt + dt_bias.to(cdt)
    if dt_softplus:
        dt = F.softplus(dt)
    lo, hi = dt_limit
    if lo > 0.0 or hi != math.inf:
        dt = dt.clamp(min=lo, max=hi)
    y, final = ssd_chunked_torch(x, dt, A.to(cdt), B, C, initial_state=initial_states, chunk_size=chunk_size,
                                 return_final_state=True)
    y = y.to(cdt)
    if D is not None:  # skip connection, D [H] or [H, P]
        Dc = D.to(cdt)
        y = y + x.to(cdt) * (Dc[:, None] if Dc.dim() == 1 else Dc)
    if z is not None:
        y = y * F.silu(z.to(cdt))
    return y.to(x.dtype), (final if want_final else None)


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, return_varlen_states=False, **unused):
    """mamba-ssm ``mamba_chunk_scan_combined`` contract on top of ``ssd_chunked_torch``.

    x [b,L,H,P], dt [b,L,H] (raw: ``dt_bias`` added, then softplus if ``dt_softplus``, then
    clamped to ``dt_limit``), A [H] (< 0), B/C [b,L,G,S], D [H] or [H,P], z [b,L,H,P] gate
    (``y * silu(z)``), initial_states [b,H,P,S]. With ``seq_idx`` ([1,L]) each run of equal ids is
    an independent sequence (only the first gets ``initial_states``; the final state is the last
    run's), as in mamba-ssm. Returns y [b,L,H,P] (x's dtype), or ``(y, final_states)``.
    """
    if return_varlen_states or cu_seqlens is not None:
        raise RuntimeError("varlen states (inference prefill) are not provided by the CPU stand-in")
    runs = _runs(seq_idx, x.shape[1])
    ys, final = [], None
    for i, (lo, hi) in enumerate(runs):  # one call per packed sequence
        y, final = _scan(x[:, lo:hi], dt[:, lo:hi], A, B[:, lo:hi], C[:, lo:hi], chunk_size, D,
                         None if z is None else z[:, lo:hi], dt_bias, initial_states if i == 0 else None,
                         dt_softplus, dt_limit, True)
        ys.append(y)
    y = torch.cat(ys, dim=1)
    return (y, final) if return_final_states else y


def _causal_depthwise_conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                           activation: Optional[str]) -> torch.Tensor:
    """Depthwise causal conv over L: x [b,L,C], weight [C,W] -> [b,L,C] (zeros before the start)."""
    W = weight.shape[-1]
    y = F.conv1d(F.pad(x.transpose(1, 2), (W - 1, 0)), weight.unsqueeze(1), bias, groups=weight.shape[0])
    if activation in ("silu", "swish"):
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"unsupported activation {activation!r}")
    return y.transpose(1, 2)


def fla_causal_conv1d(x, weight, bias=None, activation=None, initial_state=None, output_final_state=False,
                      cu_seqlens=None, **unused):
    """FLA ``fla.modules.convolution.causal_conv1d`` contract (called by megatron-core 0.19.x's
    ``GatedDeltaNet.forward``): x [b, L, C], weight [C, W] -> ``(y [b, L, C], final_state)``.
    With ``cu_seqlens`` (b = 1) the conv restarts at every packed sequence. Initial and final conv
    states (inference) are not provided by the stand-in."""
    if initial_state is not None or output_final_state:
        raise RuntimeError("conv initial/final states (inference) are not provided by the CPU stand-in")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported activation {activation!r}")
    if cu_seqlens is None:
        return _causal_depthwise_conv(x, weight, bias, activation), None
    bounds = [int(b) for b in cu_seqlens.tolist()]
    ys = [_causal_depthwise_conv(x[:, lo:hi], weight, bias, activation) for lo, hi in zip(bounds[:-1], bounds[1:])]
    return torch.cat(ys, dim=1), None


def mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                     initial_states=None, seq_idx=None, dt_limit=(0.0, float("inf")),
                                     return_final_states=False, activation="silu", rmsnorm_weight=None,
                                     rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None,
                                     ngroups=1, norm_before_gate=True):
    """mamba-ssm ``mamba_split_conv1d_scan_combined`` contract (Megatron's memory-efficient path).

    zxbcdt [b,L, 2*d + 2*G*S + H] splits into z [d], xBC [d + 2*G*S], dt [H] with d = H*P; xBC goes
    through the depthwise causal conv (``conv1d_weight`` [d+2GS, W]) and the activation, then the
    chunk scan runs with ``dt_softplus`` and ``dt_bias``. Without ``rmsnorm_weight`` the output is
    gated by ``silu(z)`` inside the scan; with it, by the gated RMSNorm over ``ngroups`` groups.
    ``outproj_weight`` applies a final linear. Returns [b,L,d or out] (and the final state).
    """
    if D.dim() == 1:
        if headdim is None:
            raise ValueError("headdim is required when D has shape [H]")
        H, P = D.shape[0], int(headdim)
    else:
        H, P = D.shape
    d = H * P
    conv_dim = conv1d_weight.shape[0]
    S = (conv_dim - d) // (2 * ngroups)
    if zxbcdt.shape[-1] != 2 * d + 2 * ngroups * S + H:
        raise ValueError(f"zxbcdt last dim {zxbcdt.shape[-1]} != 2*{d} + 2*{ngroups}*{S} + {H}")
    b, L = zxbcdt.shape[:2]
    z, xBC, dt = torch.split(zxbcdt, [d, conv_dim, H], dim=-1)
    ys, final = [], None
    for i, (lo, hi) in enumerate(_runs(seq_idx, L)):  # the conv restarts at each packed sequence too
        xbc = _causal_depthwise_conv(xBC[:, lo:hi], conv1d_weight, conv1d_bias, activation)
        x, Bm, Cm = torch.split(xbc, [d, ngroups * S, ngroups * S], dim=-1)
        n = hi - lo
        y, final = _scan(x.reshape(b, n, H, P), dt[:, lo:hi], A, Bm.reshape(b, n, ngroups, S),
                         Cm.reshape(b, n, ngroups, S), chunk_size, D,
                         z[:, lo:hi].reshape(b, n, H, P) if rmsnorm_weight is None else None, dt_bias,
                         initial_states if i == 0 else None, True, dt_limit, True)
        ys.append(y.reshape(b, n, d))
    y = torch.cat(ys, dim=1)
    if rmsnorm_weight is not None:
        y = gated_rms_norm(y, rmsnorm_weight, None, z, eps=rmsnorm_eps, group_size=d // ngroups,
                           norm_before_gate=norm_before_gate)
    if outproj_weight is not None:
        y = F.linear(y, outproj_weight, outproj_bias)
    return (y, final) if return_final_states else y


# ----------------------------------------------------------------------------------------------
# einops stand-in (only when einops is not installed)
# ----------------------------------------------------------------------------------------------
def _parse_side(side: str) -> list[list[str]]:
    groups: list[list[str]] = []
    current: Optional[list[str]] = None
    for tok in re.findall(r"\(|\)|[A-Za-z_][A-Za-z0-9_]*|\d+", side):
        if tok == "(":
            current = []
        elif tok == ")":
            groups.append(current)
            current = None
        else:
            if tok.isdigit() and tok != "1":
                raise ValueError(f"only the unit axis '1' may be a number; got {tok!r}")
            item = [] if tok == "1" else [tok]
            if current is None:
                groups.append(item)
            else:
                current.extend(item)
    return groups


def _einops(t: torch.Tensor, pattern: str, sizes: dict, allow_new: bool) -> torch.Tensor:
    lhs, rhs = pattern.split("->")
    left, right = _parse_side(lhs), _parse_side(rhs)
    if len(left) != t.dim():
        raise ValueError(f"pattern {pattern!r} expects {len(left)} dims; tensor has {t.dim()}")
    size = dict(sizes)
    for group, dim in zip(left, t.shape):
        unknown = [a for a in group if a not in size]
        known = math.prod(size[a] for a in group if a in size)
        if len(unknown) > 1:
            raise ValueError(f"cannot infer sizes of {unknown} in {pattern!r}")
        if unknown:
            if dim % known:
                raise ValueError(f"{dim} is not divisible by {known} in {pattern!r}")
            size[unknown[0]] = dim // known
        elif known != dim:
            raise ValueError(f"axis group {group} has size {dim}, expected {known} in {pattern!r}")
    names = [a for g in left for a in g]
    out_names = [a for g in right for a in g]
    if set(names) - set(out_names):
        raise ValueError(f"axes {sorted(set(names) - set(out_names))} disappear in {pattern!r}")
    new = [a for a in out_names if a not in names]
    if new and not allow_new:
        raise ValueError(f"new axes {new} in rearrange pattern {pattern!r}")
    flat = t.reshape([size[a] for a in names]).permute([names.index(a) for a in out_names if a in names])
    flat = flat.reshape([size[a] if a in names else 1 for a in out_names]).expand([size[a] for a in out_names])
    return flat.reshape([math.prod(size[a] for a in g) for g in right])


def rearrange(t: torch.Tensor, pattern: str, **sizes) -> torch.Tensor:
    """Subset of ``einops.rearrange``: axis names, parenthesised groups and the unit axis ``1``."""
    return _einops(t, pattern, sizes, allow_new=False)


def repeat(t: torch.Tensor, pattern: str, **sizes) -> torch.Tensor:
    """Subset of ``einops.repeat``: like :func:`rearrange`, plus new axes sized by keywords."""
    return _einops(t, pattern, sizes, allow_new=True)


# ----------------------------------------------------------------------------------------------
# Installation
# ----------------------------------------------------------------------------------------------
def _inference_only(name: str) -> Callable:
    def stub(*args, **kwargs):
        raise RuntimeError(f"{name} is a Triton inference kernel; it is not available on CPU")

    stub.__name__ = name
    return stub


def prepare_imports(set_attr: Callable) -> None:
    """Make ``megatron.core.ssm.mamba_mixer`` importable without Triton: its import-time
    ``from ...attention_context.triton.tensor_ops import ...`` gets a stand-in module whose
    functions (used only by dynamic-batching inference) raise."""
    if _TENSOR_OPS in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    module = types.ModuleType(_TENSOR_OPS, "CPU stand-in (megatron_tree.cpu.standins): Triton is not installed.")
    for name in ("tensor_get_slice_after", "tensor_masked_update", "tensor_merge"):
        setattr(module, name, _inference_only(name))
    set_attr(sys.modules, _TENSOR_OPS, module, "Triton inference ops module stand-in (raises if called)")


def install(set_attr: Callable) -> None:
    """Point Megatron's GatedDeltaNet and MambaMixer modules at the torch stand-ins.

    ``set_attr(target, name, value, why)`` records each change (``megatron_tree.cpu.megatron_core``).
    Real kernels are left alone where they imported.
    """
    from megatron_tree.compat.mixers import gdn_modules  # noqa: PLC0415

    # 0.16.1: one module; 0.19.x: the package and the submodules that bind the FLA names.
    modules = gdn_modules()
    if modules[0].HAVE_FLA:  # FLA imported: the real kernels stay
        modules = []
    for gdn in modules:
        # 0.16.1's single module reads names it never bound without FLA: set them all there.
        names = vars(gdn) if hasattr(gdn, "__path__") or len(modules) > 1 else None
        why = "FLA stand-in calling megatron_tree.ops.gated_delta_rule.chunk_gated_delta_rule_torch"
        if names is None or "chunk_gated_delta_rule" in names:
            set_attr(gdn, "chunk_gated_delta_rule", chunk_gated_delta_rule, why)
        if names is None or "l2norm" in names:
            set_attr(gdn, "l2norm", l2norm, "FLA l2norm stand-in")
        if names is not None and "causal_conv1d" in names and names["causal_conv1d"] is None:
            # 0.19.x: FLA's conv is called in the forward (0.16.1 falls back to nn.Conv1d itself)
            set_attr(gdn, "causal_conv1d", fla_causal_conv1d, "FLA causal_conv1d stand-in (depthwise F.conv1d)")
        if names is None or "HAVE_FLA" in names:
            set_attr(gdn, "HAVE_FLA", True, "FLA stand-ins installed")

    mixer = importlib.import_module("megatron.core.ssm.mamba_mixer")
    if not mixer.HAVE_MAMBA_SSM:
        why = "mamba-ssm stand-in calling megatron_tree.ops.ssd.ssd_chunked_torch"
        set_attr(mixer, "mamba_chunk_scan_combined", mamba_chunk_scan_combined, why)
        set_attr(mixer, "mamba_split_conv1d_scan_combined", mamba_split_conv1d_scan_combined, why)
        set_attr(mixer, "RMSNormGated", RMSNormGated, "mamba-ssm gated RMSNorm stand-in")
        # Without mamba-ssm the stock ExtendedRMSNorm is a MagicMock (it subclassed one at import).
        set_attr(mixer, "ExtendedRMSNorm", ExtendedRMSNorm, "gated RMSNorm stand-in with a sharded state dict")
        set_attr(mixer, "HAVE_MAMBA_SSM", True, "mamba-ssm stand-ins installed")
    # MambaStack builds its final norm with TENorm whatever the spec says; TENorm raises without TE.
    # Megatron's torch norm has the same parameter names (weight [, bias]) and reads the same
    # config.normalization, so a MambaModel checkpoint is unchanged by the swap.
    te_ext = importlib.import_module("megatron.core.extensions.transformer_engine")
    if not te_ext.HAVE_TE:
        from megatron.core.transformer.torch_norm import WrappedTorchNorm  # noqa: PLC0415

        # 0.16.1: ssm/mamba_block.py defines MambaStack; 0.19.x: it re-exports models/hybrid/hybrid_block.py,
        # where HybridStack reads TENorm: patch the name where the stack class is defined.
        for name in ("megatron.core.ssm.mamba_block", "megatron.core.models.hybrid.hybrid_block"):
            try:
                block = importlib.import_module(name)
            except ImportError:
                continue
            if "TENorm" in vars(block):
                set_attr(block, "TENorm", WrappedTorchNorm, "transformer-engine is not installed: the Mamba/hybrid "
                         "stack's final norm is Megatron's torch norm (same parameter names)")
    mixer_cp = importlib.import_module("megatron.core.ssm.mamba_context_parallel")
    for module in (mixer, mixer_cp):
        if not module.HAVE_EINOPS:
            set_attr(module, "rearrange", rearrange, "einops is not installed: minimal rearrange")
            set_attr(module, "repeat", repeat, "einops is not installed: minimal repeat")
            set_attr(module, "HAVE_EINOPS", True, "einops stand-ins installed")
