"""Files a reader must never see torn: written whole beside the target, then renamed over it."""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

__all__ = ["replaced_atomically", "write_atomically"]


@contextlib.contextmanager
def replaced_atomically(path: str, *, fsync: bool = False) -> Iterator[str]:
    """Yield a temporary path (``path + ".tmp"``) for the caller's writer; on a clean exit it is fsynced
    (with ``fsync``) and ``os.replace``d over ``path``, so a reader sees what ``path`` held before or all of
    the new file, never part. A write that fails or is interrupted (a signal handler's exception)
    removes the temporary file and re-raises."""
    tmp = path + ".tmp"
    try:
        yield tmp
        if fsync:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # the write's own error is the one to report
            os.remove(tmp)
        raise


def write_atomically(path: str, data: bytes, *, fsync: bool = False) -> None:
    """Make ``path`` hold ``data`` (`replaced_atomically`)."""
    with replaced_atomically(path, fsync=fsync) as tmp, open(tmp, "wb") as f:
        f.write(data)
