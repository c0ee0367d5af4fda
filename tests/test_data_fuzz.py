"""Fuzzed readers (issue 27, the data side): damaged JSONL and Parquet trajectory files.

Valid records are drawn by hypothesis, written, damaged (JSONL: bytes cut, flipped, inserted,
deleted, non-UTF-8 bytes, and records with a wrong JSON type at a field, missing / null fields,
nested lists, huge / negative / float ids, short or long per-token fields, NaN / inf / null at a
target, a list instead of an object, a key given twice or one edit off a field name; Parquet: a file
cut short, a column of the wrong type, given twice or renamed, a missing column, nulls, lengths that
disagree, non-finite values at a target, one bit flipped anywhere) and read back. ``spec`` below is
the readers' contract written out independently, line by line (or row by row): it decides whether a
line is a valid record and what `Sample` it means. The properties, for both policies:

* nothing but `DataError` (a ValueError whose message starts with the location) ever escapes;
* ``bad_sample="error"`` raises for the first line ``spec`` refuses, naming ``file:line`` (or
  ``file:row R``) and a reason, and reads everything when ``spec`` refuses nothing;
* ``bad_sample="skip"`` keeps exactly the lines ``spec`` accepts, each as the `Sample` ``spec``
  says (a damaged file never yields a record other than what its bytes say: what byte damage
  leaves valid, a flipped digit in a token id, is read as written), and records every other one;
* a structurally damaged record is always refused (the damage is checked to break the contract).

Deterministic (``derandomize``, no example database): 640 examples in all, 10-15 s on two
shared CPU cores. Raise ``max_examples`` (and drop ``derandomize``) locally to explore further.
"""
from __future__ import annotations

import codecs
import json
import math
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from megatron_tree.data.io import DataError, ReadReport, read_jsonl
from megatron_tree.tree.routes import RouteSpec

VOCAB, TOPK, EXPERTS = 50, 2, 4
ROUTES = RouteSpec(topk=TOPK, num_experts=EXPERTS)
FLOAT_FIELDS = ("advantage", "weight", "old_logprobs", "ref_logprobs")
FIELDS = ("tokens", "loss_mask", "advantage", "old_logprobs", "ref_logprobs", "weight", "group", "routed_experts")
FUZZ = settings(derandomize=True, database=None, deadline=None, print_blob=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.filter_too_much])


# ------------------------------------------------------------------------------------------------ the contract
class _Dup(Exception):
    pass


def _unique(pairs):
    d = dict(pairs)
    if len(d) != len(pairs):
        raise _Dup
    return d


def _number(x) -> bool:
    if type(x) not in (int, float):
        return False
    try:
        float(x)
    except OverflowError:
        return False
    return True


def _edits(a: str, b: str) -> int:
    """Damerau-Levenshtein distance (optimal string alignment)."""
    d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
    return d[len(a)][len(b)]


def spec(rec):
    """What a record means under the contract: a dict of expected `Sample` contents, or None when the
    record must be refused. Independent of the readers' code (plain Python over the decoded JSON)."""
    if not isinstance(rec, dict):
        return None
    if any(k not in FIELDS and any(_edits(k.lower(), f) <= 1 for f in FIELDS) for k in rec):
        return None  # a field name damaged or mistyped: refused, never meta
    tokens = rec.get("tokens")
    if not (isinstance(tokens, list) and tokens and all(type(t) is int and 0 <= t < VOCAB for t in tokens)):
        return None
    n = len(tokens)
    mask = rec.get("loss_mask")
    if mask is not None:
        if not (isinstance(mask, list) and len(mask) == n
                and all(m is True or m is False or (type(m) is int and m in (0, 1)) for m in mask) and not mask[0]):
            return None
        target = [bool(m) for m in mask]
    else:
        target = [False] + [True] * (n - 1)
    out = {"tokens": tokens, "target": target, "group": rec.get("group"),
           "meta": {k: v for k, v in rec.items() if k not in FIELDS}}
    for f in FLOAT_FIELDS:
        v = rec.get(f)
        if v is None:
            out[f] = None
            continue
        if not isinstance(v, list):
            if f in ("old_logprobs", "ref_logprobs") or not _number(v) or not math.isfinite(float(v)):
                return None
            out[f] = float(v)
            continue
        if len(v) != n or not all(x is None or _number(x) for x in v):
            return None
        vals = [math.nan if x is None else float(x) for x in v]
        if any(t and not math.isfinite(x) for x, t in zip(vals, target)):
            return None
        out[f] = vals
    routes = rec.get("routed_experts")
    out["routed_experts"] = None
    if routes is not None:
        if not (isinstance(routes, list) and len(routes) == n and all(isinstance(r, list) for r in routes)):
            return None
        layers = {len(r) for r in routes}
        if len(layers) != 1 or 0 in layers:
            return None
        for r in routes:
            for k in r:
                if not (isinstance(k, list) and len(k) == TOPK and all(type(e) is int and 0 <= e < EXPERTS for e in k)
                        and len(set(k)) == TOPK):
                    return None
        out["routed_experts"] = routes
    return out


