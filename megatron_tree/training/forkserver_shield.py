"""Imported by the local launcher's forkserver (the first module of `launch.PRELOAD`): the server
ignores the preemption signals, which a batch system sends to every process of a job at once, and
dies with the launcher.

A forkserver killed by SIGTERM takes the exit statuses of the ranks it forked with it (the launcher
would read every rank as exit code 255, give up on the run and end ranks that were still saving their
checkpoint); ignoring them, it lives until the launcher exits, as it does anyway. CPython's forkserver
already ignores SIGINT for the same reason. The ranks restore the default actions as they start
(`launch._rank_main`). Imported anywhere but in a forkserver's preloading, this module does nothing.

A launcher killed outright (``kill -9``, the OOM killer) runs no cleanup, and the forkserver, which
waits for its clients to go, outlived it with its ranks (orphans blocked in a collective until the
process group's timeout). So the kernel kills the forkserver with its parent (`die_with_parent`), and
each rank with the forkserver (`launch._rank_main` calls it too): nothing outlives the launcher.
"""
from __future__ import annotations

import os
import signal
import sys


def die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when its parent dies (``PR_SET_PDEATHSIG``; the
    request itself survives neither fork nor a parent that died first, which is checked). Elsewhere:
    nothing."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request: nothing would deliver the signal
        os._exit(1)


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
    die_with_parent()
