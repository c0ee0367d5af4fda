"""Reading and writing samples as Parquet (pyarrow, imported on use).

Columns (one row per sample; any other column is carried into ``Sample.meta``):
  tokens        list<int>            required
  loss_mask     list<bool|int>       optional, one entry per token
  advantage     float or list<float> per-sample scalar or per-token values (integer columns too)
  weight        float or list<float> per-sample scalar or per-token values (integer columns too)
  old_logprobs  list<float>          optional, one entry per token
  ref_logprobs  list<float>          optional, one entry per token
  group         any scalar           group id (e.g. GRPO prompt group)
  routed_experts  list<list<list<int>>>  optional: per token, per MoE layer, the top-k expert ids
                                     (routing replay; `megatron_tree.tree.routes`)
  images        list<binary|string>  optional: a vision-language record's images in order of appearance,
                                     encoded bytes (or paths relative to the file), read with a
                                     `data.images.VisionInput`

A bad row (empty or null tokens, a null inside a list, a length mismatch, a non-finite advantage at a
target, a token id >= vocab size, ...) raises `DataError` (a ValueError) naming ``file:row R`` (R =
0-based row index in the file) and the broken rule (``bad_sample="error"``), or is skipped and
recorded in the `ReadReport` with its reason (``bad_sample="skip"``). What no row can survive is an
error of the file whatever the policy, naming the file (and the column): a missing ``tokens``
column, a recognised column of the wrong type (``tokens`` of floats or strings, a string
``advantage``, ...) or appearing twice, a column one edit away from a field name (``advantages``:
a damaged or mistyped field, never carried as meta), a file that is not Parquet or is cut short (its footer is
at the end). Rows whose pages cannot be decoded (a damaged page: `write_parquet` writes page
checksums and the reader verifies them) are the error of their first row, or skipped and recorded
one by one under ``bad_sample="skip"``.
"""
from __future__ import annotations

import os

import numpy as np

from ..tree.sample import Sample
from .io import DataError, ReadReport, collect_samples, near_field

_LIST_FIELDS = ("tokens", "loss_mask", "old_logprobs", "ref_logprobs")
_SCALAR_OR_LIST_FIELDS = ("advantage", "weight")
_FIELDS = _LIST_FIELDS + _SCALAR_OR_LIST_FIELDS + ("group", "routed_experts", "images")


def _pa():
    try:
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
    except ImportError as e:  # pragma: no cover - exercised only without pyarrow
        raise ImportError("reading Parquet needs pyarrow (pip install pyarrow)") from e
    return pa, pc, pq


class _ListColumn:
    """A list column of one record batch as flat numpy values + offsets (no per-row Python objects).
    ``as_float``: float64 values, a null entry read as NaN (the RL fields: NaN is allowed where the
    mask has no target, as ``null`` is in JSONL); otherwise a null entry is its row's error."""

    def __init__(self, arr, name: str, as_float: bool = False):
        pa, pc, _ = _pa()
        self.name = name
        self.row_null = arr.is_null().to_numpy(zero_copy_only=False)
        lengths = pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        self.offsets = np.zeros(len(arr) + 1, np.int64)
        np.cumsum(lengths, out=self.offsets[1:])
        flat = pc.list_flatten(arr)
        if as_float:
            self.has_null_elem = np.zeros(len(arr), bool)
            self.values = pc.cast(flat, pa.float64()).to_numpy(zero_copy_only=False)
            return
        elem_null = flat.is_null().to_numpy(zero_copy_only=False)
        # Rows holding a null element, found with one reduceat over the flat validity mask.
        self.has_null_elem = np.zeros(len(arr), bool)
        if elem_null.any():
            nz = lengths > 0
            self.has_null_elem[nz] = np.add.reduceat(elem_null, self.offsets[:-1][nz]) > 0
        if pa.types.is_boolean(flat.type):
            self.values = flat.fill_null(False).to_numpy(zero_copy_only=False)
        elif pa.types.is_integer(flat.type):
            self.values = flat.fill_null(0).to_numpy(zero_copy_only=False)
        else:
            self.values = flat.to_numpy(zero_copy_only=False)

    def row(self, i: int, where: str):
        if self.row_null[i]:
            return None
        if self.has_null_elem[i]:
            raise ValueError(f"{where}: {self.name} contains a null value")
        return self.values[self.offsets[i]: self.offsets[i + 1]]


