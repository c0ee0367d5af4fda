"""Whole models on the GPU code path, under Triton's interpreter (kernel tier).

``verify``-style comparisons of a tiny hybrid model (pattern ``MG*-E``: Mamba-2, Gated DeltaNet,
attention, MLP, MoE; one layer each, hidden 32) and a tiny DSA model (one MLA + DeepSeek-sparse-
attention layer) built by `megatron_tree.training.models` with every op at its default
``backend="auto"``. The same model runs twice from the same weights, float32, on the same tree
microbatches (``verify_samples``: forks at several depths, prefix samples, duplicates, padding),
through Megatron's schedule and DDP, at CP1 (two DP ranks) and CP2 (gloo, 2 spawned ranks, each
applying the harness patches itself, see `model_ranks.py`):

* the torch side: ``"auto"`` on CPU tensors resolves every op to its torch reference;
* the GPU side: under ``ops.backend.cpu_kernels(auto=True)`` ``"auto"`` resolves as on CUDA
  tensors: mamba-ssm's ``mamba_chunk_scan_combined``, FLA's ``chunk_gated_delta_rule`` (Triton
  kernels in the interpreter) and FlexAttention (eager, its CPU form) run, forward and backward.

Compared: every per-occurrence log-prob and every parameter gradient (``main_grad`` after DDP's
DP x CP reduction). Tolerance: the GPU side's error against a float64 torch-backend run of the same
weights must stay within a small multiple of the float32 torch side's own error against it, with a
floor (see LOGPROB_* / GRAD_* for the measured figures behind them). Checked by hand that it fails
on a broken GPU path (``KERNEL_TIER_MODEL_FAULT``, `model_ranks.py`): FLA or mamba-ssm run with
zero initial states (every child segment restarted from zero) gives gradient errors of 0.74 / 1.27
relative at CP2, caught. The dispatch log (``ops.backend.record_dispatch``) and spies on the
kernels' forward and backward entry points assert which implementation each layer really ran.

Under CP2 the paths the GPU takes differ most, and the run goes through the kernels there: Mamba's
token -> head transpose (``cp.tree_mamba_cp``: each rank runs the mamba-ssm kernel over the whole
tree for its heads), GDN in **heads** mode (``cp.execution.gdn``: FLA over the whole tree for the rank's
value heads, forced with ``MEGATRON_TREE_GDN_CP_MODE=heads``; GDN layout islands on, the default),
and attention's per-wave partials (a zigzag plan with 2 K/V waves, so every rank runs FlexAttention
on its local stage and on each remote wave, merged by LSE).

Paths that still run torch on a GPU, and why (the dispatch log shows them here):

* ``tree_causal_conv1d`` (Mamba's and GDN's short conv, also its CP halos): causal-conv1d's CUDA
  kernel takes contiguous sequences (``seq_idx``) and cannot start a child segment from its
  parent's tail along ``path_prev``; its package does not import without CUDA either. The torch op
  is one bandwidth-bound gather on either device.
* GDN under CP in **summary** mode (`cp.execution.gdn`'s default choice when the cost model prefers it):
  ``gated_delta_rule_forest`` / ``gated_delta_rule_summary`` are torch only (FLA has no kernel for
  the affine state summaries ``S_out = M S_in + E``, nor for a forest whose roots start from states
  received from other ranks). Heads mode uses FLA.
* DeepSeek sparse attention: the indexer's scores and top-k (`ops.dsa.tree_dsa_topk`, and the CP
  candidate merges), ``ops.dsa.sparse_attention`` (``_GPU_BACKENDS`` is empty: no sparse kernel is
  wired) and the indexer loss are torch on every device; the DSA model's GPU path is therefore its
  torch path, which the DSA test pins bit for bit. Its Hadamard rotation runs
  fast_hadamard_transform's CUDA kernel only where that package is installed (a torch stand-in
  otherwise, `compat.dsa.use_torch_hadamard`).
* Padding rows of the recurrent ops (closed form), float64 inputs (``"auto"`` keeps the exact
  reference), GDN with ``config.deterministic_mode`` (as stock), and FlexAttention stages with no
  query or no key row (nothing to compute) take torch by design.
* In this tier only: FlexAttention runs eagerly (compiled CPU flex has neither LSE nor backward),
  so its fused Triton kernel is not what runs here; Megatron's gated RMSNorm of the Mamba mixer is
  the CPU shims' torch stand-in (`cpu.standins`), mamba-ssm's Triton norm on a GPU.
"""
from __future__ import annotations

