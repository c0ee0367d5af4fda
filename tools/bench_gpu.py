"""GPU backends vs their torch references, and tree vs flat throughput (for a session lent a GPU).

    python tools/bench_gpu.py                     # CUDA: auto backends (flex / fla / mamba), bf16
    python tools/bench_gpu.py --device cpu --quick --dtype float32   # dry run of the script on CPU
    python tools/bench_gpu.py --merge a.json b.json                  # one table from several runs

One GRPO family (prompt P + C completions x L); for each op, forward+backward:

  attention  tree_attention(backend) vs per-sample SDPA (is_causal) over the C samples batched
  gdn        tree_gated_delta_rule(backend) vs the same backend over the C samples as root chains
  ssd        tree_ssd(backend) vs the same backend over the C samples as root chains
  model step one training step (Megatron schedule, DDP) of a tiny hybrid TreeGPTModel (Mamba-2, GDN,
             attention, MLP, MoE layers; auto backends): the family as one tree vs flat packing

Error columns: the chosen backend against the torch backend on the tree, max |difference| /
max |reference| of the output and of every input gradient, the reference in float32 on the same
inputs (model step: relative difference of the tree and flat losses). Times are CUDA-event
medians over --repeats after a warm-up (compilation excluded); peak memory is
``torch.cuda.max_memory_allocated`` of the timed call ("-" on CPU). Prints one table; ``--json``
writes the rows.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

COLUMNS = ("op", "stack", "backend", "err out", "err grads", "tree s", "flat s", "speedup", "ideal",
           "tree MiB", "flat MiB")


def _timer(device):
    if device.type == "cuda":
        def run(fn, repeats):
            fn()
            torch.cuda.synchronize()
            times = []
            for _ in range(repeats):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
            return statistics.median(times)
    else:
        def run(fn, repeats):
            fn()
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times)
    return run


def _peak_mib(device, fn):
    """Peak memory of one call of ``fn`` (MiB above what was allocated before), None on CPU."""
    if device.type != "cuda":
        fn()
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def _rel(a, b) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _errors(op, backend, inputs, ref_backend_inputs, G):
    """(err of the output, max err over input gradients) of ``op(..., backend)`` vs the torch backend."""
    xs = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
    rs = [x.detach().float().requires_grad_(x.is_floating_point()) for x in ref_backend_inputs]
    y, r = op(xs, backend), op(rs, "torch")
    gy = torch.autograd.grad((y.float() * G).sum(), [x for x in xs if x.requires_grad])
    gr = torch.autograd.grad((r * G).sum(), [x for x in rs if x.requires_grad])
    return _rel(y, r), max(_rel(a, b) for a, b in zip(gy, gr))


def _resolved(op_name, backend, tensor, gpu_backends):
    from megatron_tree.ops.backend import select_backend

    try:
        return select_backend(op_name, backend, tensor, gpu_backends)
    except Exception as e:  # noqa: BLE001 (reported in the table)
        return f"unavailable ({e})"


def bench_ops(args) -> list[dict]:
    from megatron_tree.ops import tree_attention, tree_gated_delta_rule, tree_ssd
    from megatron_tree.ops.attention import _GPU_BACKENDS as ATT
    from megatron_tree.ops.gated_delta_rule import _GPU_BACKENDS as GDN
    from megatron_tree.ops.ssd import _GPU_BACKENDS as SSD
    from megatron_tree.tree.layout import TreeLayout

    dev = torch.device(args.device)
    dt = getattr(torch, args.dtype)
    P, C, L = args.prompt, args.completions, args.completion_len
    tree = TreeLayout.from_segments([P] + [L] * C, [-1] + [0] * C).to(dev)
    chains = TreeLayout.from_segments([P + L] * C, [-1] * C).to(dev)
    rows = [torch.cat([torch.arange(P), torch.arange(P + i * L, P + (i + 1) * L)]).to(dev) for i in range(C)]
    flat_rows = torch.cat(rows)
    timer = _timer(dev)
    ideal_tokens = (C * (P + L)) / (P + C * L)
    g = torch.Generator(device="cpu").manual_seed(0)
    N = tree.num_rows
    out = []

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dev, dt).requires_grad_()

    def row(op, backend, errs, t_t, t_f, ideal, m_t, m_f):
        return {"op": op, "backend": backend, "err out": errs[0], "err grads": errs[1], "tree s": t_t,
                "flat s": t_f, "speedup": t_f / t_t, "ideal": ideal, "tree MiB": m_t, "flat MiB": m_f}

    # attention: 16 heads of 128 (GQA 4 kv heads)
    Hq, Hk, D = (4, 2, 32) if args.quick else (16, 4, 128)
    q, k, v = rnd(N, Hq, D), rnd(N, Hk, D), rnd(N, Hk, D)

    def att_tree():
        tree_attention(q, k, v, tree, backend=args.backend).float().sum().backward()

    qf, kf, vf = (x.detach()[flat_rows].view(C, P + L, -1, D).transpose(1, 2).contiguous().requires_grad_()
                  for x in (q, k, v))

    def att_flat():
        F.scaled_dot_product_attention(qf, kf.repeat_interleave(Hq // Hk, 1), vf.repeat_interleave(Hq // Hk, 1),
                                       is_causal=True).float().sum().backward()

    G = torch.randn(N, Hq, D, generator=g).to(dev)
    errs = _errors(lambda x, b: tree_attention(*x, tree, backend=b), args.backend, (q, k, v), (q, k, v), G)
    pairs_flat = C * (P + L) * (P + L + 1) / 2
    out.append(row("attention", _resolved("tree_attention", args.backend, q, ATT), errs,
                   timer(att_tree, args.repeats), timer(att_flat, args.repeats), pairs_flat / tree.visible_pairs(),
                   _peak_mib(dev, att_tree), _peak_mib(dev, att_flat)))

    # gated delta rule: 8 heads, K = V = 128
    H, K = (2, 16) if args.quick else (8, 128)
    qg = F.normalize(torch.randn(N, H, K, generator=g), dim=-1).to(dev, dt).requires_grad_()
    kg = F.normalize(torch.randn(N, H, K, generator=g), dim=-1).to(dev, dt).requires_grad_()
    vg = rnd(N, H, K)
    gg = (-torch.rand(N, H, generator=g)).to(dev, torch.float32).requires_grad_()
    bg = torch.rand(N, H, generator=g).to(dev, dt).requires_grad_()
    gdn_in = (qg, kg, vg, gg, bg)

    def gdn_tree():
        tree_gated_delta_rule(*gdn_in, tree, backend=args.backend).float().sum().backward()

    gdn_flat_in = [x.detach()[flat_rows].requires_grad_() for x in gdn_in]

    def gdn_flat():
        tree_gated_delta_rule(*gdn_flat_in, chains, backend=args.backend).float().sum().backward()

    G = torch.randn(N, H, K, generator=g).to(dev)
    errs = _errors(lambda x, b: tree_gated_delta_rule(*x, tree, backend=b), args.backend, gdn_in, gdn_in, G)
    out.append(row("gated delta rule", _resolved("tree_gated_delta_rule", args.backend, qg, GDN), errs,
                   timer(gdn_tree, args.repeats), timer(gdn_flat, args.repeats), ideal_tokens,
                   _peak_mib(dev, gdn_tree), _peak_mib(dev, gdn_flat)))

    # SSD: 32 heads of 64, 1 group, state 128
    Hs, Pd, Gr, S = (4, 8, 1, 16) if args.quick else (32, 64, 1, 128)
    x = rnd(N, Hs, Pd)
    dtv = (torch.rand(N, Hs, generator=g) * 0.1 + 0.01).to(dev, torch.float32).requires_grad_()
    A = (-torch.rand(Hs, generator=g) - 0.5).to(dev, torch.float32).requires_grad_()
    B, Cm = rnd(N, Gr, S, scale=0.3), rnd(N, Gr, S, scale=0.3)
    ssd_in = (x, dtv, A, B, Cm)

    def ssd_tree():
        tree_ssd(*ssd_in, tree, backend=args.backend).float().sum().backward()

    ssd_flat_in = [t.detach()[flat_rows].requires_grad_() if t.dim() > 1 else t for t in ssd_in]

    def ssd_flat():
        tree_ssd(*ssd_flat_in, chains, backend=args.backend).float().sum().backward()

    G = torch.randn(N, Hs, Pd, generator=g).to(dev)
    errs = _errors(lambda x, b: tree_ssd(*x, tree, backend=b), args.backend, ssd_in, ssd_in, G)
    out.append(row("ssd", _resolved("tree_ssd", args.backend, x, SSD), errs,
                   timer(ssd_tree, args.repeats), timer(ssd_flat, args.repeats), ideal_tokens,
                   _peak_mib(dev, ssd_tree), _peak_mib(dev, ssd_flat)))
    return out


# ------------------------------------------------------------------------------------------- model step
def _model_step_body(a: dict) -> dict:
    """One rank (run_distributed: NCCL on a GPU, gloo + the CPU shims otherwise)."""
    torch._dynamo.config.disable = True  # Megatron's jit_fuser would torch.compile
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_tree.data.synthetic import shared_prompt
    from megatron_tree.training.megatron_init import init_megatron
    from megatron_tree.training.models import ModelArgs, build_model, forward_backward, make_config, report_totals, wrap_ddp
    from megatron_tree.tree import pack, summarize

    cuda = torch.cuda.is_available()
    init_megatron(seed=0, kernels=True)  # the CPU shims: none with CUDA
    samples = shared_prompt(a["prompt"], a["completions"], a["completion_len"], vocab=a["vocab"])
    budget = a["budget"]
    tree = pack(samples, budget, pad_to_multiple_of=8)
    flat = pack(samples, budget, pad_to_multiple_of=8, share_prefixes=False)
    margs = ModelArgs(kind="hybrid", pattern="MG*-*E", hidden_size=a["hidden"], num_attention_heads=4,
                      num_query_groups=2, ffn_hidden_size=2 * a["hidden"], vocab_size=a["vocab"], max_position=budget)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    # fusions off and weights built on the host everywhere (no TE / apex needed); then moved to the device
    config = make_config(margs, dtype=getattr(torch, a["dtype"]), cpu=True)
    model = build_model(config, margs)
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    model = model.to(dev)
    ddp = wrap_ddp(model, config)
    times, peaks, losses = {"tree": [], "flat": []}, {}, {}
    for rep in range(a["repeats"] + 1):  # the first is a warm-up
        for name, mbs in (("tree", tree), ("flat", flat)):
            ddp.zero_grad_buffer()
            if cuda:
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            reports = forward_backward(ddp, mbs)
            if cuda:
                torch.cuda.synchronize()
                peaks[name] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
            if rep:
                times[name].append(time.perf_counter() - t0)
            tot = report_totals(reports)
            losses[name] = float(tot[0] / tot[1])
    st_t, st_f = summarize(tree), summarize(flat)
    import megatron.core

    return {"op": "model step", "backend": "auto", "err out": abs(losses["tree"] - losses["flat"]) / abs(losses["flat"]),
            "err grads": None, "tree s": min(times["tree"]), "flat s": min(times["flat"]),
            "speedup": min(times["flat"]) / min(times["tree"]), "ideal": st_f["tree_tokens"] / st_t["tree_tokens"],
            "tree MiB": peaks.get("tree"), "flat MiB": peaks.get("flat"),
            "megatron_core": getattr(megatron.core, "__version__", "?")}


def bench_model_step(args) -> dict:
    from megatron_tree.training.launch import run_distributed

    if args.quick:
        a = dict(prompt=64, completions=4, completion_len=16, budget=256, hidden=32, vocab=128, repeats=1)
    else:
        a = dict(prompt=8192, completions=16, completion_len=512, budget=32768, hidden=512, vocab=32000, repeats=3)
    a["dtype"] = args.dtype
    (r,) = run_distributed(_model_step_body, 1, a, timeout=1200)
    return r


# ------------------------------------------------------------------------------------------- table
def _fmt(col, v):
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    if col.startswith("err"):
        return f"{v:.1e}"
    if col.endswith(" s"):
        return f"{v:.4f}"
    if col in ("speedup", "ideal"):
        return f"{v:.2f}x"
    if col.endswith("MiB"):
        return f"{v:.0f}"
    return str(v)


def print_table(rows: list[dict]) -> None:
    cells = [[_fmt(c, r.get(c)) for c in COLUMNS] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(COLUMNS)]
    line = "  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths))
    print(line)
    print("-" * len(line))
    for x in cells:
        print("  ".join(v.ljust(w) for v, w in zip(x, widths)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--backend", default="auto", help="auto, torch, or a named GPU backend for all ops")
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--completions", type=int, default=16)
    ap.add_argument("--completion-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="small sizes (a CPU dry run)")
    ap.add_argument("--no-model-step", action="store_true", help="ops only")
    ap.add_argument("--model-step-only", action="store_true", help="the model step only (e.g. another megatron-core)")
    ap.add_argument("--stack", default=None, help="label of the software stack in the table (default: "
                                                  "python X.Y, megatron-core version)")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--merge", nargs="+", default=None, help="print one table from these --json files and exit")
    args = ap.parse_args()
    if args.merge:
        print_table([r for path in args.merge for r in json.load(open(path))])
        return
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here; run with --device cpu --quick for a dry run")
        return
    if args.quick:
        args.prompt, args.completions, args.completion_len, args.repeats = 256, 4, 64, 2
    if args.stack is None:
        import sys
        from importlib.metadata import version

        try:
            mc = version("megatron-core")
        except Exception:  # noqa: BLE001
            mc = "?"
        args.stack = f"py{sys.version_info.major}.{sys.version_info.minor} mcore {mc}"
    print(f"bench_gpu: {args.device} {args.dtype}, family prompt {args.prompt} + {args.completions} x "
          f"{args.completion_len}, {args.stack}", flush=True)
    rows = [] if args.model_step_only else bench_ops(args)
    if not args.no_model_step:
        rows.append(bench_model_step(args))
    for r in rows:
        r["stack"] = args.stack
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
