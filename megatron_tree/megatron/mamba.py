"""`TreeMambaMixer`: Megatron-Core's Mamba-2 mixer over a packed prefix tree.

A subclass of ``megatron.core.ssm.mamba_mixer.MambaMixer`` (same parameters, initialisation, TP
sharding, ``sharded_state_dict``); only the sequence mixing changes: the causal conv follows the
tree's root paths (`tree_causal_conv1d`) and the SSD starts every segment from its parent's final
state (`tree_ssd`). The layout arrives in ``packed_seq_params`` (`TreePackedSeqParams`).

Per row (token-major, ``N`` tree rows, batch 1; ``H`` heads of head dim ``P`` and ``G`` groups of
state size ``S`` on this TP rank)::

    z, xBC, dt = split(in_proj(x))                    # in_proj gathers the sequence under SP
    x, B, C = split(silu(conv_tree(xBC)))             # depthwise, W taps back along the root path
    dt = softplus(dt + dt_bias);  A = -exp(A_log)     # fp32 as in Megatron (fp64 models: fp64)
    y = ssd_tree(x, dt, A, B, C) + D * x              # head h reads group h // (H/G)
    y = norm(y * silu(z))   (rmsnorm)   or   y * silu(z)
    out = out_proj(y)                                 # out_proj reduce-scatters under SP

Both stock training paths compute this (the memory-efficient kernel gates inside the scan and
then normalises; the other path gates inside the gated norm with ``norm_before_gate=False``).

Under context parallelism (``config.context_parallel_size > 1``) each CP rank holds its owned rows
(``packed_seq_params.local_rows``); the conv and SSD run on head shards instead
(`megatron_tree.cp.tree_mamba_cp`: an all-to-all from token shards to head shards, every row of the
tree for ``H / cp`` of this TP rank's heads, and back), while ``in_proj``, the gate, the norm and
``out_proj`` stay with the token owners.

The class works as the ``mixer`` of a ``MambaLayer`` and as the ``self_attention`` of a
``TransformerLayer`` (attention forward kwargs accepted, ``(output, bias)`` returned; ``d_model``
defaults to ``config.hidden_size``).

Importing Megatron's ``mamba_mixer`` needs Triton (inference kernels imported at module import)
and building it needs mamba-ssm's gated RMSNorm: on a CPU-only host call
``megatron_tree.cpu.enable(kernels=True)`` first. This module therefore builds
``TreeMambaMixer`` on first access (``from megatron_tree.megatron.mamba import TreeMambaMixer``),
so importing the module itself never fails.
"""
from __future__ import annotations

import importlib
from functools import partial
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.utils import deprecate_inference_params

from ..compat.mixers import mamba_conv_params, stock_kwargs
from ..ops.causal_conv1d import tree_causal_conv1d
from ..ops.ssd import tree_ssd
from .gdn import _check_rows, _check_tree_input, _require_cpu_shims, _wide, spec_provider
from .packed_seq import get_tree_layout

__all__ = ["TreeMambaMixer", "tree_mamba_module_spec", "mamba_mixer_module"]

_STOCK = "megatron.core.ssm.mamba_mixer"


def mamba_mixer_module():
    """Megatron's ``megatron.core.ssm.mamba_mixer`` module, or ImportError saying what it needs."""
    try:
        return importlib.import_module(_STOCK)
    except ImportError as exc:
        raise ImportError(
            f"{_STOCK} does not import here ({exc}): it imports Triton inference kernels at import time. "
            "On a CPU-only host call megatron_tree.cpu.enable(kernels=True) before using TreeMambaMixer; "
            "on a GPU host install triton and mamba-ssm.") from exc


