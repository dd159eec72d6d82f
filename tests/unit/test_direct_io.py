"""DirectWriter: decompressed copies written past the page cache (O_DIRECT) hold exactly the
bytes written, whatever the sizes of the writes; a file system without O_DIRECT gets them
through the file object; a write that fails in the writing thread is raised, not lost."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from msd_common.formats import direct_io
from msd_common.formats.direct_io import BUFFER, DirectWriter


def _fs_type(path: str) -> str:
    """The file system `path` is on (/proc/mounts: the longest mount point above it)."""
    best, kind = "", ""
    with open("/proc/mounts") as f:
        for line in f:
            _, mount, fs = line.split()[:3]
            if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
                best, kind = mount, fs
    return kind


def _chunks(rng: np.random.Generator, sizes: list[int]) -> list[bytes]:
    return [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]


@pytest.mark.parametrize("sizes", [
    [],  # an empty copy
    [1],
    [4095, 1, 4097],
    [BUFFER],  # exactly one buffer: no tail
    [BUFFER - 1, 2, BUFFER * 2 + 13],  # writes across buffer ends
    [3 << 20] * 5,
])
def test_the_file_holds_exactly_what_was_written(tmp_path, sizes):
    chunks = _chunks(np.random.default_rng(len(sizes)), sizes)
    path = tmp_path / "copy"
    with open(path, "wb") as out:
        with DirectWriter(out) as w:
            if _fs_type(str(tmp_path)) in ("ext4", "xfs", "btrfs"):
                assert w.direct  # these take O_DIRECT: the path under test is the direct one
            for c in chunks:
                assert w.write(c) == len(c)
    assert path.read_bytes() == b"".join(chunks)
    assert w.size == sum(sizes)


def test_memoryviews_of_any_shape_are_written_as_bytes(tmp_path):
    data = np.arange(10_000, dtype=np.int64)
    with open(tmp_path / "copy", "wb") as out, DirectWriter(out) as w:
        w.write(memoryview(data))
    assert (tmp_path / "copy").read_bytes() == data.tobytes()


def test_without_o_direct_the_file_object_takes_the_bytes(tmp_path, monkeypatch):
    monkeypatch.delattr(direct_io.os, "O_DIRECT")  # as on macOS
    chunks = _chunks(np.random.default_rng(1), [10, BUFFER + 5])
    with open(tmp_path / "copy", "wb") as out, DirectWriter(out) as w:
        assert not w.direct
        for c in chunks:
            w.write(c)
    assert (tmp_path / "copy").read_bytes() == b"".join(chunks)


def test_a_file_system_that_refuses_o_direct_gets_a_buffered_copy():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    path = f"/dev/shm/msd-direct-test-{os.getpid()}"
    try:
        with open(path, "wb") as out, DirectWriter(out) as w:
            w.write(b"x" * 5000)
        with open(path, "rb") as f:
            assert f.read() == b"x" * 5000  # whether tmpfs took O_DIRECT (newer kernels) or not
    finally:
        os.unlink(path)


def test_a_failed_write_in_the_thread_is_raised_at_close(tmp_path, monkeypatch):
    real = os.pwrite
    calls = []

    def pwrite(fd, data, offset):
        calls.append(offset)
        if len(calls) > 2:  # the probe and the first block go through, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(direct_io.os, "pwrite", pwrite)
    with open(tmp_path / "copy", "wb") as out:
        with pytest.raises(OSError, match="No space left"):
            with DirectWriter(out) as w:
                for _ in range(4):
                    w.write(b"y" * BUFFER)


def test_a_block_the_file_system_refuses_goes_through_the_page_cache(tmp_path, monkeypatch):
    """A file system that took the probe's block but refuses a later one (a stricter alignment):
    that block and the rest are written through the buffered descriptor; the file is whole."""
    real, direct_fds = os.pwrite, set()
    real_open = os.open

    def open_(path, flags, *args):
        fd = real_open(path, flags, *args)
        if flags & os.O_DIRECT:
            direct_fds.add(fd)
        return fd

    def pwrite(fd, data, offset):
        if fd in direct_fds and offset >= BUFFER:  # the probe and the first block pass
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(direct_io.os, "open", open_)
    monkeypatch.setattr(direct_io.os, "pwrite", pwrite)
    chunks = _chunks(np.random.default_rng(2), [BUFFER + 100, 3 * BUFFER, 7])
    with open(tmp_path / "copy", "wb") as out, DirectWriter(out) as w:
        for c in chunks:
            w.write(c)
    assert direct_fds  # the direct path was taken, then left
    assert (tmp_path / "copy").read_bytes() == b"".join(chunks)


@pytest.mark.parametrize("direct", [True, False])
def test_fill_from_writes_what_a_reader_gives_and_shows_each_piece(tmp_path, monkeypatch, direct):
    """fill_from: a reader's readinto fills the aligned buffers straight (or, without O_DIRECT,
    one reused buffer); the file holds exactly the reader's bytes and `seen` was shown each piece,
    in order, before it was written."""
    import io

    if not direct:
        monkeypatch.delattr(direct_io.os, "O_DIRECT")
    data = np.random.default_rng(3).integers(0, 256, 3 * BUFFER + 12345, dtype=np.uint8).tobytes()
    src = io.BytesIO(data)

    def readinto(view: memoryview) -> int:  # pieces of odd sizes, across the buffers' ends
        return src.readinto(view[:777_777])
    pieces = []
    with open(tmp_path / "copy", "wb") as out, DirectWriter(out) as w:
        assert w.direct == direct or _fs_type(str(tmp_path)) not in ("ext4", "xfs", "btrfs")
        w.fill_from(readinto, lambda buffer, start, end: pieces.append(bytes(buffer[start:end])))
    assert (tmp_path / "copy").read_bytes() == data
    assert b"".join(pieces) == data and len(pieces) >= -(-len(data) // 777_777)
