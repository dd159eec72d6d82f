"""Writing a file so that readers see the old content or the new, never a torn one."""

from __future__ import annotations

import os
import tempfile
from typing import BinaryIO, Callable


def atomic_write(path: str, content: bytes | Callable[[BinaryIO], None], mode: int = 0o644,
                 durable: bool = True) -> None:
    """Write `content` (bytes, or a function that writes to the open file) to a temporary file
    in the same directory, fsync it, then rename it over `path`. The temporary file is removed
    if anything fails; `mode` because mkstemp makes files 0600 and other users' processes
    (workers reading a sidecar index) must read them. durable=False: no fsync (the caller makes
    the file durable later, or can tell a lost one from a good one)."""
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-msd-")
    try:
        with os.fdopen(fd, "wb") as f:
            if isinstance(content, (bytes, bytearray, memoryview)):
                f.write(content)
            else:
                content(f)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def durable_append(path: str, data: bytes) -> None:
    """Append `data` and fsync, all or nothing: if the write fails (a full disk), the file is cut
    back to its old length, so a retry never leaves half a record before the whole one."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except BaseException:
            os.ftruncate(fd, start)
            raise
    finally:
        os.close(fd)