class _RoutesColumn:
    """The ``routed_experts`` column (``list<list<list<int>>>``) of one record batch as flat values and
    the offsets of each nesting level; a row becomes an ``[tokens, moe_layers, topk]`` array when every
    token has the same number of layers and every layer the same top-k (else the row's error)."""

    def __init__(self, arr, name: str):
        pa, pc, _ = _pa()
        self.name = name
        self.row_null = arr.is_null().to_numpy(zero_copy_only=False)
        self.offsets, level = [], arr
        for depth in range(3):
            t = level.type
            if not (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)):
                raise ValueError(f"column '{name}' must be a list<list<list<int>>> column (per token, per MoE layer, "
                                 f"the top-k expert ids), got type {arr.type}")
            lengths = pc.list_value_length(level).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
            off = np.zeros(len(level) + 1, np.int64)
            np.cumsum(lengths, out=off[1:])
            self.offsets.append(off)
            level = pc.list_flatten(level)
        if not pa.types.is_integer(level.type):
            raise ValueError(f"column '{name}' must hold integer expert ids, got {level.type}")
        self.has_null = bool(level.null_count)
        self.null = level.is_null().to_numpy(zero_copy_only=False)
        self.values = level.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)

    def row(self, i: int, where: str):
        if self.row_null[i]:
            return None
        o0, o1, o2 = self.offsets
        t0, t1 = o0[i], o0[i + 1]  # tokens of row i
        layers = np.diff(o1[t0: t1 + 1])
        if len(layers) and (layers != layers[0]).any():
            raise ValueError(f"{where}: {self.name} must have the same number of MoE layers at every token "
                             f"(got {sorted(set(layers.tolist()))})")
        l0, l1 = o1[t0], o1[t1]
        topk = np.diff(o2[l0: l1 + 1])
        if len(topk) and (topk != topk[0]).any():
            raise ValueError(f"{where}: {self.name} must have the same top-k at every token and MoE layer "
                             f"(got {sorted(set(topk.tolist()))})")
        v0, v1 = o2[l0], o2[l1]
        if self.has_null and self.null[v0:v1].any():
            raise ValueError(f"{where}: {self.name} contains a null value")
        n_layers = int(layers[0]) if len(layers) else 0
        k = int(topk[0]) if len(topk) else 0
        return self.values[v0:v1].reshape(t1 - t0, n_layers, k)


