"""MoE load balancing on a tree: every router statistic counts a row as many times as flat tokens stand on it.

A tree row shared by ``m`` samples stands for ``m`` flat tokens (``TreePackedSeqParams.row_samples``, from
`TreeMicrobatch.row_sample_stats`; padding rows 0). Megatron-Core's router computes its balancing
statistics on the tokens it is given, so on a tree they would see deduplicated rows. Here each router
of a tree model weighs its rows by ``m`` instead, which makes every statistic the flat one:

* tokens per expert ``f_i = sum_x m_x r_xi`` and the token count ``T = sum_x m_x`` (all-reduced over the
  groups stock reduces them over), the summed routing probability ``P_i = sum_x m_x p_xi``: so
  ``aux_loss``, ``seq_aux_loss`` (a packed ``[T, 1]`` microbatch is one sequence to stock, where it
  equals ``aux_loss``) and ``global_aux_loss`` (its running tokens-per-expert too) are stock's formulas
  on the flat pack of the microbatch's samples, gradients included (a row's ``m`` equal flat tokens
  have equal probabilities: ``d/dp_x`` of the flat sum is ``m_x`` times one token's);
* z-loss: ``coeff * sum_x m_x lse_x^2 / T``, ``T`` over the tensor- and context-parallel group (the
  flat microbatch's mean, whichever rank holds which rows);
* the expert-bias counts ``local_tokens_per_expert += sum_x m_x r_xi`` (the dispatch map, after any
  capacity dropping), which ``finalize_model_grads`` all-reduces and turns into the bias update.

How the weights reach the router: stock ``TopKRouter.routing`` already threads a per-token
``padding_mask`` (True = padding) through every statistic. Here that argument carries a float weight
``[S, B]`` instead (`_router_pre_hook`), and the four places that read it take a float as a weight
(`weighted_scores_for_aux_loss` in the router module's namespace, and per router instance
``apply_z_loss``, ``_apply_expert_bias``, ``attach_and_log_load_balancing_loss``); a bool mask keeps
stock's meaning. The weights come from the ``packed_seq_params`` each decoder layer is called with (a
forward pre-hook, as routing replay reads its routes: every pipeline stage, full recomputation), this
rank's rows: the CP view's ``local_rows`` then padding, the GDN island view's inside an island, carry's
own rows, and this TP rank's slice of them under sequence parallelism. Selective MoE recomputation
re-runs the router in the backward without an MoE module call: each such forward pushes its weights on
a FIFO that the re-run pops (`moe_layers.PerForward`, shared with routing replay).

Multipliers under ``calculate_per_token_loss`` (what makes the attached loss's gradient the flat one
after ``finalize_model_grads`` divides by the step's token count): stock multiplies a rank's partial
loss by its local token count (0.16.1) or by that times the TP x CP size (0.19, the count of the
whole microbatch when ranks hold equal slices). A tree's ranks hold unequal slices, so every rank
multiplies by the microbatch's flat token count ``T`` (all-reduced): the single-rank result on every
layout, on both stacks (stock 0.16.1 itself scales these gradients by ``1 / (TP x CP)`` under sequence
or context parallelism; 0.19 fixed that).

Refused by name (`check_balancing_config`): capacity-factor token dropping (capacity is sized from the
rows a rank holds, which no weight can turn into flat counts), the fused TE aux-loss kernels
(``moe_router_fusion``) and the ``sinkhorn`` balancing type (no statistic to weigh).
"""
from __future__ import annotations

import functools
import inspect
import types
from typing import Optional

import torch

from .moe_layers import PerForward, moe_layers_of, mtp_moe_layers_of, tensor_parallel_of
from .packed_seq import TreePackedSeqParams

__all__ = ["set_seq_aux_per_sample", "reset_moe_tracker", "local_sample_paths", "balancing_enabled",
           "check_balancing_config", "aux_losses_enabled", "refuse_aux_losses_under_carry", "install_moe_balancing",
           "local_row_weights", "weighted_scores_for_aux_loss", "RowWeights"]

# Test-only fault switch ("multiplicity_ones": every real row weighs 1, the deduplicated statistics of
# before; the planted fault of ``megatron-tree verify --moe-router-load-balancing-type ...``)
_FAULT = None


