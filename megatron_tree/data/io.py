"""Reading samples from files. JSONL: one sample per line, ``{"tokens": [...], "loss_mask": [...], ...}``.

Recognised keys are `Sample`'s fields (tokens, loss_mask, advantage, old_logprobs, ref_logprobs,
weight, group, routed_experts: a list per token of ``[moe_layers][topk]`` expert ids, as vLLM / SGLang
report them for routing replay); other keys go to ``meta``. A bad line raises ValueError naming ``file:line`` (the
file as the caller spelled it, 1-based line; ``file:line:column: invalid JSON: ...`` when the line
does not parse) and the rule it breaks (``bad_sample="error"``), or is skipped and recorded in a
`ReadReport` (``bad_sample="skip"``).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from ..tree.sample import Sample, validate_sample

_FIELDS = ("tokens", "loss_mask", "advantage", "old_logprobs", "ref_logprobs", "weight", "group", "routed_experts")


@dataclass
class ReadReport:
    """Where each kept sample came from and which lines were skipped (with the reason).

    sources  "file:line" (JSONL) / "file:row R" (Parquet) of each kept sample, in reading order
    skipped  ("file:line", reason) of each sample dropped by ``bad_sample="skip"``, in reading order;
             ``reason`` is the message ``bad_sample="error"`` would have raised (it starts with the
             location, with the column for invalid JSON)
    """

    sources: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)

    def summary(self, max_items: int = 5) -> str:
        """Human-readable account of the skipped samples, "" when none was skipped::

            skipped 7 bad samples (--tree-bad-sample skip):
              data/a.jsonl:3:1: invalid JSON: Expecting value
              data/a.jsonl:9: empty sample (no tokens)
              ... and 5 more

        The first ``max_items`` are listed with their reasons, in reading order.
        """
        n = len(self.skipped)
        if not n:
            return ""
        lines = [f"skipped {n} bad sample{'s' if n != 1 else ''} (--tree-bad-sample skip):"]
        for where, reason in self.skipped[:max_items]:
            # the reason normally starts with its location already; never print it twice
            lines.append(f"  {reason}" if reason.startswith(f"{where}:") else f"  {where}: {reason}")
        if n > max_items:
            lines.append(f"  ... and {n - max_items} more")
        return "\n".join(lines)


def sample_from_record(rec: dict, where: str, *, vocab_size: int | None = None, route_spec=None) -> Sample:
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    if "tokens" not in rec:
        raise ValueError(f"{where}: missing required key 'tokens'")
    kw = {k: rec[k] for k in _FIELDS if k in rec and rec[k] is not None}
    meta = {k: v for k, v in rec.items() if k not in _FIELDS}
    try:
        s = Sample(**kw, meta=meta)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None
    validate_sample(0, s, vocab_size=vocab_size, where=where, route_spec=route_spec)
    return s


def collect_samples(records, *, vocab_size: int | None = None, bad_sample: str = "error",
                    report: ReadReport | None = None, route_spec=None) -> list[Sample]:
    """Samples from ``records``: an iterable of ``(where, make_record)``; ``make_record()`` returns a
    dict of Sample fields (other keys become ``meta``) or raises ValueError naming ``where``.
    The one place that applies the bad-sample policy for every file format. ``route_spec``
    (`megatron_tree.tree.routes.RouteSpec`): the model's MoE layers / top-k / experts that a record's
    ``routed_experts`` must match."""
    if bad_sample not in ("error", "skip"):
        raise ValueError(f"bad_sample must be 'error' or 'skip', got {bad_sample!r}")
    report = report if report is not None else ReadReport()
    out = []
    for where, make_record in records:
        try:
            s = sample_from_record(make_record(), where, vocab_size=vocab_size, route_spec=route_spec)
        except ValueError as e:
            if bad_sample == "error":
                raise
            report.skipped.append((where, str(e)))
            continue
        out.append(s)
        report.sources.append(where)
    return out


def read_jsonl(path, *, vocab_size: int | None = None, bad_sample: str = "error",
               report: ReadReport | None = None, route_spec=None) -> list[Sample]:
    """Samples of a JSONL file, in file order. Locations read ``path:line`` with ``path`` as given
    (not resolved, not shortened to its base name), so a message points at the file the user named."""
    name = os.fspath(path)

    def records():
        with open(path) as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    where = f"{name}:{lineno}"
                    yield where, lambda line=line, where=where: _parse_json(line, where)

    return collect_samples(records(), vocab_size=vocab_size, bad_sample=bad_sample, report=report,
                           route_spec=route_spec)


def _parse_json(line: str, where: str):
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:  # colno is 1-based, like the line number
        raise ValueError(f"{where}:{e.colno}: invalid JSON: {e.msg}") from None


def write_jsonl(samples, path) -> None:
    """Write samples in the format `read_jsonl` reads."""
    with open(path, "w") as f:
        for s in samples:
            rec = {"tokens": s.tokens.tolist()}
            for k in _FIELDS[1:]:
                v = getattr(s, k)
                if v is not None:
                    rec[k] = v.tolist() if hasattr(v, "tolist") else v
            f.write(json.dumps(rec) + "\n")
