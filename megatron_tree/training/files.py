"""Files a reader must never see torn: written whole beside the target, then renamed over it."""
from __future__ import annotations

import contextlib
import os

__all__ = ["write_atomically"]


def write_atomically(path: str, data: bytes, *, fsync: bool = False) -> None:
    """Make ``path`` hold ``data``: a reader sees what it held before or all of ``data``, never part
    (written to ``path + ".tmp"``, fsynced with ``fsync``, then ``os.replace``d). A write that fails
    or is interrupted (a signal handler's exception) removes the temporary file and re-raises."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # the write's own error is the one to report
            os.remove(tmp)
        raise