def balancing_enabled(config) -> bool:
    """True when a router of ``config`` computes any statistic the tree must weigh: an aux loss with a
    positive coefficient, z-loss, or expert-bias counts."""
    if not _has_experts(config):
        return False
    return (bool(aux_losses_enabled(config)) or bool(getattr(config, "moe_z_loss_coeff", None))
            or bool(getattr(config, "moe_router_enable_expert_bias", False)))


def _has_experts(config) -> bool:
    """A TransformerConfig's ``num_moe_experts`` or Megatron-LM's ``--num-experts``."""
    return bool(getattr(config, "num_moe_experts", None) or getattr(config, "num_experts", None))


def aux_losses_enabled(config) -> list:
    """The aux-loss types of ``config`` (a TransformerConfig or Megatron-LM's arguments) with a positive
    coefficient (aux_loss, seq_aux_loss, global_aux_loss)."""
    if not _has_experts(config):
        return []
    kinds = getattr(config, "moe_router_load_balancing_type", "none")
    kinds = kinds if isinstance(kinds, (list, tuple)) else [kinds]
    coeffs = getattr(config, "moe_aux_loss_coeff", 0.0)
    coeffs = coeffs if isinstance(coeffs, (list, tuple)) else [coeffs] * len(kinds)
    return [k for k, c in zip(kinds, coeffs) if k in ("aux_loss", "seq_aux_loss", "global_aux_loss") and (c or 0) > 0]


def refuse_aux_losses_under_carry(config) -> None:
    """Carry cuts a tree over microbatches that hold no flat microbatch's samples whole; the aux losses
    are quadratic in a microbatch's counts (``sum_i P_i f_i / T``), so their sum over such microbatches
    is no flat run's. z-loss and expert-bias counts are sums over rows (per-token loss): they carry."""
    kinds = aux_losses_enabled(config)
    if kinds:
        raise ValueError(f"--tree-carry with --moe-router-load-balancing-type {'/'.join(kinds)} (coefficient > 0): an "
                         "aux loss is a product of one microbatch's counts, and carry's microbatches hold parts of "
                         "samples, so no flat run computes the same loss; z-loss and expert bias carry exactly. "
                         "Train without --tree-carry (whole trees, split packing) or use expert bias")


def check_balancing_config(config) -> None:
    """Refuse, by name, the balancing settings a tree cannot make flat-exact."""
    if not balancing_enabled(config):
        return
    if getattr(config, "moe_expert_capacity_factor", None) is not None:
        raise ValueError("--moe-expert-capacity-factor (token dropping) with MoE balancing on a tree: an expert's "
                         "capacity is sized from the rows a rank holds, and a tree row stands for several flat "
                         "tokens, so which tokens drop cannot match flat training; train without a capacity factor "
                         "(dropless), as the Bridge recipes do")
    if getattr(config, "moe_router_fusion", False):
        raise ValueError("--moe-router-fusion with MoE balancing on a tree: the fused aux-loss kernels take no per-row "
                         "weight; leave router fusion off")
    kinds = config.moe_router_load_balancing_type
    if "sinkhorn" in (kinds if isinstance(kinds, (list, tuple)) else [kinds]):
        raise ValueError("--moe-router-load-balancing-type sinkhorn on a tree: Sinkhorn balancing normalises over "
                         "the rows a rank holds, which a tree deduplicates; use aux_loss, seq_aux_loss, "
                         "global_aux_loss or expert bias")


def local_sample_paths(psp: TreePackedSeqParams) -> Optional[tuple]:
    """``(sample [F'], row [F'], lengths [S])``: for every flat token of the microbatch whose row this rank's
    modules hold, its sample and its row in this rank's order (local_rows then padding, as
    `local_row_weights`), and each sample's length (what a per-sample statistic divides by). None when the
    params carry no paths. Made once per view (kept on ``psp``), vectorised."""
    cached = psp.__dict__.get("_local_sample_paths")
    if cached is not None or psp.sample_paths is None:
        return cached
    from ..tree.microbatch import split_sample_paths

    offsets, lengths, rows = split_sample_paths(psp.sample_paths)
    sample = torch.repeat_interleave(torch.arange(lengths.numel(), device=rows.device), offsets.diff())
    if psp.local_rows is not None:
        pos = torch.full((psp.layout.num_rows,), -1, dtype=torch.int64, device=rows.device)
        pos[psp.local_rows.to(rows.device)] = torch.arange(psp.local_rows.numel(), device=rows.device)
        rows = pos[rows]
        keep = rows >= 0
        sample, rows = sample[keep], rows[keep]
    out = (sample, rows, lengths)
    psp.__dict__["_local_sample_paths"] = out
    return out