def spec_line(raw: bytes, first: bool):
    """``"blank"``, None (refused) or the expected contents of one JSONL line's bytes."""
    if first and raw.startswith(codecs.BOM_UTF8):
        raw = raw[3:]
    if not raw.strip(b" \t\r\n"):
        return "blank"
    try:
        rec = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique)
    except (ValueError, RecursionError, _Dup):
        return None
    return spec(rec)


def same_sample(s, want) -> bool:
    if s.tokens.tolist() != want["tokens"] or s.target_mask().tolist() != want["target"]:
        return False
    for f in FLOAT_FIELDS:
        v, w = getattr(s, f), want[f]
        if (v is None) != (w is None):
            return False
        if v is not None and not np.array_equal(np.asarray(v, np.float64), np.asarray(w, np.float64), equal_nan=True):
            return False
    r, w = s.routed_experts, want["routed_experts"]
    if (r is None) != (w is None) or (r is not None and np.asarray(r).tolist() != w):
        return False
    return s.group == want["group"] and s.meta == want["meta"]


def check_located(message: str, where: str):
    """The message starts with ``where`` (then ``:`` or ``:column:``) and gives a reason."""
    m = re.match(rf"{re.escape(where)}(:\d+)?: (.+)", message, re.S)
    assert m and len(m.group(2)) > 3, (where, message)


def check_reads(read, path, expected: list, kind: str):
    """``expected``: per record position (line number / row), None (refused) or its contents; the
    reader under both policies against it."""
    where = [f"{path}:{i}" if kind == "line" else f"{path}:row {i}" for i, _ in expected]
    bad = [w for w, (_, e) in zip(where, expected) if e is None]
    rep = ReadReport()
    kept = read(path, bad_sample="skip", report=rep)  # anything but DataError fails the test here
    assert [w for w, _ in rep.skipped] == bad, (rep.skipped, bad)
    for w, reason in rep.skipped:
        check_located(reason, w)
    good = [(w, e) for w, (_, e) in zip(where, expected) if e is not None]
    assert rep.sources == [w for w, _ in good]
    for s, (w, e) in zip(kept, good):
        assert same_sample(s, e), (w, s, e)
    if bad:
        with pytest.raises(DataError) as err:
            read(path)
        check_located(str(err.value), bad[0])
    else:
        assert len(read(path)) == len(good)


# -------------------------------------------------------------------------------------------- valid records
finite = st.one_of(st.floats(-20, 20, allow_nan=False, allow_infinity=False), st.integers(-3, 3))


@st.composite
def records(draw, n_max: int = 6, *, fixed: dict | None = None):
    """A valid record. ``fixed``: per-file choices (Parquet: one schema) - which fields, scalar or list."""
    f = fixed or {}
    n = draw(st.integers(1, n_max))
    rec = {"tokens": draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))}
    if f.get("loss_mask", draw(st.booleans())):
        mask = [False] + draw(st.lists(st.booleans(), min_size=n - 1, max_size=n - 1))
        rec["loss_mask"] = [int(m) for m in mask] if f.get("int_mask", draw(st.booleans())) else mask
    target = rec.get("loss_mask", [0] + [1] * (n - 1))
    for name in FLOAT_FIELDS:
        if not f.get(name, draw(st.booleans())):
            continue
        if name in ("advantage", "weight") and f.get(f"{name}_scalar", draw(st.booleans())):
            rec[name] = draw(finite)
        else:  # null / NaN allowed where the mask has no target
            rec[name] = [draw(finite) if t else draw(st.one_of(finite, st.none(), st.just(math.nan))) for t in target]
    if f.get("group", draw(st.booleans())):
        rec["group"] = draw(st.integers(0, 3)) if f.get("int_group", draw(st.booleans())) else draw(st.text(max_size=3))
    if f.get("routed_experts", draw(st.booleans())):
        layers = f.get("moe_layers", draw(st.integers(1, 2)))
        rec["routed_experts"] = [[draw(st.permutations(range(EXPERTS)))[:TOPK] for _ in range(layers)]
                                 for _ in range(n)]
    if f.get("meta", draw(st.booleans())):
        rec["id"] = draw(st.text(max_size=4))  # non-ASCII too: UTF-8 columns count characters
    return rec


def dumps(rec, ascii_only: bool = True) -> bytes:
    return json.dumps(rec, ensure_ascii=ascii_only).encode("utf-8")


# --------------------------------------------------------------------------------------- structural damage
def _targets(rec):
    n = len(rec["tokens"])
    return [i for i, t in enumerate(rec.get("loss_mask", [0] + [1] * (n - 1))) if t]


