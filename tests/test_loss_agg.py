"""`tree.loss_agg`: the loss aggregations RL frameworks name, as exact per-sample weights, and the data
pipeline (`train`, the Megatron-LM hooks) applying them to each step's window."""
from __future__ import annotations

import numpy as np
import pytest

def test_loss_agg_factors_are_exact_weights():
    """`tree.loss_agg`: factors f_i with sum_i f_i sum_t l_it / N equal to each aggregation's definition."""
    from megatron_tree.tree.loss_agg import loss_agg_factors

    rng = np.random.default_rng(0)
    counts = np.array([3, 0, 5, 1, 7])
    losses = [rng.normal(size=c) for c in counts]
    N, B = counts.sum(), 4
    expect = {"token-mean": sum(x.sum() for x in losses) / N,
              "seq-mean-token-sum": sum(x.sum() for x in losses) / B,
              "seq-mean-token-mean": sum(x.mean() for x in losses if len(x)) / B,
              "seq-mean-token-sum-norm": sum(x.sum() for x in losses) / (B * 7)}
    for mode, want in expect.items():
        f = loss_agg_factors(counts, mode)
        got = sum(fi * x.sum() for fi, x in zip(f, losses)) / N
        assert abs(got - want) < 1e-12, (mode, got, want)
    with pytest.raises(ValueError, match="loss_agg must be one of"):
        loss_agg_factors(counts, "sum")


@pytest.mark.parametrize("carry", [False, True])
def test_pipeline_weights_every_occurrence_by_its_samples_factor_over_the_window(carry):
    """`TreeDataPipeline(loss_agg=...)`: across both DP ranks' microbatches of a step (carry cutting samples
    longer than the budget too), every loss occurrence of sample i carries f_i x its own weight, f_i computed
    over the step's whole window; token-mean leaves the weights as they are."""
    from megatron_tree.data.pipeline import TreeDataPipeline
    from megatron_tree.tree import Sample

    rng = np.random.default_rng(3)
    prompt = rng.integers(1, 50, 6).tolist()
    samples = [Sample(tokens=prompt + rng.integers(1, 50, int(k)).tolist(),
                      loss_mask=[False] * 6 + [True] * int(k), weight=float(w))
               for k, w in zip((4, 9, 2, 20, 7, 3), (1.0, 0.5, 2.0, 1.0, 1.5, 1.0))]
    window = len(samples)
    for mode, norm in (("token-mean", None), ("seq-mean-token-sum", None), ("seq-mean-token-mean", None),
                       ("seq-mean-token-sum-norm", 40.0)):
        got = {}
        for rank in (0, 1):
            pipe = TreeDataPipeline(samples, max_tokens_per_mb=16 if carry else 32, global_batch_samples=window,
                                    dp_rank=rank,
                                    dp_size=2, shuffle=False, carry=carry, loss_agg=mode, loss_agg_norm=norm)
            step = next(iter(pipe))
            for mb in step.microbatches:
                lm = mb.loss_map
                for sid, w in zip(lm.sample_index.tolist(), lm.weights.tolist()):
                    got.setdefault(sid, []).append(w)
        counts = np.array([int(s.target_mask().sum()) for s in samples])
        N, B = counts.sum(), len(samples)
        f = {"token-mean": np.ones(B), "seq-mean-token-sum": np.full(B, N / B),
             "seq-mean-token-mean": N / (B * counts), "seq-mean-token-sum-norm": np.full(B, N / (B * 40.0))}[mode]
        assert sorted(got) == list(range(B)) and all(len(got[i]) == counts[i] for i in range(B)), mode
        for i, s in enumerate(samples):
            assert np.allclose(got[i], f[i] * s.weight, rtol=1e-14, atol=0), (mode, i, got[i][:3], f[i] * s.weight)


def test_bad_loss_agg_is_refused_up_front():
    from megatron_tree.data.pipeline import TreeDataPipeline
    from megatron_tree.tree import Sample

    with pytest.raises(ValueError, match="loss_agg must be one of"):
        TreeDataPipeline([Sample(tokens=[1, 2, 3])], max_tokens_per_mb=8, global_batch_samples=1, loss_agg="mean")

