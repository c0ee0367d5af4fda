"""torchrun's in-place restart (``--max-restarts``) with the agent's store: each attempt's process
groups must not read the keys a previous attempt left there.

With ``TORCHELASTIC_USE_AGENT_STORE`` (torchrun's default) every worker's ``env://`` store is a
client of the agent's TCPStore, which outlives a restart. torch up to 2.3 wrapped it in
``PrefixStore("/worker/attempt_<TORCHELASTIC_RESTART_COUNT>")``; torch 2.13 returns it bare (its
comment says a new store is made for every retry, which a ``--standalone`` restart does not do). A
restarted rank then reads the peer addresses of the attempt before it (gloo: "connectFullMesh failed
... Connection refused" to the dead rank's old port, whenever the peer arrives late) or its unique
ids. `isolate_restart_attempts` puts the per-attempt prefix back: feature-checked (a torch whose
store factory already prefixes per attempt, or has no such factory, is left alone), explicit, idempotent.
"""
from __future__ import annotations

import inspect
import os

__all__ = ["isolate_restart_attempts"]


def _prefixes_attempts(fn) -> bool:
    try:
        return "attempt_" in inspect.getsource(fn)
    except (OSError, TypeError):
        return True  # no source to read: assume the installed torch is right


def isolate_restart_attempts() -> bool:
    """Give every torchrun restart attempt its own key space in the agent's store (see the module
    docstring). Returns True when the shim is in place (or was already)."""
    import importlib

    import torch.distributed as dist

    rdzv = importlib.import_module("torch.distributed.rendezvous")  # the module: dist.rendezvous is a function

    create = getattr(rdzv, "_create_c10d_store", None)
    uses_agent = getattr(rdzv, "_torchelastic_use_agent_store", None)
    if create is None or uses_agent is None:
        return False
    if getattr(create, "_megatron_tree_attempts", False):
        return True
    if _prefixes_attempts(create):
        return False

    def _create_c10d_store(*args, **kwargs):
        store = create(*args, **kwargs)
        if uses_agent():
            store = dist.PrefixStore(f"/worker/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        return store

    _create_c10d_store.__doc__ = (create.__doc__ or "") + "\n(megatron_tree.compat.torchelastic: per-attempt key prefix)"
    _create_c10d_store._megatron_tree_attempts = True
    rdzv._create_c10d_store = _create_c10d_store
    return True
