"""Multi-token prediction on trees: step time tree vs flat with MTP on, and the bytes MTP adds under tree CP.

    .venv/bin/python tools/bench_mtp.py [--prompt 1024 --completions 16 --completion-len 100 --mtp 0,1,2]
    .venv-latest/bin/python tools/bench_mtp.py --model dsa    # DSA in decoder and MTP layers (core >= 0.19)

Workload: one GRPO family (a prompt and --completions sampled completions; loss on the completions),
a GPT model (TreeGPTModel, 4 layers; ``--model dsa``: MLA layers with DeepSeek sparse attention;
``--model mamba``: TreeMambaModel, MTP depths of an attention and an MLP layer) with K MTP layers, one
process, Megatron's schedule (forward + backward of the whole family). Where the model needs them (DSA:
`megatron.mtp.mtp_tail_rows`), both packings carry K MTP tail rows per sample (``pack(..., mtp_tail=K)``:
the positions stock's MTP indexer loss covers), counted in the rows printed per K:

  tree  the family packed as one prefix tree (every MTP depth runs on the same rows);
  flat  per-sample packing (``share_prefixes=False``): every sample its own chain, several per microbatch.

Reports the best of --repeats step times, the speedup and the ideal (flat rows / tree rows). Under
tree CP (``--cp``, host-side only, no run): each depth's cross-rank ``path_prev`` halo rows under the
planner's plan (`mtp_cp_figures`), in bytes (forward row + backward gradient, hidden x dtype size), next
to the attention layers' KV traffic of the same plan (`cp.schedule_figures`: remote K/V rows per layer).
"""
from __future__ import annotations

import argparse
import json


def _family(a):
    from megatron_tree.data.synthetic import shared_prompt

    return shared_prompt(a["prompt"], a["completions"], a["completion_len"], vocab=a["vocab"])


def _body(a: dict) -> dict:
    import torch

    torch._dynamo.config.disable = True  # Megatron's jit_fuser would torch.compile on CPU
    from bench_model import best_step_seconds  # tools/, this script's directory

    from megatron_tree.megatron.mtp import mtp_tail_rows
    from megatron_tree.training.megatron_init import init_megatron
    from megatron_tree.training.models import ModelArgs, make_config
    from megatron_tree.tree import pack, summarize

    init_megatron(seed=0, kernels=a["model"] == "mamba")  # Mamba's gated norm / scans: torch stand-ins on CPU
    if a["model"] == "dsa":
        from megatron_tree.cpu import dsa as cpu_dsa

        cpu_dsa.enable()  # torch Hadamard stand-in for the indexer on CPU
    samples = _family(a)
    out = {"runs": {}}
    for k in a["mtp"]:
        margs = ModelArgs(kind=a["model"], num_layers=4, hidden_size=a["hidden"], num_attention_heads=4,
                          num_query_groups=2, ffn_hidden_size=2 * a["hidden"], vocab_size=a["vocab"],
                          max_position=a["budget"], extra=dict(mtp_num_layers=k) if k else {})
        tail = mtp_tail_rows(make_config(margs))
        tree = pack(samples, a["budget"], pad_to_multiple_of=8, mtp_tail=tail)
        flat = pack(samples, a["budget"], pad_to_multiple_of=8, share_prefixes=False, mtp_tail=tail)
        rows_t, rows_f = summarize(tree)["tree_tokens"], summarize(flat)["tree_tokens"]
        best = best_step_seconds(margs, {"tree": tree, "flat": flat}, a["repeats"])
        t, f = best["tree"], best["flat"]
        out["runs"][k] = {"mtp_tail": tail, "tree_rows": rows_t, "flat_rows": rows_f, "ideal": rows_f / rows_t,
                          "tree_s": t, "flat_s": f, "speedup": f / t, "fraction_of_ideal": f / t / (rows_f / rows_t)}
    return out


def cp_bytes(a: dict, tail: int) -> list:
    """Per CP size: MTP halo rows / bytes per microbatch vs the attention KV rows of the same plan."""
    from megatron_tree.cp import plan_context_parallel, schedule_figures
    from megatron_tree.megatron.mtp import mtp_cp_figures
    from megatron_tree.tree import pack

    mb = max(pack(_family(a), a["budget"], pad_to_multiple_of=8, mtp_tail=tail), key=lambda m: m.layout.num_rows)
    row_bytes = a["hidden"] * 2  # bf16 hidden state
    out = []
    for cp in a["cp"]:
        plan = plan_context_parallel(mb.layout, cp)
        fig = mtp_cp_figures(plan, mb.layout, max(a["mtp"]), row_bytes)
        kv = int(schedule_figures(plan)["remote_rows"].sum())
        out.append({"cp": cp, "rows": mb.layout.num_rows, "mtp_halo_rows_per_depth": fig["halo_rows"],
                    "mtp_bytes": fig["bytes"], "attention_kv_rows_per_layer": kv})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["gpt", "dsa", "mamba"], default="gpt",
                    help="dsa / mamba need megatron-core >= 0.19 (mamba: the default Mamba pattern, MTP depths '*-')")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--completions", type=int, default=16)
    ap.add_argument("--completion-len", type=int, default=100)
    ap.add_argument("--mtp", default="0,1,2", help="MTP depth counts to time (0: no MTP)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cp", default="2,4,8", help="CP sizes for the halo figures (host-side)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    a = dict(vars(args), mtp=[int(x) for x in args.mtp.split(",")], cp=[int(x) for x in args.cp.split(",")])
    from megatron_tree.training.launch import run_distributed

    (r,) = run_distributed(_body, 1, a, timeout=3600)
    print(f"{args.model.upper()} 4 layers, hidden {args.hidden}: prompt {args.prompt} + {args.completions} x "
          f"{args.completion_len}")
    for k, x in r["runs"].items():
        print(f"  MTP K={k}: flat {x['flat_rows']} rows -> tree {x['tree_rows']} rows (ideal {x['ideal']:.2f}x); "
              f"flat {x['flat_s']:.3f} s, tree {x['tree_s']:.3f} s, speedup {x['speedup']:.2f}x "
              f"({x['fraction_of_ideal']:.0%} of ideal)")
    r["cp"] = cp_bytes(a, max(x["mtp_tail"] for x in r["runs"].values()))  # tail rows are rows of the plan too
    for c in r["cp"]:
        print(f"  CP {c['cp']}: MTP halo rows per depth {c['mtp_halo_rows_per_depth']} -> {c['mtp_bytes']} bytes "
              f"(fwd+bwd, bf16, hidden {args.hidden}) per microbatch of {c['rows']} rows; attention fetches "
              f"{c['attention_kv_rows_per_layer']} remote K/V rows per layer")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
