"""``megatron-tree verify`` with the objectives that are not plain token-level losses: ``--loss-agg`` (each
sample's exact factor over the batch), ``--loss gspo`` (each sample's sequence ratio from a forward-only
stats pass, then the graded pass) and ``--loss dpo / ipo / simpo`` (each sample's summed log-prob, then each
preference pair's factors), tree training against per-sample training in float64, each with its planted fault:
factors taken per microbatch; a sample's statistic taken from one microbatch only; the wrong pair partner."""
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


def test_verify_preference_pairs_against_per_sample_training_and_their_planted_faults():
    """``--loss dpo / ipo / simpo``: both sides run the pair losses' two passes (each sample's summed log-prob over
    DP x CP, then each pair's factors); DP 2 under carry at 16 rows (pairs cut over microbatches and ranks), CP 2,
    a hybrid ``MG*E`` stack under PP 2 with Adam steps; faults: a chosen sample paired with another pair's
    rejected one, a sample's sum taken from one microbatch."""
    from megatron_tree.training.verify import VerifyConfig, run_verify_many

    cfgs = [VerifyConfig(model="gpt", loss="dpo", dp=2, carry=True, budget=16),
            VerifyConfig(model="gpt", loss="simpo", cp=2),
            VerifyConfig(model="hybrid", pattern="MG*E", loss="ipo", pp=2, steps=2),
            VerifyConfig(model="gpt", loss="dpo", dp=2, fault="wrong_partner"),
            VerifyConfig(model="gpt", loss="dpo", dp=2, carry=True, budget=16, fault="gspo_one_microbatch")]
    *good, partner, one_mb = run_verify_many(cfgs)
    for cfg, out in zip(cfgs, good):
        assert out["passed"], (cfg, out)
    assert not partner["passed"] and not one_mb["passed"], (partner, one_mb)


def test_verify_value_reward_and_distillation_against_per_sample_training_and_their_planted_faults():
    """``--loss value / rm / distill``: both sides a value model (the scalar head, PPO's clipped value loss against
    per-token returns), a reward model (Bradley-Terry over the pairs, each sample's reward at its last row from the
    stats pass) or a student (forward KL to a random teacher's top-4 per token, the log-probs at its ids
    vocab-parallel): the value model under carry at 16 rows over DP 2 and on a hybrid ``MG*-*E`` stack under PP 2,
    the reward model under CP 2, distillation under TP 2 + SP; faults: every occurrence's return / teacher read at
    the next position, a chosen sample paired with another pair's rejected one."""
    from megatron_tree.training.verify import VerifyConfig, run_verify_many

    cfgs = [VerifyConfig(model="gpt", loss="value", dp=2, carry=True, budget=16),
            VerifyConfig(model="hybrid", pattern="MG*-*E", loss="value", pp=2),
            VerifyConfig(model="gpt", loss="rm", cp=2),
            VerifyConfig(model="gpt", loss="distill", tp=2, sp=True),
            VerifyConfig(model="gpt", loss="value", dp=2, fault="field_shift"),
            VerifyConfig(model="gpt", loss="distill", dp=2, fault="field_shift"),
            VerifyConfig(model="gpt", loss="rm", dp=2, fault="wrong_partner")]
    *good, value_shift, teacher_shift, partner = run_verify_many(cfgs)
    for cfg, out in zip(cfgs, good):
        assert out["passed"] and out["grads"] <= 1e-12, (cfg, out)
    for out in (value_shift, teacher_shift, partner):
        assert not out["passed"] and out["grads"] > 1e-3, out