class _TreeMambaMixerImpl:
    """Body of `TreeMambaMixer` (combined with ``MambaMixer`` on first access; see the module doc).

    Constructor: the stock one (``config, submodules, d_model, d_conv, conv_init, expand,
    A_init_range, D_has_hdim, rmsnorm, norm_before_gate, dt_*, bias, conv_bias, chunk_size,
    layer_number, pg_collection, pp_layer_offset``) with ``d_model`` defaulting to
    ``config.hidden_size``, plus ``backend`` for `tree_ssd` ("auto": mamba-ssm on CUDA where it
    imports, else torch) and ``cp_comm_type`` (accepted for the ``TransformerLayer`` protocol).
    ``pg_collection`` defaults to Megatron's global groups. ``name`` (passed by megatron-core 0.19+
    spec builders) is forwarded where the stock constructor accepts it, else ignored.

    Forward: ``hidden_states [s, 1, hidden]`` (``s = N / tp`` under sequence parallelism, else
    ``N = layout.num_rows``; under CP ``N`` is this rank's ``packed_seq_params.num_local_rows``),
    ``packed_seq_params`` a `TreePackedSeqParams`; returns ``(out [s, 1, hidden], bias or None)``.
    Row ``r`` of the output equals the stock mixer run on ``r``'s root path alone. Under CP the
    CP size must divide this TP rank's head count (and its B/C groups and the CP size must divide
    one another, as Megatron's ``MambaContextParallel`` requires): a ValueError names the numbers.
    """

    def __init__(self, config, submodules, d_model: Optional[int] = None, *,
                 pg_collection: Optional[ProcessGroupCollection] = None, cp_comm_type: Optional[str] = None,
                 backend: str = "auto", name: Optional[str] = None, **kwargs):
        stock = mamba_mixer_module()
        who = type(self).__name__
        _require_cpu_shims(stock, who, kernels=True)
        if not stock.HAVE_MAMBA_SSM:
            raise ImportError(f"{who} is built on Megatron's MambaMixer, whose gated RMSNorm comes from mamba-ssm: "
                              "install mamba-ssm (GPU) or call megatron_tree.cpu.enable(kernels=True) (CPU)")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        if pg_collection.cp.size() > 1:
            _check_cp_heads(config, config.hidden_size if d_model is None else d_model, kwargs.get("expand", 2),
                            pg_collection.tp.size(), pg_collection.cp.size(), who)
        super().__init__(config, submodules, config.hidden_size if d_model is None else d_model,
                         pg_collection=pg_collection, **kwargs, **stock_kwargs(stock.MambaMixer.__init__, name=name))
        self.cp_comm_type = cp_comm_type
        self.backend = backend

    def scale_projection(self, zxBCdt: torch.Tensor) -> torch.Tensor:
        """``in_proj``'s output ``[rows, z | x | B | C | dt]`` (this TP rank's widths) as the sequence mixing
        reads it: unchanged here; a family mixer with per-part multipliers (Falcon-H1's MuP vector) scales it."""
        return zxBCdt

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                inference_context=None, rotary_pos_emb=None, attention_bias=None, packed_seq_params=None,
                sequence_len_offset: Optional[int] = None, *, inference_params=None, **kwargs):
        who = type(self).__name__
        inference_context = deprecate_inference_params(inference_context, inference_params)
        if inference_context is not None:
            raise ValueError(f"{who} is a training module: inference over a tree is not supported")
        layout = get_tree_layout(packed_seq_params)
        _check_tree_input(hidden_states, who)
        if self.config.context_parallel_size > 1:
            return self._forward_cp(hidden_states, packed_seq_params)
        cp = self.cp  # CP size 1 here: its getters return this TP rank's whole parameters
        H, P, G, S = cp.nheads_local_tpcp, self.headdim, cp.ngroups_local_tpcp, self.d_state
        d_inner = H * P

        zxBCdt, _ = self.in_proj(hidden_states)
        zxBCdt = self.scale_projection(zxBCdt.squeeze(1))
        N = zxBCdt.shape[0]
        carry = getattr(packed_seq_params, "carry", None)
        if carry is None:
            _check_rows(N, layout, who, self.pg_collection.tp.size() if self.config.sequence_parallel else 1)
        elif N != len(carry.own):
            raise ValueError(f"{who}: carry: the input covers {N} rows but the microbatch owns {len(carry.own)}")
        z, xBC, dt = torch.split(zxBCdt, [d_inner, d_inner + 2 * G * S, H], dim=-1)

        # Halos follow the root path, so a child segment continues its parent's tail, never a sibling's.
        if carry is not None:  # own rows only: halos and states continue carried rows (the step's store)
            from ..cp.execution.carry import carried_conv  # the executor sits below this package

            xBC = carried_conv(xBC, cp.get_conv1d_weight().squeeze(1), cp.get_conv1d_bias(), layout, carry,
                               ("mamba", self.layer_number), activation="silu")
        else:
            xBC = tree_causal_conv1d(xBC, cp.get_conv1d_weight().squeeze(1), cp.get_conv1d_bias(), layout,
                                     activation="silu")
        x, B, C = torch.split(xBC, [d_inner, G * S, G * S], dim=-1)
        x = x.reshape(N, H, P)
        B = B.reshape(N, G, S)
        C = C.reshape(N, G, S)

        # fp32 like the mamba-ssm kernels (the stock layer's `.float()`), fp64 for a float64 model.
        cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
        A = -torch.exp(_wide(cp.get_A_log()))
        dt = F.softplus(dt.to(cdt) + _wide(cp.get_dt_bias()).to(cdt))
        D = cp.get_D()
        if carry is not None:
            from ..cp.execution.carry import carried_mamba_ssd

            ssd = partial(carried_mamba_ssd, layout=layout, view=carry, key=("mamba", self.layer_number),
                          backend=self.backend, chunk_size=self.chunk_size)
        else:
            ssd = partial(tree_ssd, layout=layout, backend=self.backend, chunk_size=self.chunk_size)
        if self.D_has_hdim:
            y = ssd(x, dt, A, B, C)
            y = (y.to(cdt) + x.to(cdt) * D.to(cdt).reshape(H, P)).to(x.dtype)
        else:
            y = ssd(x, dt, A, B, C, D=D)
        y = y.reshape(N, d_inner)

        if self.rmsnorm:
            y = self.norm(y, z)  # norm_before_gate=False: rmsnorm(y * silu(z)) over groups
        else:
            y = (y.to(cdt) * F.silu(z.to(cdt))).to(y.dtype)
        return self.out_proj(y.unsqueeze(1))

    def _forward_cp(self, hidden_states: torch.Tensor, psp):
        """Tree CP: the token -> head transpose of `megatron_tree.cp.tree_mamba_cp`.

        ``in_proj`` runs on this rank's rows (under SP it gathers the TP ranks' parts of the local
        sequence: ``psp.local_rows`` followed by ``psp.num_local_padding`` padding rows). The owned
        rows' ``x | B | C | dt`` go to the head shards, conv + SSD run there over the whole tree for
        ``H / cp`` of this TP rank's heads, and ``y`` returns; the gate ``z`` never leaves. Padding
        rows get ``y = 0`` (their output is never read). The plan rides in ``packed_seq_params``, so
        activation recomputation replays the same exchanges.
        """
        who = type(self).__name__
        plan = psp.cp_plan
        if plan is None or psp.local_rows is None:
            raise ValueError("context_parallel_size > 1 needs a CP plan in packed_seq_params: build it with "
                             "tree_packed_seq_params(mb, cp_plan=megatron_tree.cp.plan_context_parallel(mb.layout, "
                             "cp_size), cp_rank=...) or let tree_forward_step plan it")
        from ..cp import tree_mamba_cp  # the executor sits below this package

        H, P, G, S = self.nheads_local_tp, self.headdim, self.ngroups_local_tp, self.d_state
        d_inner = H * P
        zxBCdt, _ = self.in_proj(hidden_states)
        zxBCdt = self.scale_projection(zxBCdt.squeeze(1))
        s, n = zxBCdt.shape[0], int(psp.local_rows.shape[0])
        if s != psp.num_local_rows:
            sp = self.pg_collection.tp.size() if self.config.sequence_parallel else 1
            raise ValueError(f"{who}: the input covers {s} rows (sequence x {sp} under sequence parallelism) but this "
                             f"CP rank holds {psp.num_local_rows} ({n} owned + {psp.num_local_padding} padding)")
        z, xBCdt = torch.split(zxBCdt[:n], [d_inner, zxBCdt.shape[1] - d_inner], dim=-1)
        conv_w, conv_b = mamba_conv_params(self)  # the conv's parameter names differ across versions
        y = tree_mamba_cp(xBCdt, conv_w.squeeze(1), conv_b, _wide(self.dt_bias),
                          -torch.exp(_wide(self.A_log)), self.D, psp.layout, plan, self.pg_collection.cp,
                          head_dim=P, num_groups=G, d_state=S, backend=self.backend, chunk_size=self.chunk_size,
                          # carry: the head shards run over every own row (the whole view), continuing carried state
                          carry=None if psp.carry is None else psp.carry.cp.whole, key=("mamba", self.layer_number))
        y = y.reshape(n, d_inner)
        if self.rmsnorm:
            y = self.norm(y, z)  # over this TP rank's groups of the token's heads, all local again
        else:
            cdt = torch.float64 if y.dtype == torch.float64 else torch.float32
            y = (y.to(cdt) * F.silu(z.to(cdt))).to(y.dtype)
        if s > n:
            y = torch.cat([y, y.new_zeros(s - n, d_inner)])
        return self.out_proj(y.unsqueeze(1))


