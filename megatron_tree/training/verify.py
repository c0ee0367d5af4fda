"""``megatron-tree verify``: tree-packed training vs per-sample training of the same weights.

On every rank of a (TP, PP, DP, EP, SP, recompute) layout it builds a small model, packs a random
batch that really branches (forks at several depths, prompts without loss, a sample that is a
prefix of another, duplicates, EOS, several trees per microbatch, padding) and runs

* tree:  the packed microbatches, through Megatron's schedule, DDP and optimizer;
* flat:  every sample alone as its own microbatch (an unbranched chain: ordinary causal
         attention and recurrences), same initial weights, same schedule, DDP and optimizer;

then compares the logits at every sample row, the loss, every parameter gradient (after DDP
reduction) and every parameter after one optimizer step (SGD in float32, Adam in float64). Prints
each quantity's max relative error and where it is worst (sample or parameter name); the exit
status is non-zero past tolerance. A NaN or inf on either side, anywhere, is an infinite error:
it always fails and is named. ``fault=`` injects a known bug into the tree side (used by the tests
to prove verify can fail).

``model="dsa"`` (MLA with DeepSeek sparse attention): the per-sample side's core attention is stock
``DSAttention`` (``dsa_oracle.stock_oracle_class``; under tree CP our DSA on one CP rank per sample,
itself checked against stock by the CP=1 runs), and two more quantities are compared: the indexer's
ordered top-k of every (sample, row, layer), as positions on the sample's path ("selected_ids": the
fraction that differs), and the indexer loss per layer. Faults ``dsa_tie_order`` / ``dsa_loss_weight``.

``dtype="bfloat16"`` is judged against ordinary bf16 training, not a fixed tolerance. Three runs from
the same initial weights (the bf16 model's, upcast for the reference): per-sample float64, one sample
per microbatch (the reference); the baseline, the tree side's microbatches flat-packed (every sample
its own unbranched chain, `_flat_packed`: ordinary packed training); and the tree side. The tree
side's error against the reference must be at most ``BF16_RATIO`` times the baseline's plus
``BF16_FLOOR``, for the logits, the loss and the gradients (DSA: also the indexer loss and the
fraction of differing selections). Errors are relative Frobenius norms (`_rel_norm`): all samples'
logits together, the loss, each parameter's gradient (the largest over parameters on each side, as
for every dtype). The single parameter nearest its own bound is reported beside them, not judged
(see `_rank_body`). Both bf16 runs are what a Megatron-LM ``--bf16`` job runs: every parameter and
activation in bf16 (``Float16Module``'s ``module.bfloat16()``, ``config.bf16``), ``main_grad``
accumulated and reduced in float32 (``accumulate_allreduce_grads_in_fp32``, Megatron-LM's default
under ``--bf16``). No optimizer step is compared in bf16: Megatron's bf16 optimizer (float32 master
weights) needs CUDA tensors, and the stepped parameter is the same elementwise function of the
gradient on both sides.

Per-token loss over the global batch (``calculate_per_token_loss``) is used for both sides.

MoE load balancing (``balancing``: Megatron-LM's ``--moe-router-load-balancing-type``,
``--moe-aux-loss-coeff``, ``--moe-z-loss-coeff``, ``--moe-router-enable-expert-bias``): the tree side's
routers count each row once per sample through it (`megatron.moe_balance`). Aux losses are statistics
of a microbatch, so the reference is then the flat pack of each tree microbatch's samples (every
sample its own chain, one microbatch per tree microbatch: `_flat_packed`), whose padding rows weigh
nothing, as stock's padding mask makes them; z-loss and expert-bias counts are compared through the
gradients and the step (Adam in float64; the expert bias is updated by ``finalize_model_grads``), and
the expert biases after the step's update ("expert_bias": the update is the sign of each expert's count
against the mean, so a wrong count flips it). Fault ``multiplicity_ones``: every row weighs 1.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from functools import partial
from typing import Optional

import numpy as np
import torch

from ..tree.pair_loss import PAIR_LOSSES
from .verify_mtp import FAULTS as MTP_FAULTS  # (light: torch only at import)

FAULTS = ("sibling_mask", "rope_physical", "drop_occurrence", "duplicate_occurrence", "zero_state", "nan",
          "mla_rope_physical")
# faults of model "dsa" only (kept apart from FAULTS, whose faults apply to the other models)
DSA_FAULTS = ("dsa_tie_order", "dsa_loss_weight")
# faults of model "dsa" in bf16 only: an accuracy bug, exact in float64 (what the bf16 ratio rule catches)
BF16_FAULTS = ("dsa_bf16_grad_sum",)
# faults of routing replay runs only (routing_replay=True): the tree side's routes read one row off
REPLAY_FAULTS = ("route_row_shift", "route_recompute_stale")
# faults of carry runs only (carry=True), planted in the carry executor (`cp.execution.carry._FAULT`): the
# readers' gradient dropped (a detached carry), the store changed after a reader read it (what a
# recomputation would then re-read), the accumulated gradient injected twice, the gradient readers on other DP
# ranks accumulated not returned to the owner's rank (carry groups cut over DP ranks)
CARRY_FAULTS = ("carry_detach", "carry_stale", "carry_twice", "carry_return_dropped")
# faults of MoE balancing runs (balancing set): every row weighs 1 in the routers' statistics
BALANCE_FAULTS = ("multiplicity_ones",)
# faults of runs with a loss aggregation other than token-mean: the tree side's per-sample factors computed
# over each microbatch's samples instead of the whole step's (a sequence-level normaliser taken locally)
LOSS_AGG_FAULTS = ("loss_agg_per_microbatch", "gspo_one_microbatch", "wrong_partner")
# faults of --loss value / distill: the tree side reads every occurrence's per-token field (return, teacher top-k) of
# the next position
FIELD_FAULTS = ("field_shift",)
# faults of model "vlm": the tree side's rows shared where the screenshots behind identical placeholder tokens
# differ (image content left out of a row's identity, `verify_vlm.images_merged`)
VLM_FAULTS = ("images_merged",)
#: --loss value: the clip of the value loss; --loss distill: the teacher's k (a random teacher per sample, `_with_fields`)
VALUE_CLIP, DISTILL_K = 0.2, 4
#: --loss dpo / ipo / simpo: beta and SimPO's gamma (pairs: the batch's samples 2p and 2p + 1, the even one chosen;
#: DPO / IPO's reference log-probs: the samples' old_logprobs)
PAIR_BETA, PAIR_GAMMA = 0.5, 0.3
ALL_FAULTS = (FAULTS + DSA_FAULTS + BF16_FAULTS + REPLAY_FAULTS + CARRY_FAULTS + BALANCE_FAULTS + LOSS_AGG_FAULTS
              + FIELD_FAULTS + VLM_FAULTS)
# planted in the tree side's modules (`plant_model_fault`), not its metadata
MODEL_FAULTS = ("mla_rope_physical",) + DSA_FAULTS + BF16_FAULTS + REPLAY_FAULTS + CARRY_FAULTS + BALANCE_FAULTS
# faults of MTP runs (mtp_num_layers >= 1), planted in megatron.mtp for the tree side (`verify_mtp`)
ALL_FAULTS += MTP_FAULTS
MODEL_FAULTS += MTP_FAULTS
METRICS = ("logits", "loss", "grads", "params_after_step")
# dtype "bfloat16": the tree side passes iff err(tree vs float64 per-sample) <= BF16_RATIO * err(per-sample
# bf16 vs float64 per-sample) + BF16_FLOOR for every metric. The floor is 2^-16 (bf16's unit roundoff
# 2^-8 / 256): it only matters where the per-sample side's error happens to be near zero (the loss, a
# mean of a few hundred float32 terms, lands 2e-6..2e-5 from the reference by chance) and is far below
# the error of one bf16 rounding of anything (up to 2^-8 relative, ~2^-9 in norm).
BF16_RATIO = 1.5
BF16_FLOOR = 2.0 ** -16
BF16_METRICS = ("logits", "loss", "grads")
# model "dsa" also compares the indexer's selections (fraction of (sample, row, layer) whose ordered
# top-k differs) and its loss per layer
DSA_METRICS = ("selected_ids", "indexer_loss")


def metrics_of(cfg) -> tuple:
    base = BF16_METRICS if cfg.dtype == "bfloat16" else METRICS
    return (base + (DSA_METRICS if cfg.model == "dsa" else ()) + (("mtp_loss",) if cfg.mtp_num_layers else ())
            + (("expert_bias",) if (cfg.balancing or {}).get("moe_router_enable_expert_bias") else ()))


@dataclass
class VerifyConfig:
    model: str = "gpt"  # a `models.ModelArgs` kind: gpt, hybrid, mamba (MambaModel), qwen3next (GPT + GDN), ...
    pattern: Optional[str] = None
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    cp: int = 1  # tree context parallelism (attention / MLP / MoE layers)
    cp_strategy: str = "balanced"
    sp: bool = False
    recompute: str = "none"
    dtype: str = "float64"  # exact check; float32: float-noise tolerance; bfloat16: judged against per-sample bf16
    loss: str = "sft"
    window: Optional[int] = None
    sinks: bool = False
    seed: int = 1234
    families: int = 6
    budget: int = 64
    fault: Optional[str] = None
    tolerance: Optional[float] = None
    # model "dsa": sparse indexer loss (over the selected keys), IndexShare (dsa_indexer_topk_freq:
    # every n-th layer computes top-k, the others reuse it), top-k (None: models.DSA_DEFAULTS)
    dsa_sparse_loss: bool = False
    dsa_topk_freq: int = 1
    dsa_topk: Optional[int] = None
    # tree CP of GDN layers: None (``$MEGATRON_TREE_GDN_CP_MODE``, else the cost model's "auto"),
    # "summary" or "heads" (set in the rank processes for this config only)
    gdn_cp_mode: Optional[str] = None
    # rollout routing replay (R3): every sample carries routes (drawn so that rollouts sharing a token
    # prefix disagree somewhere), the tree side packs route-aware and replays per row
    # (`megatron.routing_replay`), the per-sample side replays each sample's routes through stock
    # RouterReplay; dense kinds get 4 experts (every layer MoE)
    routing_replay: bool = False
    # multi-token prediction: MTP layers on the last stage; the per-sample side runs stock MTP at CP 1
    # (`verify_mtp`); each depth's loss is compared ("mtp_loss")
    mtp_num_layers: int = 0
    # model "mamba" with MTP (megatron-core >= 0.19's HybridModel): the inner layers of every MTP depth
    mtp_pattern: str = "*-"
    # carry (`tree.carry`): the tree side packs with carry=True (every row once per step at ``budget``;
    # trees over it cut into microbatches that read their ancestors' state) and runs carry items
    carry: bool = False
    # carry with kept graphs: every exporting microbatch runs once (keep), its backward at its release
    carry_keep: bool = False
    # carry over DP ranks (`tree.carry.assign_carry_ranks`): never / auto / always cut a carry group over ranks
    carry_cut: str = "auto"
    # MoE load balancing: TransformerConfig fields (`training.arguments.moe_balancing_fields`); dense kinds
    # get 4 experts (every layer MoE). The reference is then the flat pack of each tree microbatch
    balancing: Optional[dict] = None
    # optimizer steps on the batch (``params_after_step`` / ``expert_bias`` after the last); the optimizer
    # (None: Adam in float64, SGD for float32, routing replay and MoE balancing)
    steps: int = 1
    optimizer: Optional[str] = None
    # seq_aux_loss per sample (DeepSeek-V3's definition, `moe_balance.set_seq_aux_per_sample`) on both sides
    seq_aux_per_sample: bool = False
    # the step's loss aggregation (`tree.loss_agg`): both sides weigh each sample's occurrences by its factor
    # over the whole batch, as the data pipeline does for `train --loss-agg`
    loss_agg: str = "token-mean"
    loss_agg_norm: Optional[float] = None

    def balancing_on(self) -> bool:
        from types import SimpleNamespace

        from ..megatron.moe_balance import balancing_enabled  # (light: torch and our packed-seq params)

        return balancing_enabled(SimpleNamespace(num_moe_experts=4, **(self.balancing or {})))

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def tol(self) -> float:
        """Default tolerance by dtype. float64: MoE included, since verify scores routes at float64 on
        both sides (`router_precision`; stock's float32 scoring alone put a ~1e-7 floor under it).
        bfloat16: the absolute floor of the ratio rule (``BF16_FLOOR`` unless ``tolerance`` is given)."""
        if self.tolerance is not None:
            return self.tolerance
        if self.dtype == "bfloat16":
            return BF16_FLOOR
        if self.dtype == "float64":
            return 1e-9
        # float32: per-head decay gradients (GDN A_log, dt_bias) are sums over every token with heavy
        # cancellation, and the chunked kernels round differently on a tree than on a chain, so a
        # few 1e-3 relative differences are float noise there (the op itself agrees to 1e-7).
        return 1e-2


def verify_samples(seed: int, vocab: int, families: int):
    """Random GRPO-like families that really branch (deterministic in ``seed``)."""
    from ..tree import Sample

    rng = np.random.default_rng(seed)
    eos = vocab - 1
    out = []
    for _ in range(families):
        prompt = rng.integers(1, eos, int(rng.integers(4, 12))).tolist()
        comps = []
        for _ in range(int(rng.integers(2, 4))):
            c = rng.integers(1, eos, int(rng.integers(1, 9))).tolist()
            comps.append(c + ([eos] if rng.random() < 0.5 else []))
        # a second-level fork inside the first completion, a prefix sample and a duplicate
        base = comps[0]
        comps.append(base[: max(1, len(base) // 2)] + rng.integers(1, eos, 3).tolist())
        comps.append(base[: max(1, len(base) - 1)])
        comps.append(list(comps[1]))
        for c in comps:
            toks = prompt + c
            mask = [0] * len(prompt) + [1] * len(c)
            out.append(Sample(tokens=toks, loss_mask=mask, advantage=float(rng.normal()),
                              old_logprobs=-np.log(vocab) + rng.normal(0, 0.2, len(toks))))
    # a lone sample with the default loss mask (every token after the first)
    out.append(Sample(tokens=rng.integers(1, eos, 5).tolist(), advantage=1.0, old_logprobs=-np.log(vocab) + rng.normal(0, 0.2, 5)))
    return out


# ----------------------------------------------------------------------------------------- faults
def inject_fault(mb, fault: Optional[str]):
    """A copy of ``mb`` with a known bug in its tree metadata (None: unchanged)."""
    if fault is None:
        return mb
    L, lm = mb.layout, mb.loss_map
    par = L.segment_parent
    if fault == "sibling_mask":
        # let a segment's rows stay visible to its next sibling's subtree
        for s in range(L.num_segments - 1):
            sib = torch.nonzero((par == par[s]) & (torch.arange(L.num_segments) > s)).flatten()
            if par[s] >= 0 and len(sib):
                end = L.subtree_end.clone()
                end[s] = L.subtree_end[sib[0]]
                L = dataclasses.replace(L, subtree_end=end, visible_until=end[L.segment_ids])
                return dataclasses.replace(mb, layout=L)
        return mb
    if fault == "rope_physical":
        return dataclasses.replace(mb, layout=dataclasses.replace(L, position_ids=torch.arange(L.num_rows)))
    if fault in ("drop_occurrence", "duplicate_occurrence"):
        idx = torch.arange(len(lm))
        idx = idx[1:] if fault == "drop_occurrence" else torch.cat([idx[:1], idx])
        fields = {f.name: (None if getattr(lm, f.name) is None else getattr(lm, f.name)[idx])
                  for f in dataclasses.fields(lm)}
        return dataclasses.replace(mb, loss_map=type(lm)(**fields))
    if fault == "nan" or fault in MODEL_FAULTS or fault in LOSS_AGG_FAULTS + FIELD_FAULTS + VLM_FAULTS:
        return mb  # planted after the backward pass (`_plant_nan`) / in the loss weights, not the tree metadata
    if fault == "zero_state":
        child = torch.nonzero(par >= 0).flatten()
        if len(child):
            p = par.clone()
            p[child[0]] = -1  # recurrent ops start this segment from the zero state
            return dataclasses.replace(mb, layout=dataclasses.replace(L, segment_parent=p))
        return mb
    raise ValueError(f"unknown fault {fault!r}; choose one of {FAULTS}")


def _with_sample_ids(mb, ids: list):
    """``mb`` (packed from a sub-list of the batch) with its loss map's sample indices mapped to the batch's
    ``ids`` (its j-th sample is ``ids[j]``)."""
    lm = mb.loss_map
    idx = torch.as_tensor(ids, dtype=torch.int64)[lm.sample_index]
    return dataclasses.replace(mb, loss_map=dataclasses.replace(lm, sample_index=idx))


#: the losses whose factors come from a stats pass (per sample, keyed by the batch's sample ids on every side)
STATS_LOSSES = ("gspo", "rm") + PAIR_LOSSES
#: the losses of per-token record fields (their tables are keyed by the batch's sample ids too)
FIELD_LOSSES = ("value", "distill")


def _with_fields(samples: list, vocab: int, seed: int) -> list:
    """``samples`` with a value model's ``returns`` / ``old_values`` (spread so that ``VALUE_CLIP`` binds on some
    targets) and a random teacher's top-``DISTILL_K`` ids and log-probs per token in ``meta`` (as `train` reads them)."""
    rng = np.random.default_rng(seed + 17)
    out = []
    for s in samples:
        L = len(s)
        lp = torch.log_softmax(torch.as_tensor(rng.normal(0.0, 2.0, (L, vocab))), -1)
        top = lp.topk(DISTILL_K, dim=-1)
        out.append(dataclasses.replace(s, meta=dict(
            s.meta, returns=rng.normal(0.0, 1.0, L), old_values=rng.normal(0.0, 0.3, L),
            teacher_topk_ids=top.indices.numpy(), teacher_topk_logprobs=top.values.numpy())))
    return out


