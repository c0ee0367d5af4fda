"""Reading samples from files. JSONL: one sample per line, ``{"tokens": [...], "loss_mask": [...], ...}``.

Recognised keys are `Sample`'s fields (tokens, loss_mask, advantage, old_logprobs, ref_logprobs,
weight, group, routed_experts: a list per token of ``[moe_layers][topk]`` expert ids, as vLLM / SGLang
report them for routing replay; images: the image paths of a vision-language record, absolute or relative
to the file, in order of appearance, read with a `data.images.VisionInput`); other keys go to ``meta``. A bad line raises `DataError` (a
ValueError) naming ``file:line`` (the file as the caller spelled it, 1-based line;
``file:line:column: invalid JSON: ...`` when the line does not parse, ``file:line:column: invalid
UTF-8: ...`` when it does not decode) and the rule it breaks (``bad_sample="error"``), or is skipped
and recorded in a `ReadReport` (``bad_sample="skip"``).

A key one edit away from a field name (``"advantages"``, ``"Tokens"``, a flipped byte) is refused, not
carried as ``meta`` (the record would train without the field). Types are checked before anything
is converted, so a value of the wrong JSON type is refused, never
coerced: token ids and expert ids are JSON integers (not booleans, not floats, not strings), a loss
mask holds booleans or 0 / 1, the RL fields hold numbers (``null`` inside a per-token list is NaN,
allowed only where the mask has no target), a key appears once per record. `validate_sample` then
checks lengths, ranges and finiteness at target positions.
"""
from __future__ import annotations

import codecs
import functools
import json
import os
from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from ..tree.sample import Sample, validate_sample

_FIELDS = ("tokens", "loss_mask", "advantage", "old_logprobs", "ref_logprobs", "weight", "group", "routed_experts",
           "images")


class DataError(ValueError):
    """A record, or a whole file, that the readers refuse. The message starts with the location:
    ``file:line`` (JSONL; ``file:line:column`` where the column is known), ``file:row R`` (Parquet,
    0-based row) or ``file`` alone for the whole file (a Parquet file that cannot be opened, a column
    of the wrong type); then the rule it breaks."""


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


# ------------------------------------------------------------------------------------------ field types
_KINDS = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
          dict: "an object", type(None): "null"}


def _describe(x) -> str:
    """``x`` as the JSON it was read from, shortened, with its JSON type."""
    if isinstance(x, list):
        return f"a list of {len(x)}"
    if isinstance(x, dict):
        return "an object"
    if x is None:
        return "null"
    try:
        text = json.dumps(x)
    except (TypeError, ValueError):
        text = repr(x)
    if len(text) > 40:
        text = text[:37] + "..."
    kind = "an integer outside the int64 range" if type(x) is int and not -2**63 <= x < 2**63 else \
        _KINDS.get(type(x), type(x).__name__)
    return f"{text} ({kind})"


def _is_int64(x) -> bool:
    return type(x) is int and -2**63 <= x < 2**63


def _is_number(x) -> bool:
    if type(x) is float or isinstance(x, (np.floating, np.integer)):
        return True
    if type(x) is not int:
        return False
    try:
        float(x)
    except OverflowError:
        return False
    return True


def _first_bad(v: list, depth: int, ok, path: str = ""):
    """``(index path like "[3][0][1]", value)`` of the first entry of the nested list ``v`` that is not
    a list above ``depth`` levels, or fails ``ok`` at the leaves; None when every entry is well typed."""
    for i, x in enumerate(v):
        p = f"{path}[{i}]"
        if depth > 1:
            if not isinstance(x, list):
                return p, x
            found = _first_bad(x, depth - 1, ok, p)
            if found is not None:
                return found
        elif not ok(x):
            return p, x
    return None


def _refuse(where: str, f: str, rule: str, v, depth: int, ok):
    bad = _first_bad(v, depth, ok)
    if bad is None:
        return None
    path, x = bad
    raise DataError(f"{where}: {f} must be {rule}: {f}{path} is {_describe(x)}")


def _container(where: str, f: str, rule: str, v):
    raise DataError(f"{where}: {f} must be {rule}, got {_describe(v)}")


