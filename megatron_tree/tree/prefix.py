"""Lexicographic order and longest common prefixes of token (or symbol) sequences: the one fact
packing (`packing.py`) and route-aware sharing (`routes.py`) are both built on. A sample's rows in
the prefix trie are its tokens after its LCP with its predecessor in this order."""
from __future__ import annotations

from typing import Sequence

import numpy as np


def sort_and_lcp(toks: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Lexicographic order of token sequences and the LCP of each with its predecessor (0 first)."""
    keys = [t.astype(">u4").tobytes() for t in toks]
    order = np.array(sorted(range(len(toks)), key=lambda i: (keys[i], i)), dtype=np.int64)
    lcp = np.zeros(len(order), dtype=np.int64)
    for j in range(1, len(order)):
        a, b = toks[order[j - 1]], toks[order[j]]
        m = min(len(a), len(b))
        diff = np.flatnonzero(a[:m] != b[:m])
        lcp[j] = diff[0] if diff.size else m
    return order, lcp
