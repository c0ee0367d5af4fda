"""Rank body of the whole-model GPU-path comparisons (kernel tier, `test_model_gpu_path.py`).

Runs in each process that ``run_distributed`` spawns (gloo): applies the harness patches there (a
spawned rank is a fresh interpreter), builds a tiny model twice from the same seed through
`megatron_tree.training.models` (the builders ``megatron-tree verify`` and ``train`` use) and runs
the same tree microbatches through Megatron's schedule and DDP:

* ``torch`` side: ``backend="auto"`` on CPU tensors with the kernel switch's ``auto`` off, which
  resolves every op to its torch reference (the dispatch log checks it);
* ``gpu`` side: the same model under ``cpu_kernels(auto=True)``, where ``"auto"`` resolves exactly
  as on CUDA tensors: FLA, mamba-ssm and FlexAttention run (their Triton kernels in Triton's
  interpreter; FlexAttention in its eager form, the CPU one).

It returns per rank the max relative error of the per-occurrence log-probs (the model's output with
a loss map: this rank's occurrences under CP), the max relative error of every parameter gradient
(``main_grad`` after DDP's reduction over DP x CP), the dispatch log per layer and the kernel calls
(forward and backward entry points, counted by spies).
"""
from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from functools import partial

import torch

import harness

# Kernel entry points counted on the gpu side: (module, attribute) -> label. The forward entries are
# what our backends call; the backward entries are what the kernels' autograd Functions call, so a
# count there proves the backward ran the kernel too.
SPIES = {
    ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"): "fla.chunk_gated_delta_rule",
    ("fla.ops.gated_delta_rule.chunk", "chunk_gated_delta_rule_bwd"): "fla.chunk_gated_delta_rule_bwd",
    ("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined"): "mamba.mamba_chunk_scan_combined",
    ("mamba_ssm.ops.triton.ssd_combined", "_mamba_chunk_scan_combined_bwd"): "mamba._mamba_chunk_scan_combined_bwd",
    ("torch.nn.attention.flex_attention", "flex_attention"): "flex.flex_attention",
    ("torch._higher_order_ops.flex_attention", "flex_attention_backward"): "flex.flex_attention_backward",
}


# Set to a forward label of SPIES (e.g. "fla.chunk_gated_delta_rule") to run that kernel with zero
# initial states (every non-root segment restarted from zero): a by-hand check that the comparison
# fails on a broken GPU path (not part of the tier)
FAULT_ENV = "KERNEL_TIER_MODEL_FAULT"
_EVENTS: list | None = None  # the open side's event list (the dispatch log), None between sides
KERNEL_SECONDS: Counter = Counter()  # label -> CPU seconds of this process inside it (load-independent)


def _install_spies() -> None:
    """Wrap each kernel entry point so a call appends ``("kernel", label)`` to the open event list."""
    import importlib

    for (module, name), label in SPIES.items():
        mod = importlib.import_module(module)
        real = getattr(mod, name)

        def spy(*args, _real=real, _label=label, **kwargs):
            if _EVENTS is not None:
                _EVENTS.append(("kernel", _label))
            if FAULT_ENV in os.environ and _label == os.environ[FAULT_ENV]:
                for key in ("initial_state", "initial_states"):  # a segment restarted from zero
                    if kwargs.get(key) is not None:
                        kwargs[key] = torch.zeros_like(kwargs[key])
            t0 = time.process_time()
            try:
                return _real(*args, **kwargs)
            finally:
                KERNEL_SECONDS[_label] += time.process_time() - t0

        setattr(mod, name, spy)


def _allow_flex_cpu_backward() -> None:
    """FlexAttention refuses CPU tensors for a backward (``_validate_device``); its eager path
    computes it correctly (conftest's ``flex_cpu_backward`` fixture, for this whole rank process)."""
    from torch.nn.attention import flex_attention as fa

    fa._validate_device = lambda *args, **kwargs: None


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (inf on a non-finite value)."""
    a, b = a.double(), b.double()
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        return float("inf")
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0


def _layer_markers(model, events: list) -> list:
    """Forward pre-hooks appending ``("layer", "<number>:<kind>")`` before each decoder layer runs."""
    from megatron_tree.megatron.model import layer_kind

    handles = []
    for layer in model.decoder.layers:
        tag = f"{layer.layer_number}:{layer_kind(layer)}"
        handles.append(layer.register_forward_pre_hook(lambda *a, _tag=tag: events.append(("layer", _tag))))
        handles.append(layer.register_forward_hook(
            lambda m, a, out, _tag=tag: events.append(("output", _tag, (out[0] if isinstance(out, tuple) else out)
                                                       .detach().clone()))))
    return handles


def _per_layer(events: list) -> dict:
    """{layer tag: Counter of "op->backend" and "kernel label"} of the forward part of ``events``;
    entries after the last layer's forward (the backward) go to "backward"."""
    out: dict = {}
    where = "embedding"
    for ev in events:
        if ev[0] == "output":
            continue
        if ev[0] == "layer":
            where = ev[1]
            continue
        key = f"{ev[0]}->{ev[1]}" if ev[0] != "kernel" else ev[1]
        # a backward kernel label names its own phase
        bucket = "backward" if key.endswith("_bwd") or key.endswith("_backward") else where
        out.setdefault(bucket, Counter())[key] += 1
    return {k: dict(v) for k, v in out.items()}


def _step(store: list, data_iterator, model):
    from megatron_tree.megatron.forward_step import tree_forward_step

    out, loss_func = tree_forward_step(data_iterator, model)
    store.append(out.detach().clone())  # per-occurrence log-probs of this rank's occurrences
    return out, loss_func


