from setuptools import find_packages, setup

setup(
    name="megatron-tree",
    version="0.1.0",
    description="Prefix-tree training for Megatron-Core: shared prefixes stored once, exact per-sample loss and gradients.",
    packages=find_packages(include=["megatron_tree", "megatron_tree.*"]),
    package_data={"megatron_tree.cp.planning": ["*.json"]},  # the CPU cost-model fits (cost_cpu.json, gdn_cost_cpu.json)
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",  # CPU machines: pip install torch==2.13.0 (local CPU build)
        # tested: 0.16.1 (requirements-cpu.txt, Python >= 3.10) and 0.19.2 (requirements-latest.txt,
        # Python >= 3.12); version differences live in megatron_tree/compat/
        "megatron-core>=0.16.1,<0.20",
        "numpy>=1.24",
        "psutil",  # megatron-core dist_checkpointing
        "einops",  # megatron-core Mamba mixer
    ],
    extras_require={
        # apex is a from-source build (see README); it is not installable from the index.
        "gpu": ["transformer-engine", "triton", "mamba-ssm", "causal-conv1d", "fla-core", "flash-linear-attention"],
        "test": ["pytest", "hypothesis", "pytest-xdist"],
        "plot": ["matplotlib"],
        # megatron_tree.bridge: Hugging Face checkpoints through Megatron-Bridge (Python 3.12, megatron-core 0.19)
        "hf": ["megatron-bridge>=0.6.2", "transformers>=5.8"],
        "data": ["pyarrow"],
        # tensorboardX: `megatron-tree train`; tensorboard: Megatron-LM's --tensorboard-dir (its SummaryWriter)
        "log": ["tensorboardX", "tensorboard"],
    },
    entry_points={"console_scripts": ["megatron-tree=megatron_tree.cli:main"]},
)
