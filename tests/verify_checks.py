"""The one assertion on a `megatron-tree verify` run's outcome, shared by every verify test file."""
from __future__ import annotations

from megatron_tree.training.verify import VerifyConfig, format_report

#: families of verify's batch in the test matrices (verify's default is 6): every family holds each structure
#: (forks at two depths, a prefix sample, a duplicate, EOS), so 4 keep them all and cut the per-sample side's
#: microbatches by a third (CI minutes); the carry cases keep their 19-token sample
TEST_FAMILIES = 4


def verify_config(**kw) -> VerifyConfig:
    """`VerifyConfig` with the test matrices' batch (`TEST_FAMILIES`) unless ``families`` is given."""
    kw.setdefault("families", TEST_FAMILIES)
    return VerifyConfig(**kw)


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