WRONG_ELEMENTS = ["1", True, False, None, [1], {"a": 1}, 1.5, 2 ** 70, -(2 ** 70)]
WRONG_FIELD = {
    "tokens": ["1 2 3", 3, 3.0, True, {"ids": [1]}, [], [[1, 2]], None],
    "loss_mask": ["0 1", 1, True, {"m": [0]}, [[0]]],
    "advantage": ["0.5", True, {"a": 1}, [[0.5]], math.nan, math.inf, -math.inf],
    "weight": ["1", False, {"w": 1}, [["1"]], math.nan, math.inf],
    "old_logprobs": [0.5, "x", True, {"l": 1}],
    "ref_logprobs": [-1.0, "x", False, {"l": 1}],
    "routed_experts": ["0 1", 1, True, [1, 2], {"r": 1}],
}


@st.composite
def damaged_record(draw, rec):
    """(damaged record or raw line bytes, what was done), damage chosen to break the contract."""
    rec = json.loads(json.dumps(rec))  # a deep copy, NaN kept
    n = len(rec["tokens"])
    kind = draw(st.sampled_from(["wrong_field", "wrong_element", "length", "non_finite", "no_tokens", "not_object",
                                 "mask0", "mask_value", "id_range", "routes", "duplicate_key", "key_edit"]))
    if kind == "wrong_field":
        f = draw(st.sampled_from(sorted(WRONG_FIELD)))
        rec[f] = draw(st.sampled_from(WRONG_FIELD[f]))
    elif kind == "wrong_element":
        f = draw(st.sampled_from(["tokens", "loss_mask", "old_logprobs", "advantage", "routed_experts"]))
        if f == "routed_experts":
            rec[f] = rec.get(f) or [[[0, 1]] for _ in range(n)]
            i, j = draw(st.integers(0, n - 1)), draw(st.integers(0, len(rec[f][0]) - 1))
            rec[f][i][j][draw(st.integers(0, TOPK - 1))] = draw(st.sampled_from(["1", True, None, [1], 1.0, 2 ** 70]))
        else:
            if f != "tokens" and not isinstance(rec.get(f), list):
                rec[f] = [0] * n if f == "loss_mask" else [0.0] * n
            wrong = [x for x in WRONG_ELEMENTS if not (f in FLOAT_FIELDS and (x is None or type(x) is float))]
            i = draw(st.integers(0, n - 1))
            if f == "loss_mask":  # false is a valid mask entry anywhere, true after token 0
                wrong = [x for x in wrong if x is not False and (i == 0 or x is not True)]
            if f in FLOAT_FIELDS:
                wrong = [x for x in wrong if not (type(x) is int and abs(x) < 2 ** 1000)]
            rec[f][i] = draw(st.sampled_from(wrong))
    elif kind == "length":
        f = draw(st.sampled_from(["loss_mask", "old_logprobs", "ref_logprobs", "advantage", "weight",
                                  "routed_experts"]))
        if not isinstance(rec.get(f), list):
            rec[f] = {"loss_mask": [0] * n, "routed_experts": [[[0, 1]] for _ in range(n)]}.get(f, [0.0] * n)
        if draw(st.booleans()):
            rec[f] = rec[f][:draw(st.integers(0, n - 1))]
        else:
            rec[f] = rec[f] + rec[f][-1:] * draw(st.integers(1, 3))
    elif kind == "non_finite":
        if not _targets(rec):  # make a target: a second token, predicted
            rec = {"tokens": rec["tokens"][:1] * 2}
            n = 2
        f = draw(st.sampled_from(FLOAT_FIELDS))
        bad = draw(st.sampled_from([math.nan, math.inf, -math.inf, None]))
        if f in ("advantage", "weight") and draw(st.booleans()):
            rec[f] = math.nan if bad is None else bad
        else:
            if not isinstance(rec.get(f), list):
                rec[f] = [0.0] * n
            rec[f][draw(st.sampled_from(_targets(rec)))] = bad
    elif kind == "no_tokens":
        if draw(st.booleans()):
            del rec["tokens"]
        else:
            rec["tokens"] = None
    elif kind == "not_object":
        rec = draw(st.sampled_from([[rec], list(rec.values()), "record", 7, None, True]))
    elif kind == "mask0":
        rec["loss_mask"] = [True] + [bool(x) for x in rec.get("loss_mask", [0] * n)[1:]]
    elif kind == "mask_value":
        rec["loss_mask"] = rec.get("loss_mask") or [0] * n
        rec["loss_mask"][draw(st.integers(0, n - 1))] = draw(st.sampled_from([2, -1, 0.5, 1.0, "1"]))
    elif kind == "id_range":
        rec["tokens"][draw(st.integers(0, n - 1))] = draw(st.sampled_from([-1, VOCAB, 2 ** 31, 2 ** 63, 2 ** 64,
                                                                             1.0, 2.5, -(2 ** 63) - 1]))
    elif kind == "routes":
        r = rec["routed_experts"] = rec.get("routed_experts") or [[[0, 1]] for _ in range(n)]
        i = draw(st.integers(0, n - 1))
        how = draw(st.sampled_from(["dup", "range", "negative", "topk", "ragged_layers"]))
        if how == "dup":
            r[i][0][1] = r[i][0][0]
        elif how == "range":
            r[i][0][0] = EXPERTS
        elif how == "negative":
            r[i][0][0] = -1
        elif how == "topk":
            r[i][0] = [0, 1, 2]
        else:  # one token with another number of MoE layers (none, when it is the only token)
            r[i] = r[i] + [[0, 1]] if n > 1 else []
    elif kind == "key_edit":  # a field's key one edit off (a flipped byte, a typo, a plural): never meta
        k = draw(st.sampled_from([k for k in rec if k in FIELDS]))
        i = draw(st.integers(0, len(k) - 1))
        c = draw(st.sampled_from("abcdefghijklmnopqrstuvwxyz_ -0"))
        new = draw(st.sampled_from([k[:i] + c + k[i + 1:], k[:i] + k[i + 1:], k[:i] + c + k[i:], k + "s", k.upper(),
                                    k[:i] + k[i + 1:i + 2] + k[i] + k[i + 2:]]))
        assume(new != k and new not in FIELDS)
        rec[new] = rec.pop(k)
    else:  # duplicate_key: the field given twice (which value is meant?)
        line = dumps(rec)
        f = draw(st.sampled_from([k for k in rec]))
        return b"{" + json.dumps(f).encode() + b": " + dumps(rec[f]) + b", " + line[1:], kind
    return dumps(rec), kind


