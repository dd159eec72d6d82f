"""WebDataset tar shards: samples are runs of consecutive tar entries sharing a key (the entry's
path up to the first dot of its file name), e.g. `000042.jpg` + `000042.txt`.

One sample is one record, in the order of the tar. The shard is scanned once and the index
(where each sample's image and caption bytes lie) is saved beside it as `<shard>.msdidx.json`
(or in the cache dir), stamped with the shard's size and mtime. Reading a record is then two
`pread`s. A sample whose entries are split (its key appears again later), or that lacks an
image or a caption, keeps its record index but raises RecordError, naming shard and key.
"""

from __future__ import annotations

import os
import tarfile
from typing import Any

import orjson

from trainer_client.files import atomic_write

from .errors import RecordError, SourceFormatError
from .jsonl import _sidecar_path

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
CAPTION_EXTS = ("txt", "json")
INDEX_VERSION = 1
INDEX_SUFFIX = ".msdidx.json"


def split_key(name: str) -> tuple[str, str]:
    """(key, extension) of a tar entry: `dir/000042.seg.jpg` -> (`dir/000042`, `seg.jpg`)."""
    directory, base = os.path.split(name)
    stem, dot, ext = base.partition(".")
    return (os.path.join(directory, stem) if directory else stem), (ext.lower() if dot else "")


def scan(path: str) -> list[dict[str, Any]]:
    """Samples of a tar in order: key, image/caption (offset, size, ext), and a problem or None."""
    samples: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    try:
        with tarfile.open(path, mode="r:") as tar:
            for m in tar:
                if not m.isfile():
                    continue
                key, ext = split_key(m.name)
                if not samples or samples[-1]["key"] != key:
                    if key in seen:  # the key's entries are not contiguous: both runs are unusable
                        first = samples[seen[key]]
                        first["problem"] = first["problem"] or "entries split across the tar"
                        samples.append({"key": key, "problem": "entries split across the tar"})
                        continue
                    seen[key] = len(samples)
                    samples.append({"key": key, "problem": None})
                s = samples[-1]
                kind = "image" if ext.rsplit(".", 1)[-1] in IMAGE_EXTS else "caption" if ext in CAPTION_EXTS else None
                if kind and kind not in s:
                    s[kind] = [m.offset_data, m.size, ext.rsplit(".", 1)[-1]]
    except (tarfile.TarError, OSError, EOFError) as e:
        raise SourceFormatError(f"{path}: not a readable tar file ({e})") from None
    for s in samples:
        if s["problem"] is None:
            missing = [k for k in ("image", "caption") if k not in s]
            if missing:
                s["problem"] = f"no {' and no '.join(missing)} entry"
    return samples


class WebDatasetShard:
    def __init__(self, shard: str, cache_dir: str | None = None) -> None:
        if not os.path.isfile(shard):
            raise SourceFormatError(f"{shard}: file not found")
        self.shard = shard
        self.samples = self._load_index(_sidecar_path(shard, INDEX_SUFFIX, cache_dir))
        self._fd: int | None = None

    def _load_index(self, index_path: str) -> list[dict[str, Any]]:
        st = os.stat(self.shard)
        stamp = [INDEX_VERSION, st.st_size, st.st_mtime_ns]
        try:
            with open(index_path, "rb") as f:
                saved = orjson.loads(f.read())
            if saved.get("stamp") == stamp:
                return saved["samples"]
        except (OSError, orjson.JSONDecodeError, AttributeError):
            pass  # no index yet, or an unreadable one: scan below
        samples = scan(self.shard)
        atomic_write(index_path, lambda f: f.write(orjson.dumps({"stamp": stamp, "samples": samples})))
        return samples

    def __len__(self) -> int:
        return len(self.samples)

    def entries(self, i: int) -> tuple[bytes, str, bytes, str]:
        """(image bytes, image ext, caption bytes, caption ext) of sample i."""
        s = self.samples[i]
        if s["problem"]:
            raise RecordError(f"{self.shard}: sample {s['key']!r}: {s['problem']}")
        if self._fd is None:
            self._fd = os.open(self.shard, os.O_RDONLY)
        out = []
        for kind in ("image", "caption"):
            offset, size, ext = s[kind]
            data = os.pread(self._fd, size, offset)
            if len(data) != size:
                raise RecordError(f"{self.shard}: sample {s['key']!r}: {kind} entry truncated")
            out += [data, ext]
        return out[0], out[1], out[2], out[3]

    def stored_bytes(self, i: int) -> int:
        """Bytes of sample i's image and caption entries, from the index (0 for a broken sample)."""
        s = self.samples[i]
        return sum(s[kind][1] for kind in ("image", "caption") if kind in s)

    def key(self, i: int) -> str:
        return self.samples[i]["key"]
