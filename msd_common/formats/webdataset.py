"""WebDataset tar shards: samples are runs of consecutive tar entries sharing a key (the entry's
path up to the first dot of its file name), e.g. `000042.jpg` + `000042.txt`.

One sample is one record, in the order of the tar. The shard is scanned once and the index
(where each of a sample's entries lies, and which are its image and caption) is saved beside it
as `<shard>.msdidx.json` (or in the cache dir), stamped with the shard's size and mtime. Reading
a record is then a `pread` per entry it needs: the image and the caption for the built-in
image-text path, every entry for a transform. A sample whose entries are split (its key appears
again later), or, on the built-in path, that lacks an image or a caption, keeps its record index
but raises RecordError, naming shard and key.

A shard may be a URL (storage.py): it is scanned once as a stream, its index kept in the cache
dir, and a sample's entries are read by byte range, a task's samples fetched together.
"""

from __future__ import annotations

import logging
import os
import tarfile
from typing import Any, Iterable

import orjson

from msd_common.files import atomic_write

from .errors import RecordError, SourceFormatError
from .jsonl import _sidecar_path
from .storage import is_url, store_for

log = logging.getLogger("msd.webdataset")

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
CAPTION_EXTS = ("txt", "json")
INDEX_VERSION = 2  # 2: every entry of a sample (a transform gets them all)
INDEX_SUFFIX = ".msdidx.json"


def split_key(name: str) -> tuple[str, str]:
    """(key, extension) of a tar entry: `dir/000042.seg.jpg` -> (`dir/000042`, `seg.jpg`)."""
    directory, base = os.path.split(name)
    stem, dot, ext = base.partition(".")
    return (os.path.join(directory, stem) if directory else stem), (ext.lower() if dot else "")