import re
import time

import model_ranks
from megatron_tree.training.launch import run_distributed

SEED = 1234
# Fewer heads than verify's defaults: the interpreter's time grows with the kernels' grid (heads x
# chunks x segments); CP2 still splits them (2 Mamba heads, 1 GDN value head per rank).
HYBRID_EXTRA = {"mamba_num_heads": 4, "linear_num_value_heads": 2}
# CP1: two DP ranks, one microbatch each (40 and 32 rows); CP2: one 40-row microbatch (11 segments
# over 4 levels, 4 padding rows) split over both ranks by a zigzag plan with 2 K/V waves.
HYBRID_CASES = [
    dict(model="hybrid", pattern="MG*-E", cp=1, seed=SEED, families=2, budget=64, extra=HYBRID_EXTRA),
    dict(model="hybrid", pattern="MG*-E", cp=2, seed=SEED, families=1, budget=64, extra=HYBRID_EXTRA,
         gdn_cp_mode="heads", strategy="zigzag", num_waves=2),
]
DSA_CASES = [
    dict(model="dsa", cp=1, seed=SEED, families=2, budget=64),
    dict(model="dsa", cp=2, seed=SEED, families=1, budget=64, strategy="zigzag", num_waves=2),
]
# GPU side vs float64 <= max(floor, factor x (torch fp32 side vs float64)), relative to each
# quantity's max magnitude. Log-probs: both sides measure ~1.1e-7 (the shared token-local layers'
# rounding dominates; ratio <= 1.08), so 5x; a GDN segment restarted from zero moves them by only
# 1e-6 on this freshly initialised model, which the gradients catch (0.74 on dt_bias). Gradients:
# ~5e-7 except GDN's A_log / dt_bias (sums over every token with heavy cancellation: 1e-4 for torch
# fp32, up to 4.4x that for FLA), so the op tier's 20x.
LOGPROB_FLOOR, LOGPROB_FACTOR = 1e-6, 5
GRAD_FLOOR, GRAD_FACTOR = 1e-5, 20

# kernel entry points each hybrid layer kind must call (forward), and the backward entry points
KERNELS = {"M": ("tree_ssd->mamba", "mamba.mamba_chunk_scan_combined"),
           "G": ("tree_gated_delta_rule->fla", "fla.chunk_gated_delta_rule"),
           "*": ("tree_attention->flex", "flex.flex_attention")}
BACKWARD = ("mamba._mamba_chunk_scan_combined_bwd", "fla.chunk_gated_delta_rule_bwd", "flex.flex_attention_backward")


def _run(cases: list, timeout: float) -> list:
    """The cases on 2 spawned gloo ranks; prints wall time and each rank's CPU time (the wall time
    on an idle machine with a core per rank)."""
    t0 = time.perf_counter()
    results = run_distributed(model_ranks.rank_body, 2, cases, timeout=timeout)
    cpu = [f"{r[-1]['rank_cpu_seconds']:.0f}" for r in results]
    print(f"{cases[0]['model']}: {time.perf_counter() - t0:.0f} s wall, rank CPU seconds {', '.join(cpu)}; "
          + "; ".join(f"CP{c['cp']} GPU side {max(r[i]['seconds']['gpu'][1] for r in results):.0f} s CPU"
                      for i, c in enumerate(cases)))
    return results


def _kind_of(name: str, pattern: str | None) -> str:
    """Parameter name -> "<layer kind letter> ..." group for the error table."""
    m = re.match(r"decoder\.layers\.(\d+)\.", name)
    if not m:
        return "emb/out/norm"
    return (pattern[int(m.group(1))] if pattern else "DSA") + " layer"


