"""The one assertion on a `megatron-tree verify` run's outcome, shared by every verify test file."""
from __future__ import annotations

from megatron_tree.training.verify import format_report


def check_verify(cfg, out: dict, *, exact: tuple = (), fault_seen: str | None = None, far: float = 1e-3) -> None:
    """A clean config passes on a batch that really shares prefixes (fewer tree rows than per-sample
    rows) and every metric named in ``exact`` is exactly 0; a planted fault fails, and when
    ``fault_seen`` names a metric, that metric is off by more than ``far`` (the fault is seen where
    it lives, not as a near miss elsewhere)."""
    report = format_report(cfg, out)
    if cfg.fault is None:
        assert out["passed"], report
        assert out["tree_rows"] < out["flat_rows"], report
        for key in exact:
            assert out[key] == 0.0, report
    else:
        assert not out["passed"], f"verify missed the injected fault:\n{report}"
        if fault_seen is not None:
            assert out[fault_seen] > far, report