def _field_kwargs(cfg, samples: list, side: str) -> dict:
    """``--loss value`` / ``distill``: the loss function's per-token tables (`training.objectives.token_fields`) and
    settings, and the teacher's ids to read (``occurrence_ids``). Fault ``field_shift`` (tree side): every table's
    entries moved one position back, so an occurrence reads its next position's."""
    if cfg.loss not in FIELD_LOSSES:
        return {}
    from .objectives import token_fields

    tables = token_fields(cfg.loss, samples)
    if side == "tree" and cfg.fault == "field_shift":
        for t in tables.values():
            t.flat = np.roll(t.flat, -1, axis=0)
    kw = dict(token_fields=tables, value_clip=VALUE_CLIP, distill_kl="forward")
    if cfg.loss == "distill":
        kw["occurrence_ids"] = tables["teacher_topk_ids"].at
    return kw


def _sequence_extras(ddp, batch, cfg, side: str, carry_again, wrap, samples) -> dict:
    """``--loss gspo`` / ``dpo`` / ``ipo`` / ``simpo`` / ``rm``: the trainer's stats pass over ``batch`` (forward only, every
    occurrence reported, gathered per sample over DP x CP and sent from the last PP stage), then GSPO's sequence
    ratios (`training.objectives.gspo_stats_pass`) or each sample's pair factors (`_pair_factors`); {} for the other losses.
    Faults (tree side): ``gspo_one_microbatch``, each sample's statistic from the first microbatch holding it;
    ``wrong_partner``, each chosen sample against the next pair's rejected one."""
    if cfg.loss not in STATS_LOSSES:
        return {}
    from ..megatron import loss as tree_loss_mod
    from .models import forward_backward

    items = carry_again(batch) if carry_again is not None else batch
    with torch.no_grad():
        reports = forward_backward(ddp, items, forward_only=True, loss_type="sft", cp_strategy=cfg.cp_strategy,
                                   wrap_step=wrap, report_occurrences=True)
    before = tree_loss_mod._FAULT
    tree_loss_mod._FAULT = "gspo_one_microbatch" if side == "tree" and cfg.fault == "gspo_one_microbatch" else None
    try:
        if cfg.loss == "gspo":
            return {"sequence_ratios": tree_loss_mod.gspo_sequence_ratios(reports, **tree_loss_mod.sample_sum_groups())}
        ids, sums, counts = tree_loss_mod.gather_sample_sums(reports, "logprobs", **tree_loss_mod.sample_sum_groups())
    finally:
        tree_loss_mod._FAULT = before
    return {"pair_factors": _pair_factors(cfg.loss, ids, sums, counts, samples,
                                          wrong_partner=side == "tree" and cfg.fault == "wrong_partner")}


def _pair_factors(loss: str, ids, sums, counts, samples: list, wrong_partner: bool = False) -> tuple:
    """(coef, share) `tree.loss.SampleValues` of verify's preference pairs (samples 2p and 2p + 1, the even one
    chosen; an odd last sample is in no pair) from the stats pass's per-sample sums (``rm``: the rewards,
    Bradley-Terry: DPO's form with beta 1 and no reference)."""
    from ..tree.loss import SampleValues
    from ..tree.pair_loss import pair_loss_factors

    n = len(samples)
    pi, cnt = np.zeros(n), np.zeros(n)
    pi[ids], cnt[ids] = sums, counts
    c = np.arange(0, n - 1, 2)
    r = np.roll(c + 1, 1) if wrong_partner else c + 1
    if loss == "rm":
        coef, share = pair_loss_factors("dpo", pi, np.zeros(n), cnt, c, r, n_targets=float(cnt.sum()),
                                        n_pairs=float(len(c)), beta=1.0)
    else:
        ref = np.array([float(s.old_logprobs[s.target_mask()].sum()) for s in samples])
        coef, share = pair_loss_factors(loss, pi, ref, cnt, c, r, n_targets=float(cnt.sum()), n_pairs=float(len(c)),
                                        beta=PAIR_BETA, gamma=PAIR_GAMMA)
    every = np.arange(n)
    return SampleValues(every, torch.as_tensor(coef)), SampleValues(every, torch.as_tensor(share))


