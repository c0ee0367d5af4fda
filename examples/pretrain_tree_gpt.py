"""Tree-packed GPT training with Megatron-LM's ``pretrain()`` (Megatron-LM tag core_v0.16.1, or the
``megatron.training`` inside the megatron-core 0.19.x wheel).

With 0.16.1 run from a Megatron-LM checkout (``megatron.training`` is not in that wheel), with
megatron-tree installed or on PYTHONPATH; with 0.19.x no checkout is needed. ``megatron-tree launch
[--nproc N] examples/pretrain_tree_gpt.py ...`` runs it on GPUs (torchrun) or on a CPU (see
examples/README.md). One node, 8 GPUs, TP 2, PP 2, DP 2:

    cd /path/to/Megatron-LM && PYTHONPATH=$PWD:/path/to/megatron-tree:$PYTHONPATH \\
    torchrun --nproc-per-node 8 /path/to/megatron-tree/examples/pretrain_tree_gpt.py \\
        --tree-packing --tree-data-path rollouts.jsonl --tree-max-tokens-per-mb 16384 \\
        --tree-global-batch-samples 256 --tree-loss grpo --tree-clip-eps 0.2 --tree-kl-coef 0.0 \\
        --calculate-per-token-loss --micro-batch-size 1 --global-batch-size 8 \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel \\
        --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --group-query-attention --num-query-groups 4 \\
        --ffn-hidden-size 5632 --swiglu --normalization RMSNorm --position-embedding-type rope \\
        --untie-embeddings-and-output-weights --disable-bias-linear \\
        --seq-length 16384 --max-position-embeddings 16384 --attention-dropout 0 --hidden-dropout 0 \\
        --tokenizer-type NullTokenizer --vocab-size 151936 \\
        --train-iters 1000 --lr 1e-6 --lr-decay-style constant --weight-decay 0.0 --clip-grad 1.0 --bf16 \\
        --save ckpt/tree_gpt --load ckpt/tree_gpt --save-interval 100 --log-interval 1 --eval-interval 1000 --eval-iters 0

``--global-batch-size`` counts *microbatches* (times DP): each rank runs global-batch-size / DP
tree microbatches per step, holding ``--tree-global-batch-samples`` samples over all ranks.
Multi-node: examples/slurm/train_tree_gpt.sbatch.

Qwen3-Next family (Gated DeltaNet layers in Megatron's experimental-attention slots, trained as
`TreeGatedDeltaNet`; checkpoints of the stock model load unchanged): add Megatron-LM's own flags
``--experimental-attention-variant gated_delta_net --linear-attention-freq 4 --linear-conv-kernel-dim 4
--linear-key-head-dim 128 --linear-value-head-dim 128 --linear-num-key-heads 16 --linear-num-value-heads 32
--attention-output-gate --qk-layernorm`` (MoE: ``--moe-shared-expert-intermediate-size N --moe-shared-expert-gate``).
"""
from megatron.core.enums import ModelType

# Megatron-LM's pretrain() in its core_v0.16.1 calling form, on a core_v0.16.1 checkout or on a
# megatron-core 0.19.x wheel (whose pretrain takes a config container): see megatron_tree.compat.lm_api
from megatron_tree.compat.lm_api import pretrain
from megatron_tree.training.arguments import add_tree_args
from megatron_tree.training.megatron_lm import forward_step, model_provider, train_valid_test_datasets_provider

if __name__ == "__main__":
    pretrain(
        train_valid_test_datasets_provider,
        model_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        extra_args_provider=add_tree_args,
        # both default to None in Megatron-LM, so these only fill in what the command line leaves unset
        args_defaults={"dataloader_type": "external", "tokenizer_type": "NullTokenizer"},
    )
