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
``DSAttention`` (``compat.dsa.stock_oracle_class``; under tree CP our DSA on one CP rank per sample,
itself checked against stock by the CP=1 runs), and two more quantities are compared: the indexer's
ordered top-k of every (sample, row, layer), as positions on the sample's path ("selected_ids": the
fraction that differs), and the indexer loss per layer. Faults ``dsa_tie_order`` / ``dsa_loss_weight``.

Per-token loss over the global batch (``calculate_per_token_loss``) is used for both sides. MoE
load-balancing losses are off: they are functions of the tokens the model runs, which a tree
deduplicates by design.
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

FAULTS = ("sibling_mask", "rope_physical", "drop_occurrence", "duplicate_occurrence", "zero_state", "nan",
          "mla_rope_physical")
# faults of model "dsa" only (kept apart from FAULTS, whose faults apply to the other models)
DSA_FAULTS = ("dsa_tie_order", "dsa_loss_weight")
ALL_FAULTS = FAULTS + DSA_FAULTS
# planted in the tree side's modules (`plant_model_fault`), not its metadata
MODEL_FAULTS = ("mla_rope_physical",) + DSA_FAULTS
METRICS = ("logits", "loss", "grads", "params_after_step")
# model "dsa" also compares the indexer's selections (fraction of (sample, row, layer) whose ordered
# top-k differs) and its loss per layer
DSA_METRICS = ("selected_ids", "indexer_loss")


def metrics_of(cfg) -> tuple:
    return METRICS + (DSA_METRICS if cfg.model == "dsa" else ())


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
    dtype: str = "float64"  # exact check; float32/bfloat16 are smoke checks with float-noise tolerances
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

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def has_moe(self) -> bool:
        from .models import DEFAULT_HYBRID_PATTERN, DEFAULT_MAMBA_PATTERN

        default = {"hybrid": DEFAULT_HYBRID_PATTERN, "mamba": DEFAULT_MAMBA_PATTERN}.get(self.model)
        return self.ep > 1 or (default is not None and "E" in (self.pattern or default))

    def tol(self) -> float:
        """Default tolerance by dtype. float64 with MoE: Megatron's router softmax runs in fp32."""
        if self.tolerance is not None:
            return self.tolerance
        if self.dtype == "float64":
            return 5e-6 if self.has_moe() else 1e-9
        # float32: per-head decay gradients (GDN A_log, dt_bias) are sums over every token with heavy
        # cancellation, and the chunked kernels round differently on a tree than on a chain, so a
        # few 1e-3 relative differences are float noise there (the op itself agrees to 1e-7).
        return 1e-2 if self.dtype == "float32" else 5e-2


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
    if fault == "nan" or fault in MODEL_FAULTS:
        return mb  # planted after the backward pass (`_plant_nan`), not in the tree metadata
    if fault == "zero_state":
        child = torch.nonzero(par >= 0).flatten()
        if len(child):
            p = par.clone()
            p[child[0]] = -1  # recurrent ops start this segment from the zero state
            return dataclasses.replace(mb, layout=dataclasses.replace(L, segment_parent=p))
        return mb
    raise ValueError(f"unknown fault {fault!r}; choose one of {FAULTS}")