def _agg_per_microbatch(mb, samples: list, cfg) -> "object":
    """The planted ``loss_agg_per_microbatch`` fault: ``mb``'s occurrence weights rescaled from each sample's
    factor over the whole batch to its factor over ``mb``'s own samples."""
    from ..tree.loss_agg import loss_agg_factors

    counts = np.array([int(s.target_mask().sum()) for s in samples])
    whole = loss_agg_factors(counts, cfg.loss_agg, cfg.loss_agg_norm)
    ids = list(mb.sample_ids)
    local = dict(zip(ids, loss_agg_factors(counts[ids], cfg.loss_agg, cfg.loss_agg_norm).tolist()))
    lm = mb.loss_map
    ratio = torch.tensor([local[i] / whole[i] if whole[i] else 0.0 for i in lm.sample_index.tolist()],
                         dtype=lm.weights.dtype)
    return dataclasses.replace(mb, loss_map=dataclasses.replace(lm, weights=lm.weights * ratio))


def plant_model_fault(model, fault: Optional[str]) -> None:
    """Plant a module-level fault (`MODEL_FAULTS`) into the tree side's ``model`` (others: nothing).

    ``mla_rope_physical``: every `TreeMLASelfAttention` rotates its query/key rotary parts by the
    row's physical index in the packed sequence (global row under CP) instead of its depth: what the
    stock MLA module does, since it builds its rotary table from the sequence length.
    ``dsa_tie_order``: every `TreeDSAttention` breaks top-k ties by the larger row id (not the smaller).
    ``dsa_loss_weight``: every `TreeDSAttention` weights each row's indexer loss term by 1 (dropping
    the per-sample weights ``sum 1/len(s)``).
    ``route_row_shift`` (routing replay): every MoE layer replays, at each row, the routes of the row
    before it (routes read one row off). ``route_recompute_stale``: a selective MoE recomputation in
    the backward replays the routes last set by a forward (under 1F1B a later microbatch's) instead of
    its own forward's.
    ``dsa_bf16_grad_sum`` (CP 1, bf16): every `TreeDSAttention` rounds the indexer loss's two passes'
    gradients to bf16 before summing them (`ops.dsa.tree_dsa_indexer_loss` ``fp32_grad_sum=False``),
    where they nearly cancel: float64-exact, far less accurate than per-sample bf16 training.
    """
    if fault in BALANCE_FAULTS:
        from ..megatron import moe_balance

        moe_balance._FAULT = fault  # reset after the tree side's step (`_rank_body`)
        return
    if fault in REPLAY_FAULTS:
        from ..megatron.routing_replay import install_routing_replay

        for rep in install_routing_replay(model):
            rep.fault = fault
        return
    if fault in DSA_FAULTS + BF16_FAULTS:
        from ..megatron.dsa import TreeDSAttention

        for m in model.modules():
            if isinstance(m, TreeDSAttention):
                m.fault = fault
        return
    if fault != "mla_rope_physical":
        return
    from ..megatron.mla import TreeMLASelfAttention

    def physical_rows(psp):
        rows = torch.arange(psp.layout.num_rows, device=psp.layout.device)
        if psp.local_rows is None:
            return rows
        return torch.cat([psp.local_rows, rows.new_zeros(psp.num_local_padding)])

    for m in model.modules():
        if isinstance(m, TreeMLASelfAttention):
            m.rotary_positions = physical_rows  # instance attribute: shadows the method on this module only


# ----------------------------------------------------------------------------------------- ranks
#: A gradient is judged relative to its own largest element, but never to less than this fraction of
#: the largest gradient element of the model (this rank's parameters). GDN's per-head decay gradients
#: (A_log, dt_bias) can be 1e-11..1e-8 where others are 0.1..1 (decays exp(A_log) up to 16, sums over
#: every token with heavy cancellation): against themselves, the rounding of the terms that cancel
#: reads as a large error. `megatron-tree verify --model qwen3next --tp 2 --sp` measured 3.2e-2 in
#: float32 (an absolute 3.2e-10 on a gradient of 8e-9; tolerance 1e-2: FAILED) and, with MTP, 1.16e-9
#: in float64 (an absolute 1.2e-17; tolerance 1e-9) against the previous fixed floor of 1e-8; with
#: this floor 2.2e-4 and 1.6e-13 (without MTP). Every bug planted in the suite moves gradients by far
#: more than 1e-4 of the largest, and in float64 a gradient below it is still held to ~1e-13 of the
#: largest, absolutely.
GRAD_SCALE_FLOOR = 1e-4


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-8) -> float:
    """max |a - b| / max(max |b|, floor); inf when either side holds a NaN or inf.

    Never NaN: a non-finite value is never "close", and inf (unlike NaN) survives every ``max``
    and fails every ``<= tolerance``."""
    a, b = a.double(), b.double()
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        return math.inf
    return float((a - b).abs().max() / b.abs().max().clamp_min(floor)) if b.numel() else 0.0


def _rel_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / max(||b||, 1e-30) (Frobenius); inf when either side holds a NaN or inf.

    The bf16 judge's error: every element counts, so it measures how accurate a side is overall. A
    max-element error is set by the largest values' last rounding (bf16 logits out of the output
    layer are rounded identically on both sides), which a less accurate side can hide behind."""
    a, b = a.double(), b.double()
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        return math.inf
    return float((a - b).norm() / b.norm().clamp_min(1e-30)) if b.numel() else 0.0


def _worst(items, rel=_rel) -> tuple[float, Optional[str]]:
    """The largest ``rel`` error over ``items`` (``(where, tree, flat)`` triples) and where it is.

    ``where`` names the first item with that error, with ``(non-finite on the tree side)`` (or
    per-sample side, or both) when a NaN/inf is the reason; ``(0.0, None)`` for no items."""
    err, at = 0.0, None
    for where, a, b in items:
        e = rel(a, b)
        if at is None or e > err:
            err, at = e, where
            if e == math.inf:
                bad = [side for side, x in (("tree", a), ("per-sample", b)) if not bool(torch.isfinite(x).all())]
                at = f"{where} (non-finite on the {' and '.join(bad)} side)"
    return err, at


def _plant_nan(ddp, store: list, mine: list) -> None:
    """The ``nan`` fault, tree side: NaN in one element of the gradient of this rank's last parameter,
    before the optimizer step (so the stepped parameter turns NaN too), and in one logit of the last
    sample of this rank's last microbatch. Both are the last item their comparison visits: a
    reduction with Python's ``max`` drops a NaN that is not first, which is how verify once passed."""
    _, p = list(ddp.module.named_parameters())[-1]
    p.main_grad.view(-1)[0] = float("nan")
    if store:  # last pipeline stage: the logits of this rank's real microbatches come first, in order
        rows = mine[-1].sample_rows(mine[-1].sample_ids[-1])
        store[len(mine) - 1][rows[-1], 0] = float("nan")


def _logits_step(store, cp_strategy, data_iterator, model):
    from ..megatron.carry import CarryItem
    from ..megatron.forward_step import begin_carry_item, carry_forward, context_parallel_params
    from ..megatron.packed_seq import tree_packed_seq_params

    item = next(data_iterator)
    if isinstance(item, CarryItem):
        if item.mb.carry is None:
            begin_carry_item(item, model)  # a sync of carry groups cut over DP ranks may begin here
            item = item.mb  # a padding microbatch
        else:  # this microbatch's own rows (this CP rank's under CP): logits keyed by their step-global rows
            def carry_logits(view):
                keys = item.mb.carry.keys[view.local_rows.cpu().numpy()]

                def loss_func(output):
                    store.append((keys, output.detach()[0, :len(keys)].to(
                        torch.float64 if output.dtype == torch.float64 else torch.float32).cpu()))
                    return output.sum() * 0, {}
                return loss_func

            out, loss_func = carry_forward(item, model, carry_logits, logits=True, cp_strategy=cp_strategy)
            if item.phase in ("fill", "keep"):
                return out, lambda output: (output.sum() * 0, {})
            return out, loss_func
    mb, plan = item if isinstance(item, tuple) else (item, None)
    psp = context_parallel_params(tree_packed_seq_params(mb, next(model.parameters()).device), model, plan=plan,
                                  strategy=cp_strategy)
    psp.loss_map = None
    out = model(psp.input_ids.unsqueeze(0), psp.position_ids.unsqueeze(0), None, packed_seq_params=psp)

    def loss_func(output):
        # GPTModel returns [b, s, V/tp]; float64 stays float64 (the bf16 judge's reference)
        logits = output.detach()[0].to(torch.float64 if output.dtype == torch.float64 else torch.float32).cpu()
        if psp.is_context_parallel:  # every CP rank computed its owned rows: gather the whole microbatch
            logits = _gather_cp_rows(logits, psp)
        store.append(logits)
        return output.sum() * 0, {}

    return out, loss_func


def _dedupe_selected(entries: list) -> dict:
    """{(token, layer): entry} keeping the first forward of each microbatch and layer (a recomputation
    repeats them)."""
    out = {}
    for e in entries:
        out.setdefault((e[0], e[1]), e)
    return out


def _gather_selected(entries: dict, group) -> dict:
    """Tree-format entries ``(token, layer, rows, ids)`` of every rank of ``group`` merged per (token,
    layer): each CP rank captured its own rows only."""
    if group is None or torch.distributed.get_world_size(group) == 1:
        return entries
    parts = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(parts, entries, group=group)
    merged = {}
    for part in parts:
        for key, (tok, layer, rows, ids) in part.items():
            if key in merged:
                merged[key] = (tok, layer, torch.cat([merged[key][2], rows]), torch.cat([merged[key][3], ids]))
            else:
                merged[key] = (tok, layer, rows, ids)
    return merged


def _by_token(entries: dict) -> list:
    """[{layer: entry}] per microbatch forward, in the order they ran."""
    out: dict = {}
    for (tok, layer), e in entries.items():
        out.setdefault(tok, {})[layer] = e
    return [out[t] for t in sorted(out)]


