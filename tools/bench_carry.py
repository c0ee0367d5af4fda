"""Carry vs split packing vs the unlimited budget: rows computed per step, microbatches, carried rows.

    python tools/bench_carry.py            # GRPO (4 x 8,192-token prompt + 16 x ~2K) and agent_multiturn
    python tools/bench_carry.py --time     # + step time of a tiny model on CPU: split vs carry (fill + restore)
                                           #   vs carry with kept graphs (one forward) vs unlimited
    python tools/bench_carry.py --dp       # + carry over DP 1/2/4/8 (groups cut over ranks): predicted step time,
                                           #   slowest rank vs mean, against split packing (`plan --carry --dp`)

Workloads: the issue's GRPO batch (4 groups, an 8,192-token prompt and 16 completions of 2,048 +- 256
tokens) and the ``agent_multiturn`` preset; budgets 8K / 16K / 32K. One run, side by side; the
planning time is the host time of ``pack(..., carry=True)``.
"""
from __future__ import annotations

import time

import numpy as np

from megatron_tree.data.synthetic import make_preset
from megatron_tree.tree import pack, summarize
from megatron_tree.tree.carry import carry_summary


def grpo(seed: int = 0, groups: int = 4, prompt: int = 8192, completions: int = 16, vocab: int = 32000):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(groups):
        p = rng.integers(1, vocab, prompt)
        for _ in range(completions):
            n = int(np.clip(rng.normal(2048, 256), 1024, 3072))
            out.append(np.concatenate([p, rng.integers(1, vocab, n)]))
    return out


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--time", action="store_true", help="also time one training step per packing (tiny model, CPU)")
    ap.add_argument("--dp", action="store_true", help="also predict carry over DP 1/2/4/8 against split packing")
    args = ap.parse_args()
    rows_table()
    if args.dp:
        dp_table()
        if args.time:
            print("\nDP 2 (gloo, CPU), grpo/8 (1024 + 16 x ~256) at 2,048: step time of the slower rank")
            print(f"{'workload':<20} {'packing':<13} {'rows':>8} {'mbs':>4} {'syncs':>5} {'step s':>7} {'x unl.':>6} "
                  f"{'loss':>9}")
            for name, res in dp2_times().items():
                unl = next(r["step_s"] for r in res if r["packing"] == "unlimited")
                for r in res:
                    print(f"{name:<20} {r['packing']:<13} {r['rows']:>8,} {r['microbatches']:>4} {r['syncs']:>5} "
                          f"{r['step_s']:>7.2f} {r['step_s'] / unl:>6.2f} {r['loss']:>9.6f}")
    if args.time:
        print(f"\n{'workload':<28} {'budget':>8} {'packing':>9} {'rows':>8} {'extra fw':>8} {'mbs':>4} {'step s':>7} "
              f"{'x unl.':>6} {'loss':>9} {'peak MiB':>9} {'predicted':>9}")
        res = step_times()
        unl = {r["workload"]: r["step_s"] for r in res if r["packing"] == "unlimited"}
        for r in res:
            if r.get("refused"):
                print(f"{r['workload']:<28} {r['budget']:>8} {r['packing']:>9}  refused: a sample is longer than the budget")
                continue
            print(f"{r['workload']:<28} {r['budget']:>8} {r['packing']:>9} {r['rows']:>8,} {r['extra']:>8,} "
                  f"{r['microbatches']:>4} {r['step_s']:>7.2f} {r['step_s'] / unl[r['workload']]:>6.2f} {r['loss']:>9.6f} "
                  f"{r['store'] / 2**20:>9.2f} {r['store_predicted'] / 2**20:>9.2f}")


