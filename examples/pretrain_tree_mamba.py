"""Tree-packed MambaModel (Nemotron-H family) training with Megatron-LM's ``pretrain()`` (Megatron-LM
tag core_v0.16.1): the tree counterpart of Megatron-LM's ``pretrain_mamba.py``.

Same model flags as ``pretrain_mamba.py`` (``--hybrid-override-pattern`` with M Mamba-2, * attention,
- MLP, E MoE; ``--spec`` optional: the named stack spec is treeified, default the tree variant of
``mamba_stack_spec``) plus the ``--tree-*`` flags. A checkpoint of ``pretrain_mamba.py`` loads
unchanged (same module tree and sharded state dict). One node, 8 GPUs, TP 2, DP 4:

    cd /path/to/Megatron-LM && PYTHONPATH=$PWD:/path/to/megatron-tree:$PYTHONPATH \\
    torchrun --nproc-per-node 8 /path/to/megatron-tree/examples/pretrain_tree_mamba.py \\
        --tree-packing --tree-data-path rollouts.jsonl --tree-max-tokens-per-mb 16384 \\
        --tree-global-batch-samples 256 --tree-loss grpo --tree-clip-eps 0.2 \\
        --calculate-per-token-loss --micro-batch-size 1 --global-batch-size 8 \\
        --tensor-model-parallel-size 2 --sequence-parallel \\
        --num-layers 16 --hybrid-override-pattern 'M-M-M*-M-M-M*-M-' --hidden-size 2048 \\
        --num-attention-heads 16 --group-query-attention --num-query-groups 8 --ffn-hidden-size 8192 \\
        --mamba-state-dim 128 --mamba-head-dim 64 --mamba-num-groups 8 \\
        --normalization RMSNorm --position-embedding-type rope --squared-relu \\
        --untie-embeddings-and-output-weights --disable-bias-linear \\
        --seq-length 16384 --max-position-embeddings 16384 --attention-dropout 0 --hidden-dropout 0 \\
        --tokenizer-type NullTokenizer --vocab-size 131072 \\
        --train-iters 1000 --lr 1e-6 --lr-decay-style constant --weight-decay 0.0 --clip-grad 1.0 --bf16 \\
        --load ckpt/nemotron_h --save ckpt/tree_mamba --save-interval 100 --log-interval 1 \\
        --eval-interval 1000 --eval-iters 0

Nemotron-H checkpoints use ``--position-embedding-type none``; pass what the checkpoint was trained
with (with rope, attention layers see the rotary table indexed by tree depth).
"""
from megatron.core.enums import ModelType

# Megatron-LM's pretrain() in its core_v0.16.1 calling form, on a core_v0.16.1 checkout or on a
# megatron-core 0.19.x wheel (whose pretrain takes a config container): see megatron_tree.compat.lm_api
from megatron_tree.compat.lm_api import pretrain

from megatron_tree.training.arguments import add_tree_args
from megatron_tree.training.megatron_lm import (
    forward_step,
    mamba_model_provider,
    train_valid_test_datasets_provider,
)

if __name__ == "__main__":
    pretrain(
        train_valid_test_datasets_provider,
        mamba_model_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        extra_args_provider=add_tree_args,
        args_defaults={"dataloader_type": "external", "tokenizer_type": "NullTokenizer"},
    )