# ---------------------------------------------------------------------------------------------------- JSONL
@settings(FUZZ, max_examples=160)
@given(st.lists(records(), min_size=1, max_size=5), st.data())
def test_jsonl_structural_damage_is_refused_with_file_and_line(tmp_path, recs, data):
    lines = [dumps(r) for r in recs]
    hit = data.draw(st.sets(st.integers(0, len(lines) - 1), min_size=1, max_size=len(lines)))
    for i in sorted(hit):
        lines[i], kind = data.draw(damaged_record(recs[i]))
        assert spec_line(lines[i], i == 0) is None, (kind, lines[i])  # the damage really breaks the contract
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    expected = [(i + 1, None if i in hit else spec(recs[i])) for i in range(len(recs))]
    assert all(e is not None for i, e in expected if i - 1 not in hit)
    check_reads(lambda p, **kw: read_jsonl(p, vocab_size=VOCAB, route_spec=ROUTES, **kw), path, expected, "line")


def _byte_damage(data, blob: bytes) -> bytes:
    for _ in range(data.draw(st.integers(1, 3))):
        op = data.draw(st.sampled_from(["truncate", "flip", "insert", "delete", "non_utf8", "newline"]))
        at = data.draw(st.integers(0, max(len(blob) - 1, 0)))
        if op == "truncate":
            blob = blob[:at]
        elif op == "flip" and blob:
            blob = blob[:at] + bytes([blob[at] ^ data.draw(st.integers(1, 255))]) + blob[at + 1:]
        elif op == "insert":
            ins = data.draw(st.one_of(st.binary(min_size=1, max_size=3),
                                      st.sampled_from([b"{", b"}", b"[", b"]", b",", b'"', b"1", b"-", b".", b"e9",
                                                       b"null", b"true", b" ", b"\r", b"\t", b"\x00"])))
            blob = blob[:at] + ins + blob[at:]
        elif op == "delete" and blob:
            blob = blob[:at] + blob[at + 1:]
        elif op == "non_utf8":
            blob = blob[:at] + data.draw(st.sampled_from([b"\xff", b"\xfe", b"\x80", b"\xc3", b"\xe2\x82",
                                                          b"\xed\xa0\x80", b"\xc0\xaf"])) + blob[at:]
        elif op == "newline":
            blob = blob[:at] + b"\n" + blob[at:]
    return blob


@settings(FUZZ, max_examples=200)
@given(st.lists(records(), min_size=1, max_size=5), st.booleans(), st.booleans(), st.data())
def test_jsonl_byte_damage_is_refused_or_read_as_written(tmp_path, recs, ascii_only, bom, data):
    blob = (codecs.BOM_UTF8 if bom else b"") + b"\n".join(dumps(r, ascii_only) for r in recs) + b"\n"
    damaged = _byte_damage(data, blob)
    path = tmp_path / "d.jsonl"
    path.write_bytes(damaged)
    expected = [(i + 1, spec_line(raw, i == 0)) for i, raw in enumerate(damaged.split(b"\n"))]
    expected = [(i, e) for i, e in expected if e != "blank"]
    check_reads(lambda p, **kw: read_jsonl(p, vocab_size=VOCAB, route_spec=ROUTES, **kw), path, expected, "line")
    for i, e in expected:  # a byte that does not decode is located to its column (characters, 1-based)
        raw = damaged.split(b"\n")[i - 1]
        raw = raw[3:] if i == 1 and raw.startswith(codecs.BOM_UTF8) else raw
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as u:
            rep = ReadReport()
            read_jsonl(path, vocab_size=VOCAB, route_spec=ROUTES, bad_sample="skip", report=rep)
            reason = dict(rep.skipped)[f"{path}:{i}"]
            col = len(raw[:u.start].decode("utf-8")) + 1
            assert reason.startswith(f"{path}:{i}:{col}: invalid UTF-8: byte 0x{raw[u.start]:02x}"), reason


