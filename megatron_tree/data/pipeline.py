"""`TreeDataPipeline`: trajectories -> per-step, per-DP-rank lists of packed prefix-tree microbatches.

One optimizer step consumes a *window* of ``global_batch_samples`` samples:

1. Order. Each epoch has its own deterministic order, a pure function of (seed, epoch, dataset):
   with ``keep_groups`` (default) the *groups* (``Sample.group``; a sample without one is its own
   group) are shuffled and the members of a group stay together in dataset order, so a GRPO
   group's completions land in the same window and share their prompt in the tree. A group
   straddles two windows only when group sizes do not divide ``global_batch_samples``.
2. Pack. The window's samples, taken in ascending dataset index, go through
   `megatron_tree.tree.pack`; the resulting microbatches' ``sample_ids`` and
   ``loss_map.sample_index`` are rewritten to *dataset* indices (still ascending).
3. Shard. Every DP rank packs the same window and runs the same deterministic balanced assignment
   (`sharding.balance`, greedy LPT on predicted cost = rows + attention_cost x visible pairs), so
   ranks agree without communicating. A window that would pack into fewer microbatches than DP
   slots is packed with a smaller budget when that lowers the slowest rank (``balance_budget``).
   Every rank gets the same number of microbatches; the spare slots hold padding microbatches
   (one padding row, empty `LossMap`: zero loss, zero gradient). Every rank pays for packing the
   whole window (it is what makes the ranks agree); the lookahead thread hides that cost.
4. Lookahead (``lookahead > 0``). A background thread builds (and, through ``plan_fn``, plans) the
   next steps while the current one trains; the steps are identical to synchronous building.

Exactly-once: over an epoch, the windows partition the epoch order, and within a window the DP
ranks partition the microbatches, so every sample is trained exactly once per epoch across ranks
(the last window is smaller unless ``drop_last``).

Resume: ``state_dict()`` describes the position after the last step *handed to the consumer*
(steps built ahead by the lookahead thread are not counted), as (seed, epoch, cursor = samples of
the epoch order consumed). A pipeline given that state continues with exactly the remaining
windows, so nothing is dropped or repeated, even if the DP size changes (windows do not depend on
it); a changed ``global_batch_samples`` changes only the later windows' size.

Loss denominators: every rank knows the whole step, so `TreeStep.num_targets` is the global
number of loss targets over all ranks (the "token" reduction denominator) without an all-reduce.
"""
from __future__ import annotations

import dataclasses
import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from ..tree.loss_agg import loss_agg_factors, with_loss_agg
from ..tree.microbatch import TreeMicrobatch, padding_microbatch
from ..tree.packing import PrefixPlan, pack
from ..tree.sample import Sample, as_sample, validate_sample
from .io import ReadReport, read_jsonl
from .lookahead import Lookahead
from .sharding import DEFAULT_ATTENTION_COST, balance, microbatch_cost

_STATE_VERSION = 1
_OPTIONAL_FIELDS = {"advantage": "advantages", "old_logprobs": "old_logprobs", "ref_logprobs": "ref_logprobs"}


