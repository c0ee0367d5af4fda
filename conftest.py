"""How ``pytest tests`` is collected and scheduled: the main tier (``make test``) and the latest tier
(``make test-latest``). The kernel tier (``tests_kernels/``, its own ``pytest.ini``) never loads this.

1. **A module's shared run happens once, the longest modules start first.** Many modules compute
   their results in one module-scoped fixture (a batch of ``verify`` configs on gloo ranks, a
   stock-oracle run: one Megatron import and one set of rank processes per batch) and then assert
   each case in its own test. Under ``pytest -n 2`` with per-test load balancing both workers
   executed tests of such a module, so both ran the whole batch. The Makefile runs ``--dist
   loadscope`` (a module goes to one worker; xdist's ``loadgroup`` would be finer, but with pytest
   9 it no longer tags node ids and groups nothing) with ``--no-loadscope-reorder``, and the items
   are ordered here: the modules of :data:`LONGEST_FIRST` (each one or more minutes of gloo ranks
   or Megatron-LM launches), then the rest in collection order, so that the two workers finish
   together instead of one of them starting a long module last.
2. **``--tier latest`` runs what depends on the Megatron-Core version.** The latest tier repeats the
   suite on the other supported stack (Python 3.12, megatron-core 0.19.x) to catch what changes
   with Megatron-Core: spec builders, shims, the hooks and ``pretrain()``, stock-model oracles,
   checkpoints, and one verify per model family and parallel flavour. It leaves out
   :data:`STACK_INDEPENDENT` modules (tree, ops, CP planning and CP executors on plain torch, data,
   scripts: no Megatron-Core code runs in them, so the main tier's run already decides them), the
   :data:`MAIN_TIER_ONLY` cases and the cases marked ``main_tier_only`` in their module (further
   permutations of a path the latest tier runs in another case). Each entry says why. Everything
   else, new test modules included, runs in both tiers.
"""
from __future__ import annotations

import fnmatch

import pytest

#: Test modules that run no Megatron-Core code: the latest tier would repeat them unchanged.
STACK_INDEPENDENT = {
    "test_backend_switch.py": "backend selection (ops)",
    "test_cli_data.py": "stats / data CLI, no model",
    "test_data_images.py": "image records through the readers (PIL, a test-double processor), no model",
    "test_tree_images.py": "image identity, multimodal positions and image slots of packing (numpy)",
    "test_cp_attention.py": "tree CP attention executor on plain torch",
    "test_cp_dsa.py": "tree CP DSA executor on plain torch",
    "test_cp_planner.py": "pure-numpy planner and its CLI report",
    "test_cp_gdn_layout.py": "pure-numpy GDN layout planner and the executor on plain torch",
    "test_data_pipeline.py": "readers, packing pipeline, resume state",
    "test_data_fuzz.py": "damaged JSONL / Parquet files against the readers (hypothesis)",
    "test_gpu_check.py": "the GPU check script's dry run",
    "test_layers.py": "import layering of our own package",
    "test_loss_agg.py": "loss-aggregation factors (numpy) and the data pipeline's weights",
    "test_no_orphans.py": "our launcher's processes (no Megatron-Core)",
    "test_ops_attention.py": "tree attention ops",
    "test_ops_conv.py": "tree causal conv op",
    "test_ops_gdn.py": "tree gated delta rule op",
    "test_ops_ssd.py": "tree SSD op",
    "test_slurm_scripts.py": "bash dry runs of the sbatch scripts",
    "test_tiers.py": "Makefile / CI wiring",
    "test_tree_pack.py": "packing and layout",
    "test_tree_routes.py": "route-aware packing, route columns of the readers, stats route report (numpy)",
}

