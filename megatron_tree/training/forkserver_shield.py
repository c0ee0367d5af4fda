"""Imported by the local launcher's forkserver (the first module of `launch.PRELOAD`): the server
ignores the preemption signals, which a batch system sends to every process of a job at once.

A forkserver killed by SIGTERM takes the exit statuses of the ranks it forked with it (the launcher
would read every rank as exit code 255, give up on the run and end ranks that were still saving their
checkpoint); ignoring them, it lives until the launcher exits, as it does anyway. CPython's forkserver
already ignores SIGINT for the same reason. The ranks restore the default actions as they start
(`launch._rank_main`). Imported anywhere but in a forkserver's preloading, this module does nothing.
"""
from __future__ import annotations

import signal
import sys


def _in_forkserver_preload() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "main" and frame.f_globals.get("__name__") == "multiprocessing.forkserver":
            return True
        frame = frame.f_back
    return False


if _in_forkserver_preload():
    for _sig in (signal.SIGTERM, signal.SIGUSR1):  # launch.SHIELDED_SIGNALS (not imported: no torch here)
        signal.signal(_sig, signal.SIG_IGN)
