"""Shared pieces of the tests that compare a tree model with stock Megatron run on each sample alone."""
from __future__ import annotations

import torch

# Megatron 0.16.1's top-k router takes the softmax of the selected scores in float32 whatever
# moe_router_dtype says (``torch.softmax(scores, dtype=torch.float32).type_as(logits)`` in
# moe_utils.topk_routing_with_score_function). The forward rounds identically per token, so the
# log-probs still agree to 1e-15, but the backward casts the incoming gradient to fp32: a shared
# tree row receives the sum of its samples' gradients, rounded once, the per-sample runs round each
# one. Measured: at most 1e-6 absolute on gradients up to 48 (2e-8 relative); 2e-15 when that
# softmax is made float64. A wrong tree computation moves them by O(0.1).
MOE_GRAD = dict(rtol=1e-6, atol=1e-5)

# Token lists that really branch: forks at several depths, a prefix sample, three trees, a duplicate.
SAMPLES = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14],
    [1, 2, 3, 4, 5, 9, 9, 9, 9, 9, 8, 7],  # fork at depth 5
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 20, 21, 22, 23],  # fork at depth 9
    [1, 2, 3, 4, 5, 6, 7],  # prefix of sample 0
    [1, 30, 31, 32],  # fork at depth 1
    [3, 3, 3, 1, 2, 5, 6, 7, 8, 9, 10],  # second tree
    [3, 3, 3, 1, 2, 5, 40, 41, 42, 43],  # fork at depth 6 of the second tree
    [50, 51],  # third tree
    [1, 2, 3, 4, 5, 9, 9, 9, 9, 9, 8, 7],  # duplicate of sample 1
]


def coef(i: int, t: int) -> float:
    """Weight of occurrence (sample i, position t) in the summed loss (distinct, so grads see which)."""
    return 0.5 + ((3 * i + 7 * t) % 11) / 10.0


@torch.no_grad()
def randomize(model, seed: int) -> None:
    """O(1) weights, so that every path of the computation matters (Megatron's init makes attention
    almost uniform and sinks ~0): norms 1 + 0.3 r, sinks r, Mamba's decay / step / skip parameters
    0.5 r (their working range), everything else r / sqrt(fan-in)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        r = torch.randn(p.shape, generator=gen, dtype=torch.float64)
        if "norm" in name:
            val = 1.0 + 0.3 * r
        elif name.endswith("softmax_offset"):
            val = r
        elif name.endswith(("A_log", "dt_bias", "D")):
            val = 0.5 * r
        else:
            val = r / max(p.shape[-1], 1) ** 0.5
        p.copy_(val.to(p.dtype))


def stock_logprobs(stock, samples, targets=None) -> dict:
    """{(i, t): log_softmax(stock logits of sample i alone)[t-1, tokens[t]]} for t in ``targets[i]``
    (default: every t >= 1)."""
    out = {}
    for i, toks in enumerate(samples):
        x = torch.as_tensor(toks, dtype=torch.long)
        logits = stock(x[None], torch.arange(len(x))[None], None)  # [1, L, V]: stock causal attention
        lp = torch.log_softmax(logits[0].double(), dim=-1)
        for t in (range(1, len(toks)) if targets is None else targets[i]):
            out[(i, t)] = lp[t - 1, toks[t]]
    return out


def tree_logprobs(tree, mbs) -> dict:
    """{(sample, position): per-occurrence log-prob} of the tree model over packed microbatches."""
    from megatron_tree.megatron.packed_seq import tree_packed_seq_params

    out = {}
    for mb in mbs:
        psp = tree_packed_seq_params(mb)
        lay, lm = psp.layout, psp.loss_map
        lp = tree(lay.input_ids[None], lay.position_ids[None], None, packed_seq_params=psp)
        assert lp.shape == (len(lm),)
        for e, (i, t) in enumerate(zip(lm.sample_index.tolist(), lm.positions.tolist())):
            assert (i, t) not in out
            out[(i, t)] = lp[e]
    return out
