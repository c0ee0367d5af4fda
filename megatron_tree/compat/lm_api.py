"""Megatron-LM's training entry API (``megatron.training``) across the supported versions.

Serves two installations:

* **Megatron-LM tag core_v0.16.1** (a checkout on ``PYTHONPATH``; the megatron-core 0.16.1 wheel
  has no ``megatron.training``): ``pretrain(train_valid_test_dataset_provider, model_provider,
  model_type, forward_step_func, extra_args_provider=..., args_defaults=...)`` parses the command
  line itself.
* **megatron-core 0.19.x wheels**, which ship ``megatron.training``: ``pretrain(cfg_container,
  train_valid_test_dataset_provider, model_type, forward_step_func, model_provider=...)``. The
  caller parses the command line first (``arguments.parse_and_validate_args(extra_args_provider,
  args_defaults=...)``, which also sets Megatron-LM's global args) and builds the config container
  (``argument_utils.pretrain_cfg_container_from_args(args)``).
  These wheels also ship the dataset helpers compiled (``megatron.core.datasets.helpers_cpp``)
  but not the Makefile that ``initialize``'s ``compile_helpers()`` runs, so ``pretrain()`` exits
  with "Failed to compile the C++ dataset helper functions" on any device:
  :func:`use_prebuilt_dataset_helpers` makes ``compile_helpers`` a no-op where the compiled module
  already imports (elsewhere the original runs).

:func:`pretrain` takes the 0.16.1 form and calls whichever the installed ``megatron.training``
has (told apart by ``pretrain``'s first parameter, not by a version number).
"""
from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable, Optional

__all__ = ["pretrain", "pretrain_takes_config_container", "use_prebuilt_dataset_helpers", "have_megatron_training",
           "megatron_training_import_error", "megatron_training_location_error", "MISSING_MEGATRON_TRAINING"]

MISSING_MEGATRON_TRAINING = (
    "megatron.training (Megatron-LM's pretrain()) is not importable: it ships inside the megatron-core wheel "
    "from 0.19 on (pip install 'megatron-core>=0.19,<0.20', Python >= 3.12); with megatron-core 0.16.1 put a "
    "Megatron-LM checkout at tag core_v0.16.1 on PYTHONPATH (its extra dependencies: six, pydantic, pybind11, "
    "triton). See examples/README.md.")


def megatron_training_import_error() -> Optional[str]:
    """None when ``megatron.training`` (with ``pretrain``) imports here, else why not (the
    exception, e.g. ``No module named 'six'`` for a checkout missing an extra dependency)."""
    try:
        module = importlib.import_module("megatron.training")
    except Exception as exc:  # noqa: BLE001 (ImportError, or an error inside Megatron-LM's imports)
        return f"{type(exc).__name__}: {exc}"
    if not hasattr(module, "pretrain"):
        return "megatron.training has no pretrain()"
    return None


def megatron_training_location_error() -> Optional[str]:
    """None when ``megatron.training`` can be found here, without importing it (importing it costs
    seconds of CPU: the launcher checks this, each rank imports it), else why not."""
    import importlib.util

    try:
        found = importlib.util.find_spec("megatron.training") is not None
    except (ImportError, ValueError) as exc:  # no ``megatron`` package at all, or a broken entry
        return f"{type(exc).__name__}: {exc}"
    return None if found else "ModuleNotFoundError: No module named 'megatron.training'"


def have_megatron_training() -> bool:
    """True when ``megatron.training`` (with ``pretrain``) imports here."""
    return megatron_training_import_error() is None


def pretrain_takes_config_container(pretrain_fn: Callable) -> bool:
    """True for the 0.19.x form ``pretrain(cfg_container, ...)``."""
    try:
        params = list(inspect.signature(pretrain_fn).parameters)
    except (TypeError, ValueError):
        return False
    return bool(params) and params[0] == "cfg_container"


def _prebuilt_helpers_available() -> bool:
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
        return True
    except ImportError:
        return False


def use_prebuilt_dataset_helpers() -> bool:
    """Make ``megatron.core.datasets.utils.compile_helpers`` a no-op when the compiled helpers
    already import (0.19.x wheels ship them without their Makefile). Idempotent; returns True when
    the shim is in place. Where the helpers are not compiled (a source checkout), nothing changes."""
    if not _prebuilt_helpers_available():
        return False
    utils = importlib.import_module("megatron.core.datasets.utils")
    if getattr(utils.compile_helpers, "_megatron_tree_prebuilt", False):
        return True
    original = utils.compile_helpers

    def compile_helpers():
        """megatron_tree.compat.lm_api: the dataset helpers are already compiled (helpers_cpp imports)."""
        return None

    compile_helpers._megatron_tree_prebuilt = True
    compile_helpers.__wrapped__ = original
    utils.compile_helpers = compile_helpers
    return True


def pretrain(train_valid_test_dataset_provider: Callable, model_provider: Callable, model_type: Any,
             forward_step_func: Callable, *, extra_args_provider: Optional[Callable] = None,
             args_defaults: Optional[dict] = None, **kwargs: Any):
    """Megatron-LM's ``pretrain()`` in the 0.16.1 calling form, on either supported installation.

    ``kwargs`` (``process_non_loss_data_func``, ``get_embedding_ranks``, ...) are passed through. Under
    torchrun's in-place restart each attempt's process groups get their own store keys
    (`compat.torchelastic.isolate_restart_attempts`)."""
    from .torchelastic import isolate_restart_attempts

    isolate_restart_attempts()  # torchrun --max-restarts: each attempt's process groups in their own keys
    training = importlib.import_module("megatron.training")
    args_defaults = dict(args_defaults or {})
    if not pretrain_takes_config_container(training.pretrain):
        return training.pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
                                 extra_args_provider=extra_args_provider, args_defaults=args_defaults, **kwargs)
    use_prebuilt_dataset_helpers()
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    args = parse_and_validate_args(extra_args_provider=extra_args_provider, args_defaults=args_defaults)
    cfg = pretrain_cfg_container_from_args(args)
    return training.pretrain(cfg, train_valid_test_dataset_provider, model_type, forward_step_func,
                             model_provider=model_provider, **kwargs)