def test_jsonl_non_utf8_byte_names_file_line_and_column(tmp_path):
    """The reported defect: ``'utf-8' codec can't decode byte 0xff in position 3043`` named no line."""
    p = tmp_path / "r.jsonl"
    p.write_bytes(b'{"tokens": [1, 2]}\n' * 3 + '{"tokens": [1, 2], "id": "é'.encode() + b'\xff"}\n'
                  + b'{"tokens": [3]}\n')
    with pytest.raises(DataError) as e:
        read_jsonl(p)
    assert str(e.value) == f"{p}:4:28: invalid UTF-8: byte 0xff (invalid start byte)"
    rep = ReadReport()
    assert [s.tokens.tolist() for s in read_jsonl(p, bad_sample="skip", report=rep)] == [[1, 2]] * 3 + [[3]]
    assert rep.skipped == [(f"{p}:4", str(e.value))]


def test_jsonl_wrong_types_are_refused_never_coerced(tmp_path):
    """What the readers used to coerce silently: a boolean token id (read as 1), a string advantage
    (parsed), a mask entry of 0.5 or 2 (read as True), booleans among RL values or expert ids."""
    cases = {
        '{"tokens": [1, true, 3]}': "tokens must be integers: tokens[1] is true (a boolean)",
        '{"tokens": [1, 2.0]}': "tokens must be integers: tokens[1] is 2.0 (a number)",
        '{"tokens": [1, 2], "advantage": "0.5"}': 'advantage must be a number or a list of numbers, one per token, '
                                                 'got "0.5" (a string)',
        '{"tokens": [1, 2], "weight": [1, true]}': "weight must be numbers (or null where the mask has no target): "
                                                  "weight[1] is true (a boolean)",
        '{"tokens": [1, 2], "loss_mask": [0, 0.5]}': "loss_mask must be booleans (or 0 / 1): loss_mask[1] is 0.5",
        '{"tokens": [1, 2], "loss_mask": [0, 2]}': "loss_mask must be booleans (or 0 / 1): loss_mask[1] is 2",
        '{"tokens": [1, 2], "routed_experts": [[[0, 1]], [[true, 0]]]}': "routed_experts[1][0][0] is true",
        '{"tokens": [1, 2], "tokens": [3]}': 'key "tokens" appears twice',
        '{"tokens": [1, 2], "advantages": [0, 1]}': "key \"advantages\" is not a field; did you mean 'advantage'?",
        '{"tokens": null}': "tokens is null",
        '[{"tokens": [1, 2]}]': "expected a JSON object (one record per line), got a list",
        '{"tokens": [1, 2], "old_logprobs": [null, Infinity]}': "old_logprobs has a non-finite value at a target "
                                                              "position (token 1: inf)",
    }
    p = tmp_path / "t.jsonl"
    for line, reason in cases.items():
        p.write_text('{"tokens": [5]}\n' + line + "\n")
        with pytest.raises(DataError) as e:
            read_jsonl(p)
        assert str(e.value).startswith(f"{p}:2: ") and reason in str(e.value), (line, str(e.value))
    p.write_text('{"tokens": [1, 2], "loss_mask": [0, 1], "old_logprobs": [null, -0.5], "advantage": 1}\n')
    (s,) = read_jsonl(p)  # null where no target is NaN; 0 / 1 masks and integer values are fine
    assert s.target_mask().tolist() == [False, True] and np.isnan(s.old_logprobs[0]) and float(s.advantage) == 1.0


# -------------------------------------------------------------------------------------------------- Parquet
def _pa():
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from megatron_tree.data.parquet import read_parquet

    return pa, pq, read_parquet


@st.composite
def parquet_schema(draw):
    """Per-file choices: every row has the same columns and column types."""
    return {"loss_mask": draw(st.booleans()), "int_mask": draw(st.booleans()), "group": draw(st.booleans()),
            "int_group": draw(st.booleans()), "meta": draw(st.booleans()), "routed_experts": draw(st.booleans()),
            "moe_layers": draw(st.integers(1, 2)),
            **{f: draw(st.booleans()) for f in FLOAT_FIELDS},
            **{f"{f}_scalar": draw(st.booleans()) for f in ("advantage", "weight")}}