def plant_model_fault(model, fault: Optional[str]) -> None:
    """Plant a module-level fault (`MODEL_FAULTS`) into the tree side's ``model`` (others: nothing).

    ``mla_rope_physical``: every `TreeMLASelfAttention` rotates its query/key rotary parts by the
    row's physical index in the packed sequence (global row under CP) instead of its depth: what the
    stock MLA module does, since it builds its rotary table from the sequence length.
    ``dsa_tie_order``: every `TreeDSAttention` breaks top-k ties by the larger row id (not the smaller).
    ``dsa_loss_weight``: every `TreeDSAttention` weights each row's indexer loss term by 1 (dropping
    the per-sample weights ``sum 1/len(s)``).
    """
    if fault in DSA_FAULTS:
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
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max(max |b|, 1e-8); inf when either side holds a NaN or inf.

    Never NaN: a non-finite value is never "close", and inf (unlike NaN) survives every ``max``
    and fails every ``<= tolerance``."""
    a, b = a.double(), b.double()
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        return math.inf
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-8)) if b.numel() else 0.0


def _worst(items) -> tuple[float, Optional[str]]:
    """The largest `_rel` error over ``items`` (``(where, tree, flat)`` triples) and where it is.

    ``where`` names the first item with that error, with ``(non-finite on the tree side)`` (or
    per-sample side, or both) when a NaN/inf is the reason; ``(0.0, None)`` for no items."""
    err, at = 0.0, None
    for where, a, b in items:
        e = _rel(a, b)
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
    from ..megatron.forward_step import context_parallel_params
    from ..megatron.packed_seq import tree_packed_seq_params

    item = next(data_iterator)
    mb, plan = item if isinstance(item, tuple) else (item, None)
    psp = context_parallel_params(tree_packed_seq_params(mb, next(model.parameters()).device), model, plan=plan,
                                  strategy=cp_strategy)
    psp.loss_map = None
    out = model(psp.input_ids.unsqueeze(0), psp.position_ids.unsqueeze(0), None, packed_seq_params=psp)

    def loss_func(output):
        logits = output.detach()[0].float().cpu()  # GPTModel returns [b, s, V/tp]
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


def _compare_selected(tree_sel: list, flat_sel: list, mine: list, flat_mbs: list, topk: int, *, flat_is_stock: bool,
                      cp_group=None):
    """Fraction of (sample, row, DSA layer) whose ordered top-k differs between the tree (canonical rows,
    mapped to positions on the sample's path) and the per-sample side (stock: positions; tree modules
    on one sample: canonical rows of the chain, i.e. positions), and where the first difference is."""
    tree_by_mb = _by_token(_gather_selected(_dedupe_selected(tree_sel), cp_group))
    flat = _dedupe_selected(flat_sel)
    if not flat_is_stock:
        flat = _gather_selected(flat, cp_group)
    flat_by_sample = iter(_by_token(flat))
    real_flat = iter([fm[0] if isinstance(fm, tuple) else fm for fm in flat_mbs])
    bad = total = 0
    where = None
    for j, mb in enumerate(mine):
        layers = tree_by_mb[j] if j < len(tree_by_mb) else {}
        for i in mb.sample_ids:
            ref_layers, fmb = next(flat_by_sample, {}), next(real_flat)
            rows = mb.sample_rows(i).long()
            inv = torch.full((mb.layout.num_rows,), -2, dtype=torch.long)  # -2: a row off the sample's path
            inv[rows] = torch.arange(rows.shape[0])
            for layer, (_, _, trows, tids) in sorted(layers.items()):
                if layer not in ref_layers:
                    continue
                ids = _rows_to_table(mb.layout.num_rows, trows, tids)[rows]  # [L, topk] canonical rows
                got = torch.where(ids >= 0, inv[ids.clamp_min(0)], ids)
                ref = ref_layers[layer]
                if flat_is_stock:
                    ref = ref[2]
                else:
                    ref = _rows_to_table(fmb.layout.num_rows, ref[2], ref[3])[: rows.shape[0]]
                if ref.shape[1] < topk:
                    ref = torch.cat([ref, ref.new_full((ref.shape[0], topk - ref.shape[1]), -1)], 1)
                diff = (got != ref).any(1)
                bad += int(diff.sum())
                total += int(diff.shape[0])
                if where is None and bool(diff.any()):
                    r = int(diff.nonzero()[0])
                    where = f"sample {i} layer {layer} position {r}: tree {got[r].tolist()} per-sample {ref[r].tolist()}"
    if total == 0:
        return math.inf, "no DSA selections captured"
    return bad / total, where


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

    out = []
    for cfg in cfgs:
        out.append(_rank_body(cfg))
        ps.destroy_model_parallel()
        torch.set_default_dtype(torch.float32)
    return out


def _rank_body(cfg: VerifyConfig) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from ..compat import cpu as compat_cpu
    from ..tree import pack, padding_microbatch
    from .models import ModelArgs, build_model, forward_backward, make_config, report_totals, wrap_ddp

    on_cpu = not torch.cuda.is_available()
    compat_cpu.enable(kernels=True)
    ps.initialize_model_parallel(tensor_model_parallel_size=cfg.tp, pipeline_model_parallel_size=cfg.pp,
                                 context_parallel_size=cfg.cp, expert_model_parallel_size=cfg.ep)
    dtype = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}[cfg.dtype]
    if dtype == torch.float64:
        torch.set_default_dtype(torch.float64)  # Megatron's torch norms take the default dtype, not params_dtype
    dense = ("gpt", "qwen3next", "mla", "dsa")
    margs = ModelArgs(kind=cfg.model, num_layers=4 if cfg.model in dense else 0, window_size=cfg.window,
                      sinks=cfg.sinks, num_experts=4 if cfg.ep > 1 and cfg.model in dense else None)
    dsa = cfg.model == "dsa"
    if dsa:
        from ..compat import dsa as compat_dsa

        compat_dsa.enable()  # stock DSA on CPU / float64: Hadamard stand-in, tracker device
        margs.extra.update(dsa_indexer_use_sparse_loss=cfg.dsa_sparse_loss)
        if cfg.dsa_topk is not None:
            margs.extra.update(dsa_indexer_topk=cfg.dsa_topk)
        if cfg.dsa_topk_freq > 1:
            margs.extra.update(dsa_indexer_topk_freq=cfg.dsa_topk_freq, dsa_indexer_skip_topk_offset=0)
    if cfg.pattern:
        margs.pattern = cfg.pattern
    if cfg.model == "qwen3next":
        # Qwen3-Next's attention output gate is Megatron's ``x * sigmoid(gate.float())``: float32 inside
        # a float64 model, so the backward rounds a shared row's summed gradient once in fp32 where the
        # per-sample side rounds each sample's part (~2e-9 on grads, ~1e-5 after Adam's sign-like first
        # step). Verify leaves it off to stay exact; tests/test_model_families.py checks the gate against
        # stock GPTModel per sample.
        margs.extra["attention_output_gate"] = False
    samples = verify_samples(cfg.seed, margs.vocab_size, cfg.families)
    mbs = pack(samples, cfg.budget, pad_to_multiple_of=8)
    dp, dpr = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = mbs[dpr::dp]
    if not mine:
        raise ValueError(f"only {len(mbs)} microbatches for {dp} DP ranks: raise --families")
    tree_mbs = [inject_fault(mb, cfg.fault) for mb in mine]
    pad = cfg.tp if cfg.sp else 1  # sequence parallelism splits rows evenly over TP ranks
    flat_mbs = [pack([samples[i]], cfg.budget, pad_to_multiple_of=pad)[0] for mb in mine for i in mb.sample_ids]
    # Every DP rank runs the same number of microbatches (MoE all-to-alls run once per microbatch
    # on every expert-parallel rank): top up with zero-loss padding microbatches.
    fields = [f for f in ("advantages", "old_logprobs", "ref_logprobs") if getattr(mine[0].loss_map, f) is not None]
    filler = padding_microbatch(cfg.budget, num_rows=-(-8 // pad) * pad, float_fields=fields)
    n_tree = -(-len(mbs) // dp)
    n_flat = max(sum(len(m.sample_ids) for m in mbs[r::dp]) for r in range(dp))
    tree_mbs += [filler] * (n_tree - len(tree_mbs))
    flat_mbs += [padding_microbatch(cfg.budget, num_rows=pad, float_fields=fields)] * (n_flat - len(flat_mbs))

    def fresh(stock_dsa=False):
        # a new config per model: DDP hangs hooks on it, and MoE experts deep-copy it
        config = make_config(margs, tp=cfg.tp, pp=cfg.pp, ep=cfg.ep, cp=cfg.cp, sp=cfg.sp, recompute=cfg.recompute,
                             dtype=dtype, cpu=on_cpu)
        torch.manual_seed(cfg.seed)
        model_parallel_cuda_manual_seed(cfg.seed)
        # model "dsa": the per-sample side's DSA core attention is stock DSAttention (the oracle);
        # same parameters and initial weights as the tree side
        m = build_model(config, margs, stock_dsa=stock_dsa)
        if not on_cpu:
            m = m.cuda()
        ddp = wrap_ddp(m, config)
        # Adam's first step is lr*sign(g): float noise on near-zero gradients flips whole updates, so
        # float32 runs step with SGD (linear in the gradient); float64 runs use Adam. On CPU, bf16
        # params step with the plain optimizer (Megatron's fp16/bf16 wrapper accepts CUDA tensors only).
        opt_name = "adam" if dtype == torch.float64 else "sgd"
        opt = get_megatron_optimizer(OptimizerConfig(optimizer=opt_name, lr=1e-2, weight_decay=0.01, clip_grad=0.0,
                                                     params_dtype=dtype, bf16=dtype == torch.bfloat16 and not on_cpu), [ddp])
        return ddp, opt

    result = {m: 0.0 for m in metrics_of(cfg)}
    result.update({f"{m}_at": None for m in metrics_of(cfg)})
    runs = {}
    if cfg.cp > 1:  # the tree side runs the planner's plan; the per-sample side stays on one CP rank
        from ..cp import plan_context_parallel

        tree_mbs = [(mb, plan_context_parallel(mb.layout, cfg.cp, strategy=cfg.cp_strategy)) for mb in tree_mbs]
        flat_mbs = [(mb, _single_owner_plan(mb, cfg.cp)) for mb in flat_mbs]
    # model "dsa": the per-sample side is stock DSAttention; under tree CP it is our DSA on one CP rank
    # per sample (single-owner plan, as for every model), itself checked against stock by the CP=1 runs
    stock_flat = dsa and cfg.cp == 1
    for side, batch in (("tree", tree_mbs), ("flat", flat_mbs)):
        ddp, opt = fresh(stock_dsa=stock_flat and side == "flat")
        if side == "tree":
            plant_model_fault(ddp.module, cfg.fault)
        store: list = []
        get_forward_backward_func()(forward_step_func=partial(_logits_step, store, cfg.cp_strategy),
                                    data_iterator=iter(batch), model=[ddp], num_microbatches=len(batch),
                                    seq_length=max((b[0] if isinstance(b, tuple) else b).num_rows for b in batch),
                                    micro_batch_size=1, forward_only=True)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        with contextlib.ExitStack() as stack:
            selected = None
            if dsa:
                from ..megatron.dsa import capture_selected

                compat_dsa.dsa_module().DSAIndexerLossLoggingHelper.tracker.clear()
                selected = stack.enter_context(compat_dsa.capture_stock_selected() if side == "flat" and stock_flat
                                               else capture_selected())
            reports = forward_backward(ddp, batch, loss_type=cfg.loss, cp_strategy=cfg.cp_strategy)
        tot = report_totals(reports)
        if tot is not None:  # CP ranks hold parts of one microbatch's loss: sum over DP x CP
            torch.distributed.all_reduce(tot, group=ps.get_data_parallel_group(with_context_parallel=True))
        if side == "tree" and cfg.fault == "nan":
            _plant_nan(ddp, store, mine)
        grads = {n: p.main_grad.detach().clone().cpu() for n, p in ddp.module.named_parameters()}
        opt.step()
        params = {n: p.detach().clone().cpu() for n, p in ddp.module.named_parameters()}
        runs[side] = dict(logits=store, loss=tot, grads=grads, params=params)
        if dsa:
            tracker = compat_dsa.dsa_module().DSAIndexerLossLoggingHelper.tracker
            vals = tracker["values"].clone() if "values" in tracker else torch.zeros(margs.layers(), dtype=torch.float64)
            if cfg.cp > 1:  # every CP rank logged the share of the rows it owns
                torch.distributed.all_reduce(vals, group=ps.get_context_parallel_group())
            runs[side]["indexer_loss"] = vals
            runs[side]["selected"] = selected
    t, f = runs["tree"], runs["flat"]
    if t["logits"]:  # last pipeline stage
        flat_logits = iter(f["logits"])  # one flat microbatch per sample, in the order of ``mine``
        result["logits"], result["logits_at"] = _worst(
            (f"sample {i}", t["logits"][j][mb.sample_rows(i)], next(flat_logits)[: len(mb.sample_rows(i))])
            for j, mb in enumerate(mine) for i in mb.sample_ids)
        lt, lf = t["loss"][0] / t["loss"][1], f["loss"][0] / f["loss"][1]
        result["loss"], result["loss_at"] = _worst([("loss", lt.reshape(1), lf.reshape(1))])
        result["loss_value"] = float(lf)
        result["num_tokens_tree"], result["num_tokens_flat"] = int(t["loss"][1]), int(f["loss"][1])
    result["grads"], result["grads_at"] = _worst((n, t["grads"][n], f["grads"][n]) for n in f["grads"])
    result["params_after_step"], result["params_after_step_at"] = _worst(
        (n, t["params"][n], f["params"][n]) for n in f["params"])
    if dsa:
        result["indexer_loss"], result["indexer_loss_at"] = _worst(
            [("indexer loss per layer", t["indexer_loss"], f["indexer_loss"])])
        result["selected_ids"], result["selected_ids_at"] = _compare_selected(
            t["selected"], f["selected"], mine, flat_mbs, margs.extra.get("dsa_indexer_topk", 4),
            flat_is_stock=stock_flat, cp_group=ps.get_context_parallel_group() if cfg.cp > 1 else None)
    stats = [mb.stats for mb in mine]
    result["tree_rows"] = sum(s.tree_tokens for s in stats)
    result["flat_rows"] = sum(s.flat_tokens for s in stats)
    result["num_samples"] = sum(s.num_samples for s in stats)
    return result


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
        if cfg.fault in DSA_FAULTS and cfg.model != "dsa":
            raise ValueError(f"fault {cfg.fault} plants a bug in DeepSeek sparse attention: it needs model='dsa' "
                             "(--model dsa)")
        if cfg.fault == "mla_rope_physical" and cfg.model != "mla":
            raise ValueError("fault mla_rope_physical plants a bug in Multi-Latent Attention: it needs model='mla'"
                             " (--model mla)")
        if cfg.ep > 1 and (cfg.dp * cfg.cp) % cfg.ep:  # experts spread over a stage's DP x CP ranks (ETP = TP)
            raise ValueError(f"expert parallel size {cfg.ep} must divide data x context parallel ranks "
                             f"{cfg.dp * cfg.cp}")
    per_rank = run_distributed(_rank_body_many, sizes.pop(), list(cfgs), timeout=timeout)
    return [_combine(cfg, [r[i] for r in per_rank]) for i, cfg in enumerate(cfgs)]


def _combine(cfg: VerifyConfig, per_rank: list) -> dict:
    out = {}
    for m in metrics_of(cfg):  # the worst rank names where; `_rel` is never NaN, so ``max`` sees every error
        worst = max(per_rank, key=lambda r: r[m])
        out[m], out[f"{m}_at"] = worst[m], worst.get(f"{m}_at")
    out["tolerance"] = cfg.tol()
    out["passed"] = all(out[m] <= cfg.tol() for m in metrics_of(cfg))
    last = [r for r in per_rank if "loss_value" in r]
    out["loss_value"] = last[0]["loss_value"] if last else float("nan")
    # ranks of one DP group hold the same samples: count each DP rank once (TP/PP/CP replicas share them)
    rep = cfg.tp * cfg.pp * cfg.cp
    for k in ("num_samples", "tree_rows", "flat_rows"):
        out[k] = sum(r[k] for r in per_rank) // rep
    return out


def format_report(cfg: VerifyConfig, out: dict) -> str:
    layout = (f"model={cfg.model}{'(' + (cfg.pattern or '') + ')' if cfg.model in ('hybrid', 'mamba') else ''} tp={cfg.tp} "
              f"pp={cfg.pp} dp={cfg.dp} ep={cfg.ep} sp={cfg.sp} recompute={cfg.recompute} dtype={cfg.dtype} "
              + (f"cp={cfg.cp}({cfg.cp_strategy}) " if cfg.cp > 1 else "") +
              f"loss={cfg.loss}" + (f" fault={cfg.fault}" if cfg.fault else "")
              + (f" dsa(sparse_loss={cfg.dsa_sparse_loss}, topk_freq={cfg.dsa_topk_freq})" if cfg.model == "dsa" else ""))
    lines = [f"megatron-tree verify: {layout}",
             f"batch: {out['num_samples']} samples, {out['flat_rows']} flat rows -> {out['tree_rows']} tree rows; "
             f"loss {out['loss_value']:.6f}",
             f"{'quantity':<20} {'max rel. error':>14}  status (tolerance {out['tolerance']:.0e})"]
    for m in metrics_of(cfg):
        ok = out[m] <= out["tolerance"]
        at = out.get(f"{m}_at")
        where = f"  (worst: {at})" if at and at != m else ""
        lines.append(f"{m:<20} {out[m]:>14.3e}  {'ok' if ok else 'FAIL'}{where}")
    lines.append("PASSED: tree training equals per-sample training" if out["passed"]
                 else "FAILED: tree training differs from per-sample training")
    return "\n".join(lines)