#: node-id patterns (fnmatch) of cases the latest tier leaves out, with the case that covers their
#: Megatron-Core-dependent part there.
MAIN_TIER_ONLY = {
    "test_vlm_megatron.py::test_tree_vlm_tp2*": "the vision-language wrapper under TP2 + SP; the latest tier runs it "
                                                "through verify --model vlm --tp 2 --sp (test_megatron_verify)",
    "test_examples_rl.py::test_vlm_grpo*": "the rl API with images (our code above Megatron-Core); the latest tier "
                                           "runs the rl examples without images and the VLM through the Bridge",
    "test_carry_ranks.py::test_store_held*": "the store under DP cuts item by item; the latest tier runs cuts through "
                                             "pretrain() (test_launch_lm) and the rl API (test_rl)",
    "test_cp_gdn.py::test_halo_taps_follow_the_tree_path*": "plain-torch CP op; the module test runs in latest",
    "test_cp_gdn.py::test_plan_scan_delivers_every_entry_state*": "plain-torch CP op",
    "test_cp_gdn.py::test_forest_op*": "plain-torch forest op",
    "test_cp_gdn.py::test_summary*": "plain-torch summaries",
    "test_cp_gdn.py::test_cp_gdn_*_ranks*": "plain-torch CP op on gloo; module and verify CP cases run in latest",
    "test_cp_gdn.py::test_cost_figures_and_mode_choice": "cost model (numpy)",
    "test_cp_mamba.py::test_cp_mamba_*_ranks*": "plain-torch CP op; the mixer under CP2 runs in latest",
    "test_cp_mamba.py::test_head_shards": "index arithmetic",
    "test_cp_islands.py::test_redistribution_round_trip_and_gradient*": "plain-torch row all-to-all",
    # test_ops_dsa: the stock DSA oracle's signature and three of its cases run in latest
    "test_ops_dsa.py::test_tree_dsa_vs_per_sample_stock[[]case[124567][]]": "more stock-oracle cases",
    "test_ops_dsa.py::test_sensitivity*": "planted faults in our own DSA op (no stock code)",
    "test_ops_dsa.py::test_small_batches": "chunking of our own DSA op",
    "test_ops_dsa.py::test_head_group_all_reduce_matches_all_heads": "our op's head-group all-reduce",
    "test_ops_dsa.py::test_sparse_attention_*": "our sparse attention op",
    "test_ops_dsa.py::test_packed_float32_selection_equals_sorted": "our top-k rule",
    "test_ops_dsa.py::test_merge_topk_associative_commutative": "our top-k merge",
    "test_ops_dsa.py::test_topk_partial_split_equals_whole": "our top-k stages",
    "test_ops_dsa.py::test_staged_loss_equals_whole*": "our indexer loss stages",
    "test_ops_dsa.py::test_errors_name_the_rule": "our op's errors",
    "test_ops_dsa.py::test_empty_stages": "our op's empty stages",
    "test_ops_dsa.py::test_tree_topk_float32_exact_ties_vs_per_sample": "our top-k rule in float32",
    "test_ops_dsa.py::test_bfloat16_inputs_run_in_float32": "our op's dtype rule",
    "test_verify_bf16.py::*": "bf16 accuracy (our judge, Megatron's bf16 module casting); float64 verify of "
                               "every family runs in latest",
    "test_preemption.py::test_cli_sigterm_to_launcher_then_sigkill_of_the_job_resume_exactly":
        "megatron-tree train's CLI and launcher; the collective stop and the Megatron-LM preemption run in latest",
    "test_preemption.py::test_cli_signal_to_every_process_*": "megatron-tree train's CLI, launcher and forkserver",
    "test_preemption.py::test_a_rank_error_after_a_signal_*": "the launcher's error handling",
    "test_preemption.py::test_cli_a_rank_killed_mid_run_*": "megatron-tree train's launcher (in-place restart)",
    "test_preemption.py::test_a_non_finite_*": "megatron-tree train's step check",
    "test_tree_loss.py::test_[!m]*": "loss formulas on tensors; the Megatron loss function case runs in latest",
    "test_carry.py::*": "carry plan and executors against whole trees; the latest tier runs verify --carry (hybrid "
                        "MG*-*E) and pretrain() --tree-carry (test_launch_lm.py)",
    "test_checkpoint_faults.py::test_cli_real_full_filesystem*": "megatron-tree train's CLI on a real full disk; "
                                                                  "the injected ENOSPC runs in latest",
    "test_checkpoint_faults.py::test_killed_inside_the_save*": "our staging and marker (a killed process); the "
                                                              "ENOSPC cases exercise dist_checkpointing in latest",
    "test_checkpoint_faults.py::test_a_rank_failing_alone*": "our failure flag's own group and timeout",
    "test_checkpoint_faults.py::test_load_reads_only*": "our latest-marker check",
    "test_checkpoint_faults.py::test_the_launcher_carries*": "our launcher's exception transport",
    "test_trainer.py::test_dp2_hybrid_carry*": "megatron-tree train's carry items; verify --carry and pretrain() "
                                               "--tree-carry run in latest",
    "test_concurrent_runs.py::*": "our launcher's and the single-process runs' rendezvous (stores, not Megatron-Core); "
                                  "the Megatron-LM launches of the latest tier bind through torchrun's port-0 store",
    "test_verify_objectives.py::*": "verify's loss-agg weights, GSPO and pair-loss passes (ours); "
                                    "test_rl_objectives.py runs the same objectives against stock per rollout in latest",
    "test_trainer.py::test_dp2_gspo*": "megatron-tree train's GSPO passes; test_rl_objectives.py runs the trainer's "
                                       "two passes against stock per rollout in latest",
    "test_trainer.py::test_dp2_preference_pairs*": "megatron-tree train's pair-loss passes; test_rl_objectives.py "
                                                   "runs the trainer's two passes (trainer/dpo) against stock in latest",
    "test_trainer.py::test_dp2_value_reward*": "megatron-tree train's value / reward / distillation runs; "
                                               "test_rl_value.py and test_rl_distill.py run the trainer's path "
                                               "(trainer/*) against stock in latest",
    "test_rl_value.py::*": "the value head and its losses on the model's tree output (ours); test_rl.py and "
                           "test_rl_objectives.py run the rl API's Megatron-Core path against stock in latest",
    "test_rl_distill.py::*": "the log-probs at a teacher's ids on the model's tree output (ours); test_rl.py runs the "
                             "rl API's Megatron-Core path and test_score.py the top-k against stock in latest",
    "test_score_values.py::*": "score --values reads the value head through score's loading path, which test_score.py "
                               "runs against stock in latest",
    "test_examples_rl.py::*": "the rl examples as users run them; their calls run against stock per rollout in "
                              "latest (test_rl.py, test_rl_objectives.py)",
    "test_activations.py::*": "the activation profile's fit against saved-tensor hooks (our meter and features; "
                              "a profile is per stack and model: tools/calibrate_activations.py on the one you run)",
}