def _run_side(case: dict, margs, batch: list, side: str, weights: dict | None = None) -> dict:
    """One forward-backward of ``batch`` on a fresh model. ``side``: "torch" (float32, "auto" resolves
    to torch), "gpu" (float32 under ``cpu_kernels(auto=True)``) or "float64" (the torch backend in
    float64 from ``weights``, the float32 model's parameters: the yardstick of float32 rounding)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_tree.ops.backend import cpu_kernels, record_dispatch
    from megatron_tree.training.models import build_model, make_config, wrap_ddp

    global _EVENTS
    dtype = torch.float64 if side == "float64" else torch.float32
    torch.set_default_dtype(dtype)  # Megatron's torch norms take the default dtype, not params_dtype
    try:
        config = make_config(margs, cp=case["cp"], dtype=dtype, cpu=True)
        torch.manual_seed(case["seed"])
        model_parallel_cuda_manual_seed(case["seed"])
        model = build_model(config, margs)
        if weights is not None:
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(weights[n])
        ddp = wrap_ddp(model, config)
        store: list = []
        t0, c0 = time.perf_counter(), time.process_time()
        with (cpu_kernels(auto=True) if side == "gpu" else contextlib.nullcontext()), record_dispatch() as events:
            _EVENTS = events
            hooks = _layer_markers(ddp.module, events)
            get_forward_backward_func()(
                forward_step_func=partial(_step, store), data_iterator=iter(batch), model=[ddp],
                num_microbatches=len(batch), micro_batch_size=1, forward_only=False,
                seq_length=max((b[0] if isinstance(b, tuple) else b).num_rows for b in batch))
            for h in hooks:
                h.remove()
            _EVENTS = None
        seconds = (time.perf_counter() - t0, time.process_time() - c0)  # wall, CPU of this rank
    finally:
        torch.set_default_dtype(torch.float32)
    return dict(logprobs=store, grads={n: p.main_grad.detach().clone() for n, p in ddp.module.named_parameters()},
                weights={n: p.detach().clone() for n, p in ddp.module.named_parameters()},
                events=list(events), seconds=seconds)


def _case(case: dict) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_tree.training.models import ModelArgs
    from megatron_tree.training.verify import verify_samples
    from megatron_tree.tree import pack

    cp = case["cp"]
    if case.get("gdn_cp_mode"):
        os.environ["MEGATRON_TREE_GDN_CP_MODE"] = case["gdn_cp_mode"]
    ps.initialize_model_parallel(context_parallel_size=cp)
    if case["model"] == "dsa":
        from megatron_tree.cpu import dsa as cpu_dsa

        cpu_dsa.enable()  # torch Hadamard stand-in where fast_hadamard_transform is missing
        margs = ModelArgs(kind="dsa", num_layers=1)
    else:
        margs = ModelArgs(kind="hybrid", pattern=case["pattern"])
    margs.extra.update(case.get("extra", {}))
    samples = verify_samples(case["seed"], margs.vocab_size, case["families"])
    mbs = pack(samples, case["budget"], pad_to_multiple_of=8)
    dp, dpr = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    if len(mbs) % dp:
        raise ValueError(f"{len(mbs)} microbatches do not split over {dp} DP ranks: change families / budget")
    mine = mbs[dpr::dp]
    if cp > 1:
        from megatron_tree.cp import plan_context_parallel

        mine = [(mb, plan_context_parallel(mb.layout, cp, strategy=case.get("strategy", "balanced"),
                                           num_waves=case.get("num_waves"))) for mb in mine]
    ref = _run_side(case, margs, mine, "torch")
    got = _run_side(case, margs, mine, "gpu")
    f64 = _run_side(case, margs, mine, "float64", weights=ref["weights"])
    ps.destroy_model_parallel()
    os.environ.pop("MEGATRON_TREE_GDN_CP_MODE", None)
    if any(not torch.equal(got["weights"][n], w) for n, w in ref["weights"].items()):
        raise AssertionError("the two float32 models did not start from the same weights")

    def errors(a: dict, b: dict) -> dict:
        return dict(logprobs=max(_rel(x, y) for x, y in zip(a["logprobs"], b["logprobs"])),
                    grads={n: _rel(a["grads"][n], b["grads"][n]) for n in b["grads"]})

    outs = [[ev for ev in side["events"] if ev[0] == "output"] for side in (got, ref)]
    layer_outputs = {}
    for a, b in zip(*outs):
        layer_outputs[a[1]] = max(layer_outputs.get(a[1], 0.0), _rel(a[2], b[2]))
    for side in (got, ref, f64):
        side["events"] = [ev for ev in side["events"] if ev[0] != "output"]
    return dict(
        layer_outputs=layer_outputs,
        gpu_vs_torch=errors(got, ref), gpu_vs_f64=errors(got, f64), torch_vs_f64=errors(ref, f64),
        num_occurrences=sum(int(x.numel()) for x in ref["logprobs"]),
        rows=[int((b[0] if isinstance(b, tuple) else b).num_rows) for b in mine],
        dispatch_gpu=_per_layer(got["events"]), dispatch_torch=_per_layer(ref["events"]),
        dispatch_f64=_per_layer(f64["events"]),
        seconds=dict(gpu=got["seconds"], torch=ref["seconds"], float64=f64["seconds"]),
        kernel_seconds=dict(KERNEL_SECONDS))


def rank_body(cases: list) -> list:
    """Every case in this set of ranks (one Megatron import for all of them)."""
    harness.apply()
    _allow_flex_cpu_backward()
    from megatron_tree.cpu import megatron_core as cpu_layer

    cpu_layer.enable(kernels=True)
    _install_spies()
    out = []
    for case in cases:
        out.append(_case(case))
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)  # this rank's whole life, imports included
    for r in out:
        r["rank_cpu_seconds"] = usage.ru_utime + usage.ru_stime
    return out