def local_row_weights(psp: TreePackedSeqParams) -> torch.Tensor:
    """``[n]`` float64 multiplicity of the rows this rank's modules see for ``psp``: every row, or under
    tree CP / carry / a GDN island the view's ``local_rows`` then ``num_local_padding`` zeros."""
    w = psp.row_samples
    if w is None:
        raise ValueError("MoE balancing on a tree needs packed_seq_params.row_samples (each row's multiplicity): "
                         "build the params with tree_packed_seq_params(mb)")
    if _FAULT == "multiplicity_ones":
        w = (w > 0).to(w.dtype)
    if psp.local_rows is None:
        return w
    return torch.cat([w[psp.local_rows], w.new_zeros(psp.num_local_padding)])


class RowWeights(PerForward):
    """One router's row weights (and, for a per-sample seq aux loss, its flat tokens' samples: see
    `local_sample_paths`) for the forward in flight, set by its layer's pre-hook as ``current`` =
    ``(weights [n], paths or None)`` (`moe_layers.PerForward`: recomputations)."""

    def __init__(self, tp_rank: int, tp_size: int, sequence_parallel: bool):
        super().__init__(tp_rank, tp_size, sequence_parallel)
        self.per_sample = False  # a per-sample seq aux loss reads the paths (`set_seq_aux_per_sample`)

    def for_router(self, n_tokens: int) -> Optional[tuple]:
        """``(weights [n_tokens], paths)`` of the rows the router sees (this TP rank's slice under SP)."""
        cur = self.pending()
        if cur is None:
            return None
        w, paths = cur
        seen = self.router_rows(w.shape[0], n_tokens, "MoE balancing, weighted rows")
        if paths is not None:  # the flat tokens on the rows it sees, their rows counted from the slice's start
            sample, rows, lengths = paths
            keep = (rows >= seen.start) & (rows < seen.stop)
            paths = (sample[keep], rows[keep] - seen.start, lengths)
        return w[seen], paths


# --------------------------------------------------------------------------------------------- router parts
def _is_weight(mask) -> bool:
    return mask is not None and mask.is_floating_point()


def weighted_scores_for_aux_loss(original):
    """``compute_routing_scores_for_aux_loss`` that takes a float ``padding_mask`` as per-token weights
    ``w[N]``: returns ``(w * routing_map, w * scores)`` (float), so stock's counts become ``sum w r`` and
    ``sum w`` (each row of the map holds ``topk`` ones). The scores are ``original``'s (stock's precision,
    or float64 where `router_precision` widens it). A bool mask or None: ``original`` unchanged."""
    @functools.wraps(original)  # keeps the markers of the wrappers below (router_precision's)
    def compute_routing_scores_for_aux_loss(logits, topk, score_function, fused=False, padding_mask=None):
        if not _is_weight(padding_mask):
            return original(logits, topk, score_function, fused=fused, padding_mask=padding_mask)
        routing_map, scores = original(logits, topk, score_function, fused=fused, padding_mask=None)
        w = padding_mask.reshape(-1, 1).to(scores.dtype)
        return routing_map.to(scores.dtype) * w, scores * w

    compute_routing_scores_for_aux_loss._tree_weighted = True
    return compute_routing_scores_for_aux_loss