class _Chunks:
    """A read-only stream over an iterator of byte chunks (a remote object read in order)."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._chunks, self._buf, self._pos = iter(chunks), b"", 0

    def read(self, n: int = -1) -> bytes:
        parts = []
        while n != 0:
            if self._pos == len(self._buf):
                chunk = next(self._chunks, None)
                if chunk is None:
                    break
                self._buf, self._pos = chunk, 0
            take = len(self._buf) - self._pos if n < 0 else min(n, len(self._buf) - self._pos)
            parts.append(self._buf[self._pos: self._pos + take])
            self._pos += take
            n = n - take if n > 0 else n
        return b"".join(parts)


def scan(path: str, fileobj: Any = None) -> list[dict[str, Any]]:
    """Samples of a tar in order: key, every entry (suffix -> [offset, size]), image/caption
    (offset, size, ext), and a problem or None (entries split across the tar); a missing image
    or caption is noted as `missing` (a problem for the built-in path only).
    With `fileobj`, the tar is read from it as a stream (`path` names it in errors)."""
    samples: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    try:
        with (tarfile.open(fileobj=fileobj, mode="r|") if fileobj is not None else tarfile.open(path,
                                                                                                mode="r:")) as tar:
            for m in tar:
                if not m.isfile():
                    continue
                key, ext = split_key(m.name)
                if not samples or samples[-1]["key"] != key:
                    if key in seen:  # the key's entries are not contiguous: both runs are unusable
                        first = samples[seen[key]]
                        first["problem"] = first["problem"] or "entries split across the tar"
                        samples.append({"key": key, "problem": "entries split across the tar", "entries": {}})
                        continue
                    seen[key] = len(samples)
                    samples.append({"key": key, "problem": None, "entries": {}})
                s = samples[-1]
                if ext not in s["entries"]:
                    s["entries"][ext] = [m.offset_data, m.size]
                kind = "image" if ext.rsplit(".", 1)[-1] in IMAGE_EXTS else "caption" if ext in CAPTION_EXTS else None
                if kind and kind not in s:
                    s[kind] = [m.offset_data, m.size, ext.rsplit(".", 1)[-1]]
    except (tarfile.TarError, OSError, EOFError) as e:
        raise SourceFormatError(f"{path}: not a readable tar file ({e})") from None
    for s in samples:
        missing = [k for k in ("image", "caption") if k not in s]
        if missing:
            s["missing"] = f"no {' and no '.join(missing)} entry"
    return samples


class WebDatasetShard:
    def __init__(self, shard: str, cache_dir: str | None = None, storage: dict[str, Any] | None = None) -> None:
        self.shard = shard
        self._fd: int | None = None
        self._store = store_for(shard, storage) if is_url(shard) else None
        self._prefetched: dict[int, list[bytes]] = {}
        if self._store is not None:
            try:
                size, tag = self._store.stamp(shard)
            except FileNotFoundError:
                raise SourceFormatError(f"{shard}: object not found") from None
            except OSError as e:
                raise SourceFormatError(f"{shard}: cannot read ({e})") from None
            stamp = [INDEX_VERSION, size, tag]
            build = lambda: scan(shard, _Chunks(self._store.chunks(shard)))  # noqa: E731
        else:
            if not os.path.isfile(shard):
                raise SourceFormatError(f"{shard}: file not found")
            st = os.stat(self.shard)
            stamp = [INDEX_VERSION, st.st_size, st.st_mtime_ns]
            build = lambda: scan(shard)  # noqa: E731
        self.samples = self._load_index(_sidecar_path(shard, INDEX_SUFFIX, cache_dir), stamp, build)

    def _load_index(self, index_path: str, stamp: list[int], build) -> list[dict[str, Any]]:
        try:
            with open(index_path, "rb") as f:
                saved = orjson.loads(f.read())
            if saved.get("stamp") == stamp:
                return saved["samples"]
        except (OSError, orjson.JSONDecodeError, AttributeError):
            pass  # no index yet, or an unreadable one: look beside a remote shard, else scan
        shared = self._shared_index(stamp) if self._store is not None else None
        if shared is not None:
            atomic_write(index_path, lambda f: f.write(orjson.dumps({"stamp": stamp, "samples": shared})))
            return shared
        samples = build()
        data = orjson.dumps({"stamp": stamp, "samples": samples})
        atomic_write(index_path, lambda f: f.write(data))
        if self._store is not None and self._store.share_indexes:
            try:
                self._store.put(self.shard + INDEX_SUFFIX, data)
            except OSError as e:
                log.warning("%s: cannot store the index beside the shard (%s)", self.shard, e)
        return samples

    def _shared_index(self, stamp: list[int]) -> list[dict[str, Any]] | None:
        url = self.shard + INDEX_SUFFIX
        try:
            if not self._store.exists(url):
                return None
            saved = orjson.loads(self._store.read(url, 0, self._store.stamp(url)[0]))
        except (OSError, orjson.JSONDecodeError) as e:
            log.warning("%s: shared index unreadable (%s); scanning the shard", url, e)
            return None
        return saved["samples"] if isinstance(saved, dict) and saved.get("stamp") == stamp else None

    def prefetch(self, samples: Iterable[int], every_entry: bool = False) -> None:
        """Fetch the entries of these samples of a remote shard together (a prepare task's): the
        image and caption, or with `every_entry` all of them (a transform's records)."""
        self._prefetched = {}
        if self._store is None:
            return
        wanted = [i for i in sorted(set(samples)) if not self._unreadable(i, every_entry)]
        starts, ends, counts = [], [], []
        for i in wanted:
            ranges = self._ranges(i, every_entry)
            counts.append(len(ranges))
            for offset, size in ranges.values():
                starts.append(offset)
                ends.append(offset + size)
        try:
            blobs = self._store.fetch(self.shard, starts, ends)
        except OSError as e:
            log.warning("%s: prefetch of %d samples failed (%s); reading them one by one", self.shard, len(wanted), e)
            return
        at = 0
        for i, n in zip(wanted, counts):
            self._prefetched[i] = blobs[at:at + n]
            at += n

    def _unreadable(self, i: int, every_entry: bool) -> str | None:
        s = self.samples[i]
        return s["problem"] or (None if every_entry else s.get("missing"))

    def _ranges(self, i: int, every_entry: bool) -> dict[str, list[int]]:
        """The entries to read of sample i: name -> [offset, size]."""
        s = self.samples[i]
        if every_entry:
            return s["entries"]
        return {kind: s[kind][:2] for kind in ("image", "caption")}

    def _read(self, i: int, every_entry: bool) -> dict[str, bytes]:
        s = self.samples[i]
        problem = self._unreadable(i, every_entry)
        if problem:
            raise RecordError(f"{self.shard}: sample {s['key']!r}: {problem}")
        ranges = self._ranges(i, every_entry)
        fetched = self._prefetched.pop(i, None)
        if fetched is None and self._store is not None:
            fetched = self._store.fetch(self.shard, [r[0] for r in ranges.values()],
                                        [r[0] + r[1] for r in ranges.values()])
        if fetched is None and self._fd is None:
            self._fd = os.open(self.shard, os.O_RDONLY)
        out = {}
        for n, (name, (offset, size)) in enumerate(ranges.items()):
            data = fetched[n] if fetched is not None else os.pread(self._fd, size, offset)
            if len(data) != size:
                raise RecordError(f"{self.shard}: sample {s['key']!r}: {name} entry truncated")
            out[name] = data
        return out

    def __len__(self) -> int:
        return len(self.samples)

    def entries(self, i: int) -> tuple[bytes, str, bytes, str]:
        """(image bytes, image ext, caption bytes, caption ext) of sample i."""
        got = self._read(i, every_entry=False)
        s = self.samples[i]
        return got["image"], s["image"][2], got["caption"], s["caption"][2]

    def all_entries(self, i: int) -> dict[str, bytes]:
        """Every entry of sample i: suffix (`jpg`, `seg.png`, `json`, `cls`...) -> bytes."""
        return self._read(i, every_entry=True)

    def stored_bytes(self, i: int, every_entry: bool = False) -> int:
        """Bytes of sample i's image and caption entries, or of all its entries, from the index."""
        s = self.samples[i]
        if every_entry:
            return sum(size for _, size in s["entries"].values())
        return sum(s[kind][1] for kind in ("image", "caption") if kind in s)

    def key(self, i: int) -> str:
        return self.samples[i]["key"]