def rows_table() -> None:
    for name, samples in (("grpo 4x(8192 + 16x~2K)", grpo()), ("agent_multiturn x8", make_preset("agent_multiturn", scale=8.0))):
        flat = sum(len(s.tokens) if hasattr(s, "tokens") else len(s) for s in samples)
        unlimited = summarize(pack(samples, 1 << 62))["tree_tokens"]
        print(f"\n{name}: {len(samples)} samples, {flat:,} flat tokens, unlimited budget {unlimited:,} rows "
              f"({flat / unlimited:.2f}x)")
        print(f"{'budget':>7} | {'split rows':>10} {'x':>5} {'mbs':>4} | {'carry rows':>10} {'x':>5} {'mbs':>4} "
              f"{'carried':>8} {'stored':>7} {'plan s':>6} | {'fills GiB':>9} {'peak GiB':>8} | {'extra fw':>8} "
              f"{'kept GiB':>8}")
        for budget in (8192, 16384, 32768):
            longest = max(len(s.tokens) if hasattr(s, "tokens") else len(s) for s in samples)
            sp = summarize(pack(samples, budget)) if longest <= budget else None
            t0 = time.perf_counter()
            mbs = pack(samples, budget, carry=True)
            dt = time.perf_counter() - t0
            c = carry_summary(mbs)
            real = c["rows_computed"] - sum(mb.stats.padding_tokens for mb in mbs)
            split = ("refused" if sp is None else f"{sp['tree_tokens']:>10,} {flat / sp['tree_tokens']:>5.2f} "
                     f"{sp['num_microbatches']:>4}")
            fills, peak = _store_gib(mbs)
            extra = sum(mb.owned_rows for mb in mbs if len(mb.carry.exported))
            print(f"{budget:>7} | {split:>21} | {real:>10,} {flat / real:>5.2f} {len(mbs):>4} "
                  f"{c['carried_rows']:>8,} {c['stored_rows']:>7,} {dt:>6.2f} | {fills:>9.2f} {peak:>8.2f} | "
                  f"{extra:>8,} {_kept_gib(mbs):>8.1f}")
    print(f"\nfills GiB: what the step's fills write into the carry store (all of it was held to the step's end before "
          f"the store had lifetimes); peak GiB: the most it holds with lifetimes, state plus gradient accumulators "
          f"(`carry_store_timeline`, one DP rank); both for {STORE_GEOMETRY}. extra fw: the rows the fills forward a "
          f"second time (0 where every exporter keeps its graph); kept GiB: the most the kept graphs hold at once when "
          f"every exporter keeps (`megatron.carry.kept_graph_bytes` of {KEPT_MODEL}): --tree-carry-memory at least this "
          f"keeps them all")


def dp_table(memory_gib: float = 40.0) -> None:
    """Carry over DP ranks (`cp.planning.carry_ranks.plan_carry_ranks`, what ``plan --carry --dp`` prints) for the
    8B-class shape: per workload, budget and DP size the predicted step (ms, the `CarryWork` roofline at 400 TFLOP/s,
    50 GB/s), the slowest rank's busy time over the mean, the syncs, the budget chosen, and split packing's step;
    carry without kept graphs and with ``memory_gib`` of them per rank."""
    from types import SimpleNamespace

    import torch

    from megatron_tree.cp.planning.carry import CarryGeometry, choose_kept
    from megatron_tree.cp.planning.carry_ranks import CarryWork, plan_carry_ranks, split_step_ms
    from megatron_tree.megatron.carry import kept_graph_bytes

    work = CarryWork(CarryGeometry("*" * 32, kv=(8, 128), act_bytes=2), hidden=4096, layers=32)
    nbytes = kept_graph_bytes(SimpleNamespace(num_layers=32, hidden_size=4096, params_dtype=torch.bfloat16,
                                              tensor_model_parallel_size=1, padded_vocab_size=128256))
    keep = lambda rank: choose_kept(rank, nbytes, memory_gib * 2 ** 30, remote=True)
    print(f"\ncarry over DP ranks, predicted ({KEPT_MODEL}; kept graphs within {memory_gib:g} GiB per rank or none)")
    print(f"{'workload':<24} {'budget':>7} {'dp':>3} | {'split ms':>9} | {'carry ms':>9} {'max/mean':>8} {'syncs':>5} "
          f"{'cut at':>7} | {'kept ms':>9} {'max/mean':>8} {'syncs':>5} {'cut at':>7} {'extra fw':>8} | {'split/kept':>10}")
    for name, samples in (("grpo 4x(8192 + 16x~2K)", grpo()), ("agent_multiturn x8", make_preset("agent_multiturn", scale=8.0))):
        samples = [s if hasattr(s, "tokens") else _sample(s) for s in samples]
        for budget in (8192, 16384):
            longest = max(len(s.tokens) for s in samples)
            split_mbs = pack(samples, budget) if longest <= budget else None
            for dp in (1, 2, 4, 8):
                plans = [plan_carry_ranks(samples, budget, dp, work, choose_keep=k) for k in (None, keep)]
                split = split_step_ms(split_mbs, dp, work)["step_ms"] if split_mbs else float("nan")
                cells = []
                for p in plans:
                    busy = np.asarray(p.times["rank_ms"])
                    cells.append(f"{p.times['step_ms']:>9,.1f} {busy.max() / busy.mean():>8.2f} {len(p.schedule.syncs):>5} "
                                 f"{p.budget:>7}")
                kept = plans[1]
                extra = sum(kept.microbatches[i].owned_rows for r, x in enumerate(kept.schedule.items) for i, ph in x
                            if ph == "fill" and kept.microbatches[i].carry.index not in kept.keep[r])
                print(f"{name:<24} {budget:>7} {dp:>3} | {split:>9,.1f} | {cells[0]} | {cells[1]} {extra:>8,} | "
                      f"{split / kept.times['step_ms']:>10.2f}")


