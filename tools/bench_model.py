"""One training step (forward+backward) of a tiny hybrid Megatron model: tree vs flat packing.

    .venv/bin/python tools/bench_model.py [--prompt 1024 --completions 16 --completion-len 100]
    .venv/bin/python tools/bench_model.py --model-family mla   # GPT with Multi-Latent Attention + MoE
    .venv/bin/python tools/bench_model.py --model-family mamba       # Megatron's MambaModel, pattern M*-E
    .venv/bin/python tools/bench_model.py --model-family qwen3next   # GPT + Gated DeltaNet (G*G*), MoE

Workload: a scaled-down fixed_5k_16x100 GRPO family (prompt 1024 + 16 x 100 by default). Same
model (TreeGPTModel, hybrid pattern with Mamba-2, GDN, attention, MLP and MoE layers), same weights,
same Megatron schedule (get_forward_backward_func), one process:

  tree  the family packed as one prefix tree;
  flat  per-sample packing (``pack(..., share_prefixes=False)``): every sample its own unbranched
        chain, several chains per microbatch, the ordinary causal computation.

The flat side runs our modules on chains rather than Megatron's stock modules: on chains they are
the same math (tests/test_megatron_gdn_mamba.py, tests/test_megatron_lm_hooks.py), and on CPU the
stock GDN/Mamba would run through slower torch stand-ins, which would flatter the tree. Reports
the speedup against the ideal (flat tokens / tree tokens). Times are the best of --repeats.
"""
from __future__ import annotations

import argparse
import json
import time


def best_step_seconds(margs, batches: dict, repeats: int) -> dict:
    """One model from ``margs`` (seed 0) in DDP; each of ``batches`` ({name: microbatches}) as a
    forward-backward step, interleaved ``repeats`` times; {name: best wall seconds}."""
    import torch
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_tree.training.models import build_model, forward_backward, make_config, wrap_ddp

    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    config = make_config(margs)
    ddp = wrap_ddp(build_model(config, margs), config)
    times: dict = {name: [] for name in batches}
    for _ in range(repeats):
        for name, mbs in batches.items():
            ddp.zero_grad_buffer()
            t0 = time.perf_counter()
            forward_backward(ddp, mbs)
            times[name].append(time.perf_counter() - t0)
    return {name: min(t) for name, t in times.items()}


