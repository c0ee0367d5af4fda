"""Fit the CP planner's cost model (`megatron_tree.cp.CostModel`) to this machine.

Measures, with one torch thread per rank (as `training.launch.run_distributed` runs CP ranks):

* attention stages: ``ops.tree_attention_partial`` forward and backward on a grid of query / key
  set sizes and visible-pair counts: local stages (a rank's rows against themselves: causal
  chains and a prefix forest) and remote stages (queries against earlier keys: full rectangles and
  sparse tree cases where most queries do not see most keys);
* the LSE merge (``ops.merge_attention``) forward and backward per query row;
* a token-local proxy: a transformer layer's projections and MLP (``hidden = q_heads * head_dim``,
  ``ffn = 4 * hidden``) forward and backward per row;
* the all-to-all: ``torch.distributed.all_to_all_single`` of several sizes between 2 local ranks
  (gloo on CPU, NCCL with 2 GPUs), and how much of a transfer hides behind compute when it is
  issued asynchronously (the executor's prefetch).

Compute is timed as process CPU time on a CPU (wall time on CUDA), the fastest of interleaved
rounds; the all-to-all in wall time. Each stage family is fitted by non-negative least squares on
relative error
(``t = launch + full_tile * full + part_tile * partial + stage_row * (nq + nk)`` with the tiles
``ops.blocks.block_pairs`` finds for the stage, ``t = latency + per_byte * bytes``, ...),
written as JSON that `CostModel.from_json` loads, and every measurement is printed next to its
prediction. Default arguments run in about a minute on two CPU cores.

    python tools/calibrate_cp.py                     # -> megatron_tree/cp/planning/cost_cpu.json
    python tools/calibrate_cp.py --out my_gpu.json --device cuda
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_tree.cp.planning.cost_model import CPU_COST_JSON, CostModel  # noqa: E402
from megatron_tree.ops import merge_attention, tree_attention_partial  # noqa: E402
from megatron_tree.tree.layout import TreeLayout  # noqa: E402


# ---------------------------------------------------------------------------------------------- timing
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _clock(device):
    """Process CPU time on a CPU device, wall time on CUDA (after a sync). CP ranks on a CPU run one
    thread each, so CPU time is the work of a rank that has its core to itself; on a shared machine
    wall time would mostly measure the neighbours."""
    return time.perf_counter if device.type == "cuda" else time.process_time


def _best_in_rounds(fns: list, reps: int, device) -> list[float]:
    """Fastest time of each of ``fns`` over ``reps`` interleaved rounds (every fn once per round):
    a burst of load spoils one round of every configuration instead of every repetition of one.
    ``fn(clock)`` may time its own part and return ms (a backward after an untimed forward);
    returning None times the whole call."""
    clock = _clock(device)
    for fn in fns:  # warm-up
        fn(clock)
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            _sync(device)
            t0 = clock()
            own = fn(clock)
            _sync(device)
            best[i] = min(best[i], own if own is not None else (clock() - t0) * 1e3)
    return best


def _backward_ms(forward, loss, clock, device) -> float:
    """Run ``forward`` untimed, then time the backward of ``loss(out)`` alone."""
    out = forward(None)
    l = loss(out)
    _sync(device)
    t0 = clock()
    l.backward()
    _sync(device)
    return (clock() - t0) * 1e3


def nnls(X: np.ndarray, y: np.ndarray, w: np.ndarray | None = None) -> np.ndarray:
    """Non-negative least squares by an active set: drop the most negative coefficient, refit."""
    w = np.ones_like(y) if w is None else w
    Xw, yw = X * w[:, None], y * w
    active = list(range(X.shape[1]))
    coef = np.zeros(X.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(Xw[:, active], yw, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            return coef
        active.pop(int(np.argmin(sol)))
    return coef


# ---------------------------------------------------------------------------------------------- attention
def _stage_cases(quick: bool):
    """(kind, layout, q_rows, k_rows) cases: kind 'local' (keys = the queries' own rows) or 'remote'."""
    cases = []
    sizes = (256, 1024, 2048) if quick else (256, 512, 1024, 2048, 3072)
    chain = TreeLayout.from_segments([8192], [-1])
    for n in sizes:  # a rank's own rows of a chain: causal triangle
        rows = torch.arange(n)
        cases.append(("local", chain, rows, rows))
    for nq in (128, 512, 2048):  # remote: queries after the keys, every pair visible
        for nk in (128, 512, 2048):
            cases.append(("remote", chain, torch.arange(4096, 4096 + nq), torch.arange(nk)))
    # a prefix forest: 8 families, prompt 300 + 8 completions x 60
    lengths, parents = [], []
    for _ in range(8):
        root = len(lengths)
        lengths.append(300)
        parents.append(-1)
        for _ in range(8):
            lengths.append(60)
            parents.append(root)
    forest = TreeLayout.from_segments(lengths, parents)
    N = forest.num_rows
    every = torch.arange(N)
    cases.append(("local", forest, every[: N // 2], every[: N // 2]))
    cases.append(("local", forest, every, every))
    # remote in a forest: completions of all families against the prompts (each sees one prompt)
    seg = forest.segment_ids
    is_prompt = forest.segment_parent[seg] < 0
    cases.append(("remote", forest, every[~is_prompt], every[is_prompt]))
    cases.append(("remote", forest, every[~is_prompt][::2], every[is_prompt][: 600]))
    return cases


def _pairs(layout, q_rows, k_rows) -> int:
    vu = layout.visible_until
    q = q_rows.view(-1, 1)
    k = k_rows.view(1, -1)
    return int(((k <= q) & (q < vu[k_rows].view(1, -1))).sum())


def _tiles(layout, q_rows, k_rows, block: int) -> tuple[int, int]:
    """(full, partial) tiles the kernels compute for this stage (``ops.blocks.block_pairs``)."""
    from megatron_tree.ops.blocks import block_pairs

    bp = block_pairs(q_rows, k_rows, layout.visible_until[k_rows], block_q=block, block_k=block)
    full = int(bp.full.sum())
    return full, bp.num_pairs - full


def measure_attention(args, device):
    Hq, Hkv, D = args.heads, args.kv_heads, args.head_dim
    dtype = torch.float32
    g = torch.Generator().manual_seed(0)
    fns, info = [], []
    for kind, layout, q_rows, k_rows in _stage_cases(args.quick):
        nq, nk = int(q_rows.numel()), int(k_rows.numel())
        q = torch.randn(nq, Hq, D, generator=g, dtype=dtype).to(device).requires_grad_()
        k = torch.randn(nk, Hkv, D, generator=g, dtype=dtype).to(device).requires_grad_()
        v = torch.randn(nk, Hkv, D, generator=g, dtype=dtype).to(device).requires_grad_()
        qr, kr, kvu = q_rows.to(device), k_rows.to(device), layout.visible_until[k_rows].to(device)

        def fwd(clock, q=q, k=k, v=v, qr=qr, kr=kr, kvu=kvu):
            return tree_attention_partial(q, k, v, qr, kr, kvu, backend=args.backend) if clock is None else \
                (tree_attention_partial(q, k, v, qr, kr, kvu, backend=args.backend), None)[1]

        def both(clock, fwd=fwd):
            return _backward_ms(fwd, lambda ol: ol[0].sum() + torch.nan_to_num(ol[1], neginf=0.0).sum(), clock, device)

        fns += [fwd, both]
        full, part = _tiles(layout, q_rows, k_rows, args.tile_rows)
        info.append(dict(kind=kind, nq=nq, nk=nk, pairs=_pairs(layout, q_rows, k_rows), full=full, part=part))
    times = _best_in_rounds(fns, args.reps, device)
    out = []
    for m, t_f, t_b in zip(info, times[0::2], times[1::2]):
        out.append(dict(m, fwd=t_f, bwd=t_b))
        print(f"  {m['kind']:6s} nq={m['nq']:5d} nk={m['nk']:5d} pairs={m['pairs']:>10,d} tiles {m['full']:4d} full "
              f"{m['part']:4d} partial  fwd {t_f:8.2f} ms  bwd {out[-1]['bwd']:8.2f} ms", flush=True)
    return out


def fit_attention(meas, direction):
    """One direction, local and remote stages together: (launch, per full tile, per partial tile,
    per stage row) -- the CostModel's stage formula."""
    X = np.array([[1.0, m["full"], m["part"], m["nq"] + m["nk"]] for m in meas])
    y = np.array([m[direction] for m in meas])
    return nnls(X, y, 1.0 / y)


# ---------------------------------------------------------------------------------------------- merge / tokens
def measure_merge(args, device):
    Hq, D = args.heads, args.head_dim
    fns, sizes = [], (1024, 4096, 16384)
    for n in sizes:
        oa = torch.randn(n, Hq, D, device=device, requires_grad=True)
        ob = torch.randn(n, Hq, D, device=device, requires_grad=True)
        la = torch.randn(n, Hq, device=device, requires_grad=True)
        lb = torch.randn(n, Hq, device=device, requires_grad=True)

        def fwd(clock, oa=oa, ob=ob, la=la, lb=lb):
            out = merge_attention(oa, la, ob, lb)
            return out if clock is None else None

        def both(clock, fwd=fwd):
            return _backward_ms(fwd, lambda ol: ol[0].sum() + ol[1].sum(), clock, device)

        fns += [fwd, both]
    times = _best_in_rounds(fns, args.reps, device)
    out = []
    for n, t_f, t_b in zip(sizes, times[0::2], times[1::2]):
        out.append(dict(rows=n, fwd=t_f, bwd=t_b))
        print(f"  merge rows={n:6d}  fwd {t_f:7.3f} ms  bwd {out[-1]['bwd']:7.3f} ms", flush=True)
    return out


def measure_tokens(args, device):
    h = args.heads * args.head_dim
    qkv = torch.nn.Linear(h, (args.heads + 2 * args.kv_heads) * args.head_dim).to(device)
    proj = torch.nn.Linear(args.heads * args.head_dim, h).to(device)
    up = torch.nn.Linear(h, 4 * h).to(device)
    down = torch.nn.Linear(4 * h, h).to(device)
    norm = torch.nn.LayerNorm(h).to(device)
    fns, sizes = [], (1024, 4096, 16384)
    for n in sizes:
        x = torch.randn(n, h, device=device, requires_grad=True)

        def fwd(clock, x=x):
            y = x + proj(qkv(norm(x))[:, : args.heads * args.head_dim])
            y = y + down(torch.nn.functional.gelu(up(norm(y))))
            return y if clock is None else None

        def both(clock, fwd=fwd):
            return _backward_ms(fwd, lambda y: y.sum(), clock, device)

        fns += [fwd, both]
    times = _best_in_rounds(fns, args.reps, device)
    out = []
    for n, t_f, t_b in zip(sizes, times[0::2], times[1::2]):
        out.append(dict(rows=n, fwd=t_f, bwd=t_b))
        print(f"  token-local rows={n:6d}  fwd {t_f:7.3f} ms  bwd {out[-1]['bwd']:7.3f} ms", flush=True)
    return out


# ---------------------------------------------------------------------------------------------- all-to-all
def _a2a_body(sizes, reps, feat):
    """Runs on each of 2 ranks: all_to_all_single timings and the async overlap probe (rank 0's)."""
    import torch.distributed as dist

    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    res = []
    for rows in sizes:  # rows sent to the other rank (and as many kept)
        send = torch.randn(2 * rows, feat, device=dev)
        out = torch.empty_like(send)
        ts = []
        for i in range(reps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_to_all_single(out, send, output_split_sizes=[rows, rows], input_split_sizes=[rows, rows])
            _sync(dev)
            if i:
                ts.append((time.perf_counter() - t0) * 1e3)
        res.append((rows * feat * send.element_size(), float(np.min(ts))))
    # overlap probe: a transfer issued asynchronously while a compute loop runs
    rows = sizes[-1]
    send = torch.randn(2 * rows, feat, device=dev)
    out = torch.empty_like(send)
    a = torch.randn(256, 256, device=dev)

    def compute():
        b = a
        for _ in range(40):
            b = torch.tanh(b @ a)
        _sync(dev)

    def timed(f):
        ts = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            f()
            ts.append((time.perf_counter() - t0) * 1e3)
        return float(np.min(ts))

    def comm():
        dist.all_to_all_single(out, send, output_split_sizes=[rows, rows], input_split_sizes=[rows, rows])
        _sync(dev)

    def both():
        work = dist.all_to_all_single(out, send, output_split_sizes=[rows, rows], input_split_sizes=[rows, rows],
                                      async_op=True)
        compute()
        work.wait()
        _sync(dev)

    compute()
    t_comp, t_comm, t_both = timed(compute), timed(comm), timed(both)
    return dict(points=res, t_comp=t_comp, t_comm=t_comm, t_both=t_both)


def measure_comm(args):
    from megatron_tree.training.launch import run_distributed

    feat = 2 * args.kv_heads * args.head_dim  # K and V of one row
    sizes = [64, 512, 4096, 16384, 65536] if not args.quick else [64, 4096, 32768]
    res = run_distributed(_a2a_body, 2, sizes, args.reps + 2, feat, timeout=300.0)[0]
    for b, t in res["points"]:
        print(f"  all_to_all {b / 1024:9.1f} KiB each way  {t:8.3f} ms", flush=True)
    hide = (res["t_comm"] + res["t_comp"] - res["t_both"]) / max(min(res["t_comm"], res["t_comp"]), 1e-9)
    res["overlap"] = float(np.clip(hide, 0.0, 1.0))
    print(f"  overlap probe: compute {res['t_comp']:.2f} ms, transfer {res['t_comm']:.2f} ms, both {res['t_both']:.2f} ms "
          f"-> overlap {res['overlap']:.2f}", flush=True)
    return res


# ---------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=CPU_COST_JSON, help="JSON to write (default: the shipped CPU profile)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--backend", default="auto", help="tree_attention_partial backend")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tile-rows", type=int, default=128, help="the kernels' block (ops.attention.DEFAULT_BLOCK_SIZE)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (CP ranks run with 1)")
    ap.add_argument("--quick", action="store_true", help="a smaller grid (tests / smoke runs)")
    ap.add_argument("--no-comm", action="store_true", help="skip the all-to-all (keeps the current comm figures)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    if load0 > (os.cpu_count() or 1):
        print(f"warning: load average {load0:.1f} on {os.cpu_count()} cores: timings will be disturbed", flush=True)

    print("attention stages (tree_attention_partial, forward and backward):")
    att = measure_attention(args, device)
    print("LSE merge:")
    mer = measure_merge(args, device)
    print("token-local proxy:")
    tok = measure_tokens(args, device)
    comm = None
    if not args.no_comm:
        print("all-to-all (2 local ranks):")
        comm = measure_comm(args)

    f, b = fit_attention(att, "fwd"), fit_attention(att, "bwd")
    mX = np.array([[m["rows"]] for m in mer], float)
    merge_f = nnls(mX, np.array([m["fwd"] for m in mer]), 1 / np.array([m["fwd"] for m in mer]))[0]
    merge_b = nnls(mX, np.array([m["bwd"] for m in mer]), 1 / np.array([m["bwd"] for m in mer]))[0]
    tX = np.array([[m["rows"]] for m in tok], float)
    tok_f = nnls(tX, np.array([m["fwd"] for m in tok]), 1 / np.array([m["fwd"] for m in tok]))[0]
    tok_b = nnls(tX, np.array([m["bwd"] for m in tok]), 1 / np.array([m["bwd"] for m in tok]))[0]
    try:  # the figures --no-comm keeps: those of the file being replaced, if it still loads
        base = CostModel.from_json(args.out) if os.path.exists(args.out) else CostModel.gpu()
    except ValueError:
        base = CostModel.gpu()
    kv_bytes = 2 * args.kv_heads * args.head_dim * 4  # float32 K + V
    fields = dict(
        name=f"{args.device}-calibrated", tok_fwd_ms_per_row=tok_f, tok_bwd_ms_per_row=tok_b,
        fwd_full_tile_ms=f[1], fwd_part_tile_ms=f[2], bwd_full_tile_ms=b[1], bwd_part_tile_ms=b[2],
        tile_rows=args.tile_rows, fwd_launch_ms=f[0], bwd_launch_ms=b[0], underfill_tiles=0.0,
        # the model has one per-row figure for both directions: their mean (forward and backward
        # fits each carry their own launch and pair terms)
        stage_row_ms=float(np.mean([f[3], b[3]])), merge_fwd_ms_per_row=merge_f, merge_bwd_ms_per_row=merge_b,
        kv_bytes_per_row=float(kv_bytes), dkv_bytes_per_row=float(kv_bytes), bwd_refetch=False, layers=1)
    if comm is not None:
        cX = np.array([[1.0, b] for b, _ in comm["points"]])
        cy = np.array([t for _, t in comm["points"]])
        lat, per_byte = nnls(cX, cy, 1 / cy)
        fields.update(comm_latency_ms=lat, comm_ms_per_byte=per_byte, overlap=comm["overlap"])
    else:
        fields.update(comm_latency_ms=base.comm_latency_ms, comm_ms_per_byte=base.comm_ms_per_byte, overlap=base.overlap)
    fields = {k: (float(v) if isinstance(v, (np.floating, float)) else v) for k, v in fields.items()}
    meta = dict(clock="process CPU time (compute), wall (all-to-all)" if device.type == "cpu" else "wall",
                date=datetime.datetime.now().isoformat(timespec="seconds"), host=platform.node(),
                machine=platform.machine(), processor=platform.processor() or platform.machine(),
                torch=torch.__version__, threads=args.threads, device=args.device, backend=args.backend,
                load_average=[load0, os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")],
                shape=dict(q_heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, dtype="float32",
                           hidden=args.heads * args.head_dim, ffn=4 * args.heads * args.head_dim),
                measurements=dict(attention=att, merge=mer, token_local=tok,
                                  comm=None if comm is None else comm["points"]))
    cm = CostModel(**fields, meta=meta)

    # ---------------------------------------------------------------- predicted vs measured
    print("\npredicted vs measured (ms):")
    errs = []

    def row(label, meas, pred):
        err = (pred - meas) / meas * 100
        errs.append(abs(err))
        print(f"  {label:44s} measured {meas:9.3f}  predicted {pred:9.3f}  error {err:+6.1f}%")

    for m in att:
        for direction in ("fwd", "bwd"):
            p = float(cm.stage_ms(m["full"], m["part"], m["nq"], m["nk"], backward=direction == "bwd"))
            row(f"{m['kind']} {direction} nq={m['nq']} nk={m['nk']}", m[direction], p)
    for m in mer:
        row(f"merge fwd rows={m['rows']}", m["fwd"], cm.merge_fwd_ms_per_row * m["rows"])
        row(f"merge bwd rows={m['rows']}", m["bwd"], cm.merge_bwd_ms_per_row * m["rows"])
    for m in tok:
        row(f"token-local fwd rows={m['rows']}", m["fwd"], cm.tok_fwd_ms_per_row * m["rows"])
        row(f"token-local bwd rows={m['rows']}", m["bwd"], cm.tok_bwd_ms_per_row * m["rows"])
    if comm is not None:
        for b, t in comm["points"]:
            row(f"all_to_all {b / 1024:.0f} KiB", t, float(cm.transfer_ms(b)))
    meta["median_abs_error_pct"] = float(np.median(errs))
    meta["max_abs_error_pct"] = float(np.max(errs))
    cm.to_json(args.out)
    print(f"\nmedian |error| {np.median(errs):.1f}%, max {np.max(errs):.1f}%  "
          f"({len(errs)} stages, {time.perf_counter() - t0:.0f} s)")
    print("fitted:", {k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in fields.items() if k != "name"})
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