def _sample(tokens):
    from megatron_tree.tree import Sample

    return Sample(tokens=np.asarray(tokens), loss_mask=np.r_[False, np.ones(len(tokens) - 1, bool)])


#: A store geometry for the figures: 32 GQA attention layers (8 KV heads of 128), bf16 (an 8B-class model)
STORE_GEOMETRY = "32 attention layers, 8 KV heads x 128, bf16"


#: The model shape of the kept-graph figures (`kept_graph_bytes`: activations by the model's shape)
KEPT_MODEL = "32 layers, hidden 4096, bf16, 128K vocabulary, TP 1, every token a target"


def _kept_gib(mbs) -> float:
    """Peak over the schedule of the kept graphs' estimated bytes when every exporter keeps its graph."""
    from types import SimpleNamespace

    import torch

    from megatron_tree.cp.planning.carry import carry_phases
    from megatron_tree.megatron.carry import kept_graph_bytes

    nbytes = kept_graph_bytes(SimpleNamespace(num_layers=32, hidden_size=4096, params_dtype=torch.bfloat16,
                                              tensor_model_parallel_size=1, padded_vocab_size=128256))
    phases = carry_phases(mbs, keep=True)
    held = np.zeros(len(phases))
    start = {i: k for k, (i, p) in enumerate(phases) if p == "keep"}
    for k, (i, p) in enumerate(phases):
        if p == "release":
            held[start[i]: k + 1] += nbytes(mbs[i])
    return float(held.max(initial=0.0)) / 2 ** 30


def _store_gib(mbs) -> tuple:
    from megatron_tree.cp.planning.carry import CarryGeometry, carry_store_bytes, carry_store_timeline

    geom = CarryGeometry("*" * 32, kv=(8, 128), act_bytes=2)
    fills = sum(carry_store_bytes(mbs, geom))
    peak = max((a + b for a, b in carry_store_timeline(mbs, geom)), default=0)
    return fills / 2 ** 30, peak / 2 ** 30



