"""Keeping freed buffers in the process instead of returning them to the OS after every step,
and giving them back now and then where a process's freed memory is long-lived.

Every step allocates and frees the same few multi-megabyte buffers (received token frames,
int64 batch arrays). glibc serves blocks above M_MMAP_THRESHOLD (128 KiB at first) with fresh
mmap()s and trims freed heap memory above M_TRIM_THRESHOLD, so each step pays page faults on
every page it touches: measured here, assembling a 65k-token step took 2.8 ms this way and 0.9
ms with the thresholds raised. Raising them costs at most the thresholds in resident memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("msd.memory")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's maximum for 64-bit
TRIM_THRESHOLD = 256 << 20
_done = False
_libc: ctypes.CDLL | None = None


def _glibc() -> ctypes.CDLL | None:
    global _libc
    if _libc is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            libc.mallopt, libc.malloc_trim  # noqa: B018 - glibc's, absent from musl and macOS
        except (OSError, AttributeError):
            return None
        _libc = libc
    return _libc


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once). Returns False where
    there is no glibc (musl, macOS): nothing changes there."""
    global _done
    if _done:
        return True
    libc = _glibc()
    if libc is None:
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        log.debug("mallopt refused the thresholds; allocation behaviour unchanged")
    _done = ok
    return ok


def return_freed_memory() -> bool:
    """Give the OS back the whole free pages of this process's heap now, wherever they lie
    (glibc's malloc_trim). A worker process calls it every few seconds: the thresholds above
    keep its freed memory for reuse, but prepared records of every size come and go, and the
    free holes they leave in the heap stayed resident (3.3 of its 37 MB in tools/bench_e2e.py).
    Returns False where there is no glibc."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
