"""Local image-text and Parquet datasets for tests, benchmarks and examples (no network).

Images are real encoded files (JPEG, PNG, WebP written by Pillow) of procedurally drawn scenes:
gradients, shapes and text, in varied sizes and aspect ratios, so decoding and resizing cost
what they cost on real photos of the same size. Captions are docstrings of the Python standard
library (`demo_data`).
"""

from __future__ import annotations

import functools
import io
import struct
import tarfile
import zlib

import numpy as np
import orjson

from msd_common.files import atomic_write

from .demo_data import _docstrings, _stdlib_sources


@functools.lru_cache(maxsize=4)
def captions(limit: int = 5000) -> list[str]:
    out: list[str] = []
    for _, source in _stdlib_sources():
        out.extend(d.split("\n\n")[0] for d in _docstrings(source))
        if len(out) >= limit:
            break
    return out[:limit]


def draw_image(rng: np.random.Generator, width: int, height: int, fmt: str) -> bytes:
    from PIL import Image, ImageDraw

    y, x = np.mgrid[0:height, 0:width]
    base = rng.integers(0, 256, size=(2, 3))
    t = ((x / max(width - 1, 1) + y / max(height - 1, 1)) / 2)[..., None]
    pixels = (base[0] * (1 - t) + base[1] * t).astype(np.uint8)
    img = Image.fromarray(pixels, "RGB")
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(3, 12))):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        x1, y1 = x0 + int(rng.integers(4, width // 2 + 5)), y0 + int(rng.integers(4, height // 2 + 5))
        color = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)([x0, y0, x1, y1], fill=color)
    out = io.BytesIO()
    img.save(out, format={"jpg": "JPEG", "png": "PNG", "webp": "WEBP"}[fmt], quality=90)
    return out.getvalue()


def bomb_png(width: int, height: int) -> bytes:
    """A small PNG whose header declares width x height RGB pixels (its data is a few bytes): what
    a decompression bomb looks like to a decoder before it decodes."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + chunk(b"IEND", b""))


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0
    tar.addfile(info, io.BytesIO(data))


def write_webdataset(path: str, n: int, seed: int = 0, sizes: tuple[int, int] = (96, 640),
                     formats: tuple[str, ...] = ("jpg", "png", "webp"), broken: dict[int, str] | None = None) -> None:
    """A tar of n image-text samples `{i:06d}.{jpg|png|webp}` + `.txt` (every third one `.json`).
    broken: sample index -> "no_caption" | "bad_image" | "split" (its caption comes at the end) |
    "bomb" (a PNG whose header declares 20000 x 10000 pixels: a decompression bomb)."""
    rng = np.random.default_rng(seed)
    texts = captions()
    broken = broken or {}
    late: list[tuple[str, bytes]] = []

    def write(f) -> None:
        with tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(n):
                key = f"{i:06d}"
                fmt = formats[i % len(formats)]
                w, h = (int(v) for v in rng.integers(sizes[0], sizes[1] + 1, 2))
                image = {"bad_image": b"not an image at all", "bomb": bomb_png(20000, 10000)}.get(broken.get(i), b"")
                image = image or draw_image(rng, w, h, fmt)
                text = texts[int(rng.integers(0, len(texts)))]
                caption = orjson.dumps({"caption": text}) if i % 3 == 2 else text.encode()
                _add(tar, f"{key}.{fmt}", image)
                cap_name = f"{key}.{'json' if i % 3 == 2 else 'txt'}"
                if broken.get(i) == "split":
                    late.append((cap_name, caption))
                elif broken.get(i) != "no_caption":
                    _add(tar, cap_name, caption)
            for name, data in late:
                _add(tar, name, data)

    atomic_write(path, write)


def write_parquet(path: str, texts: list[str], row_group_size: int = 64, tokens: bool = False) -> None:
    """A Parquet file with a `text` column (or, tokens=True, also a `tokens` list<int32> column
    holding the byte tokens of each text plus end-of-document 256)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = {"text": pa.array(texts, pa.string())}
    if tokens:
        ids = [list(t.encode()) + [256] for t in texts]
        columns["tokens"] = pa.array(ids, pa.list_(pa.int32()))
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
