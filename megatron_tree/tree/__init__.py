"""Prefix-tree data model: samples, packing, layout, loss map and loss helpers (no distributed code)."""
from .layout import TreeLayout
from .loss import entropy_loss, gather_logprobs, policy_loss, sft_loss, tree_loss
from .loss_map import LossMap
from .microbatch import MicrobatchStats, TreeMicrobatch, padding_microbatch, summarize
from .packing import pack
from .sample import Sample, as_sample, validate_sample

__all__ = ["Sample", "as_sample", "validate_sample", "pack", "TreeLayout", "TreeMicrobatch", "MicrobatchStats",
           "LossMap", "summarize", "padding_microbatch", "gather_logprobs", "sft_loss", "policy_loss",
           "entropy_loss", "tree_loss"]