def _group_total(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` summed over ``group`` (a detached copy)."""
    t = x.detach().clone()
    if group is not None and group.size() > 1:
        torch.distributed.all_reduce(t, group=group)
    return t


def _record(router, name: str, value: torch.Tensor, **kw) -> None:
    """Stock's tracker call for ``name`` (0.19's metrics tracker, 0.16's aux-loss tracker)."""
    from megatron.core.transformer.moe import moe_utils

    config = router.config
    num_layers = config.num_layers + (config.mtp_num_layers or 0)
    layer_number = router.layer_number
    if getattr(router, "is_mtp_layer", False) and layer_number is not None:
        layer_number = layer_number + config.num_layers
    tracker = getattr(moe_utils, "get_moe_metrics_tracker", None)
    if tracker is None:
        from megatron.core.transformer.moe import router as router_module

        tracker = getattr(router_module, "get_moe_metrics_tracker", None)
    if tracker is not None:
        tracker().record(name, value, layer_number, num_layers, **kw)
    else:
        moe_utils.save_to_aux_losses_tracker(name, value, layer_number, num_layers)


def reset_moe_tracker() -> None:
    """Drop stock's MoE logging tracker (0.19's metrics tracker, 0.16's layer-wise dict): it is sized by the
    first model that records into it, so a process that builds another model with more MoE layers (verify's
    configs, one after another) must start a new one."""
    from megatron.core.transformer.moe import moe_utils

    try:
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    except ImportError:  # megatron-core 0.16: the layer-wise dict
        moe_utils.get_moe_layer_wise_logging_tracker().clear()
    else:
        destroy_moe_metrics_tracker()


def _apply_z_loss(self, logits, padding_mask=None):
    """z-loss with per-row weights: this rank's share ``coeff * sum_x w_x lse_x^2 / T`` of the flat
    microbatch's mean (``T = sum w`` over TP x CP); attached with ``T`` as the per-token multiplier.
    Logged as this rank's weighted mean of ``lse^2``. A bool mask / None: stock's."""
    if not _is_weight(padding_mask):
        return type(self).apply_z_loss(self, logits, padding_mask=padding_mask)
    if self.config.moe_z_loss_coeff is None or not (self.training and torch.is_grad_enabled()):
        return logits
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    coeff = self.config.moe_z_loss_coeff
    w = padding_mask.reshape(-1).to(torch.promote_types(logits.dtype, torch.float32))
    lse2 = torch.logsumexp(logits.to(w.dtype), dim=-1).square()
    local = w.sum()
    total = _group_total(local, self.tp_cp_group).clamp(min=1)
    z = coeff * (w * lse2).sum() / total
    if self.calculate_per_token_loss:
        logits = MoEAuxLossAutoScaler.apply(logits, z * total)
    else:
        logits = MoEAuxLossAutoScaler.apply(logits, z)
    logged = (w * lse2).sum().detach() / local.clamp(min=1)
    if getattr(self, "is_mtp_layer", False) and getattr(self.config, "mtp_use_repeated_layer", False) \
            and self.config.mtp_num_layers:
        logged = logged / self.config.mtp_num_layers
    if _tracker_is_v019():
        _record(self, "z_loss", logged, avg_group=self.tp_dp_cp_group)
    else:
        _record(self, "z_loss", logged)
    return logits


def _apply_expert_bias(self, routing_map, padding_mask=None):
    """Expert-bias counts with per-row weights (``sum_x w_x r_xi`` of the dispatch map); a bool mask /
    None: stock's."""
    if not _is_weight(padding_mask):
        return type(self)._apply_expert_bias(self, routing_map, padding_mask=padding_mask)
    if self.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            w = padding_mask.reshape(-1, 1).to(self.local_tokens_per_expert.dtype)
            self.local_tokens_per_expert += (routing_map.to(w.dtype) * w).sum(dim=0)


def _attach_and_log(self, activation, aux_loss_coeff, aux_loss, aux_loss_name, reduce_group, *args, **kwargs):
    """Stock's attach, with the per-token multiplier of a weighted microbatch: ``T``, the flat tokens of
    the whole microbatch over TP x CP, on every rank (see the module docstring). ``T`` is summed from this
    call's row weights, not from the ``valid_token_count`` stock passes: under TP x CP > 1 stock's count is
    already the group's (`get_tokens_per_expert_and_token_count` all-reduces its local counts in place
    before it sums them: stock's padding-mask path doubles the multiplier at TP 2)."""
    if self.calculate_per_token_loss and self._tree_weighted_call:
        total = _group_total(self._tree_weights.sum().to(torch.float64), self.tp_cp_group)
        kwargs["valid_token_count"] = total / self.tp_cp_group.size() if _attach_scales_by_tp_cp() else total
    return type(self).attach_and_log_load_balancing_loss(self, activation, aux_loss_coeff, aux_loss, aux_loss_name,
                                                         reduce_group, *args, **kwargs)


def _apply_seq_aux_loss(self, probs, scores_for_aux_loss, routing_map, seq_length, bsz, with_padding_mask=False):
    """Per-sample seq aux loss (DeepSeek-V3's definition; `set_seq_aux_per_sample`): with ``P_si`` / ``f_si``
    the sums of sample s's own tokens' probabilities / expert choices (a shared row counts in every sample
    through it) and ``T_s`` its length, ``coeff * E / (k S) * sum_s sum_i P_si f_si / T_s^2`` over the S samples
    of the microbatch; this rank adds its rows' part of ``P`` (``f`` summed over TP x CP), as stock does.
    Otherwise (the default, a packed microbatch as one sequence, where it equals aux_loss): stock's."""
    paths = self._tree_paths
    if not (self._tree_weighted_call and self._tree_seq_aux_per_sample and paths is not None):
        return type(self)._apply_seq_aux_loss(self, probs, scores_for_aux_loss, routing_map, seq_length, bsz,
                                              with_padding_mask=with_padding_mask)
    coeff = self.get_aux_loss_coeff("seq_aux_loss")
    if coeff == 0:
        return probs
    sample, rows, lengths = paths
    w = self._tree_weights.reshape(-1, 1).to(scores_for_aux_loss.dtype)
    unweighted = w.clamp(min=1)  # the weighted map / scores back per token (w > 0 on every row of a path)
    p = (scores_for_aux_loss / unweighted)[rows]
    r = (routing_map.to(scores_for_aux_loss.dtype) / unweighted)[rows].detach()
    S, E = int(lengths.numel()), scores_for_aux_loss.shape[1]
    P = scores_for_aux_loss.new_zeros(S, E).index_add(0, sample, p)
    f = _group_total(scores_for_aux_loss.new_zeros(S, E).index_add(0, sample, r), self.tp_cp_group)
    T = lengths.to(P.dtype).clamp(min=1).reshape(-1, 1)
    aux = (P * f / T.square()).sum() * (E * coeff / (self.topk * max(S, 1)))
    return self.attach_and_log_load_balancing_loss(probs, coeff, aux, "seq_load_balancing_loss", self.tp_cp_group,
                                                   valid_token_count=self._tree_weights.sum())


def _routing(self, logits, padding_mask=None):
    self._tree_weighted_call = _is_weight(padding_mask)
    try:
        return type(self).routing(self, logits, padding_mask=padding_mask)
    finally:
        self._tree_weighted_call = False


_SOURCE_CHECKS: dict = {}


def _source_has(fn, text: str) -> bool:
    key = (fn, text)
    if key not in _SOURCE_CHECKS:
        try:
            _SOURCE_CHECKS[key] = text in inspect.getsource(fn)
        except (OSError, TypeError):  # pragma: no cover - no source
            _SOURCE_CHECKS[key] = False
    return _SOURCE_CHECKS[key]


def _attach_scales_by_tp_cp() -> bool:
    """True where stock's per-token multiplier is ``count * tp_cp_group.size()`` (megatron-core 0.19)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return _source_has(TopKRouter.attach_and_log_load_balancing_loss, "tp_cp_group.size()")


def _tracker_is_v019() -> bool:
    from megatron.core.transformer.moe.router import TopKRouter

    return _source_has(TopKRouter.apply_z_loss, "get_moe_metrics_tracker")


def counts_with_empty_microbatches(original):
    """``get_tokens_per_expert_and_token_count`` whose token count is at least 1 under a mask: a
    microbatch whose rows all weigh 0 on the reduce group (the zero-loss padding microbatches that give
    every data-parallel rank the same count) then has zero counts and probabilities, so its aux loss is
    0 with a zero gradient, where ``0 / 0`` made stock's NaN. Counts of 1 or more are unchanged."""
    @functools.wraps(original)
    def get_tokens_per_expert_and_token_count(*args, **kwargs):
        tokens, local, total = original(*args, **kwargs)
        with_mask = kwargs.get("with_padding_mask", args[3] if len(args) > 3 else False)
        if with_mask and torch.is_tensor(total):
            total = total.clamp(min=1)
        return tokens, local, total

    get_tokens_per_expert_and_token_count._tree_weighted = True
    return get_tokens_per_expert_and_token_count


def _patch_router_module() -> None:
    """Make the router module's ``compute_routing_scores_for_aux_loss`` accept weights and its token
    count survive an all-padding microbatch (idempotent; a bool mask or None keeps stock's behaviour
    otherwise, so stock models are unaffected)."""
    from megatron.core.transformer.moe import router as router_module

    for name, wrap in (("compute_routing_scores_for_aux_loss", weighted_scores_for_aux_loss),
                       ("get_tokens_per_expert_and_token_count", counts_with_empty_microbatches)):
        fn = getattr(router_module, name)
        if not getattr(fn, "_tree_weighted", False):
            setattr(router_module, name, wrap(fn))


# --------------------------------------------------------------------------------------------- install
def _router_pre_hook(weights: RowWeights):
    def hook(module, args, kwargs):
        hidden = args[0] if args else kwargs["input"]
        s, b = hidden.shape[0], hidden.shape[1] if hidden.dim() == 3 else 1
        got = weights.for_router(s * b)
        module._tree_paths = None if got is None else got[1]  # read by this call's routing, synchronously
        if got is None:
            return None
        w = got[0].to(hidden.device).reshape(s, b)
        if len(args) > 1:
            mask = args[1]
            args = args[:1]
        else:
            mask = kwargs.get("padding_mask")
        if mask is not None:  # a stock padding mask ([S, B], True = padding) beside the weights: padding weighs 0
            w = w * (~mask.bool().reshape(s, b)).to(w.dtype)
        kwargs["padding_mask"] = w
        module._tree_weights = w.reshape(-1)
        return args, kwargs

    return hook


def _layer_pre_hook(weights: RowWeights):
    def hook(module, args, kwargs):
        psp = kwargs.get("packed_seq_params")
        if isinstance(psp, TreePackedSeqParams) and psp.layout is not None:
            paths = local_sample_paths(psp) if weights.per_sample else None
            weights.current = (local_row_weights(psp), paths)
        else:  # any other input: stock's statistics, unweighted
            weights.current = None
        return None

    return hook


def install_moe_balancing(model) -> list:
    """Weigh every router statistic of ``model``'s MoE layers (this pipeline stage) by row multiplicity;
    returns the `RowWeights` per MoE layer (empty when ``model`` has no MoE layer or no balancing is on).
    Idempotent; called by `TreeGPTModel` / `TreeMambaModel` as they are built."""
    m = model
    while hasattr(m, "module"):  # DDP, Float16Module
        m = m.module
    if getattr(m, "_tree_moe_balancing", None) is not None:
        return m._tree_moe_balancing
    if not balancing_enabled(m.config):
        m._tree_moe_balancing = []
        return []
    check_balancing_config(m.config)
    _patch_router_module()
    tp_rank, tp_size, sp = tensor_parallel_of(m)
    out = []
    # MTP depths' MoE layers read their depth's view: its row_samples weigh the rows of depth >= k and the
    # sample's first k MTP tail rows (`mtp._depth_weights`), the positions stock's depth k routes
    for layer, moe in moe_layers_of(m) + mtp_moe_layers_of(m):
        weights = RowWeights(tp_rank, tp_size, sp)
        router = moe.router
        router.apply_z_loss = types.MethodType(_apply_z_loss, router)
        router._apply_expert_bias = types.MethodType(_apply_expert_bias, router)
        router.attach_and_log_load_balancing_loss = types.MethodType(_attach_and_log, router)
        router.routing = types.MethodType(_routing, router)
        router._apply_seq_aux_loss = types.MethodType(_apply_seq_aux_loss, router)
        router._tree_weighted_call, router._tree_seq_aux_per_sample = False, False
        router._tree_paths = router._tree_weights = None
        weights.router = router
        router.register_forward_pre_hook(_router_pre_hook(weights), with_kwargs=True)
        layer.register_forward_pre_hook(_layer_pre_hook(weights), with_kwargs=True)
        weights.attach(moe)
        out.append(weights)
    m._tree_moe_balancing = out
    m._tree_moe_mtp_layers = len(mtp_moe_layers_of(m))
    return out


def set_seq_aux_per_sample(model, on: bool = True) -> None:
    """``seq_aux_loss`` per sample (DeepSeek-V3's definition: each sample's own tokens, a shared row counted in
    every sample through it) instead of stock's on a packed microbatch (one sequence, equal to aux_loss). The
    params must carry ``sample_paths`` (`tree_packed_seq_params` and the hooks' `get_batch` do). Not with MTP
    layers that hold MoE (their depth-k positions are not a sample's path)."""
    m = model
    while hasattr(m, "module"):
        m = m.module
    weights = install_moe_balancing(m)
    if on and getattr(m, "_tree_moe_mtp_layers", 0):
        raise ValueError("--tree-seq-aux-per-sample with MoE in the MTP layers is not supported: an MTP depth's "
                         "positions are not a sample's path; use the default (the packed microbatch as one sequence)")
    for w in weights:
        w.per_sample = bool(on)
        w.router._tree_seq_aux_per_sample = bool(on)