def _check_case(case: dict, per_rank: list, record) -> None:
    label = f"CP{case['cp']}"
    pattern = case.get("pattern")
    for rank, r in enumerate(per_rank):
        where = f"{case['model']} {label} rank {rank}"
        # the torch side resolved every op to torch and ran no kernel
        torch_ops = {k for layer in r["dispatch_torch"].values() for k in layer}
        assert torch_ops and all(k.endswith("->torch") for k in torch_ops), (where, r["dispatch_torch"])
        # log-probs and every gradient against float64, the float32 torch side as the yardstick
        got, ref, direct = r["gpu_vs_f64"], r["torch_vs_f64"], r["gpu_vs_torch"]
        assert got["logprobs"] <= max(LOGPROB_FLOOR, LOGPROB_FACTOR * ref["logprobs"]), \
            (where, got["logprobs"], ref["logprobs"])
        bad = {n: (e, ref["grads"][n]) for n, e in got["grads"].items()
               if not e <= max(GRAD_FLOOR, GRAD_FACTOR * ref["grads"][n])}
        assert not bad, (f"{where}: gradients beyond max({GRAD_FLOOR}, {GRAD_FACTOR} x torch fp32 error) vs float64 "
                         f"(gpu error, torch fp32 error): {bad}")
        assert len(got["grads"]) == len(ref["grads"]) > 10
    # the error table: worst rank per quantity
    rows = "+".join(str(n) for r in per_rank for n in r["rows"]) if case["cp"] == 1 else f"{per_rank[0]['rows']} split"
    cpu = max(r["seconds"]["gpu"][1] for r in per_rank)  # the GPU side's CPU seconds on its slowest rank
    record(f"model {case['model']}", f"{label} rows {rows} ({cpu:.0f} s CPU)", "logprobs",
           max(r["gpu_vs_f64"]["logprobs"] for r in per_rank), max(r["torch_vs_f64"]["logprobs"] for r in per_rank))
    kinds: dict = {}
    for r in per_rank:
        for n, e in r["gpu_vs_f64"]["grads"].items():
            k = _kind_of(n, pattern)
            old = kinds.get(k, (0.0, 0.0))
            kinds[k] = (max(old[0], e), max(old[1], r["torch_vs_f64"]["grads"][n]))
    for k, (e_gpu, e_torch) in sorted(kinds.items()):
        record(f"model {case['model']}", f"{label} grads {k}", "grads", e_gpu, e_torch)


def test_hybrid_model_gpu_path_matches_torch(kernel_report):
    """MG*-E: Mamba-2 (mamba-ssm), GDN (FLA), attention (FlexAttention), MLP, MoE; CP1 and CP2."""
    results = _run(HYBRID_CASES, timeout=1200)
    for i, case in enumerate(HYBRID_CASES):
        per_rank = [results[rank][i] for rank in range(2)]
        _check_case(case, per_rank, kernel_report)
        for rank, r in enumerate(per_rank):
            where = f"hybrid CP{case['cp']} rank {rank}"
            d = r["dispatch_gpu"]
            layers = {tag.split(":")[1]: ops for tag, ops in d.items() if ":" in tag}
            assert set(layers) >= set(KERNELS), (where, d)
            for kind, (op, kernel) in KERNELS.items():
                ops = layers[kind]
                # the layer resolved its op to the GPU backend only, and the kernel really ran
                assert ops.get(op, 0) >= 1 and not any(k.endswith("->torch") for k in ops), (where, kind, ops)
                assert ops.get(kernel, 0) >= 1, (where, kind, ops)
            for kind in "-E":  # token-local layers: no tree op at all
                assert not layers.get(kind), (where, kind, layers.get(kind))
            assert all(d.get("backward", {}).get(k, 0) >= 1 for k in BACKWARD), (where, d.get("backward"))
            # at least one varlen FLA call per level of the forest (4 levels) per microbatch
            assert layers["G"]["fla.chunk_gated_delta_rule"] >= 3 * len(r["rows"]), (where, layers["G"])
            if case["cp"] > 1:
                # per-wave partials: the local stage and both remote waves ran FlexAttention
                assert layers["*"]["tree_attention->flex"] >= 1 + case["num_waves"], (where, layers["*"])


def test_dsa_model_gpu_path_is_its_torch_path(kernel_report):
    """MLA + DSA: no op of DeepSeek sparse attention has a GPU kernel wired, so ``"auto"`` as on a
    GPU resolves its sparse attention to torch and the model equals the torch-backend model bit for
    bit, at CP1 and under tree CP (`cp.tree_dsa_cp`) at CP2."""
    results = _run(DSA_CASES, timeout=600)
    for i, case in enumerate(DSA_CASES):
        per_rank = [results[rank][i] for rank in range(2)]
        _check_case(case, per_rank, kernel_report)
        for rank, r in enumerate(per_rank):
            where = f"dsa CP{case['cp']} rank {rank}"
            assert r["dispatch_gpu"] == r["dispatch_torch"], where
            ops = {k for layer in r["dispatch_gpu"].values() for k in layer}
            assert "sparse_attention->torch" in ops and not any("." in k for k in ops), (where, ops)
            assert r["gpu_vs_torch"]["logprobs"] == 0.0 and not any(r["gpu_vs_torch"]["grads"].values()), where
