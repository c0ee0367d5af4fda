"""Test hook (on PYTHONPATH only where a test puts it): one rank of a ``megatron-tree train --nproc``
run stops before a given step and waits, so a test can kill it from outside at a known step instead of
racing the training loop (a 1-layer step takes ~30 ms: a kill aimed "after step 4" by reading the log
could land a checkpoint or a whole run later on a loaded machine).

``MTREE_TEST_PAUSE="RANK:STEP:MARKER"``: the process whose ``RANK`` is RANK, on its STEP-th call of
`megatron_tree.training.models.forward_backward` (one per training step of a run started from scratch),
writes its pid to MARKER, prints ``rank RANK (pid P) paused before step STEP`` and sleeps. An existing MARKER
means the pause already happened (the restarted ranks of the same run): nothing is done."""
import importlib.abc
import importlib.util
import os
import sys
import time

_SPEC = os.environ.get("MTREE_TEST_PAUSE")
_TARGET = "megatron_tree.training.models"


def _patch(models) -> None:
    rank, step, marker = _SPEC.split(":", 2)
    real, calls = models.forward_backward, []

    def forward_backward(*args, **kwargs):
        calls.append(None)
        if os.environ.get("RANK") == rank and len(calls) == int(step) and not os.path.exists(marker):
            with open(marker, "w") as f:
                f.write(str(os.getpid()))
            print(f"rank {rank} (pid {os.getpid()}) paused before step {step}", flush=True)
            time.sleep(600)
        return real(*args, **kwargs)

    models.forward_backward = forward_backward


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if _SPEC:
    sys.meta_path.insert(0, _PatchOnImport())