#: Modules in the order their run should start (longest first, measured with --durations); any
#: other module follows in collection order.
LONGEST_FIRST = (
    "test_megatron_verify.py", "test_launch_lm.py", "test_preemption.py", "test_slurm_job.py",
    "test_model_families.py", "test_mla.py", "test_verify_bf16.py", "test_dsa_megatron.py", "test_ops_dsa.py",
    "test_cp_megatron.py", "test_cp_gdn.py", "test_cp_islands.py", "test_ops_attention.py", "test_megatron_lm_hooks.py",
    "test_megatron_stock_oracle.py", "test_trainer.py", "test_checkpoint_faults.py", "test_carry.py",
    "test_compat_cpu.py", "test_bridge.py", "test_vlm_hf.py", "test_ops_gdn.py", "test_concurrent_runs.py",
)


def pytest_configure(config):
    config.addinivalue_line("markers", "main_tier_only: the latest tier (--tier latest) leaves this case out")


def pytest_addoption(parser):
    parser.addoption("--tier", choices=("main", "latest"), default="main",
                     help="latest: only what depends on the Megatron-Core version (conftest.py says what)")


def _main_tier_only(nodeid: str) -> bool:
    path, _, rest = nodeid.partition("::")
    name = path.rsplit("/", 1)[-1]
    if name in STACK_INDEPENDENT:
        return True
    return any(fnmatch.fnmatchcase(f"{name}::{rest}", pat) for pat in MAIN_TIER_ONLY)


def pytest_collection_modifyitems(config, items):
    if config.getoption("--tier") == "latest":
        kept, dropped = [], []
        for item in items:
            main_only = _main_tier_only(item.nodeid) or item.get_closest_marker("main_tier_only") is not None
            (dropped if main_only else kept).append(item)
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = kept
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.partition("::")[0].rsplit("/", 1)[-1], len(rank)))