# ---------------------------------------------------------------------------------------------- readers
def read_samples(paths, *, vocab_size: int | None = None, bad_sample: str = "error",
                 report: ReadReport | None = None, route_spec=None, require_routes: bool = False,
                 vision=None) -> list[Sample]:
    """Samples of one or more files, in the order given, then file order.

    ``.jsonl`` / ``.json`` files go to `io.read_jsonl`, ``.parquet`` / ``.pq`` to
    `parquet.read_parquet`; a directory contributes its files of those kinds in sorted name order.
    ``report.sources`` gets ``file:line`` (JSONL) or ``file:row R`` (Parquet, 0-based) of each kept
    sample, ``report.skipped`` ``(where, reason)`` of each skipped one (``bad_sample="skip"``).
    ``file`` is spelled as given (a directory's files as ``os.path.join(directory, name)``), so
    messages point at what the user typed. ``route_spec``: the model's MoE shape that records'
    ``routed_experts`` must match (`megatron_tree.tree.routes.RouteSpec`); ``require_routes``
    (routing replay): a record without ``routed_experts`` is a bad record like any other. A refused
    record or file raises `io.DataError` (a ValueError) whose message starts with its location.
    ``vision`` (`data.images.VisionInput`): records' ``images`` are read, keyed by content and matched
    with their placeholder tokens.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    report = report if report is not None else ReadReport()
    files: list[str] = []
    for p in map(os.fspath, paths):
        if os.path.isdir(p):
            files += [os.path.join(p, q.name) for q in sorted(Path(p).iterdir())
                      if q.suffix in (".jsonl", ".json", ".parquet", ".pq")]
        else:
            files.append(p)
    out: list[Sample] = []
    for f in files:
        suffix = Path(f).suffix
        if suffix in (".jsonl", ".json"):
            out += read_jsonl(f, vocab_size=vocab_size, bad_sample=bad_sample, report=report, route_spec=route_spec,
                              require_routes=require_routes, vision=vision)
        elif suffix in (".parquet", ".pq"):
            from .parquet import read_parquet

            out += read_parquet(f, vocab_size=vocab_size, bad_sample=bad_sample, report=report, route_spec=route_spec,
                                require_routes=require_routes, vision=vision)
        else:
            raise ValueError(f"{f}: unknown file type {suffix!r} (expected .jsonl, .json, .parquet or .pq)")
    return out


# ---------------------------------------------------------------------------------------------- results
@dataclass
class TreeStep:
    """What one DP rank trains in one optimizer step.

    microbatches      this rank's microbatches, always ``microbatches_per_rank`` of them: real ones in
                      pack order, then ``num_padding_microbatches`` padding ones (empty loss maps)
    plans             ``[plan_fn(mb) for mb in microbatches]`` when the pipeline has a ``plan_fn``
    sample_ids        dataset indices of the whole window (all ranks), ascending
    rank_sample_ids   dataset indices trained by this rank, ascending
    num_targets       loss targets over ALL ranks: the global "token" loss denominator
    num_samples       samples in the window (all ranks)
    num_samples_with_targets  samples with at least one target (global "sample" reduction denominator)
    tree_tokens, flat_tokens  real rows of the tree vs per-sample tokens, all ranks (padding excluded)
    local_*           the same for this rank
    num_microbatches  real microbatches over all ranks
    target_weight_by_depth  [D] float64: the loss weights of the step's targets (all ranks) summed by
                      the depth of their source row (MTP depth k averages over depths >= k); every
                      microbatch of the step carries it too (``TreeMicrobatch.step_weight_by_depth``)
    rank_costs        predicted cost of every rank (padding microbatches included), index = DP rank
    state             `TreeDataPipeline.state_dict()` once this step has been handed out: save it
                      with the checkpoint written after this step's optimizer update
    pack_s, plan_s    seconds spent building this step (packing + sharding) and in ``plan_fn``
    wait_s            seconds the consumer blocked waiting for this step
    """

    epoch: int
    step: int
    global_step: int
    dp_rank: int
    microbatches: list[TreeMicrobatch]
    num_padding_microbatches: int
    plans: list | None
    sample_ids: tuple[int, ...]
    rank_sample_ids: tuple[int, ...]
    num_targets: int
    num_samples: int
    num_samples_with_targets: int
    tree_tokens: int
    flat_tokens: int
    local_num_targets: int
    local_tree_tokens: int
    local_flat_tokens: int
    num_microbatches: int
    rank_costs: tuple[float, ...]
    state: dict
    pack_s: float = 0.0
    plan_s: float = 0.0
    wait_s: float = 0.0
    target_weight_by_depth: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    # carry groups cut over DP ranks: the schedule of every rank (`cp.planning.carry_ranks.RankSchedule`), the
    # whole step's microbatches it indexes and the padding microbatch of its padding items; None when no group is cut
    carry_schedule: object = None
    carry_microbatches: tuple = ()
    carry_pad: object = None

    @property
    def microbatches_per_rank(self) -> int:
        return len(self.microbatches)

    @property
    def balance_ratio(self) -> float:
        """max / mean predicted rank cost (1 = perfectly balanced)."""
        c = np.asarray(self.rank_costs)
        return float(c.max() / max(c.mean(), 1e-12))

    @property
    def tree_token_ratio(self) -> float:
        return self.flat_tokens / max(self.tree_tokens, 1)


def _weight_by_depth(mbs) -> np.ndarray:
    """[D] summed target weights of ``mbs`` by their source row's depth (`TreeStep.target_weight_by_depth`)."""
    parts = [np.bincount(mb.layout.position_ids.numpy()[mb.loss_map.source_rows.numpy()],
                         weights=mb.loss_map.weights.numpy()) for mb in mbs if len(mb.loss_map)]
    out = np.zeros(max((len(p) for p in parts), default=0))
    for p in parts:
        out[: len(p)] += p
    return out


@dataclass
class PipelineTiming:
    """Time spent producing the steps handed out so far vs time the consumer waited for them.

    Without lookahead ``wait_s`` >= ``pack_s + plan_s`` (the consumer does the work); with
    lookahead ``hidden_fraction`` tells how much of the production time the training step hid.
    """

    steps: int = 0
    pack_s: float = 0.0
    plan_s: float = 0.0
    wait_s: float = 0.0
    max_wait_s: float = 0.0

    @property
    def produce_s(self) -> float:
        return self.pack_s + self.plan_s

    @property
    def hidden_fraction(self) -> float:
        if self.produce_s <= 0:
            return 1.0
        return float(min(max(1.0 - self.wait_s / self.produce_s, 0.0), 1.0))

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(produce_s=self.produce_s, hidden_fraction=self.hidden_fraction)
        return d


