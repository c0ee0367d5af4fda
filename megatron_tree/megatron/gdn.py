"""`TreeGatedDeltaNet`: Megatron-Core's Gated DeltaNet mixer over a packed prefix tree.

Same parameters, initialisation, TP sharding and ``sharded_state_dict`` as the stock
``megatron.core.ssm.gated_delta_net.GatedDeltaNet`` (it is a subclass); only the sequence mixing
changes: the short causal conv follows the tree's root paths (`tree_causal_conv1d`) and the
recurrence starts every segment from its parent's final state (`tree_gated_delta_rule`). The
layout arrives in ``packed_seq_params`` (`TreePackedSeqParams`), so the module keeps no state.

Per row (token-major, ``N`` tree rows, batch 1; ``Hk``/``Hv`` key/value heads of this TP rank)::

    q, k, v, z, b, a = split(in_proj(x))                         # in_proj gathers the sequence under SP
    q, k, v = act(conv_tree(q, k, v))                            # depthwise, W taps back along the root path
    q, k = l2norm(q), l2norm(k)                                  # if use_qk_l2norm
    g = -exp(A_log) * softplus(a + dt_bias);  beta = sigmoid(b)  # fp32 as in Megatron (fp64 models: fp64)
    o = gated_delta_rule_tree(q, k, v, g, beta)                  # value head h reads key head h // (Hv/Hk)
    y = out_proj(out_norm(o) * act(z))                           # out_proj reduce-scatters under SP

Usable as the ``self_attention`` of a Megatron ``TransformerLayer`` (the stock GDN forward
signature, extra attention kwargs such as ``rotary_pos_emb`` are accepted and ignored) and returns
``(output, bias)``.

On a CPU-only host the stock constructor places parameters with ``torch.cuda.current_device()``:
call ``megatron_tree.cpu.enable()`` first. FLA is never required.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.ssm import gated_delta_net as _stock
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import deprecate_inference_params

from ..compat.mixers import fla_check_bypassed, stock_kwargs
from ..ops.causal_conv1d import tree_causal_conv1d
from ..ops.gated_delta_rule import l2norm, tree_gated_delta_rule
from .packed_seq import get_tree_layout

__all__ = ["TreeGatedDeltaNet", "tree_gdn_module_spec", "spec_provider", "l2norm"]


def _wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32, or kept in fp64. Where the stock layers write ``.float()`` (fp32 maths for
    bf16/fp32 models) we use this: identical in bf16/fp32, and a float64 test model stays float64
    end to end, so tree and per-sample gradients agree to ~1e-12 instead of fp32 rounding."""
    return x if x.dtype == torch.float64 else x.float()


# Where the stock constructor reads HAVE_FLA differs by version (module in 0.16.1, package in 0.19.x).
_fla_check_bypassed = fla_check_bypassed


def _require_cpu_shims(module, what: str, *, kernels: bool = False) -> None:
    """On a CPU-only host, Megatron's SSM constructors call ``torch.cuda.current_device()``: make sure
    the CPU shims are active and cover ``module`` (it may have been imported after ``enable()``)."""
    if torch.cuda.is_available():
        return
    from megatron_tree.cpu import megatron_core as cpu  # noqa: PLC0415  (CPU hosts only)

    if not cpu.is_enabled():
        hint = "enable(kernels=True)" if kernels else "enable()"
        raise RuntimeError(f"{what} on a CPU-only host needs Megatron's CPU shims: call "
                           f"megatron_tree.cpu.megatron_core.{hint} before building it")
    cpu.patch_module(module)


def _check_tree_input(hidden_states: torch.Tensor, who: str) -> None:
    """Tree mixers take Megatron's ``[s, b, h]`` with ``b == 1``: the tree is the batch."""
    if hidden_states.dim() != 3 or hidden_states.shape[1] != 1:
        raise ValueError(f"{who}: hidden_states must be [s, 1, hidden] (the packed tree is the batch, so the "
                         f"micro-batch size must be 1); got shape {tuple(hidden_states.shape)}")


def _check_rows(n: int, layout, who: str, sp: int) -> None:
    if n != layout.num_rows:
        raise ValueError(f"{who}: the input covers {n} rows (sequence x {sp} under sequence parallelism) but the "
                         f"tree layout has {layout.num_rows}")