def _rows_to_table(num_rows: int, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[num_rows, topk] ids by global row from a (rows, ids) capture."""
    table = torch.full((num_rows, ids.shape[1]), -3, dtype=torch.long)  # -3: a row nobody computed
    table[rows.long()] = ids.long()
    return table


def _pad_topk(t: torch.Tensor, topk: int) -> torch.Tensor:
    """[L, k] ids padded with -1 (no key) to [L, topk]: stock returns fewer columns on short samples."""
    if t.shape[1] >= topk:
        return t
    return torch.cat([t, t.new_full((t.shape[0], topk - t.shape[1]), -1)], 1)


def _layer_rows(mb, i: int, layer: int, num_layers: int) -> torch.Tensor:
    """[L] rows of sample ``i`` that ``layer`` computes, in position order: the sample's path; for MTP
    depth k (captured as layer ``num_layers + k``) its rows of depth >= k, then its first k tail rows
    (stock's anchors 0..L-1, `megatron.mtp`)."""
    rows = mb.sample_rows(i).long()
    k = layer - num_layers
    return rows if k <= 0 else torch.cat([rows[k:], mb.tail_rows(i)[:k].long()])


def _sample_table(mb, i: int, layer: int, num_layers: int, trows, tids, topk: int) -> torch.Tensor:
    """[L, topk] ordered top-k of sample ``i`` in ``layer`` as positions (canonical rows mapped through
    `_layer_rows`; -2: a row off the sample's path) from a tree-format capture ``(trows, tids)``."""
    rows = _layer_rows(mb, i, layer, num_layers)
    return _path_positions(_rows_to_table(mb.layout.num_rows, trows, tids)[rows], rows, mb.layout.num_rows, topk)


def _path_positions(ids: torch.Tensor, path: torch.Tensor, num_rows: int, topk: int) -> torch.Tensor:
    """[L, topk] selections ``ids`` (rows of a space of ``num_rows``; < 0 kept) as positions on ``path``
    (those rows in position order; -2: a row off the path)."""
    inv = torch.full((num_rows,), -2, dtype=torch.long)
    inv[path] = torch.arange(path.shape[0])
    return _pad_topk(torch.where(ids >= 0, inv[ids.clamp_min(0)], ids), topk)


def _tree_selected_tables(tree_sel: list, mine: list, topk: int, num_layers: int, cp_group=None, *,
                          local_ids: bool = False) -> list:
    """[(sample id, {layer: [L, topk] ordered top-k as positions on the sample's path})] of the tree
    side (`_sample_table`), in sample order. ``local_ids``: each microbatch's samples are 0, 1, ... in
    that order (verify's flat-packed bf16 baseline, `_flat_packed`), not ``mb.sample_ids``."""
    tree_by_mb = _by_token(_gather_selected(_dedupe_selected(tree_sel), cp_group))
    out = []
    for j, mb in enumerate(mine):
        layers = tree_by_mb[j] if j < len(tree_by_mb) else {}
        for i in (range(len(mb.sample_ids)) if local_ids else mb.sample_ids):
            out.append((i, {layer: _sample_table(mb, i, layer, num_layers, trows, tids, topk)
                            for layer, (_, _, trows, tids) in sorted(layers.items())}))
    return out


def _carry_selected_tables(tree_sel: list, mine: list, topk: int, cp_group=None) -> list:
    """`_tree_selected_tables` of a carry step: each row's selection comes from the microbatch that owns
    it, captured as step-global rows (`megatron.dsa`; under CP by the rank that computes the row); a
    sample's path is read from the microbatch that completes it (its carried rows and its own)."""
    by_layer: dict = {}
    for _, layer, rows, ids in _gather_selected(_dedupe_selected(tree_sel), cp_group).values():
        real = rows >= 0  # padding rows have no step-global row
        by_layer.setdefault(layer, []).append((rows[real], ids[real]))
    R = 1 + max([int(mb.carry.keys.max()) for mb in mine if mb.carry is not None]
                + [int(r.max()) for parts in by_layer.values() for r, _ in parts if len(r)] + [0])
    tables = {layer: _rows_to_table(R, torch.cat([r for r, _ in parts]), torch.cat([i for _, i in parts]))
              for layer, parts in sorted(by_layer.items())}
    out = []
    for mb in mine:
        for i in mb.sample_ids:
            path = torch.from_numpy(mb.carry.keys[mb.sample_rows(i).numpy()]).long()
            out.append((i, {layer: _path_positions(t[path], path, R, topk) for layer, t in tables.items()}))
    return out


def _flat_selected_tables(flat_sel: list, mine: list, flat_mbs: list, topk: int, num_layers: int, *,
                          is_stock: bool, cp_group=None) -> list:
    """`_tree_selected_tables` of a per-sample side (stock: positions; tree modules on one sample: the
    chain's canonical rows, i.e. positions)."""
    flat = _dedupe_selected(flat_sel)
    if not is_stock:
        flat = _gather_selected(flat, cp_group)
    by_sample = iter(_by_token(flat))
    real_flat = iter([fm[0] if isinstance(fm, tuple) else fm for fm in flat_mbs])
    out = []
    for mb in mine:
        for i in mb.sample_ids:
            layers, fmb = next(by_sample, {}), next(real_flat)
            out.append((i, {layer: _pad_topk(e[2].long(), topk) if is_stock else
                            _sample_table(fmb, 0, layer, num_layers, e[2], e[3], topk)
                            for layer, e in layers.items()}))
    return out


def _diff_selected(got: list, ref: list):
    """Fraction of (sample, row, DSA layer) of ``ref`` whose ordered top-k differs in ``got``, and the first."""
    bad = total = 0
    where = None
    for (i, g), (_, r) in zip(got, ref):
        if set(g) != set(r):  # a layer one side did not capture (MTP layers are num_layers + k)
            return math.inf, f"sample {i}: DSA layers {sorted(g)} captured vs {sorted(r)}"
        for layer in sorted(g):
            diff = (g[layer] != r[layer]).any(1)
            bad += int(diff.sum())
            total += int(diff.shape[0])
            if where is None and bool(diff.any()):
                k = int(diff.nonzero()[0])
                where = f"sample {i} layer {layer} position {k}: {g[layer][k].tolist()} vs {r[layer][k].tolist()}"
    if total == 0:
        return math.inf, "no DSA selections captured"
    return bad / total, where


def _mb_of(item):
    """The microbatch of a batch item (a microbatch, or a (microbatch, CPPlan) pair under CP)."""
    return item[0] if isinstance(item, tuple) else item


def _flat_packed(samples: list, mb, pad: int, route_aware: bool = False, mtp_tail: int = 0):
    """The samples of tree microbatch ``mb`` as one flat-packed microbatch (every sample its own
    unbranched chain, in the order of ``mb.sample_ids``; its sample ``j`` is ``mb.sample_ids[j]``):
    ordinary packed training of the same microbatch, the bf16 judge's baseline."""
    from ..tree import pack

    chosen = [samples[i] for i in mb.sample_ids]
    rows = sum(len(s.tokens) + mtp_tail for s in chosen)
    out = pack(chosen, -(-rows // pad) * pad, pad_to_multiple_of=pad, share_prefixes=False, route_aware=route_aware,
               mtp_tail=mtp_tail)
    if len(out) != 1:
        raise RuntimeError(f"flat packing of one microbatch's {len(chosen)} samples gave {len(out)} microbatches")
    return out[0]


def _gather_cp_rows(local: torch.Tensor, psp) -> torch.Tensor:
    """[N, V] logits of every row from each CP rank's [n_local (+ padding), V] (all-gather, padded)."""
    from megatron.core import parallel_state as ps

    group = ps.get_context_parallel_group()
    rows = psp.local_rows.cpu()
    width = max(int(r.shape[0]) for r in (psp.cp_plan.owner_rows(i) for i in range(psp.cp_plan.cp_size)))
    buf = local.new_zeros(width, local.shape[1])
    buf[: rows.shape[0]] = local[: rows.shape[0]]
    parts = [torch.empty_like(buf) for _ in range(psp.cp_plan.cp_size)]
    torch.distributed.all_gather(parts, buf, group=group)
    full = local.new_zeros(psp.layout.num_rows, local.shape[1])
    for r, part in enumerate(parts):
        owned = torch.from_numpy(psp.cp_plan.owner_rows(r))
        full[owned] = part[: owned.shape[0]]
    return full


def _single_owner_plan(mb, cp: int):
    """CP plan putting every row on CP rank 0: the per-sample side never crosses ranks, so it stays an
    oracle that does not share the CP executor's cross-rank code with the tree side."""
    from ..cp import CPPlan

    n = mb.layout.num_rows
    return CPPlan(cp, "single_owner", np.zeros(n, np.int32), mb.layout.visible_until.numpy(),
                  mb.layout.position_ids.numpy())


def _rank_body_many(cfgs: list) -> list:
    """Several configs in one set of processes (saves a Megatron import per config)."""
    from megatron.core import parallel_state as ps

    import os

    from ..cp.execution.gdn import MODE_ENV

    out = []
    for cfg in cfgs:
        saved = os.environ.get(MODE_ENV)
        if cfg.gdn_cp_mode is not None:
            os.environ[MODE_ENV] = cfg.gdn_cp_mode
        try:
            out.append(_rank_body(cfg))
        finally:
            if saved is None:
                os.environ.pop(MODE_ENV, None)
            else:
                os.environ[MODE_ENV] = saved
            ps.destroy_model_parallel()
            torch.set_default_dtype(torch.float32)
    return out


def _rank_body(cfg: VerifyConfig) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from ..cpu import megatron_core as cpu_layer
    from ..megatron.mtp import mtp_tail_rows
    from ..megatron.router_precision import widen_router_scores
    from ..tree import pack, padding_microbatch
    from .models import ModelArgs, build_model, forward_backward, make_config, report_totals, wrap_ddp

    on_cpu = not torch.cuda.is_available()
    cpu_layer.enable(kernels=True)
    ps.initialize_model_parallel(tensor_model_parallel_size=cfg.tp, pipeline_model_parallel_size=cfg.pp,
                                 context_parallel_size=cfg.cp, expert_model_parallel_size=cfg.ep)
    dtype = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}[cfg.dtype]
    if dtype == torch.float64:
        torch.set_default_dtype(torch.float64)  # Megatron's torch norms take the default dtype, not params_dtype
    # stock scores MoE routes in float32 whatever the dtype: float64 runs score them in float64 on both
    # sides (stock's own code, `router_precision`), so the check is exact to float64 rounding
    widen_router_scores(dtype == torch.float64)
    dense = ("gpt", "qwen3next", "mla", "dsa", "vlm")
    margs = ModelArgs(kind=cfg.model, num_layers=4 if cfg.model in dense else 0, window_size=cfg.window,
                      sinks=cfg.sinks,
                      num_experts=4 if (cfg.ep > 1 or cfg.routing_replay or cfg.balancing_on()) and cfg.model in dense
                      else None)
    balance = cfg.balancing_on()
    if balance:
        from ..megatron.moe_balance import reset_moe_tracker

        margs.extra.update(cfg.balancing)
        reset_moe_tracker()  # sized by the first model that records: this config's may have more MoE layers
    dsa = cfg.model == "dsa"
    if dsa:
        from . import dsa_oracle

        dsa_oracle.enable()  # stock DSA on CPU / float64: Hadamard stand-in, tracker device
        margs.extra.update(dsa_indexer_use_sparse_loss=cfg.dsa_sparse_loss)
        if cfg.dsa_topk is not None:
            margs.extra.update(dsa_indexer_topk=cfg.dsa_topk)
        if cfg.dsa_topk_freq > 1:
            margs.extra.update(dsa_indexer_topk_freq=cfg.dsa_topk_freq, dsa_indexer_skip_topk_offset=0)
    if cfg.pattern:
        margs.pattern = cfg.pattern
    if cfg.mtp_num_layers:
        margs.extra.update(mtp_num_layers=cfg.mtp_num_layers)
        margs.mtp_pattern = cfg.mtp_pattern
    if cfg.model == "qwen3next":
        # Qwen3-Next's attention output gate is Megatron's ``x * sigmoid(gate.float())``: float32 inside
        # a float64 model, so the backward rounds a shared row's summed gradient once in fp32 where the
        # per-sample side rounds each sample's part (~2e-9 on grads, ~1e-5 after Adam's sign-like first
        # step). Verify leaves it off to stay exact; tests/test_model_families.py checks the gate against
        # stock GPTModel per sample.
        margs.extra["attention_output_gate"] = False
    from ..tree.loss_agg import with_loss_agg

    vision = None
    if cfg.model == "vlm":  # image records, their pixels held by `vision` (`verify_vlm`)
        from .verify_vlm import vlm_verify_samples

        records, vision = vlm_verify_samples(cfg.seed, margs.vocab_size, cfg.families)
    else:
        records = verify_samples(cfg.seed, margs.vocab_size, cfg.families)
    samples = with_loss_agg(records, cfg.loss_agg, cfg.loss_agg_norm)
    if cfg.loss in FIELD_LOSSES:
        samples = _with_fields(samples, margs.vocab_size, cfg.seed)
    if cfg.loss == "rm":  # a reward model reads each sample's last row: one leaf token appended as its target
        from .objectives import reward_samples

        samples = reward_samples(samples)
    route_shape = None
    if cfg.routing_replay:
        margs.extra["moe_enable_routing_replay"] = True
    if (cfg.routing_replay or balance) and cfg.recompute == "selective" and cfg.model not in ("mla", "dsa"):
        margs.extra["recompute_modules"] = ["core_attn", "moe"]  # the MoE layer's routing reruns in backward
    probe = make_config(margs, tp=cfg.tp, pp=cfg.pp, ep=cfg.ep, cp=cfg.cp, sp=cfg.sp, dtype=dtype, cpu=on_cpu)
    if cfg.routing_replay:
        route_shape = (_moe_layer_count(margs, probe), margs.moe_router_topk)
        samples = verify_routes(samples, *route_shape, margs.num_experts, cfg.seed)
    # DSA in the MTP layers: every sample's K trailing MTP positions as tail rows
    tail = mtp_tail_rows(probe)
    dp, dpr = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    # the tree side's records (every field set above): with the planted fault "images_merged", image content is
    # no part of a row's identity
    tree_samples = samples
    if cfg.fault == "images_merged":
        from .verify_vlm import images_merged

        tree_samples = images_merged(samples)
    if cfg.carry:
        from ..tree.carry import assign_carry_ranks

        if tail:
            raise ValueError("verify --carry with MTP layers that run DeepSeek sparse attention: their MTP tail rows "
                             "are not carried yet")
        mbs = pack(tree_samples, cfg.budget, pad_to_multiple_of=8, carry=True, route_aware=cfg.routing_replay)
        ranks = assign_carry_ranks(mbs, dp, cut=cfg.carry_cut)
        mine = [mbs[i] for i in ranks[dpr]]
    else:
        mbs = pack(tree_samples, cfg.budget, pad_to_multiple_of=8, route_aware=cfg.routing_replay, mtp_tail=tail)
        mine = mbs[dpr::dp]
    if vision is not None:  # every microbatch's image slots get their pixels (the tree side's, the faulted ones')
        mbs = [vision.attach(mb) for mb in mbs]
        mine = [vision.attach(mb) for mb in mine]
    if not mine:
        raise ValueError(f"only {len(mbs)} microbatches for {dp} DP ranks: raise --families")
    tree_mbs = [inject_fault(mb, cfg.fault) for mb in mine]
    if cfg.fault == "loss_agg_per_microbatch":
        tree_mbs = [_agg_per_microbatch(mb, samples, cfg) for mb in tree_mbs]
    pad = cfg.tp if cfg.sp else 1  # sequence parallelism splits rows evenly over TP ranks
    # the per-sample side is stock MTP at CP 1 (it rolls token 0 in itself), the tree MTP code under CP
    # carry: a sample may be longer than the budget; the per-sample side runs it whole
    flat_budget = max(cfg.budget, -(-max(len(s) for s in samples) // 8) * 8) if cfg.carry else cfg.budget
    flat_mbs = [pack([samples[i]], flat_budget, pad_to_multiple_of=pad, mtp_tail=tail if cfg.cp > 1 else 0)[0]
                for mb in mine for i in mb.sample_ids]
    if vision is not None:
        flat_mbs = [vision.attach(mb) for mb in flat_mbs]
    if cfg.loss in STATS_LOSSES + FIELD_LOSSES:  # per-sample statistics and fields are keyed by the batch's ids
        flat_mbs = [_with_sample_ids(fm, [i]) for fm, i in zip(flat_mbs, [i for mb in mine for i in mb.sample_ids])]
    # Every DP rank runs the same number of microbatches (MoE all-to-alls run once per microbatch
    # on every expert-parallel rank): top up with zero-loss padding microbatches.
    fields = [f for f in ("advantages", "old_logprobs", "ref_logprobs") if getattr(mine[0].loss_map, f) is not None]
    filler = padding_microbatch(cfg.budget, num_rows=-(-8 // pad) * pad, float_fields=fields, route_shape=route_shape)
    n_tree = -(-len(mbs) // dp)
    n_flat = max(sum(len(m.sample_ids) for m in mbs[r::dp]) for r in range(dp))
    bf16 = dtype == torch.bfloat16
    # bf16: the baseline is ordinary packed training of the same microbatches (every sample its own
    # chain): each microbatch's parameter gradients are rounded to bf16 once before Megatron adds
    # them into the float32 main_grad, so one sample per microbatch would average that rounding over
    # ~sqrt(#samples) more microbatches than the tree side has (5.9x on GDN's A_log at 34 samples),
    # an effect of the microbatch count, not of the tree. The float64 reference stays per sample.
    # MoE balancing: aux losses are statistics of a microbatch, so the reference packs each tree microbatch's
    # samples flat (stock's statistic on the same microbatch), padding weighing nothing
    cut = False  # carry groups cut over DP ranks (set below)
    packed_mbs = ([_flat_packed(samples, mb, pad, route_aware=cfg.routing_replay, mtp_tail=tail if balance else 0)
                   for mb in mine] if bf16 or balance else None)
    if packed_mbs is not None and vision is not None:
        packed_mbs = [vision.attach(mb) for mb in packed_mbs]
    if packed_mbs is not None and cfg.loss in STATS_LOSSES + FIELD_LOSSES:
        packed_mbs = [_with_sample_ids(pm, list(mb.sample_ids)) for pm, mb in zip(packed_mbs, mine)]
    if cfg.carry:  # every DP rank runs the schedule's items (`cp.planning.carry_ranks`), padding items included
        from ..cp.planning.carry_ranks import rank_schedule

        schedule = rank_schedule(mbs, ranks, keep=[True] * dp if cfg.carry_keep else None)
        cut = bool(schedule.syncs)
        step_mbs = list(mbs)  # this rank's items read its own (faulted) microbatches
        for i, mb in zip(ranks[dpr], tree_mbs):
            step_mbs[i] = mb
    else:
        tree_mbs += [filler] * (n_tree - len(tree_mbs))
    # routing replay, per-sample side: each sample's own routes (then valid ones on its padding rows),
    # fed to stock RouterReplay (`_stock_replay`), never read from the tree side's packing
    flat_routes = ([_sample_routes(samples[i], fm.num_rows) for fm, i in
                    zip(flat_mbs, [i for mb in mine for i in mb.sample_ids])] if cfg.routing_replay else None)
    flat_mbs += [padding_microbatch(cfg.budget, num_rows=pad, float_fields=fields, route_shape=route_shape)] * (
        n_flat - len(flat_mbs))
    if cfg.routing_replay:
        flat_routes += [_sample_routes(None, pad, route_shape)] * (len(flat_mbs) - len(flat_routes))
    if bf16 or balance:
        packed_mbs += [filler] * (n_tree - len(packed_mbs))

    def fresh(stock_dsa=False, side_dtype=dtype, init=None, recompute=cfg.recompute, stock_mtp=False):
        # a new config per model: DDP hangs hooks on it, and MoE experts deep-copy it
        config = make_config(margs, tp=cfg.tp, pp=cfg.pp, ep=cfg.ep, cp=cfg.cp, sp=cfg.sp, recompute=recompute,
                             dtype=side_dtype, cpu=on_cpu)
        torch.manual_seed(cfg.seed)
        model_parallel_cuda_manual_seed(cfg.seed)
        # model "dsa": the per-sample side's DSA core attention is stock DSAttention (the oracle);
        # same parameters and initial weights as the tree side
        m = build_model(config, margs, stock_dsa=stock_dsa, stock_mtp=stock_mtp)
        if cfg.loss in ("rm", "value"):  # a reward / value model: the scalar head, the same initial weights per side
            from ..megatron.value_head import add_value_head

            add_value_head(m, bias=cfg.loss != "rm")  # (a reward's bias cancels in Bradley-Terry: none, as train's)
        if cfg.seq_aux_per_sample:
            from ..megatron.moe_balance import set_seq_aux_per_sample

            set_seq_aux_per_sample(m)
        if stock_mtp:  # the per-sample side's MTP: stock GPTModel._postprocess (`verify_mtp`)
            from .verify_mtp import install_stock_mtp

            install_stock_mtp(m)
        if dsa and cfg.mtp_num_layers:
            from .verify_mtp import number_mtp_captures

            number_mtp_captures(m)
        if side_dtype == torch.bfloat16:
            # as Megatron-LM's --bf16: Float16Module casts the whole module (norm weights, Mamba's
            # A_log / D included) with ``module.bfloat16()``
            config.bf16 = True
            m = m.bfloat16()
        if init is not None:  # the float64 reference starts from the bf16 sides' initial weights
            named = dict(m.named_parameters())
            if set(named) != set(init):
                raise RuntimeError(f"reference model's parameters differ: {sorted(set(named) ^ set(init))}")
            with torch.no_grad():
                for n, p in named.items():
                    p.copy_(init[n].to(p.device, p.dtype))
        if not on_cpu:
            m = m.cuda()
        ddp = wrap_ddp(m, config, grad_reduce_in_fp32=side_dtype == torch.bfloat16)
        if bf16:  # no optimizer step is compared in bf16 (module docstring)
            return ddp, None
        # Adam's first step is lr*sign(g): float noise on near-zero gradients flips whole updates, so
        # float32 runs step with SGD (linear in the gradient); float64 runs use Adam.
        # Routing replay and MoE balancing runs (all-MoE models) step with SGD by default: chosen when
        # Megatron's fp32 route scoring left router gradients at ~1e-7 (Adam then moved a few small router
        # elements by 1e-5..2e-4 of the largest). Float64 runs now widen that scoring (`router_precision`),
        # and ``optimizer`` overrides the choice: the multi-step balancing check runs Adam to 1e-10.
        exact_adam = dtype == torch.float64 and not (cfg.routing_replay or balance)
        opt_name = cfg.optimizer or ("adam" if exact_adam else "sgd")
        opt = get_megatron_optimizer(OptimizerConfig(optimizer=opt_name, lr=1e-2, weight_decay=0.01, clip_grad=0.0,
                                                     params_dtype=dtype), [ddp])
        return ddp, opt

    result = {m: 0.0 for m in metrics_of(cfg)}
    result.update({f"{m}_at": None for m in metrics_of(cfg)})
    runs = {}
    if cfg.cp > 1:  # the tree side runs the planner's plan; the per-sample side stays on one CP rank
        from ..cp import plan_context_parallel

        if not cfg.carry:  # carry plans each item's layout (carried rows included) as it runs
            tree_mbs = [(mb, plan_context_parallel(mb.layout, cfg.cp, strategy=cfg.cp_strategy)) for mb in tree_mbs]
        flat_mbs = [(mb, _single_owner_plan(mb, cfg.cp)) for mb in flat_mbs]
        if cfg.routing_replay:  # each CP rank's routers see its rows of the single-owner plan
            cpr, mult = ps.get_context_parallel_rank(), (cfg.tp if cfg.sp else 1)
            flat_routes = [_cp_rank_routes(r, plan, cpr, mult) for r, (_, plan) in zip(flat_routes, flat_mbs)]
        if bf16 or balance:
            packed_mbs = [(mb, _single_owner_plan(mb, cfg.cp)) for mb in packed_mbs]
    # model "dsa": the per-sample side is stock DSAttention; under tree CP it is our DSA on one CP rank
    # per sample (single-owner plan, as for every model), itself checked against stock by the CP=1 runs
    stock_flat = dsa and cfg.cp == 1
    if cfg.carry:  # (kept graphs: every exporter's graph kept from its keep to its release)
        from ..megatron.carry import CarryItem, carry_rank_items

        dp_group = ps.get_data_parallel_group()
        tree_mbs = carry_rank_items(step_mbs, schedule, dpr, filler, dp_group)
        # a fresh store per pass (the logits pass, the training step): the items again, from the microbatches
        carry_again = lambda batch: (carry_rank_items(step_mbs, schedule, dpr, filler, dp_group)
                                     if batch and isinstance(batch[0], CarryItem) else batch)
    sides = [("tree", tree_mbs, dtype), ("flat", packed_mbs if bf16 or balance else flat_mbs, dtype)]
    if bf16:  # the reference: per-sample training in float64 from the same initial weights
        sides.append(("ref", flat_mbs, torch.float64))
    # the sides that run one sample per microbatch
    per_sample = ("ref",) if bf16 else (() if balance else ("flat",))
    init = None
    for side, batch, side_dtype in sides:
        torch.set_default_dtype(torch.float64 if side_dtype == torch.float64 else torch.float32)
        stock = stock_flat and side in per_sample  # model "dsa" at CP 1: stock DSAttention per sample
        # routing replay under PP: stock RouterReplay replays "the current" routes when a recomputation
        # runs, which 1F1B has already replaced by a later microbatch's; recomputation changes no number,
        # so the per-sample side runs without it there (the tree side keeps it: its routes follow the rows)
        side_recompute = "none" if cfg.routing_replay and cfg.pp > 1 and side in per_sample else cfg.recompute
        if cfg.mtp_num_layers and cfg.cp == 1 and side in per_sample:
            side_recompute = "none"  # stock MTP (0.16) cannot checkpoint with packed_seq_params; no number changes
        ddp, opt = fresh(stock_dsa=stock, side_dtype=side_dtype, init=init if side == "ref" else None,
                         recompute=side_recompute,
                         # balancing: the flat pack runs our MTP (stock MTP rolls a pack as one sequence)
                         stock_mtp=bool(cfg.mtp_num_layers) and cfg.cp == 1 and side != "tree" and not balance)
        if cfg.mtp_num_layers:
            from .verify_mtp import set_mtp_fault

            set_mtp_fault(cfg.fault if side == "tree" else None)
        if side == "tree" and bf16:
            init = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
        wrap = None
        if cfg.routing_replay:
            if side in per_sample:  # stock RouterReplay, fed each sample's routes before its forward
                wrap = partial(_stock_replay, ddp.module, flat_routes)
            else:
                from ..megatron.routing_replay import install_routing_replay

                install_routing_replay(ddp.module)
        if side == "tree":
            plant_model_fault(ddp.module, cfg.fault)
            if cfg.carry:
                from ..cp.execution import carry as carry_exec

                carry_exec._FAULT = {"carry_detach": "detach", "carry_stale": "stale", "carry_twice": "twice",
                                     "carry_return_dropped": "return_dropped"}.get(cfg.fault)
                batch = carry_again(batch)
        store: list = []
        logits_step = partial(_logits_step, store, cfg.cp_strategy)
        get_forward_backward_func()(forward_step_func=wrap(logits_step) if wrap else logits_step,
                                    data_iterator=iter(batch), model=[ddp], num_microbatches=len(batch),
                                    seq_length=max((b[0] if isinstance(b, tuple) else b).num_rows for b in batch),
                                    micro_batch_size=1, forward_only=True)
        ddp.zero_grad_buffer()
        if opt is not None:
            opt.zero_grad()
        with contextlib.ExitStack() as stack:
            selected = None
            if dsa:
                from ..megatron.dsa import capture_selected

                dsa_oracle.dsa_module().DSAIndexerLossLoggingHelper.tracker.clear()
                selected = stack.enter_context(dsa_oracle.capture_stock_selected() if stock else capture_selected())
            if cfg.carry and side == "tree":
                batch = carry_again(batch)
            extra = _sequence_extras(ddp, batch, cfg, side, carry_again if cfg.carry and side == "tree" else None, wrap,
                                     samples)
            if cfg.carry and side == "tree" and extra:
                batch = carry_again(batch)
            reports = forward_backward(ddp, batch, loss_type=cfg.loss, cp_strategy=cfg.cp_strategy, wrap_step=wrap,
                                       **extra, **_field_kwargs(cfg, samples, side))
        tot = report_totals(reports)
        if tot is not None:  # CP ranks hold parts of one microbatch's loss: sum over DP x CP
            tot = tot.double()
            torch.distributed.all_reduce(tot, group=ps.get_data_parallel_group(with_context_parallel=True))
        if side == "tree" and cfg.fault == "nan":
            _plant_nan(ddp, store, mine)
        grads = {n: p.main_grad.detach().clone().cpu() for n, p in ddp.module.named_parameters()}
        params = None
        if opt is not None:
            opt.step()
            for _ in range(cfg.steps - 1):  # the same batch again: Adam's moments, expert-bias updates, drift
                ddp.zero_grad_buffer()
                opt.zero_grad()
                if cfg.carry and side == "tree":
                    batch = carry_again(batch)
                extra = _sequence_extras(ddp, batch, cfg, side, carry_again if cfg.carry and side == "tree" else None,
                                         wrap, samples)
                if cfg.carry and side == "tree" and extra:
                    batch = carry_again(batch)
                forward_backward(ddp, batch, loss_type=cfg.loss, cp_strategy=cfg.cp_strategy, wrap_step=wrap, **extra,
                                 **_field_kwargs(cfg, samples, side))
                opt.step()
            params = {n: p.detach().clone().cpu() for n, p in ddp.module.named_parameters()}
        if cfg.carry:
            from ..cp.execution import carry as carry_exec

            carry_exec._FAULT = None
        if balance:
            from ..megatron import moe_balance

            moe_balance._FAULT = None
        if cfg.carry and side == "tree" and cfg.cp > 1:  # each CP rank holds its rows' logits: gather them
            parts = [None] * cfg.cp
            torch.distributed.all_gather_object(parts, [x for x in store if isinstance(x, tuple)],
                                                group=ps.get_context_parallel_group())
            store = [x for part in parts for x in part]
        runs[side] = dict(logits=store, loss=tot, grads=grads, params=params)
        if balance:  # the expert biases after finalize_model_grads' update (buffers, not parameters)
            runs[side]["expert_bias"] = {n: b.detach().clone().cpu() for n, b in ddp.module.named_buffers()
                                         if n.endswith("expert_bias")}
        if cfg.mtp_num_layers:
            from .verify_mtp import mtp_totals, set_mtp_fault

            set_mtp_fault(None)
            runs[side]["mtp"] = mtp_totals(reports, cfg.mtp_num_layers,
                                           ps.get_data_parallel_group(with_context_parallel=True))
        if dsa:
            tracker = dsa_oracle.dsa_module().DSAIndexerLossLoggingHelper.tracker
            vals = tracker["values"].clone() if "values" in tracker else torch.zeros(margs.layers(), dtype=torch.float64)
            if cfg.cp > 1:  # every CP rank logged the share of the rows it owns
                torch.distributed.all_reduce(vals, group=ps.get_context_parallel_group())
            if cut:  # carry groups cut over DP ranks: a rank's rows are not its samples' rows; compare the sums
                torch.distributed.all_reduce(vals, group=ps.get_data_parallel_group())
            runs[side]["indexer_loss"] = vals
            runs[side]["selected"] = selected
    torch.set_default_dtype(torch.float64 if dtype == torch.float64 else torch.float32)
    cp_group = ps.get_context_parallel_group() if cfg.cp > 1 else None
    topk = margs.extra.get("dsa_indexer_topk", 4)

    def sample_logits(side):
        """[(sample name, [L, V/tp] logits at the sample's rows in path order)], in the order of ``mine``."""
        logits = runs[side]["logits"]
        if side == "tree" and cfg.carry:  # every row's logits come from its owner: gather by step-global row
            parts = [item for item in logits if isinstance(item, tuple)]  # padding microbatches: none
            if schedule.syncs:  # groups cut over DP ranks: a sample's rows may have their owners on other ranks
                everyone = [None] * dp
                torch.distributed.all_gather_object(everyone, parts, group=ps.get_data_parallel_group())
                parts = [p for rank_parts in everyone for p in rank_parts]
            by_key = {int(k): row for item in parts for k, row in zip(item[0].tolist(), item[1]) if k >= 0}
            return [(f"sample {i}", torch.stack([by_key[int(k)] for k in mb.carry.keys[mb.sample_rows(i).numpy()]]))
                    for mb in mine for i in mb.sample_ids]
        if side == "tree":
            return [(f"sample {i}", logits[j][mb.sample_rows(i)]) for j, mb in enumerate(mine) for i in mb.sample_ids]
        if side not in per_sample:  # flat-packed: microbatch j holds mine[j]'s samples as 0, 1, ...
            return [(f"sample {i}", logits[j][_mb_of(packed_mbs[j]).sample_rows(p)])
                    for j, mb in enumerate(mine) for p, i in enumerate(mb.sample_ids)]
        it = iter(logits)  # one per-sample microbatch per sample, in the order of ``mine``
        return [(f"sample {i}", next(it)[: len(mb.sample_rows(i))]) for mb in mine for i in mb.sample_ids]

    def selected_tables(side):
        if side == "tree" and cfg.carry:
            return _carry_selected_tables(runs[side]["selected"], mine, topk,
                                          ps.get_data_parallel_group(with_context_parallel=True) if cut else cp_group)
        if side == "tree":
            return _tree_selected_tables(runs[side]["selected"], mine, topk, margs.layers(), cp_group)
        if side not in per_sample:
            return _tree_selected_tables(runs[side]["selected"], [_mb_of(b) for b in packed_mbs[:len(mine)]], topk,
                                         margs.layers(), cp_group, local_ids=True)
        return _flat_selected_tables(runs[side]["selected"], mine, flat_mbs, topk, margs.layers(),
                                     is_stock=stock_flat, cp_group=cp_group)

    def errors(a, b) -> dict:
        """{metric: (max rel. error of side ``a`` against side ``b``, where)}."""
        x, y = runs[a], runs[b]
        worst = partial(_worst, rel=_rel_norm if bf16 else _rel)
        out = {}
        if x["logits"]:  # last pipeline stage
            pairs = [(n, u, v) for (n, u), (_, v) in zip(sample_logits(a), sample_logits(b))]
            if bf16 and pairs:  # one norm over every sample's rows: the worst sample is often unshared
                pairs = [("every sample", torch.cat([u for _, u, _ in pairs]), torch.cat([v for _, _, v in pairs]))]
            out["logits"] = worst(pairs)
            la, lb = x["loss"][0] / x["loss"][1], y["loss"][0] / y["loss"][1]
            out["loss"] = worst([("loss", la.reshape(1), lb.reshape(1))])
        else:
            out["logits"] = out["loss"] = (0.0, None)
        if bf16:
            out["grads"] = worst((n, x["grads"][n], y["grads"][n]) for n in y["grads"])
        else:  # each gradient against its own scale, floored at a fraction of the largest (GRAD_SCALE_FLOOR)
            scale = max([float(g.detach().abs().max()) for g in y["grads"].values() if g.numel()] or [0.0])
            floor = max(1e-8, GRAD_SCALE_FLOOR * scale) if math.isfinite(scale) else 1e-8
            out["grads"] = _worst(((n, x["grads"][n], y["grads"][n]) for n in y["grads"]),
                                  rel=partial(_rel, floor=floor))
        if x["params"] is not None:
            out["params_after_step"] = worst((n, x["params"][n], y["params"][n]) for n in y["params"])
        if dsa:
            out["indexer_loss"] = worst([("indexer loss per layer", x["indexer_loss"], y["indexer_loss"])])
            out["selected_ids"] = _diff_selected(selected_tables(a), selected_tables(b))
        if "expert_bias" in metrics_of(cfg):
            out["expert_bias"] = worst((n, x["expert_bias"][n], y["expert_bias"][n]) for n in y["expert_bias"])
        if cfg.mtp_num_layers:  # each depth's per-token loss (last stage; elsewhere nothing to compare)
            ma, mb_ = x.get("mtp"), y.get("mtp")
            out["mtp_loss"] = (0.0, None) if ma is None else worst(
                [(f"mtp_{k + 1} loss", ma[k, :1] / ma[k, 1], mb_[k, :1] / mb_[k, 1]) for k in range(ma.shape[0])])
        return out

    judged = errors("tree", "ref" if bf16 else "flat")
    for m in metrics_of(cfg):
        result[m], result[f"{m}_at"] = judged[m]
    if bf16:  # the per-sample bf16 side's error against the same reference: the standard to meet
        for m, (e, at) in errors("flat", "ref").items():
            result[f"{m}_ps"], result[f"{m}_ps_at"] = e, at
        # "grads" (judged) is, on each side, the largest error over the parameters, as for every dtype.
        # Reported beside it, not judged: the single parameter nearest (or past) its own bound. A few
        # parameters summed over every row (norm weights, GDN's A_log) are structurally up to ~sqrt(k)
        # less accurate on a tree whose rows k samples share: bf16 activation gradients round the sum
        # of k aligned contributions once, where packed training rounds each and the errors partly
        # cancel in the parameter's sum (the whole gradient vector's error stays within a few %).
        ref_g = runs["ref"]["grads"]
        if ref_g:
            pairs = {n: (_rel_norm(runs["tree"]["grads"][n], g), _rel_norm(runs["flat"]["grads"][n], g))
                     for n, g in ref_g.items()}
            at = max(pairs, key=lambda n: _bound_use(*pairs[n], cfg.tol()))
            (result["param_grad"], result["param_grad_ps"]), result["param_grad_at"] = pairs[at], at
    t, f = runs["tree"], runs["flat"]
    if t["logits"]:
        lf = f["loss"][0] / f["loss"][1]
        result["loss_value"] = float(lf)
        result["num_tokens_tree"], result["num_tokens_flat"] = int(t["loss"][1]), int(f["loss"][1])
    stats = [mb.stats for mb in mine]
    if cfg.carry:
        result["carry_microbatches"] = len(mine)
        result["carried_rows"] = sum(len(mb.carry.carried) for mb in mine)
        result["longest_sample"] = max(len(s) for s in samples)
        result["carry_cut_owners"] = len(schedule.cut_owners())  # the same on every rank
        result["carry_syncs"] = len(schedule.syncs)
    result["tree_rows"] = sum(s.tree_tokens for s in stats)
    result["flat_rows"] = sum(s.flat_tokens for s in stats)
    result["num_samples"] = sum(s.num_samples for s in stats)
    return result


# ----------------------------------------------------------------------------------------- routing replay
def _moe_layer_count(margs, config) -> int:
    """MoE layers of the whole model: 'E' letters of a hybrid / Mamba pattern, else Megatron's
    ``moe_layer_freq`` over ``num_layers`` (an int: every n-th layer from the first; a list: 1 = MoE)."""
    if margs.kind in ("hybrid", "mamba"):
        return margs.pattern.count("E")
    freq = config.moe_layer_freq
    return int(sum(freq)) if isinstance(freq, list) else sum(1 for i in range(config.num_layers) if i % freq == 0)


def verify_routes(samples: list, moe_layers: int, topk: int, num_experts: int, seed: int) -> list:
    """``samples`` with ``routed_experts``: the route at position t is drawn from the token prefix
    ``tokens[:t+1]`` (equal prefixes agree, so trees still share), except that every fourth sample
    of the batch (1, 5, 9, ...) was "prefilled elsewhere": its routes at position 1 + (j % 3) (inside
    every family's prompt) are another draw, so rollouts sharing a token prefix disagree there."""
    import dataclasses as dc

    out = []
    for j, s in enumerate(samples):
        h, rows = seed, []
        for t, tok in enumerate(s.tokens.tolist()):
            h = (h * 1000003 + int(tok) + 1) % (1 << 61)
            alt = j % 4 == 1 and t == min(len(s) - 1, 1 + j % 3)
            rng = np.random.default_rng([h, int(alt), j if alt else 0])
            rows.append(np.argsort(rng.random((moe_layers, num_experts)), axis=1)[:, :topk])
        out.append(dc.replace(s, routed_experts=np.stack(rows)))
    return out


def _sample_routes(sample, num_rows: int, shape=None) -> torch.Tensor:
    """[num_rows, moe_layers, topk] routes of a one-sample microbatch: the sample's, then experts
    0..topk-1 on its padding rows (``sample`` None: a padding microbatch of ``shape``)."""
    r = np.zeros((0,) + tuple(shape), np.int64) if sample is None else np.asarray(sample.routed_experts, np.int64)
    pad = np.broadcast_to(np.arange(r.shape[2]), (num_rows - r.shape[0],) + r.shape[1:])
    return torch.from_numpy(np.concatenate([r, pad]).astype(np.int64))


def _cp_rank_routes(routes: torch.Tensor, plan, cp_rank: int, multiple: int) -> torch.Tensor:
    """The routes of the rows CP rank ``cp_rank`` holds under ``plan`` (its owned rows, then padding rows
    up to a multiple of ``multiple``, one slot per TP rank when it owns nothing), experts 0..k-1 there."""
    rows = torch.from_numpy(plan.owner_rows(cp_rank)).long()
    n = int(rows.shape[0])
    pad = (-n) % multiple or (multiple if n == 0 else 0)
    fill = torch.arange(routes.shape[2]).expand(pad, routes.shape[1], -1)
    return torch.cat([routes[rows], fill])


def _stock_replay(model, routes: list, step):
    """Wrap a forward-step function for the per-sample side: before microbatch i's forward, feed
    ``routes[i]`` to every stock ``RouterReplay`` of this stage (its MoE layers' columns, this TP
    rank's sequence-parallel slice) and set them to REPLAY_FORWARD (the no-pipelining schedule runs
    each microbatch's backward, recomputation included, before the next forward)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = [mod.router for mod in model.modules() if isinstance(mod, MoELayer)]
    if ps.get_pipeline_model_parallel_world_size() > 1:
        counts = [None] * ps.get_pipeline_model_parallel_world_size()
        torch.distributed.all_gather_object(counts, len(routers), group=ps.get_pipeline_model_parallel_group())
        first = sum(counts[: ps.get_pipeline_model_parallel_rank()])
    else:
        first = 0
    tp, tpr = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    sp = model.config.sequence_parallel and tp > 1
    feed = iter(routes)

    def wrapped(data_iterator, model_):
        r = next(feed)
        if sp:
            n = r.shape[0] // tp
            r = r[tpr * n: (tpr + 1) * n]
        for k, router in enumerate(routers):
            rr = router.router_replay
            rr.clear_indices()
            rr.set_target_indices(r[:, first + k].contiguous())
            rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        return step(data_iterator, model_)

    return wrapped


def run_verify(cfg: VerifyConfig, *, timeout: float = 600.0) -> dict:
    """Run the comparison on ``cfg.world_size`` local ranks; returns the worst errors over ranks."""
    return run_verify_many([cfg], timeout=timeout)[0]


def run_verify_many(cfgs: list, *, timeout: float = 900.0) -> list:
    """`run_verify` for several configs of one world size, in one set of rank processes."""
    from .launch import run_distributed

    sizes = {c.world_size for c in cfgs}
    if len(sizes) != 1:
        raise ValueError(f"run_verify_many needs one world size, got {sorted(sizes)}")
    for cfg in cfgs:
        if cfg.fault is not None and cfg.fault not in ALL_FAULTS:
            raise ValueError(f"unknown fault {cfg.fault!r}; choose one of {ALL_FAULTS}")
        if cfg.model == "dsa" and cfg.sp:
            raise ValueError("verify --model dsa has no sequence parallelism: the per-sample side pads each sample "
                             "to a multiple of the TP size, and stock DSA's indexer loss averages over those padding "
                             "rows too")
        if cfg.fault in BF16_FAULTS and (cfg.model != "dsa" or cfg.dtype != "bfloat16" or cfg.cp != 1):
            raise ValueError(f"fault {cfg.fault} is an accuracy bug of DSA's indexer loss in bf16 at CP 1: it needs "
                             "model='dsa', dtype='bfloat16' and cp=1")
        if cfg.fault in DSA_FAULTS and cfg.model != "dsa":
            raise ValueError(f"fault {cfg.fault} plants a bug in DeepSeek sparse attention: it needs model='dsa' "
                             "(--model dsa)")
        if cfg.fault == "gspo_one_microbatch" and (cfg.loss not in ("gspo",) + PAIR_LOSSES
                                                    or not (cfg.carry or cfg.cp > 1)):
            raise ValueError("fault gspo_one_microbatch takes a sample's statistic from one microbatch: it needs "
                             "--loss gspo / dpo / ipo / simpo and a sample cut over microbatches or ranks (--carry or "
                             "--cp > 1)")
        if cfg.fault == "wrong_partner" and cfg.loss not in PAIR_LOSSES + ("rm",):
            raise ValueError("fault wrong_partner pairs each chosen sample with another pair's rejected one: it needs "
                             "--loss dpo / ipo / simpo / rm")
        if cfg.fault in FIELD_FAULTS and cfg.loss not in FIELD_LOSSES:
            raise ValueError(f"fault {cfg.fault} reads each occurrence's per-token field one position off: it needs "
                             "--loss value / distill")
        if cfg.loss in PAIR_LOSSES + ("rm",) and cfg.loss_agg != "token-mean":
            raise ValueError(f"verify --loss {cfg.loss} is the mean over preference pairs: --loss-agg {cfg.loss_agg} "
                             "does not apply")
        if cfg.loss in ("rm", "value") and cfg.mtp_num_layers:
            raise ValueError(f"verify --loss {cfg.loss} builds a reward / value model, which takes no MTP layers")
        if cfg.fault == "loss_agg_per_microbatch" and cfg.loss_agg == "token-mean":
            raise ValueError(f"fault {cfg.fault} plants a bug in a loss aggregation's per-sample factors: it needs "
                             "--loss-agg other than token-mean (whose factors are all 1)")
        if cfg.fault == "mla_rope_physical" and cfg.model != "mla":
            raise ValueError("fault mla_rope_physical plants a bug in Multi-Latent Attention: it needs model='mla'"
                             " (--model mla)")
        if cfg.routing_replay and cfg.dtype == "bfloat16":
            raise ValueError("verify --routing-replay runs in float64 / float32 (an expert choice is discrete: "
                             "bf16's judge compares against float64 per-sample training)")
        if cfg.carry_keep and not cfg.carry:
            raise ValueError("verify --carry-keep keeps the graphs of carry's exporting microbatches: it needs --carry")
        if cfg.carry_keep and (cfg.pp > 1 or cfg.recompute != "none"):
            raise ValueError("verify --carry-keep: a kept graph needs a schedule without pipelining and no "
                             "recomputation (--pp 1, --recompute none)")
        if cfg.fault in CARRY_FAULTS and not cfg.carry:
            raise ValueError(f"fault {cfg.fault} plants a bug in carry: it needs carry=True (--carry)")
        if cfg.carry and cfg.ep > 1:
            from ..megatron.carry import CARRY_EP_REFUSAL

            raise ValueError(f"verify --carry --ep {cfg.ep}: {CARRY_EP_REFUSAL}")
        if cfg.carry:
            bad = [what for what, on in (("--inject-fault nan", cfg.fault == "nan"),) if on]
            if bad:
                raise ValueError(f"verify --carry does not run with {', '.join(bad)} yet")
        if cfg.fault in REPLAY_FAULTS and not cfg.routing_replay:
            raise ValueError(f"fault {cfg.fault} plants a bug in routing replay: it needs routing_replay=True "
                             "(--routing-replay)")
        if cfg.steps < 1:
            raise ValueError(f"verify --steps must be >= 1, got {cfg.steps}")
        if cfg.steps > 1 and (cfg.routing_replay or cfg.dtype == "bfloat16"):
            raise ValueError("verify --steps > 1 runs without --routing-replay and not in bf16 (the per-sample side "
                             "feeds stock RouterReplay each sample's routes once; bf16 compares no step)")
        if cfg.fault in BALANCE_FAULTS and not cfg.balancing_on():
            raise ValueError(f"fault {cfg.fault} plants a bug in MoE balancing: it needs a balancing setting "
                             "(--moe-aux-loss-coeff, --moe-z-loss-coeff or --moe-router-enable-expert-bias)")
        if cfg.carry and cfg.balancing_on():
            from types import SimpleNamespace

            from ..megatron.moe_balance import aux_losses_enabled

            if aux_losses_enabled(SimpleNamespace(num_moe_experts=4, **cfg.balancing)):
                raise ValueError("verify --carry with an aux loss: refused (an aux loss is a product of one "
                                 "microbatch's counts, and carry's microbatches hold parts of samples); z-loss and "
                                 "expert bias carry")
        from .verify_mtp import check_mtp_config

        check_mtp_config(cfg)
        if cfg.ep > 1 and (cfg.dp * cfg.cp) % cfg.ep:  # experts spread over a stage's DP x CP ranks (ETP = TP)
            raise ValueError(f"expert parallel size {cfg.ep} must divide data x context parallel ranks "
                             f"{cfg.dp * cfg.cp}")
    per_rank = run_distributed(_rank_body_many, sizes.pop(), list(cfgs), timeout=timeout)
    return [_combine(cfg, [r[i] for r in per_rank]) for i, cfg in enumerate(cfgs)]


def _bound_use(err: float, err_ps: float, floor: float) -> float:
    """err / (BF16_RATIO * err_ps + floor): above 1 fails; inf when either error is non-finite."""
    if not (math.isfinite(err) and math.isfinite(err_ps)):
        return math.inf
    return err / (BF16_RATIO * err_ps + floor)


def bf16_bound(cfg: VerifyConfig, out: dict, m: str) -> float:
    """The most the tree side's bf16 error in metric ``m`` may be: ``BF16_RATIO`` x the per-sample bf16
    side's error against the same float64 reference, plus the floor (``cfg.tol()``)."""
    return BF16_RATIO * out[f"{m}_ps"] + cfg.tol()


def metric_passes(cfg: VerifyConfig, out: dict, m: str) -> bool:
    """bfloat16: the ratio rule (`bf16_bound`); other dtypes: the fixed tolerance."""
    if cfg.dtype == "bfloat16":  # a non-finite error on either side fails (inf <= 1.5 * inf would not)
        return math.isfinite(out[m]) and math.isfinite(out[f"{m}_ps"]) and out[m] <= bf16_bound(cfg, out, m)
    return out[m] <= cfg.tol()


def _combine(cfg: VerifyConfig, per_rank: list) -> dict:
    out = {}
    bf16 = cfg.dtype == "bfloat16"
    for m in metrics_of(cfg):  # the worst rank names where; `_rel` is never NaN, so ``max`` sees every error
        if bf16:  # the rank nearest (or furthest past) its bound, both sides' errors from it
            worst = max(per_rank, key=lambda r: _bound_use(r[m], r[f"{m}_ps"], cfg.tol()))
            for key in (m, f"{m}_ps"):
                out[key], out[f"{key}_at"] = worst[key], worst.get(f"{key}_at")
            continue
        worst = max(per_rank, key=lambda r: r[m])
        out[m], out[f"{m}_at"] = worst[m], worst.get(f"{m}_at")
    out["tolerance"] = cfg.tol()
    out["passed"] = all(metric_passes(cfg, out, m) for m in metrics_of(cfg))
    if bf16 and all("param_grad" in r for r in per_rank):  # reported only: the parameter nearest its bound
        worst = max(per_rank, key=lambda r: _bound_use(r["param_grad"], r["param_grad_ps"], cfg.tol()))
        for key in ("param_grad", "param_grad_ps", "param_grad_at"):
            out[key] = worst[key]
    last = [r for r in per_rank if "loss_value" in r]
    out["loss_value"] = last[0]["loss_value"] if last else float("nan")
    # ranks of one DP group hold the same samples: count each DP rank once (TP/PP/CP replicas share them)
    rep = cfg.tp * cfg.pp * cfg.cp
    for k in ("num_samples", "tree_rows", "flat_rows", "carry_microbatches", "carried_rows"):
        if all(k in r for r in per_rank):
            out[k] = sum(r[k] for r in per_rank) // rep
    if all("longest_sample" in r for r in per_rank):
        out["longest_sample"] = max(r["longest_sample"] for r in per_rank)
    for k in ("carry_cut_owners", "carry_syncs"):
        if all(k in r for r in per_rank):
            out[k] = per_rank[0][k]
    return out


def format_report(cfg: VerifyConfig, out: dict) -> str:
    layout = (f"model={cfg.model}{'(' + (cfg.pattern or '') + ')' if cfg.model in ('hybrid', 'mamba') else ''} tp={cfg.tp} "
              f"pp={cfg.pp} dp={cfg.dp} ep={cfg.ep} sp={cfg.sp} recompute={cfg.recompute} dtype={cfg.dtype} "
              + (f"cp={cfg.cp}({cfg.cp_strategy}) " if cfg.cp > 1 else "") +
              f"loss={cfg.loss}" + (f" fault={cfg.fault}" if cfg.fault else "")
              + (f" dsa(sparse_loss={cfg.dsa_sparse_loss}, topk_freq={cfg.dsa_topk_freq})" if cfg.model == "dsa" else "")
              + (f" mtp_num_layers={cfg.mtp_num_layers}" if cfg.mtp_num_layers else ""))
    if cfg.gdn_cp_mode is not None:
        layout += f" gdn_cp_mode={cfg.gdn_cp_mode}"
    if cfg.routing_replay:
        layout += " routing_replay"
    if cfg.carry:
        layout += f" carry(budget={cfg.budget}{', kept graphs' if cfg.carry_keep else ''})"
    lines = [f"megatron-tree verify: {layout}",
             f"batch: {out['num_samples']} samples, {out['flat_rows']} flat rows -> {out['tree_rows']} tree rows; "
             f"loss {out['loss_value']:.6f}"]
    if cfg.carry and out.get("carry_microbatches"):
        lines.append(f"carry: {out['carry_microbatches']} microbatches of <= {cfg.budget} owned rows, "
                     f"{out['carried_rows']} carried rows read, {out['longest_sample']} tokens in the longest sample"
                     + (f"; cut over DP ranks: {out['carry_cut_owners']} owners' state crossed ranks at "
                        f"{out['carry_syncs']} syncs" if out.get("carry_syncs") else ""))
    if cfg.dtype == "bfloat16":
        lines.append(f"||side - ref|| / ||ref|| against per-sample float64 training from the same "
                     f"initial weights; "
                     f"pass: tree <= {BF16_RATIO} x packed (flat) bf16 + {out['tolerance']:.1e}")
        lines.append(f"{'quantity':<20} {'tree bf16':>10} {'packed':>10} {'ratio':>7}  status")
        for m in metrics_of(cfg):
            e, ps_e = out[m], out[f"{m}_ps"]
            ratio = e / ps_e if ps_e > 0 else (math.inf if e > 0 else 1.0)
            at = out.get(f"{m}_at")
            where = f"  (worst: {at})" if at and at != m else ""
            lines.append(f"{m:<20} {e:>10.3e} {ps_e:>10.3e} {ratio:>7.3f}  "
                         f"{'ok' if metric_passes(cfg, out, m) else 'FAIL'}{where}")
        if "param_grad" in out:
            e, ps_e = out["param_grad"], out["param_grad_ps"]
            ratio = e / ps_e if ps_e > 0 else math.inf
            lines.append(f"{'(one parameter)':<20} {e:>10.3e} {ps_e:>10.3e} {ratio:>7.3f}  "
                         f"reported, not judged  (nearest its own bound: {out['param_grad_at']})")
        lines.append("PASSED: tree bf16 training is as accurate as ordinary bf16 training" if out["passed"]
                     else "FAILED: tree bf16 training is less accurate than ordinary bf16 training")
        return "\n".join(lines)
    lines.append(f"{'quantity':<20} {'max rel. error':>14}  status (tolerance {out['tolerance']:.0e})")
    for m in metrics_of(cfg):
        ok = out[m] <= out["tolerance"]
        at = out.get(f"{m}_at")
        where = f"  (worst: {at})" if at and at != m else ""
        lines.append(f"{m:<20} {out[m]:>14.3e}  {'ok' if ok else 'FAIL'}{where}")
    lines.append("PASSED: tree training equals per-sample training" if out["passed"]
                 else "FAILED: tree training differs from per-sample training")
    return "\n".join(lines)
