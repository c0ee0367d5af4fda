"""Hybrid layer patterns (Megatron's ``hybrid_override_pattern`` letters), without Megatron-Core.

`parse_hybrid_pattern` is what argument checks need (`training.arguments.validate_tree_args`, which
the ``megatron-tree train`` launcher runs before it starts any rank): importing `specs` for it would
import Megatron-Core's spec modules, seconds of CPU in a process that builds no model.
"""
from __future__ import annotations

__all__ = ["HYBRID_LETTERS", "parse_hybrid_pattern"]

HYBRID_LETTERS = {"M": "mamba", "G": "gdn", "*": "attention", "-": "mlp", "E": "moe"}


def parse_hybrid_pattern(pattern: str) -> list[str]:
    """Letters of a hybrid pattern; '|' (Megatron's pipeline-stage separator) is ignored."""
    letters = [c for c in pattern if c != "|"]
    bad = sorted({c for c in letters if c not in HYBRID_LETTERS})
    if bad or not letters:
        raise ValueError(f"hybrid pattern {pattern!r}: letters must be from {''.join(HYBRID_LETTERS)} "
                         f"(M Mamba-2, G GDN, * attention, - MLP, E MoE); bad: {bad}")
    return letters