def _column_types(pa, recs, schema):
    t = {"tokens": pa.list_(pa.int64()), "loss_mask": pa.list_(pa.int8() if schema["int_mask"] else pa.bool_()),
         "old_logprobs": pa.list_(pa.float64()), "ref_logprobs": pa.list_(pa.float64()),
         "group": pa.int64() if schema["int_group"] else pa.string(), "id": pa.string(),
         "routed_experts": pa.list_(pa.list_(pa.list_(pa.int32())))}
    for f in ("advantage", "weight"):
        t[f] = pa.float64() if schema[f"{f}_scalar"] else pa.list_(pa.float64())
    return t


def _write_table(pa, pq, path, cols: dict, types: dict, row_group_size: int):
    arrays = {k: pa.array(v, type=types.get(k)) for k, v in cols.items()}
    pq.write_table(pa.table(arrays), path, row_group_size=row_group_size, write_page_checksum=True)


def _columns(recs):
    names = [k for k in ("tokens", "loss_mask", "advantage", "weight", "old_logprobs", "ref_logprobs", "group",
                         "routed_experts", "id") if any(k in r for r in recs)]
    return {k: [r.get(k) for r in recs] for k in names}


@st.composite
def parquet_row_damage(draw, rec, schema):
    """A row damaged within the column types (nulls, lengths, values), chosen to break the contract."""
    rec = json.loads(json.dumps(rec))
    n = len(rec["tokens"])
    lists = [f for f in ("loss_mask", "old_logprobs", "ref_logprobs", "advantage", "weight", "routed_experts")
             if isinstance(rec.get(f), list)]
    kinds = ["null_tokens", "empty_tokens", "null_token", "token_range"] + (["mask0"] if "loss_mask" in rec else []) + \
        (["length"] if lists else []) + (["non_finite"] if _targets(rec) else []) + \
        (["mask_value"] if schema["int_mask"] and "loss_mask" in rec else []) + \
        (["null_mask_entry"] if "loss_mask" in rec else []) + (["routes"] if "routed_experts" in rec else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "null_tokens":
        rec["tokens"] = None
    elif kind == "empty_tokens":
        rec["tokens"] = []
    elif kind == "null_token":
        rec["tokens"][draw(st.integers(0, n - 1))] = None
    elif kind == "token_range":
        rec["tokens"][draw(st.integers(0, n - 1))] = draw(st.sampled_from([-1, VOCAB, 2 ** 31, 2 ** 62]))
    elif kind == "mask0":
        rec["loss_mask"][0] = 1 if schema["int_mask"] else True
    elif kind == "length":
        f = draw(st.sampled_from(lists))
        rec[f] = rec[f][:-1] if draw(st.booleans()) else rec[f] + rec[f][-1:]
    elif kind == "non_finite":
        f = draw(st.sampled_from([f for f in FLOAT_FIELDS if isinstance(rec.get(f), list)] or ["tokens"]))
        if f == "tokens":  # no per-token float column in this file: a non-finite scalar if there is one
            g = [g for g in ("advantage", "weight") if g in rec]
            if g:
                rec[g[0]] = draw(st.sampled_from([math.nan, math.inf]))
            else:
                rec["tokens"] = None
        else:
            rec[f][draw(st.sampled_from(_targets(rec)))] = draw(st.sampled_from([math.nan, math.inf, -math.inf, None]))
    elif kind == "mask_value":
        rec["loss_mask"][draw(st.integers(1, n - 1)) if n > 1 else 0] = draw(st.sampled_from([2, -1, 7]))
    elif kind == "null_mask_entry":
        rec["loss_mask"][draw(st.integers(0, n - 1))] = None
    else:
        r = rec["routed_experts"]
        how = draw(st.sampled_from(["dup", "range", "topk", "tokens", "ragged"]))
        if how == "dup":
            r[0][0][1] = r[0][0][0]
        elif how == "range":
            r[0][0][0] = EXPERTS
        elif how == "topk":
            r[0][0] = [0, 1, 2]
        elif how == "tokens":
            rec["routed_experts"] = r[:-1] if draw(st.booleans()) else r + r[-1:]
        else:  # one token with another number of MoE layers (none, when it is the only token)
            r[0] = r[0] + [[0, 1]] if n > 1 else []
    return rec


@settings(FUZZ, max_examples=100)
@given(parquet_schema(), st.data())
def test_parquet_row_damage_is_refused_with_file_and_row(tmp_path, schema, data):
    pa, pq, read_parquet = _pa()
    recs = data.draw(st.lists(records(fixed=schema), min_size=1, max_size=7))
    hit = data.draw(st.sets(st.integers(0, len(recs) - 1), max_size=len(recs)))
    damaged = [data.draw(parquet_row_damage(r, schema)) if i in hit else r for i, r in enumerate(recs)]
    assert all(spec(damaged[i]) is None for i in hit), [damaged[i] for i in hit]  # the damage breaks the contract
    cols = _columns(damaged)
    nulls = data.draw(st.sampled_from([None] + [k for k in cols if k != "tokens"]))  # a null cell of a column
    if nulls is not None:  # a recognised field: absent (the record may become valid); another: meta None
        i = data.draw(st.integers(0, len(recs) - 1))
        cols[nulls][i] = None
        damaged[i] = {k: v for k, v in damaged[i].items() if k != nulls} if nulls in FIELDS else \
            dict(damaged[i], **{nulls: None})
    path = tmp_path / "d.parquet"
    _write_table(pa, pq, path, cols, _column_types(pa, damaged, schema), data.draw(st.integers(1, 4)))
    expected = [(i, spec(r)) for i, r in enumerate(damaged)]
    batch = data.draw(st.integers(1, 5))
    check_reads(lambda p, **kw: read_parquet(p, vocab_size=VOCAB, route_spec=ROUTES, batch_size=batch, **kw),
                path, expected, "row")


WRONG_COLUMNS = {
    "tokens": [("list<double>", lambda pa, n: pa.array([[1.0, 2.0]] * n, pa.list_(pa.float64()))),
               ("list<string>", lambda pa, n: pa.array([["1"]] * n, pa.list_(pa.string()))),
               ("list<bool>", lambda pa, n: pa.array([[True]] * n, pa.list_(pa.bool_()))),
               ("int64", lambda pa, n: pa.array([1] * n, pa.int64())),
               ("string", lambda pa, n: pa.array(["1 2"] * n, pa.string())),
               ("list<list<int64>>", lambda pa, n: pa.array([[[1, 2]]] * n, pa.list_(pa.list_(pa.int64()))))],
    "loss_mask": [("list<double>", lambda pa, n: pa.array([[0.0, 1.0]] * n, pa.list_(pa.float64()))),
                  ("list<string>", lambda pa, n: pa.array([["0", "1"]] * n, pa.list_(pa.string()))),
                  ("bool", lambda pa, n: pa.array([True] * n, pa.bool_()))],
    "advantage": [("string", lambda pa, n: pa.array(["0.5"] * n, pa.string())),
                  ("bool", lambda pa, n: pa.array([True] * n, pa.bool_())),
                  ("list<string>", lambda pa, n: pa.array([["0.5"]] * n, pa.list_(pa.string())))],
    "weight": [("list<bool>", lambda pa, n: pa.array([[True, False]] * n, pa.list_(pa.bool_()))),
               ("struct", lambda pa, n: pa.array([{"w": 1.0}] * n))],
    "old_logprobs": [("double", lambda pa, n: pa.array([-1.0] * n, pa.float64())),
                     ("list<string>", lambda pa, n: pa.array([["-1"]] * n, pa.list_(pa.string())))],
    "routed_experts": [("list<list<int64>>", lambda pa, n: pa.array([[[0, 1]]] * n, pa.list_(pa.list_(pa.int64())))),
                       ("list<list<list<double>>>",
                        lambda pa, n: pa.array([[[[0.0, 1.0]]]] * n, pa.list_(pa.list_(pa.list_(pa.float64())))))],
}


@settings(FUZZ, max_examples=80)
@given(parquet_schema(), st.data())
def test_parquet_file_damage_is_an_error_naming_the_file(tmp_path, schema, data):
    """Cut short anywhere, a recognised column of the wrong type or given twice, no tokens column:
    an error of the file (whatever the policy) naming it, never a row read from it."""
    pa, pq, read_parquet = _pa()
    recs = data.draw(st.lists(records(fixed=schema), min_size=1, max_size=6))
    cols = _columns(recs)
    types = _column_types(pa, recs, schema)
    path = tmp_path / "d.parquet"
    kind = data.draw(st.sampled_from(["cut", "wrong_type", "twice", "no_tokens", "renamed"]))
    column = None
    if kind != "cut":
        arrays = [pa.array(v, type=types.get(k)) for k, v in cols.items()]
        names = list(cols)
        if kind == "wrong_type":
            column = data.draw(st.sampled_from(sorted(WRONG_COLUMNS)))
            _, make = data.draw(st.sampled_from(WRONG_COLUMNS[column]))
            if column in names:
                arrays[names.index(column)] = make(pa, len(recs))
            else:
                arrays.append(make(pa, len(recs)))
                names.append(column)
        elif kind == "twice":
            column = data.draw(st.sampled_from(names))
            arrays.append(arrays[names.index(column)])
            names.append(column)
        elif kind == "renamed":  # a field's column name one edit off: a damaged footer, a typo
            i = data.draw(st.sampled_from([i for i, k in enumerate(names) if k in FIELDS and k != "tokens"] or [0]))
            k = names[i]
            column = data.draw(st.sampled_from([k + "s", k[:-1], k.capitalize(), k[:1] + "x" + k[2:]]))
            names[i] = column
        else:
            column = "tokens"
            arrays, names = arrays[1:], names[1:]
            if not names:
                arrays, names = [pa.array([1] * len(recs))], ["other"]
        pq.write_table(pa.Table.from_arrays(arrays, names=names), path)
    else:
        _write_table(pa, pq, path, cols, types, data.draw(st.integers(1, 3)))
        blob = path.read_bytes()
        path.write_bytes(blob[:data.draw(st.integers(0, len(blob) - 1))])
    for policy in ("error", "skip"):
        with pytest.raises(DataError) as e:
            read_parquet(path, vocab_size=VOCAB, route_spec=ROUTES, bad_sample=policy)
        msg = str(e.value)
        assert msg.startswith(f"{path}: ") and len(msg) > len(str(path)) + 10, msg
        if column is not None:
            assert f"'{column}'" in msg, msg


def test_parquet_damaged_page_is_refused_by_its_checksum(tmp_path):
    """A flipped byte inside a data page (what a bad disk or a torn copy does) would decode as other
    values; `write_parquet` writes page checksums and the reader checks them: the rows of that row
    group are refused from their first row, or skipped and recorded one by one."""
    pa, pq, read_parquet = _pa()
    from megatron_tree.data.parquet import write_parquet
    from megatron_tree.tree import Sample

    samples = [Sample(tokens=[i % 7 + 1] * 40 + list(range(10)), advantage=0.5 * i) for i in range(12)]
    path = tmp_path / "s.parquet"
    write_parquet(samples, path, row_group_size=4)
    blob = bytearray(path.read_bytes())
    meta = pq.ParquetFile(path).metadata
    col = meta.row_group(1).column(0)  # row group 1's tokens column chunk
    start = col.dictionary_page_offset or col.data_page_offset
    blob[start + col.total_compressed_size - 3] ^= 0x10  # inside the page body, before the next chunk
    bad = tmp_path / "flip.parquet"
    bad.write_bytes(bytes(blob))
    with pytest.raises(DataError) as e:
        read_parquet(bad)
    assert str(e.value).startswith(f"{bad}:row 4: rows 4-7 (row group 1) cannot be read"), str(e.value)
    rep = ReadReport()
    kept = read_parquet(bad, bad_sample="skip", report=rep)
    assert [s.tokens.tolist() for s in kept] == [s.tokens.tolist() for s in samples[:4] + samples[8:]]
    assert [w for w, _ in rep.skipped] == [f"{bad}:row {r}" for r in range(4, 8)]


@pytest.fixture(scope="module")
def parquet_blob(tmp_path_factory):
    """A `write_parquet` file (5 row groups, every training field) and the samples in it."""
    _, _, read_parquet = _pa()
    from megatron_tree.data.parquet import write_parquet
    from megatron_tree.tree import Sample

    samples = [Sample(tokens=[i % 7 + 1] * 5 + list(range(i % 9 + 1)), loss_mask=[0] * 5 + [1] * (i % 9 + 1),
                      advantage=0.5 * i, old_logprobs=[-0.1 * j for j in range(5 + i % 9 + 1)],
                      routed_experts=[[[t % 4, (t + 1) % 4]] for t in range(5 + i % 9 + 1)]) for i in range(40)]
    path = tmp_path_factory.mktemp("pq") / "base.parquet"
    write_parquet(samples, path, row_group_size=8)

    class Blob(tuple):  # hypothesis prints the test's arguments on failure: not 10 kB of bytes
        def __repr__(self):
            return f"<{path}, {len(self[0])} bytes>"

    return Blob((path.read_bytes(), read_parquet(path)))


@settings(FUZZ, max_examples=100)
@given(st.data())
def test_parquet_bit_flips_are_refused_or_harmless(tmp_path, parquet_blob, data):
    """One flipped bit anywhere in a `write_parquet` file (pages carry checksums; a footer flip that
    renames a column, changes a row count or a type is caught by the column and row-count checks):
    an error naming the file or the rows, or rows identical to those written, never other values."""
    _, _, read_parquet = _pa()
    blob, base = parquet_blob
    at, bit = data.draw(st.integers(0, len(blob) - 1)), data.draw(st.integers(0, 7))
    path = tmp_path / "flip.parquet"
    path.write_bytes(blob[:at] + bytes([blob[at] ^ (1 << bit)]) + blob[at + 1:])
    rep = ReadReport()
    try:
        kept = read_parquet(path, bad_sample="skip", report=rep)
    except DataError as e:
        assert str(e).startswith(f"{path}: "), str(e)
        return
    for w, reason in rep.skipped:
        check_located(reason, w)
    rows = [int(w.rsplit(" ", 1)[1]) for w in rep.sources]
    assert sorted(rows + [int(w.rsplit(" ", 1)[1]) for w, _ in rep.skipped]) == list(range(len(base)))
    for s, r in zip(kept, rows):
        b = base[r]
        assert s.tokens.tolist() == b.tokens.tolist() and s.target_mask().tolist() == b.target_mask().tolist()
        assert float(s.advantage) == float(b.advantage) and np.array_equal(s.old_logprobs, b.old_logprobs)
        assert np.array_equal(s.routed_experts, b.routed_experts) and s.meta == b.meta == {}
