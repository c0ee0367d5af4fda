"""``megatron-tree verify`` with the objectives that are not plain token-level losses: ``--loss-agg`` (each
sample's exact factor over the batch) and ``--loss gspo`` (each sample's sequence ratio from a forward-only
stats pass, then the graded pass), tree training against per-sample training in float64, each with its
planted fault: factors taken per microbatch; a sample's GSPO statistic taken from one microbatch only."""
from __future__ import annotations


def test_verify_loss_agg_and_gspo_against_per_sample_training_and_their_planted_faults():
    from megatron_tree.training.verify import VerifyConfig, run_verify_many

    cfgs = [VerifyConfig(model="gpt", loss="grpo", dp=2, loss_agg="seq-mean-token-mean"),
            VerifyConfig(model="gpt", loss="sft", dp=2, carry=True, budget=16, loss_agg="seq-mean-token-sum-norm",
                         loss_agg_norm=40.0),
            VerifyConfig(model="gpt", loss="gspo", dp=2, carry=True, budget=16),
            VerifyConfig(model="gpt", loss="gspo", cp=2, loss_agg="seq-mean-token-mean"),
            VerifyConfig(model="gpt", loss="grpo", dp=2, loss_agg="seq-mean-token-mean",
                         fault="loss_agg_per_microbatch"),
            VerifyConfig(model="gpt", loss="gspo", dp=2, carry=True, budget=16, fault="gspo_one_microbatch")]
    *good, agg_fault, gspo_fault = run_verify_many(cfgs)
    for cfg, out in zip(cfgs, good):
        assert out["passed"], (cfg, out)
    assert not agg_fault["passed"] and not gspo_fault["passed"], (agg_fault, gspo_fault)