def _check_cp_heads(config, d_model: int, expand, tp: int, cp: int, who: str) -> None:
    """Clear errors, before the stock constructor's asserts, for head / group counts that context
    parallelism cannot split: CP shards this TP rank's heads, and Megatron's ``MambaContextParallel``
    (built by the stock constructor) also needs the groups and the CP size to divide one another."""
    heads = config.mamba_num_heads or int(expand * d_model) // config.mamba_head_dim
    groups = config.mamba_num_groups
    if heads % tp or groups % tp:
        return  # the stock constructor names these
    h, g = heads // tp, groups // tp
    if h % cp:
        raise ValueError(f"{who}: context parallelism splits Mamba heads over the CP ranks, but the CP size {cp} does "
                         f"not divide the {h} Mamba heads of a tensor-parallel rank ({heads} heads / TP {tp})")
    if (g < cp and cp % g) or (g >= cp and g % cp):
        raise ValueError(f"{who}: under context parallelism the {g} Mamba B/C groups of a tensor-parallel rank "
                         f"({groups} / TP {tp}) and the CP size {cp} must divide one another")


_CLASSES: dict = {}


def tree_mamba_mixer_over(base: type, name: str, *, mixins: tuple = (), module: str = __name__) -> type:
    """The tree mixer class over ``base`` (Megatron's ``MambaMixer`` or a family's subclass of it, e.g.
    Megatron-Bridge's ``FalconH1MambaMixer``): `TreeMambaMixer`'s sequence mixing with ``base``'s parameters
    and constructor; ``mixins`` go first in the MRO (a family's `_TreeMambaMixerImpl.scale_projection`).
    One class per (base, name)."""
    key = (base, name)
    if key not in _CLASSES:
        _CLASSES[key] = type(name, (*mixins, _TreeMambaMixerImpl, base),
                             {"__module__": module, "__qualname__": name,
                              "__doc__": f"``{base.__name__}`` over a prefix tree.\n\n" + _TreeMambaMixerImpl.__doc__})
    return _CLASSES[key]