class TreeGatedDeltaNet(GatedDeltaNet):
    """Megatron's ``GatedDeltaNet`` over a prefix tree.

    Constructor: the stock one (``config, submodules, layer_number, bias, conv_bias, conv_init,
    use_qk_l2norm, A_init_range, pg_collection``) plus ``backend`` for the tree ops ("auto": FLA on
    CUDA where it imports, else the torch reference; ``config.deterministic_mode`` selects the torch
    backend, as the stock layer selects its torch chunk kernel) and ``cp_comm_type`` (accepted for
    the ``TransformerLayer`` protocol). ``pg_collection`` defaults to Megatron's global groups.
    ``name`` (the instance name megatron-core 0.19+ spec builders pass) is forwarded to the stock
    constructor where it accepts it and ignored otherwise (`megatron_tree.compat.mixers`).
    ``gdn_cp_mode`` ("auto" | "summary" | "heads", default: ``$MEGATRON_TREE_GDN_CP_MODE`` or
    "auto") chooses the tree-CP execution when ``context_parallel_size > 1`` (`megatron_tree.cp.execution.gdn`).

    Forward: ``hidden_states [s, 1, hidden]`` (``s = N / tp`` under sequence parallelism, else
    ``N``, where ``N = layout.num_rows``), ``packed_seq_params`` a `TreePackedSeqParams`; returns
    ``(out [s, 1, hidden], bias or None)``. ``attention_mask`` is ignored (visibility is the tree).
    Row ``r`` of the output equals the stock layer run on ``r``'s root path alone.
    """

    def __init__(self, config: TransformerConfig, submodules: GatedDeltaNetSubmodules, layer_number: int = None,
                 bias: bool = False, conv_bias: bool = False, conv_init: Optional[float] = None,
                 use_qk_l2norm: bool = True, A_init_range: Tuple[float, float] = (1, 16),
                 pg_collection: Optional[ProcessGroupCollection] = None, cp_comm_type: Optional[str] = None,
                 backend: str = "auto", name: Optional[str] = None, gdn_cp_mode: Optional[str] = None):
        _require_cpu_shims(_stock, type(self).__name__)
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        if gdn_cp_mode not in (None, "auto", "summary", "heads"):
            raise ValueError(f"gdn_cp_mode must be None, 'auto', 'summary' or 'heads'; got {gdn_cp_mode!r}")
        with _fla_check_bypassed():
            super().__init__(config, submodules, layer_number=layer_number, bias=bias, conv_bias=conv_bias,
                             conv_init=conv_init, use_qk_l2norm=use_qk_l2norm, A_init_range=A_init_range,
                             pg_collection=pg_collection, **stock_kwargs(GatedDeltaNet.__init__, name=name))
        self.cp_comm_type = cp_comm_type
        self.backend = "torch" if (config.deterministic_mode and backend == "auto") else backend
        self.gdn_cp_mode = gdn_cp_mode  # None: megatron_tree.cp.execution.gdn.default_gdn_cp_mode() at call time

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                key_value_states: Optional[torch.Tensor] = None, inference_context=None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params=None,
                sequence_len_offset: Optional[int] = None, *, inference_params=None, **kwargs):
        who = type(self).__name__
        inference_context = deprecate_inference_params(inference_context, inference_params)
        if inference_context is not None:
            raise ValueError(f"{who} is a training module: inference over a tree is not supported")
        if key_value_states is not None:
            raise ValueError(f"{who} is self-attention only (got key_value_states)")
        layout = get_tree_layout(packed_seq_params)
        _check_tree_input(hidden_states, who)
        tp = self.tp_size

        qkvzba, _ = self.in_proj(hidden_states)
        qkvzba = qkvzba.squeeze(1)
        N = qkvzba.shape[0]
        context_parallel = self.config.context_parallel_size > 1
        carry = getattr(packed_seq_params, "carry", None)
        if carry is not None and not context_parallel:
            if N != len(carry.own):
                raise ValueError(f"{who}: carry: the input covers {N} rows but the microbatch owns {len(carry.own)}")
        elif not context_parallel:
            _check_rows(N, layout, who, self.sp_size)
        qkv, gate, beta, alpha = torch.split(
            qkvzba, [(2 * self.qk_dim + self.v_dim) // tp, self.v_dim // tp, self.num_value_heads // tp,
                     self.num_value_heads // tp], dim=-1)
        if carry is not None and not context_parallel:  # own rows: conv halos and states continue carried rows
            from ..cp.execution.carry import carried_gdn  # the executor sits below this package

            g = -self.A_log.exp() * F.softplus(_wide(alpha) + self.dt_bias)
            core = carried_gdn(qkv, g, beta.sigmoid(), self.conv1d.weight.squeeze(1), self.conv1d.bias,
                               packed_seq_params.layout, carry, ("gdn", self.layer_number),
                               num_k_heads=self.num_key_heads // tp, head_k_dim=self.key_head_dim,
                               head_v_dim=self.value_head_dim, activation="silu" if self.act_fn is F.silu else self.act_fn,
                               qk_l2norm=self.use_qk_l2norm, backend=self.backend)
            out = self._tree_gated_norm(core, gate.reshape(N, -1, self.value_head_dim))
            return self.out_proj(out.reshape(N, 1, -1))
        if context_parallel:  # this rank's rows only: conv halos and states cross ranks in megatron_tree.cp
            core = self._core_cp(qkv, beta, alpha, packed_seq_params, who)
            out = self._tree_gated_norm(core, gate.reshape(N, -1, self.value_head_dim))
            return self.out_proj(out.reshape(N, 1, -1))

        # Halos follow the root path, so a child segment continues its parent's tail, never a sibling's.
        fused_silu = self.act_fn is F.silu
        qkv = tree_causal_conv1d(qkv, self.conv1d.weight.squeeze(1), self.conv1d.bias, layout,
                                 activation="silu" if fused_silu else None)
        if not fused_silu:
            qkv = self.act_fn(qkv)
        query, key, value = torch.split(qkv, [self.qk_dim // tp, self.qk_dim // tp, self.v_dim // tp], dim=-1)
        query = query.reshape(N, -1, self.key_head_dim)
        key = key.reshape(N, -1, self.key_head_dim)
        value = value.reshape(N, -1, self.value_head_dim)
        if self.use_qk_l2norm:
            query, key = l2norm(query), l2norm(key)

        g = -self.A_log.exp() * F.softplus(_wide(alpha) + self.dt_bias)  # fp32 (stock: alpha.float())
        beta = beta.sigmoid()
        # GVA: the op maps value head h to key head h // (Hv/Hk), which is the stock repeat_interleave,
        # without materialising the repeated q/k.
        core = tree_gated_delta_rule(query, key, value, g, beta, layout, backend=self.backend)

        out = self._tree_gated_norm(core, gate.reshape(N, -1, self.value_head_dim))
        return self.out_proj(out.reshape(N, 1, -1))

    def _core_cp(self, qkv, beta, alpha, psp, who: str) -> torch.Tensor:
        """Conv + recurrence under tree CP (`megatron_tree.cp.tree_gdn_cp`): [s, HV/tp, V] for this rank.

        The local sequence (``s`` rows after in_proj's SP gather) is ``psp.local_rows`` followed by
        ``psp.num_local_padding`` rows that pad it to a multiple of the TP size: padding rows are
        stripped before the CP exchange and get a zero core output (their gate, norm and projections
        stay token-local and reach no loss). Decay and beta are token-local, made on the owner.
        """
        plan = psp.cp_plan
        s = qkv.shape[0]
        n = psp.cp_owned_rows(s, who)
        from ..cp.execution.gdn import default_gdn_cp_mode, tree_gdn_cp  # the executor sits below this package

        g = -self.A_log.exp() * F.softplus(_wide(alpha[:n]) + self.dt_bias)  # fp32 (stock: alpha.float())
        fused_silu = self.act_fn is F.silu
        core = tree_gdn_cp(qkv[:n], g, beta[:n].sigmoid(), self.conv1d.weight.squeeze(1), self.conv1d.bias,
                           psp.layout, plan, self.pg_collection.cp, num_k_heads=self.num_key_heads // self.tp_size,
                           head_k_dim=self.key_head_dim, head_v_dim=self.value_head_dim,
                           activation="silu" if fused_silu else self.act_fn, qk_l2norm=self.use_qk_l2norm,
                           mode=self.gdn_cp_mode or default_gdn_cp_mode(), backend=self.backend,
                           # carry: heads mode over every own row (the whole view), continuing carried state
                           carry=None if psp.carry is None else psp.carry.cp.whole, key=("gdn", self.layer_number))
        if s > n:
            core = torch.cat([core, core.new_zeros((s - n,) + tuple(core.shape[1:]))])
        return core

    def _tree_gated_norm(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``out_norm(x) * act(gate)`` per value head, as the stock ``_apply_gated_norm``.

        ``out_norm``'s weight ([value_head_dim]) is shared by all heads while each TP rank holds a
        different subset of heads, so its gradient on a rank is a partial sum over heads. Megatron
        sums it over TP only for parameters marked ``sequence_parallel`` under sequence parallelism
        (TE norms are, and so is the CPU torch norm under the compat shims); in every other TP>1 case
        the stock layer leaves the replicas diverging. There the weight enters through
        ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce backward) instead.
        """
        V = x.shape[-1]
        x2 = x.reshape(-1, V)
        if self.tp_size > 1 and not self._norm_grads_reduced_by_megatron():
            params = {name: copy_to_tensor_model_parallel_region(p, group=self.pg_collection.tp)
                      for name, p in self.out_norm.named_parameters()}
            y = torch.func.functional_call(self.out_norm, params, (x2,))
        else:
            y = self.out_norm(x2)
        y = y * self.act_fn(_wide(gate.reshape(-1, V)))
        return y.to(x.dtype)

    def _norm_grads_reduced_by_megatron(self) -> bool:
        """True when ``finalize_model_grads`` already sums out_norm's gradients over TP."""
        params = list(self.out_norm.parameters())
        return bool(self.config.sequence_parallel) and all(getattr(p, "sequence_parallel", False) for p in params)


def spec_provider(use_transformer_engine: bool = False):
    """Megatron's backend spec provider: ``LocalSpecProvider`` (torch/local layers, runs on CPU) or
    ``TESpecProvider`` (transformer-engine, imported only when asked for)."""
    if use_transformer_engine:
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider  # noqa: PLC0415

        return TESpecProvider()
    from megatron.core.models.backends import LocalSpecProvider  # noqa: PLC0415

    return LocalSpecProvider()


def tree_gdn_module_spec(*, use_transformer_engine: bool = False, normalization: Optional[str] = "RMSNorm",
                         in_proj=None, out_norm=None, out_proj=None, **params) -> ModuleSpec:
    """``ModuleSpec`` of `TreeGatedDeltaNet` with Megatron's submodules for the chosen backend.

    Local backend (default): ``ColumnParallelLinear`` in_proj, ``RowParallelLinear`` out_proj and
    the per-head ``out_norm`` Megatron's local provider gives for ``normalization`` (the torch norm
    for RMSNorm; it follows ``config.normalization``). ``use_transformer_engine``: TE column/row
    linears and ``TENorm``. ``in_proj``/``out_norm``/``out_proj`` override single submodules;
    ``params`` go to the constructor (``conv_bias``, ``use_qk_l2norm``, ``backend``, ...).

    Unlike Megatron's TE GDN spec, the input layernorm is never fused into ``in_proj``
    (``metainfo["fuse_input_layernorm"] = False``): the layer spec gives ``TransformerLayer`` an
    ``input_layernorm``.
    """
    provider = spec_provider(use_transformer_engine)
    submodules = GatedDeltaNetSubmodules(
        in_proj=in_proj or provider.column_parallel_linear(),
        out_norm=out_norm or provider.layer_norm(rms_norm=normalization == "RMSNorm", for_qk=False),
        out_proj=out_proj or provider.row_parallel_linear())
    return ModuleSpec(module=TreeGatedDeltaNet, submodules=submodules, params=dict(params),
                      metainfo={"fuse_input_layernorm": False})
