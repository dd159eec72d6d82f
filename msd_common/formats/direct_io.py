"""Writing a large file past the page cache (O_DIRECT): the decompressed copies of compressed
shards, which a cold start writes at 4.4 times the compressed bytes.

Through the page cache, every page written must first be allocated. On a virtual machine whose
host takes back the memory the guest frees (virtio-balloon free page reporting, as on the
machines of docs/BENCHMARKS.md), that allocation cost more than decompressing: 16 shards, 1.7 GB
of copies, took 1.8-2.3 s to index with 2 processes once the memory of the previous copies had
gone back to the host, and 1.15 s when it had not. Written with O_DIRECT, from two page-aligned
buffers in turn (a thread writes one while the decompressor fills the other), the copies cost
the same whatever the memory did, and they do not push the rest of the page cache out (at a
terabyte they would not fit in it anyway; records are read back with pread, through the cache).
Where O_DIRECT cannot be used (not Linux, tmpfs, some network file systems) the data goes to
the file object as before.
"""

from __future__ import annotations

import errno
import mmap
import os
import queue
import threading
from typing import BinaryIO, Callable

# the bytes a reader put into a buffer: (the buffer, start, end); a buffer that has .find
Seen = Callable[[mmap.mmap | bytearray, int, int], None]

BLOCK = 4096  # O_DIRECT wants offsets, lengths and buffer addresses aligned to the device's block
BUFFER = 4 << 20  # per buffer; two of them: one being filled, one being written


class DirectWriter:
    """A `write` target for `out`, a file just opened for writing (empty, at offset 0): the bytes
    go to the same file through a second descriptor opened with O_DIRECT, written by a thread in
    BUFFER-sized blocks; close() pads the last block, writes it and cuts the file back to the
    bytes written. `direct` says whether O_DIRECT is in use; if not, write() is out.write."""

    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self.fd = _open_direct(out)
        self.direct = self.fd is not None
        self.size = 0  # bytes written so far
        if not self.direct:
            return
        self._maps = [mmap.mmap(-1, BUFFER) for _ in range(2)]  # page-aligned
        self._views = {id(m): memoryview(m) for m in self._maps}
        self._free: queue.Queue[mmap.mmap] = queue.Queue()
        self._full: queue.Queue[tuple[mmap.mmap, int, int] | None] = queue.Queue()
        for m in self._maps:
            self._free.put(m)
        self._error: OSError | None = None
        self._map = self._free.get()
        self._buffer = self._views[id(self._map)]
        self._fill = 0  # bytes in the buffer being filled
        self._offset = 0  # where in the file that buffer goes
        self._thread = threading.Thread(target=self._write_blocks, name="msd-direct-write", daemon=True)
        self._thread.start()

    def __enter__(self) -> DirectWriter:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.close()
        else:
            self._stop()

    def write(self, data: bytes | memoryview) -> int:
        if not self.direct:
            return self.out.write(data)
        view = memoryview(data).cast("B")
        n = len(view)
        while view:
            take = min(len(view), BUFFER - self._fill)
            self._buffer[self._fill:self._fill + take] = view[:take]
            self._fill += take
            view = view[take:]
            if self._fill == BUFFER:
                self._hand_over(BUFFER)
        self.size += n
        return n

    def fill_from(self, readinto: Callable[[memoryview], int], seen: Seen | None = None) -> None:
        """Write what `readinto` (a reader's readinto) gives until it gives nothing, read straight
        into the aligned buffers: a decompressor's output then never passes through a bytes object
        (that copy and its allocation were a tenth of a cold start). `seen(buffer, start, end)`
        is shown each piece before it is written (the line scan of a copy)."""
        if not self.direct:
            pump(readinto, self.out.write, seen)
            return
        while n := readinto(self._buffer[self._fill:]):
            if seen is not None:
                seen(self._map, self._fill, self._fill + n)
            self._fill += n
            self.size += n
            if self._fill == BUFFER:
                self._hand_over(BUFFER)

    def close(self) -> None:
        """Write what is left and wait for the thread; raises the OSError a write met."""
        if not self.direct:
            return
        try:
            if self._fill:
                padded = -(-self._fill // BLOCK) * BLOCK
                self._buffer[self._fill:padded] = bytes(padded - self._fill)
                self._hand_over(padded)
        finally:
            self._stop()
        if self._error is not None:
            raise self._error
        os.ftruncate(self.out.fileno(), self.size)

    def _hand_over(self, length: int) -> None:
        self._full.put((self._map, length, self._offset))
        self._offset += length
        self._map, self._fill = self._free.get(), 0
        self._buffer = self._views[id(self._map)]
        if self._error is not None:
            raise self._error

    def _write_blocks(self) -> None:
        fd = self.fd
        while (item := self._full.get()) is not None:
            full, length, offset = item
            buffer = self._views[id(full)]
            try:
                if self._error is None:
                    try:
                        _write_all(fd, buffer, length, offset)
                    except OSError as e:
                        if e.errno != errno.EINVAL or fd != self.fd:
                            raise
                        # a file system that took the probe but not this block (a stricter
                        # alignment): this block and the rest go through the page cache
                        fd = self.out.fileno()
                        _write_all(fd, buffer, length, offset)
            except OSError as e:
                self._error = e.with_traceback(None)  # its frames would keep views of the buffer
            finally:
                self._free.put(full)

    def _stop(self) -> None:
        if self.fd is None:
            return
        self._full.put(None)
        self._thread.join()
        os.close(self.fd)
        self.fd = None
        for view in self._views.values():
            view.release()
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a view still held somewhere: the map goes with the last of them
                pass


def pump(readinto: Callable[[memoryview], int], write: Callable[[memoryview], object], seen: Seen | None = None,
         size: int = 1 << 20) -> None:
    """Copy what `readinto` gives to `write` through one reused buffer of `size` bytes, showing each
    piece to `seen` first, until readinto gives nothing."""
    buffer = bytearray(size)
    view = memoryview(buffer)
    while n := readinto(view):
        if seen is not None:
            seen(buffer, 0, n)
        write(view[:n])


def _write_all(fd: int, buffer: memoryview, length: int, offset: int) -> None:
    done = 0
    while done < length:
        done += os.pwrite(fd, buffer[done:length], offset + done)


def _open_direct(out: BinaryIO) -> int | None:
    """A second descriptor of `out`'s file with O_DIRECT, if this system and file system take it
    (checked by writing one zero block, which the copy overwrites or close() cuts off)."""
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:
        return None
    try:
        fd = os.open(f"/proc/self/fd/{out.fileno()}", os.O_WRONLY | flag)
    except OSError:  # no /proc, or a file system without O_DIRECT (tmpfs: EINVAL)
        return None
    probe = mmap.mmap(-1, BLOCK)
    try:
        os.pwrite(fd, probe, 0)
        return fd
    except OSError as e:
        os.close(fd)
        if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            raise
        return None
    finally:
        probe.close()