# ------------------------------------------------------------------------------------------- step time
def _step_time_body(cases, repeats):
    """In one gloo rank: a tiny float32 model, one forward-backward step per packing, best of ``repeats``."""
    import time as _time

    import torch

    from megatron_tree.megatron.carry import carry_geometry, carry_items
    from megatron_tree.training.models import (ModelArgs, build_model, forward_backward, make_config,
                                               report_totals, wrap_ddp)
    from megatron_tree.training.megatron_init import init_megatron

    init_megatron(seed=0, kernels=True)
    out = []
    for name, pattern, samples, budgets in cases:
        margs = ModelArgs(kind="hybrid" if pattern else "gpt", num_layers=2, vocab_size=1024,
                          max_position=max(len(s) for s in samples) + 8)
        if pattern:
            margs.pattern = pattern
        config = make_config(margs, dtype=torch.float32)
        torch.manual_seed(0)
        ddp = wrap_ddp(build_model(config, margs), config)
        geom = carry_geometry(ddp.module)
        for budget, packing in budgets:
            if packing == "split" and max(len(x) for x in samples) > budget:
                out.append(dict(workload=name, budget=budget, packing="split", refused=True))
                continue
            keep = True if packing == "kept" else None  # kept graphs: every exporter forwards once
            if packing in ("carry", "kept"):
                mbs = pack(samples, budget, carry=True, pad_to_multiple_of=8)
                make = lambda: carry_items(mbs, keep=keep)  # noqa: E731
            else:
                mbs = pack(samples, budget, pad_to_multiple_of=8)
                make = lambda: mbs  # noqa: E731
            best, loss, store = float("inf"), None, 0
            for _ in range(repeats):
                ddp.zero_grad_buffer()
                items = make()
                t0 = _time.perf_counter()
                reports = forward_backward(ddp, items, loss_type="sft")
                best = min(best, _time.perf_counter() - t0)
                tot = report_totals(reports)
                loss = float(tot[0] / tot[1])
                if packing in ("carry", "kept"):  # the peak the store held (state + accumulators), item by item
                    store = max(b + a for _, b, a in items[0].store.history[1:]) if len(items) > 1 else 0
            from megatron_tree.cp.planning.carry import carry_store_timeline

            predicted = (max((b + a for b, a in carry_store_timeline(mbs, geom, keep=keep)[:-1]), default=0)
                         if packing in ("carry", "kept") else 0)
            rows = sum(getattr(m, "owned_rows", m.num_rows) for m in mbs)
            # the rows a fill forwards a second time (an exporter's, without a kept graph)
            extra = sum(m.owned_rows for m in mbs if packing == "carry" and m.carry is not None and len(m.carry.exported))
            out.append(dict(workload=name, budget=budget, packing=packing, rows=rows, microbatches=len(mbs),
                            step_s=best, loss=loss, store=store, store_predicted=predicted, extra=extra))
    return out