def _is_list(pa, t) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _check_columns(pa, schema, name: str) -> None:
    """DataError naming the file and the column for what no row could survive: a column name that
    appears twice (which one is meant?) or is one edit from a field name (`io.near_field`), a
    recognised column of the wrong type."""
    names = schema.names
    for c in names:
        if names.count(c) > 1:
            raise DataError(f"{name}: column '{c}' appears {names.count(c)} times")
        near = near_field(c)
        if near is not None:
            raise DataError(f"{name}: column '{c}' is not a field; did you mean '{near}'? (a column one edit from a "
                            "field name is taken for a damaged or mistyped field, never carried as meta)")

    def ints(t):
        return pa.types.is_integer(t) or pa.types.is_null(t)

    def numbers(t):
        return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_null(t)

    def mask(t):
        return pa.types.is_boolean(t) or ints(t)

    rules = {"tokens": (ints, "a list<integer> column"), "loss_mask": (mask, "a list<bool> (or list<integer>) column"),
             "old_logprobs": (numbers, "a list<float> column"), "ref_logprobs": (numbers, "a list<float> column")}
    for f in names:
        t = schema.field(f).type
        if f in rules:
            ok, what = rules[f]
            if not (_is_list(pa, t) and ok(t.value_type)):
                raise DataError(f"{name}: column '{f}' must be {what}, got type {t}")
        elif f in _SCALAR_OR_LIST_FIELDS and not (numbers(t) or (_is_list(pa, t) and numbers(t.value_type))):
            raise DataError(f"{name}: column '{f}' must be a float column (one value per sample) or a list<float> "
                            f"column (one per token), got type {t}")
        elif f == "images" and not (_is_list(pa, t) and (pa.types.is_binary(t.value_type) or pa.types.is_string(
                t.value_type) or pa.types.is_large_binary(t.value_type) or pa.types.is_large_string(t.value_type))):
            raise DataError(f"{name}: column 'images' must be a list<binary> column (encoded images; list<string>: "
                            f"paths), got type {t}")
        elif f == "routed_experts":
            inner = t
            for _ in range(3):
                inner = inner.value_type if _is_list(pa, inner) else None
                if inner is None:
                    break
            if inner is None or not ints(inner):
                raise DataError(f"{name}: column '{f}' must be a list<list<list<integer>>> column (per token, per MoE "
                                f"layer, the top-k expert ids), got type {t}")


def read_parquet(path, *, vocab_size: int | None = None, bad_sample: str = "error",
                 report: ReadReport | None = None, batch_size: int = 4096, route_spec=None,
                 require_routes: bool = False, vision=None) -> list[Sample]:
    """Samples of a Parquet file, in row order (see the module docstring for columns and policy).
    ``require_routes``: a row without ``routed_experts`` is refused (routing replay); ``vision``
    (`data.images.VisionInput`): each row's ``images`` (encoded bytes, or paths relative to the file)."""
    if bad_sample not in ("error", "skip"):
        raise ValueError(f"bad_sample must be 'error' or 'skip', got {bad_sample!r}")
    pa, _, pq = _pa()
    report = report if report is not None else ReadReport()
    name = os.fspath(path)  # as the caller spelled it: messages point at the file the user named
    try:
        pf = pq.ParquetFile(path, page_checksum_verification=True)
        meta = pf.metadata
        schema = pf.schema_arrow
    except FileNotFoundError:
        raise
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{name}: not a readable Parquet file (damaged, cut short or another format): {e}") from None
    names = schema.names
    if "tokens" not in names:
        raise DataError(f"{name}: missing required column 'tokens' (columns: {', '.join(names)})")
    _check_columns(pa, schema, name)
    out: list[Sample] = []
    row0 = 0
    for rg in range(meta.num_row_groups):
        n_rows, done, failed = meta.row_group(rg).num_rows, 0, False
        batches = pf.iter_batches(batch_size=batch_size, row_groups=[rg])
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                break
            except (pa.ArrowException, OSError) as e:
                first, last = row0 + done, row0 + n_rows - 1
                why = f"rows {first}-{last} (row group {rg}) cannot be read (a damaged page or a file cut short): {e}"
                if bad_sample == "error" or done >= n_rows:
                    raise DataError(f"{name}:row {first}: {why}" if done < n_rows else
                                    f"{name}: row group {rg} cannot be read: {e}") from None
                report.skipped += [(f"{name}:row {r}", f"{name}:row {r}: {why}") for r in range(first, last + 1)]
                failed = True
                break
            if done + batch.num_rows > n_rows:
                done += batch.num_rows
                break
            out += _batch_samples(pa, batch, name, row0 + done, vocab_size=vocab_size, bad_sample=bad_sample,
                                  report=report, route_spec=route_spec, require_routes=require_routes,
                                  vision=vision, base_dir=os.path.dirname(os.path.abspath(name)))
            done += batch.num_rows
        if not failed and done != n_rows:  # the footer's row count is damaged: no row number can be trusted
            held = f"{done} rows" if done < n_rows else f"more than {n_rows} rows"
            raise DataError(f"{name}: row group {rg} holds {held} but its metadata says {n_rows}: the file's metadata "
                            "is damaged")
        row0 += n_rows
    return out


