"""Tree-packed hybrid (Mamba-2 / Gated DeltaNet / attention / MLP / MoE) training with Megatron-LM's
``pretrain()`` (Megatron-LM tag core_v0.16.1, or the ``megatron.training`` inside the megatron-core
0.19.x wheel).

The stack is one layer per letter of ``--tree-hybrid-pattern`` (M Mamba-2, G Gated DeltaNet,
* attention, - MLP, E MoE); ``--num-layers`` must equal the number of letters. With 0.16.1 run from
a Megatron-LM checkout with megatron-tree on PYTHONPATH; with 0.19.x no checkout is needed.
``megatron-tree launch [--nproc N] examples/pretrain_tree_hybrid.py ...`` runs it on GPUs
(torchrun) or on a CPU (see examples/README.md). One node, 8 GPUs, TP 2, EP 2, DP 4:

    cd /path/to/Megatron-LM && PYTHONPATH=$PWD:/path/to/megatron-tree:$PYTHONPATH \\
    torchrun --nproc-per-node 8 /path/to/megatron-tree/examples/pretrain_tree_hybrid.py \\
        --tree-packing --tree-hybrid-pattern 'MG*-MGE-MG*-MGE-' --num-layers 16 \\
        --tree-data-path rollouts.jsonl --tree-max-tokens-per-mb 16384 --tree-global-batch-samples 256 \\
        --tree-loss sft --calculate-per-token-loss --micro-batch-size 1 --global-batch-size 8 \\
        --tensor-model-parallel-size 2 --expert-model-parallel-size 2 --sequence-parallel \\
        --num-experts 8 --moe-router-topk 2 --moe-token-dispatcher-type alltoall --moe-ffn-hidden-size 1024 \\
        --hidden-size 2048 --num-attention-heads 16 --group-query-attention --num-query-groups 4 \\
        --ffn-hidden-size 5632 --swiglu --normalization RMSNorm --position-embedding-type rope \\
        --mamba-state-dim 128 --mamba-head-dim 64 --mamba-num-groups 8 \\
        --linear-num-key-heads 16 --linear-num-value-heads 32 --linear-key-head-dim 128 --linear-value-head-dim 128 \\
        --untie-embeddings-and-output-weights --disable-bias-linear \\
        --seq-length 16384 --max-position-embeddings 16384 --attention-dropout 0 --hidden-dropout 0 \\
        --tokenizer-type NullTokenizer --vocab-size 151936 \\
        --train-iters 1000 --lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 50 --clip-grad 1.0 --bf16 \\
        --save ckpt/tree_hybrid --load ckpt/tree_hybrid --save-interval 100 --log-interval 1 --eval-interval 1000 --eval-iters 0

Multi-node: examples/slurm/train_tree_hybrid.sbatch.
"""
from megatron.core.enums import ModelType

# Megatron-LM's pretrain() in its core_v0.16.1 calling form, on a core_v0.16.1 checkout or on a
# megatron-core 0.19.x wheel (whose pretrain takes a config container): see megatron_tree.compat.lm_api
from megatron_tree.compat.lm_api import pretrain
from megatron_tree.training.arguments import add_tree_args
from megatron_tree.training.megatron_lm import forward_step, model_provider, train_valid_test_datasets_provider


def hybrid_model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """`model_provider`, refusing to silently build a GPT stack when the pattern is missing."""
    from megatron.training import get_args

    if not get_args().tree_hybrid_pattern:
        raise ValueError("pretrain_tree_hybrid.py needs --tree-hybrid-pattern (e.g. 'MG*-MGE-'); "
                         "use pretrain_tree_gpt.py for a GPT stack")
    return model_provider(pre_process, post_process, vp_stage, config, pg_collection)


if __name__ == "__main__":
    pretrain(
        train_valid_test_datasets_provider,
        hybrid_model_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        extra_args_provider=add_tree_args,
        args_defaults={"dataloader_type": "external", "tokenizer_type": "NullTokenizer"},
    )