# ---------------------------------------------------------------------------------------------- pipeline
class TreeDataPipeline:
    """Deterministic, resumable, DP-sharded stream of packed prefix-tree steps (module docstring).

    samples               `Sample`s (or dicts / token lists, see `as_sample`); see `from_files`
    max_tokens_per_mb     row budget of a microbatch (padding included)
    global_batch_samples  samples per optimizer step, over all DP ranks
    dp_rank, dp_size      this rank's data-parallel index and the DP world size (no torch.distributed
                          needed); the TP / CP / PP ranks of one model replica share a dp_rank and so
                          receive identical steps
    seed                  shuffle seed; epoch e uses the order drawn from (seed, e)
    num_epochs            epochs to iterate (None: forever)
    shuffle, keep_groups  shuffle per epoch; keep group members together (see module docstring)
    drop_last             drop an epoch's last, smaller window
    pad_to_multiple_of, pad_to_budget, pad_id   forwarded to `pack` (padding microbatches follow them)
    vocab_size            token ids must be below it (checked once, at construction)
    microbatches_per_rank fixed microbatch count per rank (None: ceil(real microbatches / dp_size),
                          which may vary from step to step); a step needing more raises ValueError
    attention_cost, cost_fn  cost model for balancing (`sharding.microbatch_cost` by default)
    balance_budget        when a window would pack into fewer microbatches than DP slots, pack it
                          with the smaller budget that minimises the slowest rank's rows
                          (`_choose_budget`; not with ``pad_to_budget`` or without prefix sharing)
    share_prefixes        False: flat packing (every sample its own chain, same windows and budget),
                          the baseline tree packing is measured against
    lookahead             steps built ahead by a background thread (0: build on demand)
    plan_fn               optional ``plan_fn(mb) -> plan`` run on each of this rank's microbatches
                          (padding ones included) while building, e.g. the CP planner; with
                          lookahead it runs in the background thread, so it must be pure CPU work
                          (no collectives, no CUDA stream it does not own)
    sources               optional "file:line" of each sample, used in error messages
    read_report           optional `io.ReadReport` of the read that produced ``samples`` (`from_files`
                          passes its own): kept as ``self.read_report``; ``self.skipped`` is its number
                          of samples dropped by ``bad_sample="skip"`` (0 without a report)
    route_aware           routing replay: pack with ``route_aware=True`` (rows shared only where tokens
                          and ``routed_experts`` agree; microbatches, padding ones too, carry per-row
                          routes); every sample must carry routes (error naming the first that does not)
    route_spec            `megatron_tree.tree.routes.RouteSpec` the routes must match
    mtp_tail              K MTP tail rows after every sample (``pack(..., mtp_tail=K)``: a model whose MTP
                          layers run DSA with an indexer loss, `megatron.mtp.mtp_tail_rows`); they count
                          against ``max_tokens_per_mb``
    loss_agg, loss_agg_norm  how a step's loss is aggregated (`tree.loss_agg`: token-mean by default; the others
                          multiply each sample's loss weights by its exact factor within the step's window)
    vision                `data.images.VisionInput` of image records (``Sample.images``): every microbatch's image
                          slots get their pixels (`TreeMicrobatch.image_slots`), what the vision encoder runs on
    carry                 pack with ``carry=True`` (`tree.carry`: every row once per step at any budget, samples
                          longer than the budget allowed); a carry group stays on one DP rank, in step order,
                          unless ``carry_cut`` cuts it over ranks (`tree.carry.assign_carry_ranks`: "auto", the
                          default, cuts a group over one rank's share of the rows; "never"; "always") and
                          ``carry_schedule_fn(microbatches, ranks)`` schedules the ranks' items and syncs
                          (`cp.planning.carry_ranks.rank_schedule`; without it no group is cut), and
                          every rank gets the same number of schedule items (`megatron.carry.carry_items`:
                          an exporting microbatch counts twice), topped up with padding microbatches

    Iterate it (``for step in pipe``) to get `TreeStep`s from the current state; `build_step`
    builds any step directly. `state_dict` / `load_state_dict` resume; `timing` reports production
    vs waiting time. Samples are validated up front (budget, vocab, consistent optional fields).
    """

    def __init__(self, samples: Sequence, *, max_tokens_per_mb: int, global_batch_samples: int, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0, num_epochs: int | None = 1, shuffle: bool = True,
                 keep_groups: bool = True, drop_last: bool = False, pad_to_multiple_of: int = 1,
                 pad_to_budget: bool = False, pad_id: int = 0, vocab_size: int | None = None,
                 microbatches_per_rank: int | None = None, attention_cost: float = DEFAULT_ATTENTION_COST,
                 cost_fn: Callable[[TreeMicrobatch], float] | None = None, balance_budget: bool = True,
                 share_prefixes: bool = True, lookahead: int = 0,
                 plan_fn: Callable[[TreeMicrobatch], Any] | None = None, sources: Sequence[str] | None = None,
                 read_report: ReadReport | None = None, route_aware: bool = False, route_spec=None,
                 mtp_tail: int = 0, carry: bool = False, carry_cut: str = "auto", carry_schedule_fn=None,
                 loss_agg: str = "token-mean",
                 loss_agg_norm: float | None = None, vision=None):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must lie in [0, dp_size={dp_size})")
        if global_batch_samples < 1:
            raise ValueError(f"global_batch_samples must be >= 1, got {global_batch_samples}")
        if lookahead < 0:
            raise ValueError(f"lookahead must be >= 0, got {lookahead}")
        if microbatches_per_rank is not None and microbatches_per_rank < 1:
            raise ValueError(f"microbatches_per_rank must be >= 1, got {microbatches_per_rank}")
        if max_tokens_per_mb <= 0 or pad_to_multiple_of <= 0 or max_tokens_per_mb % pad_to_multiple_of:
            raise ValueError(f"max_tokens_per_mb={max_tokens_per_mb} must be a positive multiple of "
                             f"pad_to_multiple_of={pad_to_multiple_of}")
        self.samples = [as_sample(s) for s in samples]
        if not self.samples:
            raise ValueError("the pipeline needs at least one sample")
        if drop_last and len(self.samples) < global_batch_samples:
            raise ValueError(f"drop_last with {len(self.samples)} samples < global_batch_samples="
                             f"{global_batch_samples} leaves no step")
        if sources is not None and len(sources) != len(self.samples):
            raise ValueError(f"{len(sources)} sources for {len(self.samples)} samples")
        self.sources = list(sources) if sources is not None else None
        self.read_report = read_report
        self.max_tokens_per_mb = int(max_tokens_per_mb)
        self.global_batch_samples = int(global_batch_samples)
        self.dp_rank, self.dp_size = int(dp_rank), int(dp_size)
        self.num_epochs = num_epochs
        self.shuffle, self.keep_groups, self.drop_last = shuffle, keep_groups, drop_last
        self.pad_to_multiple_of, self.pad_to_budget, self.pad_id = pad_to_multiple_of, pad_to_budget, pad_id
        self.microbatches_per_rank = microbatches_per_rank
        self.cost_fn = cost_fn or (lambda mb: microbatch_cost(mb, attention_cost))
        self.balance_budget = balance_budget
        self.share_prefixes = share_prefixes
        self.lookahead = int(lookahead)
        self.plan_fn = plan_fn
        self.route_aware, self.route_spec = bool(route_aware), route_spec
        self.mtp_tail = int(mtp_tail)
        self.carry = bool(carry)
        self.carry_cut, self.carry_schedule_fn = carry_cut, carry_schedule_fn
        loss_agg_factors([1], loss_agg, loss_agg_norm)  # a bad mode or norm is an error now
        self.loss_agg, self.loss_agg_norm = loss_agg, loss_agg_norm
        self.vision = vision  # `data.images.VisionInput` of image records: each microbatch gets its slots' pixels
        if self.carry and (mtp_tail or not share_prefixes):
            raise ValueError("carry packing does not run with MTP tail rows or flat packing yet")
        self._float_fields = self._validate(vocab_size)
        self._group_code, self._num_groups = self._group_codes()
        self._fingerprint = self._dataset_fingerprint()
        self._state = {"version": _STATE_VERSION, "seed": int(seed), "epoch": 0, "cursor": 0, "epoch_step": 0,
                       "global_step": 0, "num_samples": len(self.samples), "fingerprint": self._fingerprint}
        # Immutable, so one object serves every padding slot of every step.
        self._pad_mb = padding_microbatch(
            self.max_tokens_per_mb, num_rows=self.max_tokens_per_mb if pad_to_budget else pad_to_multiple_of,
            pad_id=pad_id, float_fields=self._float_fields, route_shape=self._route_shape)
        self.timing = PipelineTiming()
        self._active: Lookahead | None = None
        self._generation = 0

    @classmethod
    def from_files(cls, paths, *, vocab_size: int | None = None, bad_sample: str = "error",
                   report: ReadReport | None = None, **kwargs) -> "TreeDataPipeline":
        """Read JSONL / Parquet files (`read_samples`) and build a pipeline over their samples.

        The read's `ReadReport` (``report`` if given, else a new one) stays on the pipeline as
        ``read_report``: ``pipe.skipped`` counts the samples ``bad_sample="skip"`` dropped and
        ``pipe.read_report.summary()`` lists them; ``read_report.sources`` names every sample."""
        report = report if report is not None else ReadReport()
        samples = read_samples(paths, vocab_size=vocab_size, bad_sample=bad_sample, report=report,
                               route_spec=kwargs.get("route_spec"), require_routes=bool(kwargs.get("route_aware")))
        return cls(samples, vocab_size=vocab_size, sources=report.sources, read_report=report, **kwargs)

    @property
    def skipped(self) -> int:
        """Samples dropped while reading (``bad_sample="skip"``); 0 when no `ReadReport` was given.
        Fixed once the pipeline exists (the data is read up front), so it is the same at every step."""
        return self.read_report.num_skipped if self.read_report is not None else 0

    # ------------------------------------------------------------------ setup
    def _where(self, i: int) -> str:
        return self.sources[i] if self.sources is not None else f"sample {i}"

    def _validate(self, vocab_size) -> tuple[str, ...]:
        """Validate every sample once; returns the optional loss-map fields the run carries."""
        for i, s in enumerate(self.samples):
            validate_sample(i, s, max_tokens=None if self.carry else self.max_tokens_per_mb, vocab_size=vocab_size,
                            where=self._where(i),
                            route_spec=self.route_spec, mtp_tail=self.mtp_tail)
        self._route_shape = None
        if self.route_aware:
            from ..tree.routes import routes_shape

            has = np.array([s.routed_experts is not None for s in self.samples])
            if not has.all():
                i = int(np.argmin(has))
                raise ValueError(f"{self._where(i)}: has no routed_experts, but routing replay (route-aware packing) "
                                 "needs routes on every sample: a sample without them would be re-routed, not replayed")
            try:
                self._route_shape = routes_shape(self.samples)
            except ValueError as e:  # names "sample i": say where it came from
                i = int(str(e).split(":")[0].split()[-1])
                raise ValueError(f"{self._where(i)}: {str(e).split(': ', 1)[1]}") from None
        present = []
        for f, lm_name in _OPTIONAL_FIELDS.items():
            has = np.array([getattr(s, f) is not None for s in self.samples])
            if has.any() and not has.all():
                # pack refuses a microbatch mixing samples with and without the field, and any two
                # samples may meet in a window: the whole dataset must agree.
                i = int(np.argmin(has))
                raise ValueError(f"{self._where(i)}: has no {f}, but other samples of the dataset do")
            if has.all():
                present.append(lm_name)
        return tuple(present)

    def _group_codes(self) -> tuple[np.ndarray, int]:
        codes: dict = {}
        out = np.empty(len(self.samples), np.int64)
        for i, s in enumerate(self.samples):
            g = s.group
            if g is None:
                key = ("__sample__", i)
            else:
                key = ("__group__", g.item() if isinstance(g, np.generic) else g)
            try:
                out[i] = codes.setdefault(key, len(codes))
            except TypeError:  # unhashable group id (e.g. a list from JSON)
                out[i] = codes.setdefault(("__group__", repr(g)), len(codes))
        return out, len(codes)

    def _dataset_fingerprint(self) -> int:
        lens = np.array([len(s) for s in self.samples], np.int64)
        first = np.array([int(s.tokens[0]) for s in self.samples], np.int64)
        return zlib.crc32(first.tobytes(), zlib.crc32(lens.tobytes()))

    # ------------------------------------------------------------------ order and windows
    def epoch_order(self, epoch: int, seed: int | None = None) -> np.ndarray:
        """[num_samples] dataset indices in the order epoch ``epoch`` visits them."""
        n = len(self.samples)
        if not self.shuffle:
            return np.arange(n, dtype=np.int64)
        seed = self._state["seed"] if seed is None else seed
        rng = np.random.default_rng(np.random.SeedSequence([int(seed), int(epoch)]))
        if not self.keep_groups:
            return rng.permutation(n).astype(np.int64)
        group_rank = np.empty(self._num_groups, np.int64)
        group_rank[rng.permutation(self._num_groups)] = np.arange(self._num_groups)
        return np.argsort(group_rank[self._group_code], kind="stable").astype(np.int64)

    def _epoch_end(self) -> int:
        """Cursor value at which an epoch ends (the start of a window too small to use, if drop_last)."""
        n = len(self.samples)
        return n - n % self.global_batch_samples if self.drop_last else n

    @property
    def steps_per_epoch(self) -> int:
        """Steps of a full epoch (from cursor 0)."""
        n = len(self.samples)
        G = self.global_batch_samples
        return n // G if self.drop_last else -(-n // G)

    # ------------------------------------------------------------------ one step
    def build_step(self, state: dict | None = None) -> TreeStep:
        """Build the step that starts at ``state`` (default: the current state), without advancing.

        Pure: the same state and configuration give the same microbatches on every call and rank.
        """
        state = self._normalise(dict(self._state if state is None else state))
        return self._build(state, self.epoch_order(state["epoch"], state["seed"]))

    def _normalise(self, state: dict) -> dict:
        """Roll a state sitting at the end of an epoch over to the start of the next one."""
        if state["cursor"] >= self._epoch_end():
            state.update(epoch=state["epoch"] + 1, cursor=0, epoch_step=0)
        return state

    def _pack(self, window: np.ndarray, budget: int) -> list[TreeMicrobatch]:
        attach = (lambda mb: mb) if self.vision is None else self.vision.attach  # each microbatch's image pixels
        return [attach(self._to_dataset_ids(mb, window))
                for mb in pack(with_loss_agg([self.samples[i] for i in window.tolist()], self.loss_agg,
                                             self.loss_agg_norm), budget,
                               pad_to_multiple_of=self.pad_to_multiple_of, pad_id=self.pad_id,
                               pad_to_budget=self.pad_to_budget, share_prefixes=self.share_prefixes,
                               route_aware=self.route_aware, mtp_tail=self.mtp_tail, carry=self.carry)]

    def _slots_makespan(self, rows: Sequence[int]) -> float:
        """Slowest rank's rows when microbatches of ``rows`` are balanced (inf if they cannot fit)."""
        per_rank = self.microbatches_per_rank or max(1, -(-len(rows) // self.dp_size))
        if len(rows) > per_rank * self.dp_size:
            return float("inf")
        pad = self.pad_to_multiple_of
        return max(sum(rows[i] for i in a) + pad * (per_rank - len(a)) for a in balance(rows, self.dp_size, per_rank))

    def _choose_budget(self, window: np.ndarray) -> int:
        """Packing budget for a window: the full budget, or a smaller one when the window would pack
        into fewer microbatches than DP slots and leave ranks idle.

        Candidates start at max(longest sample, tree rows / slots) and grow by 10% (first-fit does not
        fill bins exactly, so the even split can spill into extra microbatches); the one with the
        smallest slowest rank wins, the full budget on ties. Smaller budgets may cut a tree and repeat
        its prefix: that is priced in, because each candidate is planned with the packer's own
        tree-splitting and first-fit steps (rows only, no layout is built).
        """
        B = self.max_tokens_per_mb
        # budgets are priced with the sharing packer's rows, so flat packing keeps the full budget
        if not self.balance_budget or self.pad_to_budget or self.dp_size == 1 or not self.share_prefixes or self.carry:
            return B
        m = self.pad_to_multiple_of
        plan = PrefixPlan([self.samples[i].tokens.astype(np.int64, copy=False) for i in window.tolist()],
                          [self.samples[i].routed_experts for i in window.tolist()] if self.route_aware else None,
                          mtp_tail=self.mtp_tail)

        def bin_rows(budget):
            return plan.microbatch_rows(budget, m)

        slots = self.dp_size * (self.microbatches_per_rank or 1)
        full = bin_rows(B)
        if len(full) >= slots:
            return B
        best, best_span = B, self._slots_makespan(full)
        budget = max(int(plan.lens.max()), -(-int((plan.lens - plan.lcp).sum()) // slots))
        for _ in range(12):
            budget = -(-budget // m) * m
            if budget >= B:
                break
            rows = bin_rows(budget)
            span = self._slots_makespan(rows)
            if span < best_span:
                best, best_span = budget, span
            if len(rows) <= slots:
                break
            budget = int(budget * 1.1) + 1
        return best

    def _build(self, state: dict, order: np.ndarray) -> TreeStep:
        t0 = time.perf_counter()
        start = state["cursor"]
        window = np.sort(order[start: start + self.global_batch_samples])
        pad_mb = self._pad_mb
        mbs = self._pack(window, self._choose_budget(window))
        costs = [float(self.cost_fn(mb)) for mb in mbs]
        if self.carry:
            return self._build_carry(state, window, mbs, costs, t0)
        per_rank = self.microbatches_per_rank or max(1, -(-len(mbs) // self.dp_size))
        if len(mbs) > per_rank * self.dp_size:
            raise ValueError(f"epoch {state['epoch']} step {state['epoch_step']}: {len(mbs)} microbatches do not fit "
                             f"{self.dp_size} ranks x microbatches_per_rank={self.microbatches_per_rank}; raise "
                             f"microbatches_per_rank or max_tokens_per_mb, or lower global_batch_samples")
        assign = balance(costs, self.dp_size, per_rank)
        pad_cost = float(self.cost_fn(pad_mb))
        rank_costs = tuple(sum(costs[i] for i in a) + pad_cost * (per_rank - len(a)) for a in assign)
        mine = assign[self.dp_rank]
        by_depth = _weight_by_depth(mbs)
        local = [dataclasses.replace(mb, step_weight_by_depth=by_depth)
                 for mb in [mbs[i] for i in mine] + [pad_mb] * (per_rank - len(mine))]
        pack_s = time.perf_counter() - t0

        return self._step(state, window, mbs, mine, local, per_rank - len(mine), rank_costs, by_depth, pack_s)

    def _build_carry(self, state: dict, window: np.ndarray, mbs: list, costs: list, t0: float) -> TreeStep:
        """Carry: groups on the ranks by `assign_carry_ranks` (``carry_cut``: a group over one rank's share of the
        rows is cut over ranks, its carried state crossing them at the syncs of `rank_schedule`); every rank then
        runs the same number of schedule items (an exporting microbatch is a fill and a restore), padding
        microbatches making up the difference."""
        from ..tree.carry import assign_carry_ranks

        cut = self.carry_cut if self.carry_schedule_fn is not None else "never"
        assign = assign_carry_ranks(mbs, self.dp_size, cut=cut)
        schedule = self.carry_schedule_fn(mbs, assign) if self.dp_size > 1 and cut != "never" else None
        if schedule is not None and not schedule.syncs:
            schedule = None  # no group is cut: each rank runs its groups whole (`megatron.carry.carry_items`)
        items = [sum(1 + (len(mbs[i].carry.exported) > 0) for i in a) for a in assign]
        if schedule is not None:  # (its padding items are padding microbatches here)
            if self.microbatches_per_rank is not None and schedule.num_items < self.microbatches_per_rank:
                schedule = schedule.padded(self.microbatches_per_rank)  # padding items at the end
            items = [schedule.num_items - schedule.num_pads(r) for r in range(self.dp_size)]
            if self.microbatches_per_rank is not None and schedule.num_items > self.microbatches_per_rank:
                raise ValueError(f"epoch {state['epoch']} step {state['epoch_step']}: carry cut over DP ranks runs "
                                 f"{schedule.num_items} schedule items per rank but microbatches_per_rank="
                                 f"{self.microbatches_per_rank}")
        per_rank_items = max(items) if schedule is None else schedule.num_items
        if self.microbatches_per_rank is not None and per_rank_items > self.microbatches_per_rank:
            raise ValueError(f"epoch {state['epoch']} step {state['epoch_step']}: carry needs {per_rank_items} schedule "
                             f"items on a rank but microbatches_per_rank={self.microbatches_per_rank}")
        per_rank_items = self.microbatches_per_rank or per_rank_items
        pad_mb = self._pad_mb
        pad_cost = float(self.cost_fn(pad_mb))
        rank_costs = tuple(sum(costs[i] for i in a) + pad_cost * (per_rank_items - n) for a, n in zip(assign, items))
        mine = assign[self.dp_rank]
        by_depth = _weight_by_depth(mbs)
        pad = per_rank_items - items[self.dp_rank]
        local = [dataclasses.replace(mb, step_weight_by_depth=by_depth) for mb in [mbs[i] for i in mine] + [pad_mb] * pad]
        step = self._step(state, window, mbs, mine, local, pad, rank_costs, by_depth, time.perf_counter() - t0)
        if schedule is None:
            return step
        whole = tuple(dataclasses.replace(mb, step_weight_by_depth=by_depth) for mb in mbs)
        return dataclasses.replace(step, carry_schedule=schedule, carry_microbatches=whole,
                                   carry_pad=dataclasses.replace(pad_mb, step_weight_by_depth=by_depth))

    def _step(self, state, window, mbs, mine, local, num_padding, rank_costs, by_depth, pack_s) -> TreeStep:
        plans, plan_s = None, 0.0
        if self.plan_fn is not None:
            t1 = time.perf_counter()
            plans = [self.plan_fn(mb) for mb in local]
            plan_s = time.perf_counter() - t1

        tot = lambda xs, k: int(sum(getattr(mb.stats, k) for mb in xs))
        # unique over the step: with carry one sample's targets may lie in several microbatches
        with_targets = len(np.unique(np.concatenate([mb.loss_map.sample_index.numpy() for mb in mbs] + [np.zeros(0, int)])))
        after = self._normalise(dict(state, cursor=state["cursor"] + len(window), epoch_step=state["epoch_step"] + 1,
                                     global_step=state["global_step"] + 1))
        return TreeStep(
            epoch=state["epoch"], step=state["epoch_step"], global_step=state["global_step"], dp_rank=self.dp_rank,
            microbatches=local, num_padding_microbatches=num_padding, plans=plans,
            sample_ids=tuple(window.tolist()),
            rank_sample_ids=tuple(sorted(i for k in mine for i in mbs[k].sample_ids)),
            num_targets=tot(mbs, "num_targets"), num_samples=len(window), num_samples_with_targets=with_targets,
            tree_tokens=tot(mbs, "tree_tokens"), flat_tokens=tot(mbs, "flat_tokens"),
            local_num_targets=tot(local, "num_targets"), local_tree_tokens=tot(local, "tree_tokens"),
            local_flat_tokens=tot(local, "flat_tokens"), num_microbatches=len(mbs), rank_costs=rank_costs,
            state=after, pack_s=pack_s, plan_s=plan_s, target_weight_by_depth=by_depth)

    @staticmethod
    def _to_dataset_ids(mb: TreeMicrobatch, window: np.ndarray) -> TreeMicrobatch:
        # pack numbers samples by their index in the window; the window is ascending, so the
        # dataset ids stay ascending (TreeMicrobatch.sample_rows relies on that).
        # numpy, not torch indexing: this runs in the lookahead thread, away from torch's thread pool.
        lm = dataclasses.replace(mb.loss_map, sample_index=torch.from_numpy(window[mb.loss_map.sample_index.numpy()]))
        extra = {}
        if mb.carry is not None:  # the samples whose paths it holds, too
            ids = tuple(window[list(mb._path_ids)].tolist())
            extra = dict(_path_ids=ids, carry=dataclasses.replace(mb.carry, path_sample_ids=ids))
        return dataclasses.replace(mb, loss_map=lm, sample_ids=tuple(window[list(mb.sample_ids)].tolist()), **extra)

    # ------------------------------------------------------------------ iteration
    def _produce(self, state: dict) -> Iterator[TreeStep]:
        """Steps from ``state`` to the end of the last epoch (forever when num_epochs is None)."""
        state = self._normalise(dict(state))
        order_epoch, order = None, None
        while self.num_epochs is None or state["epoch"] < self.num_epochs:
            if order_epoch != state["epoch"]:
                order_epoch, order = state["epoch"], self.epoch_order(state["epoch"], state["seed"])
            step = self._build(state, order)
            yield step
            state = step.state

    def __iter__(self) -> Iterator[TreeStep]:
        """Steps from the current state. Starting a new iteration closes the previous one."""
        self.close()
        self._generation += 1
        gen = self._generation
        start = dict(self._state)
        if self.lookahead:
            source = self._active = Lookahead(lambda: self._produce(start), depth=self.lookahead)
        else:
            source = self._produce(start)
        return self._consume(source, gen)

    def _consume(self, source, gen: int) -> Iterator[TreeStep]:
        try:
            while gen == self._generation:
                t0 = time.perf_counter()
                try:
                    step = next(source)
                except StopIteration:
                    return
                step.wait_s = time.perf_counter() - t0
                if gen != self._generation:  # load_state_dict / a new iteration superseded this one
                    return
                self._state = dict(step.state)
                t = self.timing
                t.steps += 1
                t.pack_s += step.pack_s
                t.plan_s += step.plan_s
                t.wait_s += step.wait_s
                t.max_wait_s = max(t.max_wait_s, step.wait_s)
                yield step
        finally:
            source.close()

    def close(self) -> None:
        """Stop the lookahead thread of the current iteration (if any). The state is kept."""
        if self._active is not None:
            self._active.close()
            self._active = None

    def __enter__(self) -> "TreeDataPipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict:
        """Position after the last step handed to the consumer: plain ints, safe to pickle / JSON.

        keys: version, seed, epoch, cursor (samples of the epoch order consumed), epoch_step,
        global_step, num_samples and fingerprint (to refuse resuming on a different dataset).
        """
        return dict(self._normalise(dict(self._state)))

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (from `state_dict` or `TreeStep.state`), including its seed.

        Stops a running iteration (its iterator ends); iterate again to continue."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"unsupported pipeline state version {state.get('version')!r}")
        if state["num_samples"] != len(self.samples) or state["fingerprint"] != self._fingerprint:
            raise ValueError(f"pipeline state was saved for a different dataset ({state['num_samples']} samples, "
                             f"fingerprint {state['fingerprint']}; this one: {len(self.samples)}, {self._fingerprint})")
        if not 0 <= state["cursor"] <= len(self.samples):
            raise ValueError(f"cursor {state['cursor']} outside [0, {len(self.samples)}]")
        self.close()
        self._generation += 1
        self._state = {k: int(state[k]) for k in ("version", "seed", "epoch", "cursor", "epoch_step", "global_step",
                                                   "num_samples", "fingerprint")}