def _ints(v, f: str, where: str, depth: int, rule: str, container: str, bools: bool):
    """Integer ids (``tokens`` depth 1, ``routed_experts`` depth 3) as an integer array; a well-typed
    ragged nesting is returned as read, for the shape rules to name."""
    if isinstance(v, np.ndarray):
        if v.dtype.kind in "iu" or v.size == 0:
            return v
        raise DataError(f"{where}: {f} must be {rule}, got values of type {v.dtype}")
    if not isinstance(v, list):
        _container(where, f, container, v)
    if not v:
        return np.zeros(0, np.int64) if depth == 1 else v
    if depth == 1:
        ok = set(map(type, v)) == {int}
    else:  # a routes-sized nesting: numpy's dtype says everything but a boolean, looked for only if present
        try:
            ok = not bools or bool not in set(map(type, chain.from_iterable(chain.from_iterable(v))))
        except TypeError:  # an entry that is not a list: named below
            ok = False
    if ok:
        try:
            a = np.asarray(v)
        except (ValueError, OverflowError):  # ragged, or an id beyond 64 bits
            a = None
        if a is not None and a.dtype.kind in "iu" and a.ndim == depth:
            return a
    _refuse(where, f, rule, v, depth, _is_int64)
    return v


def _mask(v, f: str, where: str):
    if isinstance(v, np.ndarray):
        return v  # a typed column: validate_sample checks its values
    if not isinstance(v, list):
        _container(where, f, "a list of booleans (or 0 / 1), one per token", v)
    types = set(map(type, v))
    if types <= {bool}:
        return np.array(v, dtype=bool)
    if types <= {bool, int}:
        try:
            a = np.asarray(v, dtype=np.int64)
        except OverflowError:
            a = None
        if a is not None and ((a == 0) | (a == 1)).all():
            return a.astype(bool)
    _refuse(where, f, "booleans (or 0 / 1)", v, 1,
            lambda x: x is True or x is False or (type(x) is int and x in (0, 1)))
    return v


def _floats(v, f: str, where: str, scalar: bool):
    """Per-token RL values (or a per-sample scalar where ``scalar``) as float64; ``null`` in a list is NaN."""
    rule = "a number or a list of numbers, one per token" if scalar else "a list of numbers, one per token"
    if isinstance(v, np.ndarray):
        if v.dtype.kind in "fiu":
            return v
        raise DataError(f"{where}: {f} must be {rule}, got values of type {v.dtype}")
    if not isinstance(v, list):
        if scalar and _is_number(v):
            return v
        _container(where, f, rule, v)
    if set(map(type, v)) <= {int, float, type(None)}:
        try:
            return np.asarray(v, dtype=np.float64)
        except OverflowError:  # an integer beyond float64
            pass
    _refuse(where, f, "numbers (or null where the mask has no target)", v, 1, lambda x: x is None or _is_number(x))
    return v


def _typed(rec: dict, where: str, bools: bool) -> dict:
    """The recognised fields of ``rec`` with their JSON types checked (`DataError` naming the field,
    the first offending entry and its type) and converted to arrays; ``group`` as read."""
    kw = {}
    for f in _FIELDS:
        v = rec.get(f)
        if v is None or f == "images":  # images: read by `data.images.VisionInput.refs`
            continue
        if f == "tokens":
            v = _ints(v, f, where, 1, "integers", "a list of integers", bools)
        elif f == "routed_experts":
            v = _ints(v, f, where, 3, "integer expert ids", "a list per token of [moe_layers][topk] integer expert ids",
                      bools)
        elif f == "loss_mask":
            v = _mask(v, f, where)
        elif f in ("old_logprobs", "ref_logprobs"):
            v = _floats(v, f, where, scalar=False)
        elif f in ("advantage", "weight"):
            v = _floats(v, f, where, scalar=True)
        kw[f] = v
    return kw


