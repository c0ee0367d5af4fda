"""Tree core attentions of the families whose layers choose their own window.

Megatron-Bridge builds some families with a core attention class of their own, picked by name in the
family's layer spec. `treeify_spec` replaces such a class by its tree counterpart here (`TREE_CORES`,
keyed by the stock class's name, so nothing here imports the Bridge) and refuses a custom core
attention it does not know: replacing it with plain tree attention would drop what it does.

* ``Gemma2DotProductAttention`` / ``Gemma2FlexDotProductAttention`` (Gemma 2): local (a ``(left, 0)`` window)
  on odd layers, global on even ones, scale ``1 / sqrt(query_pre_attn_scalar)``, attention logit soft-cap.
* ``Gemma3TEDotProductAttention`` (Gemma 3): layer ``n`` (1-based) attends globally when
  ``n % sum(config.interleaved_attn_pattern) == 0`` and within an integer ``config.window_size`` of
  positions otherwise (``q - k < window_size``, as the Bridge's ``(window_size - 1, 0)``). Its vision-language
  form (an attention bias instead of the window) is not built on the tree.
"""
from __future__ import annotations

import math
from typing import Optional

from .attention import TreeDotProductAttention

__all__ = ["TreeGemma2DotProductAttention", "TreeGemma3DotProductAttention", "TREE_CORES", "tree_core_for", "stand_in_name", "is_stand_in"]


class TreeGemma3DotProductAttention(TreeDotProductAttention):
    """Gemma 3's per-layer local / global core attention on a tree (window by depth)."""

    def layer_window(self, config, layer_number: int) -> Optional[int]:
        if getattr(config, "is_vision_language", False):
            raise ValueError("Gemma 3's vision-language attention (a local / global attention bias) has no tree "
                             "variant yet")
        pattern = sum(config.interleaved_attn_pattern)
        if layer_number % pattern == 0 or not config.window_size:
            return None
        return int(config.window_size)


class TreeGemma2DotProductAttention(TreeDotProductAttention):
    """Gemma 2's core attention on a tree (the Bridge's ``Gemma2DotProductAttention`` and its FlexAttention
    twin): odd layers (1-based) attend within ``config.window_size = (left, 0)`` of depth, even ones
    globally; scores scaled by ``1 / sqrt(config.query_pre_attn_scalar)`` whatever ``softmax_scale`` says
    (as the Bridge's class), then soft-capped, ``c tanh(s / c)`` with ``c = config.attn_logit_softcapping``."""

    def __init__(self, config, layer_number: int, *args, softmax_scale=None, **kwargs):
        scale = 1.0 / math.sqrt(config.query_pre_attn_scalar)
        super().__init__(config, layer_number, *args, softmax_scale=scale, **kwargs)
        self.softcap = float(config.attn_logit_softcapping) if getattr(config, "attn_logit_softcapping", None) else None

    def layer_window(self, config, layer_number: int) -> Optional[int]:
        if max(1, layer_number) % 2 == 0 or not config.window_size:
            return None
        left, right = config.window_size
        if right not in (0, -1) or left < 0:
            raise ValueError(f"tree attention is causal: window_size must be (left >= 0, 0), got {config.window_size}")
        return left + 1


#: stock core-attention class name -> its tree class
TREE_CORES = {"DotProductAttention": TreeDotProductAttention, "TEDotProductAttention": TreeDotProductAttention,
              "Gemma3TEDotProductAttention": TreeGemma3DotProductAttention,
              "Gemma2DotProductAttention": TreeGemma2DotProductAttention,
              "Gemma2FlexDotProductAttention": TreeGemma2DotProductAttention}


def tree_core_for(core_cls) -> type:
    """The tree core attention standing for ``core_cls``; a ValueError naming a class it does not know."""
    if isinstance(core_cls, type) and issubclass(core_cls, TreeDotProductAttention):
        return core_cls
    name = getattr(core_cls, "__name__", None) if isinstance(core_cls, type) else stand_in_name(core_cls)
    name = name or repr(core_cls)
    if name in TREE_CORES:
        return TREE_CORES[name]
    raise ValueError(f"core attention {getattr(core_cls, '__module__', '?')}.{name} has no tree variant: "
                     f"tree training knows {', '.join(sorted(TREE_CORES))}; replacing it with plain tree attention "
                     "would drop what it does")



def is_stand_in(obj) -> bool:
    """A ``MagicMock`` standing for a transformer-engine class that could not be imported."""
    return type(obj).__module__ == "unittest.mock"


def stand_in_name(obj):
    """On a host without transformer-engine, Megatron's and the Bridge's modules bind the TE classes they
    cannot import (and a class derived from one, the Bridge's ``Gemma3TEDotProductAttention``) to ``MagicMock``
    stand-ins: such an object is known by the name a loaded ``megatron`` module binds it to. None for
    anything else, or a stand-in no module names."""
    import sys

    if not is_stand_in(obj):
        return None
    for mod_name, module in list(sys.modules.items()):
        if mod_name.startswith("megatron.") and module is not None:
            for key, value in list(vars(module).items()):
                if value is obj:
                    return key
    return None
