"""`Lookahead`: run an iterator in a background thread, a bounded number of items ahead.

The training loop consumes step t while the thread already builds steps t+1 .. t+depth (packing
and CP planning are pure CPU work, mostly numpy, which releases the GIL in its heavy loops).

Guarantees:
  * items arrive in exactly the order the source yields them (one producer, one FIFO queue);
  * at most ``depth`` finished items wait in the queue (plus the one being built), so memory
    stays bounded however slow the consumer is;
  * an exception raised by the source is re-raised in the consumer, at the position where it
    happened (earlier items are still delivered first), with its original traceback;
  * `close` stops the thread promptly, closes the source (its ``finally`` blocks run in the
    producer thread, which owns it) and joins; it is idempotent and called on garbage collection.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable, Iterator

_END = object()


class _Failure:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc


def _put(q: queue.Queue, stop: threading.Event, item) -> bool:
    # Poll the stop flag so that `close` never waits on a full queue nobody drains.
    while not stop.is_set():
        try:
            q.put(item, timeout=0.05)
            return True
        except queue.Full:
            continue
    return False


def _produce(make_source, q: queue.Queue, stop: threading.Event) -> None:
    source = None
    try:
        source = make_source()
        for item in source:
            if not _put(q, stop, item):
                return
        _put(q, stop, _END)
    except BaseException as e:  # noqa: BLE001 - everything is handed to the consumer
        _put(q, stop, _Failure(e))
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            try:
                close()
            except Exception:  # noqa: BLE001 - a failing cleanup must not hide the real outcome
                pass


class Lookahead:
    """Iterator over ``make_source()``'s items, produced by a daemon thread ``depth`` items ahead.

    make_source  zero-argument callable returning the iterator to run; it is called inside the
                 thread so that a generator is created, advanced and closed by one thread only
    depth        maximum number of finished items buffered (>= 1)
    """

    def __init__(self, make_source: Callable[[], Iterator], depth: int = 2, *, name: str = "megatron-tree-lookahead"):
        if depth < 1:
            raise ValueError(f"lookahead depth must be >= 1, got {depth}")
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        # The thread gets the queue and the flag, not ``self``: an abandoned Lookahead can then be
        # garbage-collected, and its __del__ stops the thread.
        self._thread = threading.Thread(target=_produce, args=(make_source, self._queue, self._stop), name=name,
                                        daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- consumer side
    def __iter__(self) -> "Lookahead":
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        while True:
            try:
                item = self._queue.get(timeout=0.1)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    # Only reachable after `close` (the thread always enqueues _END or a failure).
                    self._done = True
                    raise StopIteration from None
        if item is _END:
            self._done = True
            self._thread.join()
            raise StopIteration
        if isinstance(item, _Failure):
            self._done = True
            self._thread.join()
            raise item.exc
        return item

    def close(self) -> None:
        """Stop the producer, drop buffered items, join the thread. Safe to call repeatedly."""
        self._done = True
        self._stop.set()
        while self._thread.is_alive():
            try:
                while True:
                    self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=0.05)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def __enter__(self) -> "Lookahead":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