@functools.lru_cache(maxsize=4096)
def near_field(key: str):
    """The field name ``key`` is one edit away from (a character changed, added, dropped, two adjacent
    ones swapped, or the case changed), None when it is a field or none is that close: such a key is
    a damaged or mistyped field name (``"advantages"``, ``"loss_mask "``, a flipped byte), whose value
    would otherwise go to ``meta`` and the record train without it."""
    if key in _FIELDS:
        return None
    a = key.lower()
    for f in _FIELDS:
        if a == f:
            return f
        if abs(len(a) - len(f)) > 1:
            continue
        if len(a) == len(f):
            d = [i for i in range(len(a)) if a[i] != f[i]]
            if len(d) == 1 or (len(d) == 2 and d[1] == d[0] + 1 and a[d[0]] == f[d[1]] and a[d[1]] == f[d[0]]):
                return f
            continue
        short, long_ = (a, f) if len(a) < len(f) else (f, a)
        i = 0
        while i < len(short) and short[i] == long_[i]:
            i += 1
        if short[i:] == long_[i + 1:]:
            return f
    return None


def sample_from_record(rec: dict, where: str, *, vocab_size: int | None = None, route_spec=None,
                       require_routes: bool = False, maybe_bools: bool = True, vision=None,
                       base_dir: str | None = None) -> Sample:
    """The `Sample` of one record (a dict of Sample fields, other keys become ``meta``), or `DataError`
    naming ``where``. ``require_routes``: a record without ``routed_experts`` is refused (routing
    replay). ``maybe_bools=False`` promises the record holds no JSON boolean (the JSONL reader knows
    it from the line's text), which saves scanning large ``routed_experts`` nestings for one.
    ``vision`` (`data.images.VisionInput`): read the record's ``images`` (paths from ``base_dir``, or
    bytes) and match them with its placeholder tokens; without it a record with images is refused."""
    if not isinstance(rec, dict):
        kind = _KINDS.get(type(rec), type(rec).__name__)
        raise DataError(f"{where}: expected a JSON object (one record per line), got {kind}")
    for k in rec:
        near = near_field(k) if k not in _FIELDS else None
        if near is not None:
            raise DataError(f"{where}: key {json.dumps(k)} is not a field; did you mean '{near}'? (a key one edit "
                            "from a field name is taken for a damaged or mistyped field, never carried as meta)")
    if rec.get("tokens") is None:
        raise DataError(f"{where}: tokens is null" if "tokens" in rec else f"{where}: missing required key 'tokens'")
    kw = _typed(rec, where, maybe_bools)
    meta = {k: v for k, v in rec.items() if k not in _FIELDS}
    if vision is not None:
        try:
            kw["images"] = vision.refs(where, kw["tokens"], rec.get("images") or [], base_dir)
        except ValueError as e:
            raise DataError(str(e) if str(e).startswith(where) else f"{where}: {e}") from None
    elif rec.get("images"):
        raise DataError(f"{where}: has images, but no vision-language model reads them (give the VLM checkpoint, "
                        "--hf-model): its image processor and placeholder token define the image rows")
    try:
        s = Sample(**kw, meta=meta)
    except (TypeError, ValueError) as e:
        raise DataError(f"{where}: {e}") from None
    validate_sample(0, s, vocab_size=vocab_size, where=where, route_spec=route_spec)
    if require_routes and s.routed_experts is None:
        raise DataError(f"{where}: has no routed_experts, but routing replay needs routes on every record: a record "
                        "without them would be re-routed, not replayed")
    return s


def collect_samples(records, *, vocab_size: int | None = None, bad_sample: str = "error",
                    report: ReadReport | None = None, route_spec=None, require_routes: bool = False,
                    vision=None, base_dir: str | None = None) -> list[Sample]:
    """Samples from ``records``: an iterable of ``(where, make_record)``; ``make_record()`` returns a
    dict of Sample fields (other keys become ``meta``) or ``(dict, maybe_bools)``, or raises ValueError
    naming ``where``. The one place that applies the bad-sample policy for every file format: a refused
    record raises `DataError` (its message starts with ``where``) or is skipped and recorded.
    ``route_spec`` (`megatron_tree.tree.routes.RouteSpec`): the model's MoE layers / top-k / experts
    that a record's ``routed_experts`` must match; ``require_routes``: every record must carry them;
    ``vision`` / ``base_dir``: see `sample_from_record`."""
    if bad_sample not in ("error", "skip"):
        raise ValueError(f"bad_sample must be 'error' or 'skip', got {bad_sample!r}")
    report = report if report is not None else ReadReport()
    out = []
    for where, make_record in records:
        try:
            rec = make_record()
            rec, bools = rec if isinstance(rec, tuple) else (rec, True)
            s = sample_from_record(rec, where, vocab_size=vocab_size, route_spec=route_spec,
                                   require_routes=require_routes, maybe_bools=bools, vision=vision, base_dir=base_dir)
        except ValueError as e:
            msg = str(e)
            err = e if isinstance(e, DataError) and msg.startswith(where) else \
                DataError(msg if msg.startswith(f"{where}:") else f"{where}: {msg}")
            if bad_sample == "error":
                raise err from None
            report.skipped.append((where, str(err)))
            continue
        out.append(s)
        report.sources.append(where)
    return out


