"""One bounded, thread-safe LRU lookup for the host-side caches of `cp` (plans, schedules, index maps).

The data pipeline's lookahead thread warms these caches (planning microbatch i+1) while the
training thread reads them, hence the lock. Values are immutable results of pure functions of the
key (plans and everything derived from them are identified by their hashes).
"""
from __future__ import annotations

import threading
from collections import OrderedDict

__all__ = ["lru_get"]

_lock = threading.Lock()


def lru_get(cache: OrderedDict, key, make, maxsize: int = 16):
    """``cache[key]``, made by ``make()`` and stored on a miss; the least recently used entries are
    dropped beyond ``maxsize``. ``make`` runs outside the lock: two threads may both compute one
    entry, identically."""
    with _lock:
        if key in cache:
            cache.move_to_end(key)
            return cache[key]
    value = make()
    with _lock:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > maxsize:
            cache.popitem(last=False)
    return value