def _dp_time_body(samples, budget, repeats):
    """On each of two gloo ranks: the same tiny model, one step per packing over the two DP ranks; the step time is
    the slower rank's (best of ``repeats``). split / unlimited: microbatches balanced by rows with equal counts;
    carry: groups whole on a rank (--tree-carry-cut never), cut over both (auto, then every microbatch: always),
    with kept graphs."""
    import time as _time

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_tree.cp.planning.carry_ranks import rank_schedule
    from megatron_tree.data.sharding import balance
    from megatron_tree.megatron.carry import carry_items, carry_rank_items
    from megatron_tree.training.megatron_init import init_megatron
    from megatron_tree.training.models import (ModelArgs, build_model, forward_backward, make_config, report_totals,
                                               wrap_ddp)
    from megatron_tree.tree import padding_microbatch
    from megatron_tree.tree.carry import assign_carry_ranks
    from megatron_tree.tree.packing import PrefixPlan

    init_megatron(seed=0, kernels=True)
    rank, group = ps.get_data_parallel_rank(), ps.get_data_parallel_group()
    margs = ModelArgs(kind="gpt", num_layers=2, vocab_size=1024, max_position=max(len(s) for s in samples) + 8)
    config = make_config(margs, dtype=torch.float32)
    torch.manual_seed(0)
    ddp = wrap_ddp(build_model(config, margs), config)
    pad = padding_microbatch(budget, num_rows=8)
    out = []
    for packing in ("split", "carry never", "carry auto", "carry always", "kept auto", "unlimited"):
        if packing in ("split", "unlimited"):  # unlimited: every tree whole, one per microbatch at most
            largest = -(-int(PrefixPlan([np.asarray(s.tokens) for s in samples]).tree_rows().max()) // 8) * 8
            mbs = pack(samples, budget if packing == "split" else largest, pad_to_multiple_of=8)
            mine = balance([m.num_rows for m in mbs], 2)
            n = max(len(x) for x in mine)
            make = lambda: [mbs[i] for i in mine[rank]] + [pad] * (n - len(mine[rank]))  # noqa: E731
            rows = sum(m.num_rows for m in mbs)
            syncs = 0
        else:
            cut = packing.split()[1]
            mbs = pack(samples, budget, carry=True, pad_to_multiple_of=8)
            ranks = assign_carry_ranks(mbs, 2, cut=cut)
            schedule = rank_schedule(mbs, ranks)
            keep = {i for i in ranks[rank] if len(mbs[i].carry.exported)} if packing.startswith("kept") else None
            syncs = len(schedule.syncs)
            if schedule.syncs:
                make = lambda: carry_rank_items(mbs, schedule, rank, pad, group, keep=keep)  # noqa: E731
            else:  # each group on one rank: the same item count on both (padding microbatches)
                count = [sum(1 + (len(mbs[i].carry.exported) > 0) for i in r) for r in ranks]
                make = lambda: carry_items([mbs[i] for i in ranks[rank]] + [pad] * (max(count) - count[rank]),  # noqa: E731
                                           keep=keep)
            rows = sum(m.owned_rows for m in mbs)
        best, loss = float("inf"), None
        for _ in range(repeats):
            ddp.zero_grad_buffer()
            items = make()
            dist.barrier()
            t0 = _time.perf_counter()
            reports = forward_backward(ddp, items, loss_type="sft")
            t = torch.tensor([_time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            best = min(best, float(t))
            tot = report_totals(reports)
            tot = torch.zeros(2, dtype=torch.float64) if tot is None else tot.detach().to(torch.float64).clone()
            dist.all_reduce(tot)
            loss = float(tot[0] / tot[1])
        out.append(dict(packing=packing, rows=rows, microbatches=len(mbs), step_s=best, loss=loss, syncs=syncs))
    return out


def dp2_times(repeats: int = 2) -> dict:
    """GRPO/8 (1024 + 16 x ~256) at a 2,048 budget over two gloo DP ranks on CPU: four groups (each fits one rank's
    share) and one group (over a share: auto cuts it)."""
    from megatron_tree.training.launch import run_distributed

    out = {}
    for groups in (4, 1):
        small = grpo(prompt=1024, completions=16, groups=groups, vocab=1024)
        small = [_sample(s[: 1024 + (len(s) - 1024) // 8]) for s in small]
        out[f"grpo/8, {groups} group{'s' if groups > 1 else ''}"] = run_distributed(_dp_time_body, 2, small, 2048,
                                                                                     repeats, timeout=3600)[0]
    return out


def step_times(repeats: int = 2) -> list:
    """The step-time figures (a tiny model on CPU; the rows and ratios are what transfers)."""
    from megatron_tree.training.launch import run_distributed

    # vocabulary 1,024: a tiny model's step time is otherwise the output layer's (rows x 32K logits)
    small = grpo(prompt=1024, completions=16, groups=4, vocab=1024)
    small = [s[: 1024 + (len(s) - 1024) // 8] for s in small]  # completions of ~256
    path = [np.random.default_rng(1).integers(1, 1024, 32768)]
    cases = [("grpo/8 (1024 + 16 x ~256)", None, small,
              [(b, p) for b in (1024, 2048, 4096) for p in ("split", "carry", "kept")] + [(1 << 20, "unlimited")]),
             ("grpo/8 hybrid MG*-", "MG*-", small, [(2048, "split"), (2048, "carry"), (2048, "kept"),
                                                    (1 << 20, "unlimited")]),
             ("one 32,768-token path", None, path, [(4096, "carry"), (4096, "kept"), (32768, "unlimited")])]
    return run_distributed(_step_time_body, 1, cases, repeats, timeout=3600)[0]


if __name__ == "__main__":
    main()
