"""Benchmark of tree DSA (torch reference path) vs per-sample stock Megatron DSA on CPU.

One GRPO family (default: prompt 4096 + 8 responses x 512, topk 256), float32, small head counts.

* tree: `ops.dsa.tree_dsa` over the packed family: blockwise indexer top-k over visible keys,
  sparse attention over the selected rows, the dense indexer KL loss (row-weighted), then backward
  of (o * g).sum() + loss.
* per-sample stock: for each sample alone (prompt + its response, the same numbers gathered):
  the stock indexer's dense index scores (`DSAIndexer._compute_index_scores`) + causal mask,
  `topk`, `unfused_dsa_fn`, `compute_dsa_indexer_loss`, then the same backward.

Prints the fwd+bwd time of each (minimum over ``--repeats``, runs alternate; the machine may be
shared), the time ratio (per-sample / tree) and the token ratio (per-sample tokens / tree tokens),
and a sanity check that the two agree (summed loss, outputs at the sample rows).

    PYTHONPATH=. .venv/bin/python tools/bench_dsa.py [--quick] [--prompt 4096 --responses 8 ...]
"""
from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import torch

from megatron_tree.ops.dsa import tree_dsa
from megatron_tree.tree.layout import TreeLayout


def _stock():
    from megatron.core.transformer.experimental_attention_variant import dsa as stock

    try:  # megatron-core >= 0.19 writes the KL term with a log-softmax (ops.dsa.KL_FORMS)
        import megatron.core.transformer.experimental_attention_variant.dsa_indexer_loss  # noqa: F401
        form = "log_softmax"
    except ImportError:
        form = "eps"
    return stock, form


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--responses", type=int, default=8)
    ap.add_argument("--response-len", type=int, default=512)
    ap.add_argument("--topk", type=int, default=256)
    ap.add_argument("--heads", type=int, default=2, help="main attention heads (key/value heads alike, as MLA)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--v-dim", type=int, default=64)
    ap.add_argument("--index-heads", type=int, default=2)
    ap.add_argument("--index-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--sparse-loss", action="store_true")
    ap.add_argument("--key-bias", type=float, default=0.0,
                    help="add bias * U(0,1) per key to index_k (with non-negative index_q, weights): a per-key "
                         "importance, so that neighbouring queries select overlapping keys as a trained indexer "
                         "does (0: independent random selections)")
    ap.add_argument("--quick", action="store_true", help="prompt 512 + 4 x 128, topk 64")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompt, args.responses, args.response_len, args.topk = 512, 4, 128, 64
    if args.threads:
        torch.set_num_threads(args.threads)
    stock, kl_form = _stock()
    torch.manual_seed(0)

    layout = TreeLayout.from_segments([args.prompt] + [args.response_len] * args.responses,
                                      [-1] + [0] * args.responses)
    n = layout.num_rows
    off = layout.segment_offsets.tolist()
    samples = [torch.cat([torch.arange(off[0], off[1]), torch.arange(off[s], off[s + 1])])
               for s in range(1, layout.num_segments)]
    h, d, dv, hi, di = args.heads, args.head_dim, args.v_dim, args.index_heads, args.index_dim
    scale = d ** -0.5
    coeff = 1.0
    data = dict(query=torch.randn(n, h, d), key=torch.randn(n, h, d), value=torch.randn(n, h, dv),
                index_q=torch.randn(n, hi, di), weights=torch.randn(n, hi) * hi ** -0.5 * di ** -0.5,
                index_k=torch.randn(n, di))
    if args.key_bias:
        data["index_q"], data["weights"] = data["index_q"].abs(), data["weights"].abs()
        data["index_k"] += args.key_bias * torch.rand(n, 1)
    go = torch.randn(n, h, dv)
    rw = torch.zeros(n)
    for rows in samples:
        rw[rows] += coeff / rows.shape[0]
    count = torch.zeros(n)
    for rows in samples:
        count[rows] += 1
    pg = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))

    def tree_step():
        t = {k_: v_.clone().requires_grad_(True) for k_, v_ in data.items()}
        o, ids, loss = tree_dsa(t["query"], t["key"], t["value"], t["index_q"], t["weights"], t["index_k"], layout,
                                topk=args.topk, softmax_scale=scale, loss_row_weight=rw,
                                sparse_loss=args.sparse_loss, kl_form=kl_form, block_size=args.block_size)
        ((o * go * count[:, None, None]).sum() + loss).backward()
        return o.detach(), loss.item()

    # per-sample inputs are gathered once, outside the timed region (per-sample training owns them)
    per_sample = [{k_: v_[rows].clone() for k_, v_ in data.items()} for rows in samples]

    def flat_step():
        outs, total = [], 0.0
        for rows, x in zip(samples, per_sample):
            t = {k_: v_.clone().requires_grad_(True) for k_, v_ in x.items()}
            sq = rows.shape[0]
            causal = torch.triu(torch.full((sq, sq), float("-inf")), diagonal=1)
            # the stock indexer's scoring (its module method uses no module state)
            s = stock.DSAIndexer._compute_index_scores(None, t["index_q"][:, None], t["weights"][:, None],
                                                       t["index_k"][:, None]) + causal
            # the tree's tie rule (score desc, position asc): a stable sort. Stock's `topk` breaks the
            # frequent exact ties (all relu terms 0) arbitrarily, which would make outputs differ.
            topk = torch.sort(-s.detach(), dim=-1, stable=True).indices[..., :min(args.topk, sq)]
            o = stock.unfused_dsa_fn(t["query"][:, None], t["key"][:, None], t["value"][:, None], topk, scale)
            loss = stock.compute_dsa_indexer_loss(s, topk, t["query"].detach()[:, None], t["key"].detach()[:, None],
                                                  scale, coeff, args.sparse_loss, pg)
            ((o.view(sq, h, dv) * go[rows]).sum() + loss).backward()
            outs.append(o.detach().view(sq, h, dv))
            total += loss.item()
        return outs, total

    def timed(fn):
        t0 = time.perf_counter()
        r = fn()
        return time.perf_counter() - t0, r

    t_tree, t_flat = [], []
    for _ in range(args.repeats):
        dt, (o_tree, loss_tree) = timed(tree_step)
        t_tree.append(dt)
        dt, (o_flat, loss_flat) = timed(flat_step)
        t_flat.append(dt)
    o_err = max((o_tree[rows] - of).abs().max().item() for rows, of in zip(samples, o_flat))
    tree_tokens, flat_tokens = n, sum(int(r.shape[0]) for r in samples)
    res = dict(prompt=args.prompt, responses=args.responses, response_len=args.response_len, topk=args.topk,
               heads=h, head_dim=d, index_heads=hi, index_dim=di, sparse_loss=args.sparse_loss, key_bias=args.key_bias,
               threads=torch.get_num_threads(), tree_s=round(min(t_tree), 3), per_sample_s=round(min(t_flat), 3),
               speedup=round(min(t_flat) / min(t_tree), 2), token_ratio=round(flat_tokens / tree_tokens, 3),
               loss_tree=loss_tree, loss_per_sample=loss_flat,
               loss_rel_diff=abs(loss_tree - loss_flat) / max(abs(loss_flat), 1e-30), max_abs_o_diff=o_err)
    print(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
