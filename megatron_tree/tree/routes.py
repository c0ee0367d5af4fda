"""Rollout routes (R3): per-token MoE expert choices, and route-aware prefix sharing.

A rollout engine (vLLM / SGLang) reports, for every token of a rollout, the experts each MoE layer
chose: ``routed_experts`` of shape ``[tokens, moe_layers, topk]`` (`Sample.routed_experts`). Routing
replay trains with exactly those experts. Two rollouts that share a token prefix may have been
routed differently on it (it was prefilled in different batches), so a tree may merge two rows only
where the tokens *and* the routes agree: `route_symbols` maps every (token, routes) position to one
symbol id (``np.unique`` over rows), and packing sorts and takes longest common prefixes over
symbol sequences, so the trie forks at the first disagreement while the layout keeps the tokens.
Every physical row then has exactly one route (`row_routes`).

`route_sharing_cost` compares that trie with the token-only one (what ``megatron-tree stats``
reports): the forks routes caused and the rows they cost.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .prefix import sort_and_lcp

__all__ = ["RouteSpec", "read_time_route_spec", "validate_routes", "route_symbols", "padding_routes", "row_routes", "route_sharing_cost",
           "routes_shape"]


@dataclass(frozen=True)
class RouteSpec:
    """What the model says routes must look like (None: not checked). ``moe_layers``: MoE layers of
    the whole model (every pipeline stage); ``topk``: experts per token; ``num_experts``: expert ids
    lie in ``[0, num_experts)``."""

    moe_layers: Optional[int] = None
    topk: Optional[int] = None
    num_experts: Optional[int] = None


def read_time_route_spec(args) -> RouteSpec:
    """What every reader of records checks of their ``routed_experts`` under routing replay, where
    ``file:line`` is still known and before any rank starts (``megatron-tree train``, ``megatron-tree
    score``, the Megatron-LM hooks' ``--tree-routing-replay``): top-k equal to ``args.moe_router_topk``
    and expert ids below ``args.num_experts`` (the flags' names in ours and Megatron-LM's arguments;
    either missing or None: not checked). The MoE layer count is the built model's, checked when
    packing."""
    return RouteSpec(topk=getattr(args, "moe_router_topk", None), num_experts=getattr(args, "num_experts", None))


def validate_routes(name: str, routes, length: int, spec: Optional[RouteSpec] = None) -> np.ndarray:
    """``routes`` as an int64 ``[length, moe_layers, topk]`` array, or ValueError naming ``name`` (e.g.
    ``file.jsonl:12``) and the rule it breaks: one ``[moe_layers][topk]`` block per token, integer
    expert ids, non-negative and below ``spec.num_experts``, distinct within a token's top-k, layer
    count and top-k equal to the model's (``spec``)."""
    try:
        r = np.asarray(routes)
    except ValueError:  # ragged nesting (numpy >= 1.24 refuses it)
        r = np.asarray(routes, dtype=object)
    if r.dtype == object:
        raise ValueError(f"{name}: routed_experts must be a list per token of [moe_layers][topk] integers with the "
                         "same moe_layers and topk at every token (got a ragged nesting)")
    if r.ndim != 3:
        raise ValueError(f"{name}: routed_experts must have shape [tokens, moe_layers, topk], got {r.ndim} "
                         f"dimension(s) {tuple(r.shape)}")
    if r.shape[0] != length:
        raise ValueError(f"{name}: routed_experts has {r.shape[0]} entries but the sample has {length} tokens "
                         "(one [moe_layers][topk] block per token)")
    if r.shape[1] == 0 or r.shape[2] == 0:
        raise ValueError(f"{name}: routed_experts has shape {tuple(r.shape)}: at least one MoE layer and one expert "
                         "per token")
    if not np.issubdtype(r.dtype, np.integer):
        if not (np.issubdtype(r.dtype, np.floating) and np.all(np.mod(r, 1) == 0)):
            raise ValueError(f"{name}: routed_experts must hold integer expert ids, got dtype {r.dtype}")
    r = r.astype(np.int64, copy=False)
    spec = spec or RouteSpec()
    if spec.moe_layers is not None and r.shape[1] != spec.moe_layers:
        raise ValueError(f"{name}: routed_experts has {r.shape[1]} MoE layers per token but the model has "
                         f"{spec.moe_layers}")
    if spec.topk is not None and r.shape[2] != spec.topk:
        raise ValueError(f"{name}: routed_experts has top-{r.shape[2]} per token and layer but the model routes "
                         f"top-{spec.topk}")
    if r.min() < 0:
        t = int(np.argwhere(r < 0)[0][0])
        raise ValueError(f"{name}: routed_experts holds a negative expert id at token {t}")
    if spec.num_experts is not None and r.max() >= spec.num_experts:
        t = int(np.argwhere(r >= spec.num_experts)[0][0])
        raise ValueError(f"{name}: routed_experts holds expert id {int(r.max())} at token {t}, but the model has "
                         f"{spec.num_experts} experts")
    if r.shape[2] > 1:
        s = np.sort(r, axis=2)
        dup = (s[:, :, 1:] == s[:, :, :-1]).any(axis=2)
        if dup.any():
            t, layer = (int(v) for v in np.argwhere(dup)[0])
            raise ValueError(f"{name}: routed_experts repeats an expert within the top-{r.shape[2]} of token {t}, MoE "
                             f"layer {layer}: {r[t, layer].tolist()}")
    return r


def routes_shape(samples: Sequence) -> Optional[tuple]:
    """``(moe_layers, topk)`` common to every sample that carries routes (None when none does);
    ValueError naming the first sample that disagrees."""
    shape, first = None, None
    for i, s in enumerate(samples):
        r = getattr(s, "routed_experts", None)
        if r is None:
            continue
        if shape is None:
            shape, first = tuple(r.shape[1:]), i
        elif tuple(r.shape[1:]) != shape:
            raise ValueError(f"sample {i}: routed_experts has [moe_layers, topk] = {list(r.shape[1:])} but sample "
                             f"{first} has {list(shape)}: every sample of a batch must be routed by the same model")
    return shape


def route_symbols(toks: Sequence[np.ndarray], routes: Sequence[np.ndarray]) -> list[np.ndarray]:
    """One int64 symbol per position: equal iff the token and its ``[moe_layers, topk]`` routes are equal.

    ``np.unique`` over the rows ``[token, routes...]`` of every position of every sample (sorted rows,
    so the ids depend only on the set of positions, never on the order the samples came in, and all
    symbols of one token are consecutive ids). Sorting and LCP over these sequences give the trie of
    (token, route) pairs; the ids stay below the number of distinct positions (< 2**32)."""
    lens = np.array([len(t) for t in toks], dtype=np.int64)
    if not len(toks):
        return []
    tok = np.concatenate([np.asarray(t, np.int64) for t in toks])
    r = np.concatenate([np.asarray(x, np.int64).reshape(len(x), -1) for x in routes])
    # one 64-bit key per position (token and a multiplicative hash of its routes, wrapping int64
    # arithmetic), uniqued in 1-D; then checked: positions that share a key must share token and routes
    # (a hash collision falls back to the exact row-wise unique)
    mult = _hash_multipliers(r.shape[1])
    with np.errstate(over="ignore"):
        key = (r * mult).sum(1) * np.int64(0x9E3779B97F4A7C15 - 2**64) + tok
    _, first, inv = np.unique(key, return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    rep = first[inv]
    if not (np.array_equal(tok, tok[rep]) and np.array_equal(r, r[rep])):
        rows = np.concatenate([tok[:, None], r], 1)
        _, first, inv = np.unique(rows, axis=0, return_index=True, return_inverse=True)
        inv = inv.reshape(-1)
    # symbol ids in (token, routes) order, so every symbol of one token is consecutive
    order = np.lexsort(tuple(r[first].T[::-1]) + (tok[first],))
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return np.split(rank[inv].astype(np.int64), np.cumsum(lens)[:-1])


def _hash_multipliers(width: int) -> np.ndarray:
    """Odd 64-bit multipliers of `route_symbols`' route hash (fixed: symbols are deterministic)."""
    return np.random.default_rng(0x5EED).integers(1, 2**62, width, dtype=np.int64) | 1


def padding_routes(num_rows: int, moe_layers: int, topk: int) -> np.ndarray:
    """``[num_rows, moe_layers, topk]`` valid routes for padding rows (experts 0..topk-1): a padding row
    is routed like any row (Megatron runs it through the experts), its output is never read."""
    return np.broadcast_to(np.arange(topk, dtype=np.int64), (num_rows, moe_layers, topk)).copy()


def row_routes(path_rows: np.ndarray, sample_routes: Sequence[np.ndarray], num_rows: int) -> np.ndarray:
    """``[num_rows, moe_layers, topk]`` route of every physical row: the routes of the samples whose
    path passes through it (``path_rows``: the concatenated paths, aligned with the concatenated
    ``sample_routes``); rows no path reaches (padding) get `padding_routes`. Route-aware packing makes
    every writer of a row agree; an assertion guards it."""
    L, K = sample_routes[0].shape[1:]
    out = padding_routes(num_rows, L, K)
    flat = np.concatenate(sample_routes).astype(np.int64, copy=False)
    out[path_rows] = flat
    assert np.array_equal(out[path_rows], flat), "two samples share a row but disagree on its routes"
    return out


def route_sharing_cost(samples: Sequence) -> dict:
    """Token-only vs route-aware sharing of ``samples`` (each carrying ``routed_experts``), whole forest
    (no row budget).

    flat_rows        rows without sharing (sum of lengths)
    token_rows       rows of the token trie (sharing wherever tokens agree: replays one rollout's
                     routes for another where they disagree)
    route_rows       rows of the (token, route) trie: what route-aware packing runs
    route_forks      branch points routes alone caused: a sample leaves a path whose next token is
                     the same as its own but whose routes differ there
    route_extra_rows route_rows - token_rows (rows the route forks cost)
    """
    toks = [np.asarray(s.tokens, np.int64) for s in samples]
    missing = [i for i, s in enumerate(samples) if getattr(s, "routed_experts", None) is None]
    if missing:
        raise ValueError(f"sample {missing[0]}: no routed_experts: route-aware sharing needs routes on every sample "
                         f"({len(missing)} of {len(samples)} have none)")
    routes_shape(samples)
    lens = np.array([len(t) for t in toks], dtype=np.int64)
    _, lcp_tok = sort_and_lcp(toks)
    syms = route_symbols(toks, [s.routed_experts for s in samples])
    order, lcp = sort_and_lcp(syms)
    token_rows = int((lens - lcp_tok).sum())
    route_rows = int((lens[order] - lcp).sum())
    # a sample's first new row p = lcp[j] is a route fork iff its predecessor (in symbol order) also has
    # a row at depth p with the same token: same-token symbols are consecutive ids, so an earlier
    # sibling with this token exists iff the predecessor's child is one
    forks = 0
    for j in range(1, len(order)):
        p, a, b = int(lcp[j]), toks[order[j - 1]], toks[order[j]]
        if p < len(a) and p < len(b) and a[p] == b[p]:
            forks += 1
    return dict(num_samples=len(samples), flat_rows=int(lens.sum()), token_rows=token_rows, route_rows=route_rows,
                route_forks=forks, route_extra_rows=route_rows - token_rows)
