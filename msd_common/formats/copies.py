"""Local copies of remote objects that cannot be read by range (compressed JSONL: a zstd or gzip
stream has no random access) or that a source asks to read whole (`storage.whole_objects`), in a
directory bounded to `runtime.cache_bytes` with least-recently-used eviction.

Several worker processes of a host share the directory. A copy is made once per host (the
processes that want it wait on a lock file while one makes it) and atomically (written
under a temporary name, then renamed), marked used by its modification time, and evicted by
whichever process goes over the bound; a process still reading an evicted copy notices
(`is_evicted`: the file it holds has no name left) and fetches it again.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from typing import Callable, BinaryIO

from msd_common.files import atomic_write

log = logging.getLogger("msd.copies")

COPY_SUFFIX = ".msd.copy"
LOCK_SUFFIX = ".msd.lock"
TOUCH_EVERY_S = 10.0  # a copy in use is marked used at most this often (a syscall per read otherwise)


class CopyCache:
    def __init__(self, directory: str, max_bytes: int | None) -> None:
        self.directory = os.path.join(directory, "copies")
        self.max_bytes = max_bytes
        self._touched: dict[str, float] = {}

    def path(self, name: str, make: Callable[[BinaryIO], None]) -> str:
        """The path of the copy called `name`, made by `make(out)` if it is not there."""
        path = os.path.join(self.directory, name + COPY_SUFFIX)
        if os.path.exists(path):
            self.touch(path, force=True)
            return path
        os.makedirs(self.directory, exist_ok=True)
        # one process of the host makes it; the others wait for it (each fetching its own copy
        # would read the object once per worker process)
        with open(os.path.join(self.directory, name + LOCK_SUFFIX), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if os.path.exists(path):
                self.touch(path, force=True)
                return path
            atomic_write(path, make)
        self._touched[path] = time.monotonic()
        self.evict(keep=path)
        return path

    def touch(self, path: str, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._touched.get(path, 0.0) >= TOUCH_EVERY_S:
            self._touched[path] = now
            try:
                os.utime(path)
            except OSError:
                pass  # evicted meanwhile: the reader notices at its next read

    def evict(self, keep: str | None = None) -> None:
        """Remove the least recently used copies until the directory fits its bound."""
        if self.max_bytes is None:
            return
        entries = []
        with os.scandir(self.directory) as it:
            for e in it:
                if e.name.endswith(COPY_SUFFIX):
                    try:
                        st = e.stat()
                    except OSError:
                        continue
                    entries.append((st.st_mtime_ns, st.st_size, e.path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            if path == keep:
                continue
            try:
                os.unlink(path)
                total -= size
                log.info("cache %s: evicted %s (%.1f MB) to stay under %d bytes", self.directory,
                         os.path.basename(path), size / 1e6, self.max_bytes)
            except FileNotFoundError:
                total -= size  # another process evicted it first


def is_evicted(fd: int) -> bool:
    """The file open as `fd` has been removed from the cache (its last name unlinked)."""
    return os.fstat(fd).st_nlink == 0