def _body(a: dict) -> dict:
    import torch

    torch._dynamo.config.disable = True  # Megatron's jit_fuser would torch.compile on CPU

    from megatron_tree.data.synthetic import shared_prompt
    from megatron_tree.training.megatron_init import init_megatron
    from megatron_tree.training.models import ModelArgs
    from megatron_tree.tree import pack, summarize

    init_megatron(seed=0, kernels=True)
    samples = shared_prompt(a["prompt"], a["completions"], a["completion_len"], vocab=a["vocab"])
    budget = a["budget"]
    tree = pack(samples, budget, pad_to_multiple_of=8)
    flat = pack(samples, budget, pad_to_multiple_of=8, share_prefixes=False)
    margs = ModelArgs(kind="hybrid", pattern=a["pattern"], hidden_size=a["hidden"], num_attention_heads=4,
                      num_query_groups=2, ffn_hidden_size=2 * a["hidden"], vocab_size=a["vocab"],
                      max_position=budget)
    if a.get("model_family") == "mla":
        # DeepSeek-V3 structure at toy size: q/kv latents, YaRN, 4 layers (first dense, then MoE)
        h = a["hidden"]
        margs = ModelArgs(kind="mla", num_layers=4, hidden_size=h, num_attention_heads=4, ffn_hidden_size=2 * h,
                          vocab_size=a["vocab"], max_position=budget, num_experts=4, moe_ffn_hidden_size=h,
                          extra=dict(q_lora_rank=h // 2, kv_lora_rank=h // 2, qk_head_dim=h // 4,
                                     qk_pos_emb_head_dim=h // 8, v_head_dim=h // 4))
    if a.get("model_family") in ("mamba", "qwen3next"):
        # MambaModel (TreeMambaModel) with MambaModel's pattern; or Qwen3-Next's block (TreeGPTModel): GDN
        # layers with gated attention every --linear-attention-freq layers (Qwen3-Next: 4), every layer MoE
        # with a gated shared expert
        margs = ModelArgs(kind=a["model_family"], pattern=a["pattern"], num_layers=4, hidden_size=a["hidden"],
                          linear_attention_freq=a["linear_attention_freq"],
                          num_attention_heads=4, num_query_groups=2, ffn_hidden_size=2 * a["hidden"],
                          vocab_size=a["vocab"], max_position=budget,
                          num_experts=4 if a["model_family"] == "qwen3next" else None)
    best = best_step_seconds(margs, {"tree": tree, "flat": flat}, a["repeats"])
    st_t, st_f = summarize(tree), summarize(flat)
    ideal = st_f["tree_tokens"] / st_t["tree_tokens"]
    t_tree, t_flat = best["tree"], best["flat"]
    return {"flat_tokens": st_f["tree_tokens"], "tree_tokens": st_t["tree_tokens"],
            "microbatches_tree": len(tree), "microbatches_flat": len(flat), "tree_s": t_tree, "flat_s": t_flat,
            "speedup": t_flat / t_tree, "ideal": ideal, "fraction_of_ideal": t_flat / t_tree / ideal,
            "useful_tokens_per_s_tree": st_f["tree_tokens"] / t_tree,
            "useful_tokens_per_s_flat": st_f["tree_tokens"] / t_flat,
            # attention's own ideal: visible (query, key) pairs per-sample / on the tree (below the token
            # ratio when completions are long next to the prompt; bounds attention-dominated models)
            "attention_pair_ratio": st_t["attention_pair_ratio"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--completions", type=int, default=16)
    ap.add_argument("--completion-len", type=int, default=100)
    ap.add_argument("--pattern", default=None, help="hybrid (default MG*-*E) or mamba (default M*-E) layer pattern")
    ap.add_argument("--model-family", choices=["hybrid", "mla", "mamba", "qwen3next"], default="hybrid",
                    help="hybrid: our hybrid stack (--pattern); mla: GPT with Multi-Latent Attention (YaRN, MoE); "
                         "mamba: Megatron's MambaModel (--pattern); qwen3next: GPT with Gated DeltaNet layers")
    ap.add_argument("--linear-attention-freq", type=int, default=4,
                    help="qwen3next: one attention layer every N of its 4 layers (Qwen3-Next: 4)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.pattern is None:
        args.pattern = "M*-E" if args.model_family == "mamba" else "MG*-*E"
    from megatron_tree.training.launch import run_distributed

    (r,) = run_distributed(_body, 1, vars(args), timeout=1800)
    model = f"{args.model_family} '{args.pattern}'" if args.model_family in ("hybrid", "mamba") else args.model_family
    if args.model_family == "qwen3next":
        model += f" (4 layers, attention every {args.linear_attention_freq})"
    print(f"{model}, hidden {args.hidden}: prompt {args.prompt} + {args.completions} x {args.completion_len}")
    print(f"flat: {r['flat_tokens']} rows in {r['microbatches_flat']} microbatches, {r['flat_s']:.3f} s/step "
          f"({r['useful_tokens_per_s_flat']:.0f} useful tok/s)")
    print(f"tree: {r['tree_tokens']} rows in {r['microbatches_tree']} microbatches, {r['tree_s']:.3f} s/step "
          f"({r['useful_tokens_per_s_tree']:.0f} useful tok/s)")
    print(f"speedup {r['speedup']:.2f}x, ideal {r['ideal']:.2f}x, fraction of ideal {r['fraction_of_ideal']:.0%}")
    print(f"(attention pairs per-sample / tree: {r['attention_pair_ratio']:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