def read_jsonl(path, *, vocab_size: int | None = None, bad_sample: str = "error",
               report: ReadReport | None = None, route_spec=None, require_routes: bool = False,
               vision=None) -> list[Sample]:
    """Samples of a JSONL file, in file order. Locations read ``path:line`` with ``path`` as given
    (not resolved, not shortened to its base name), so a message points at the file the user named.
    Lines are split at ``\\n`` only (as ``sed -n Np`` counts them) and decoded as UTF-8 one by one (a
    byte-order mark on the first line is dropped): a byte that does not decode is the error of its
    line, with its column. Lines holding only JSON whitespace are not records. ``vision``
    (`data.images.VisionInput`): image paths are read relative to the file's directory."""
    name = os.fspath(path)

    def records():
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                if lineno == 1 and raw.startswith(codecs.BOM_UTF8):
                    raw = raw[len(codecs.BOM_UTF8):]
                if raw.strip(b" \t\r\n"):
                    where = f"{name}:{lineno}"
                    yield where, lambda raw=raw, where=where: _parse_json(raw, where)

    return collect_samples(records(), vocab_size=vocab_size, bad_sample=bad_sample, report=report,
                           route_spec=route_spec, require_routes=require_routes, vision=vision,
                           base_dir=os.path.dirname(os.path.abspath(name)))


def _unique_keys(pairs):
    d = dict(pairs)
    if len(d) != len(pairs):
        seen = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise _DuplicateKey(dup)
    return d


class _DuplicateKey(ValueError):
    pass


def _parse_json(raw: bytes, where: str):
    """``(record, maybe_bools)`` of one line's bytes; DataError naming ``where:column``."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:  # the column in characters, 1-based like JSON's (the bytes before decode)
        col = len(raw[:e.start].decode("utf-8")) + 1
        raise DataError(f"{where}:{col}: invalid UTF-8: byte 0x{raw[e.start]:02x} ({e.reason})") from None
    try:
        rec = json.loads(line, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as e:  # colno is 1-based, like the line number
        raise DataError(f"{where}:{e.colno}: invalid JSON: {e.msg}") from None
    except _DuplicateKey as e:
        raise DataError(f"{where}: key {json.dumps(e.args[0])} appears twice in one object (which value is "
                        "meant?)") from None
    except RecursionError:
        raise DataError(f"{where}: invalid JSON: nested too deeply") from None
    return rec, (b"true" in raw or b"false" in raw)


def _image_path(s, im) -> str:
    if not os.path.isfile(im.source):
        raise ValueError(f"sample with tokens {s.tokens[:8].tolist()}...: image {im.source!r} is not a file (it came "
                         "as bytes): JSONL names images by path")
    return os.path.abspath(im.source)


def write_jsonl(samples, path) -> None:
    """Write samples in the format `read_jsonl` reads (``meta`` as the record's other keys, as it reads them)."""
    with open(path, "w") as f:
        for s in samples:
            rec = {"tokens": s.tokens.tolist()}
            for k in _FIELDS[1:]:
                v = getattr(s, k)
                if k == "images" and v:
                    v = [_image_path(s, im) for im in v]
                if v is not None:
                    rec[k] = v.tolist() if hasattr(v, "tolist") else v
            rec.update((k, v) for k, v in (s.meta or {}).items() if k not in rec)
            f.write(json.dumps(rec) + "\n")