def _tree_mamba_mixer_class():
    return tree_mamba_mixer_over(mamba_mixer_module().MambaMixer, "TreeMambaMixer")


def __getattr__(name: str):
    # PEP 562: `TreeMambaMixer` is created on first access (Megatron's mixer module may need the CPU
    # shims before it imports); pickling finds it by name through here too.
    if name == "TreeMambaMixer":
        return _tree_mamba_mixer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def tree_mamba_module_spec(*, use_transformer_engine: bool = False, normalization: Optional[str] = None,
                           in_proj=None, out_proj=None, **params) -> ModuleSpec:
    """``ModuleSpec`` of `TreeMambaMixer` with Megatron's linears for the chosen backend.

    Local backend (default): ``ColumnParallelLinear`` in_proj and ``RowParallelLinear`` out_proj;
    ``use_transformer_engine``: TE's. ``in_proj``/``out_proj`` override them; ``params`` go to the
    constructor (``d_conv``, ``expand``, ``D_has_hdim``, ``rmsnorm``, ``chunk_size``, ``backend``,
    ...). The mixer's gated RMSNorm is built by the stock constructor, so ``normalization`` (accepted
    for symmetry with `tree_gdn_module_spec`) changes nothing here.

    The input layernorm is not fused into ``in_proj`` (``metainfo["fuse_input_layernorm"] = False``):
    as the ``self_attention`` of a ``TransformerLayer``, give the layer an ``input_layernorm``; as
    the ``mixer`` of a ``MambaLayer``, the layer's ``norm`` plays that role.
    """
    stock = mamba_mixer_module()
    provider = spec_provider(use_transformer_engine)
    submodules = stock.MambaMixerSubmodules(in_proj=in_proj or provider.column_parallel_linear(),
                                            out_proj=out_proj or provider.row_parallel_linear())
    return ModuleSpec(module=_tree_mamba_mixer_class(), submodules=submodules, params=dict(params),
                      metainfo={"fuse_input_layernorm": False})
