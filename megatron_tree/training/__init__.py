"""Our training application on top of the extension: trainer, launch, demo, verify, Megatron-LM hooks.

``megatron_tree.megatron`` is what a Megatron-Core user swaps into an existing model; this package
is how *we* train with it (``megatron-tree train`` / ``verify`` / ``demo``) and how Megatron-LM's
``pretrain()`` does (``megatron_lm`` hooks, ``arguments``). It imports ``megatron`` and ``data``;
nothing below it imports this package. Names are exported lazily (PEP 562), so importing it does
not import Megatron-Core.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "ModelArgs": "models", "make_config": "models", "build_model": "models", "wrap_ddp": "models",
    "forward_backward": "models",
    "VerifyConfig": "verify", "run_verify": "verify",
    "add_tree_args": "arguments", "validate_tree_args": "arguments",
    "run_distributed": "launch",
    "run_demo": "demo",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