def _batch_samples(pa, batch, name: str, row0: int, **kw) -> list[Sample]:
    """The samples of one record batch whose first row is row ``row0`` of the file."""
    cols = {}
    for f in _FIELDS:
        if f not in batch.schema.names:
            continue
        arr = batch.column(f)
        if f in ("group", "images"):
            cols[f] = arr.to_pylist()
        elif f == "routed_experts":
            try:
                cols[f] = _RoutesColumn(arr, f)
            except ValueError as e:
                raise DataError(f"{name}: {e}") from None
        elif _is_list(pa, arr.type):
            cols[f] = _ListColumn(arr, f, as_float=f not in ("tokens", "loss_mask"))
        else:  # a per-sample scalar (advantage, weight): the column types are checked up front
            cols[f] = arr.to_pylist()
    extra = {c: batch.column(c).to_pylist() for c in batch.schema.names if c not in _FIELDS}

    def record(i, where):
        rec = {c: v[i] for c, v in extra.items()}
        for f, col in cols.items():
            v = col.row(i, where) if isinstance(col, (_ListColumn, _RoutesColumn)) else col[i]
            if v is not None:
                rec[f] = v
        if "tokens" not in rec:
            raise DataError(f"{where}: tokens is null")
        return rec

    rows = ((f"{name}:row {row0 + i}", lambda i=i, w=f"{name}:row {row0 + i}": record(i, w))
            for i in range(batch.num_rows))
    return collect_samples(rows, **kw)


def write_parquet(samples, path, *, row_group_size: int | None = None) -> None:
    """Write samples in the format `read_parquet` reads. ``advantage`` / ``weight`` become a scalar
    column when every sample has a scalar (or none), else a list column (scalars broadcast)."""
    pa, _, pq = _pa()
    samples = list(samples)
    data = {"tokens": pa.array([s.tokens.astype(np.int64).tolist() for s in samples], type=pa.list_(pa.int64()))}
    if any(s.loss_mask is not None for s in samples):
        data["loss_mask"] = pa.array([None if s.loss_mask is None else s.loss_mask.astype(bool).tolist()
                                      for s in samples], type=pa.list_(pa.bool_()))
    for f in ("old_logprobs", "ref_logprobs"):
        if any(getattr(s, f) is not None for s in samples):
            data[f] = pa.array([None if getattr(s, f) is None else getattr(s, f).tolist() for s in samples],
                               type=pa.list_(pa.float64()))
    for f in _SCALAR_OR_LIST_FIELDS:
        vals = [getattr(s, f) for s in samples]
        if all(v is None for v in vals):
            continue
        if all(v is None or v.ndim == 0 for v in vals):
            data[f] = pa.array([None if v is None else float(v) for v in vals], type=pa.float64())
        else:
            data[f] = pa.array([None if v is None else s.per_token(f, 0.0).tolist() for v, s in zip(vals, samples)],
                               type=pa.list_(pa.float64()))
    if any(s.group is not None for s in samples):
        data["group"] = pa.array([s.group for s in samples])
    if any(s.routed_experts is not None for s in samples):
        data["routed_experts"] = pa.array([None if s.routed_experts is None else np.asarray(s.routed_experts).tolist()
                                           for s in samples], type=pa.list_(pa.list_(pa.list_(pa.int64()))))
    if any(s.images for s in samples):
        data["images"] = pa.array([[_image_bytes(im) for im in (s.images or ())] for s in samples],
                                  type=pa.list_(pa.binary()))
    pq.write_table(pa.table(data), path, row_group_size=row_group_size, write_page_checksum=True)


def _image_bytes(im) -> bytes:
    if not os.path.isfile(im.source):
        raise ValueError(f"image {im.source!r} is not a file: write_parquet stores the bytes of image files")
    with open(im.source, "rb") as f:
        return f.read()
