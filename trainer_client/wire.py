"""Encoding and decoding of multipart messages: frame 0 a msgpack header, then raw array frames.

Decoding never trusts the sender: frame count and sizes are checked before msgpack or numpy
touch the bytes, msgpack runs with explicit length limits, and the header is validated against
its schema (protocol.validate). Nothing here ever unpickles.
"""

from __future__ import annotations

from typing import Any, Sequence

import msgpack
import numpy as np

from . import protocol
from .errors import ProtocolError


def encode(header: dict[str, Any], *arrays: np.ndarray) -> list[Any]:
    """Frames for one message. Arrays must be C-contiguous; they are sent without a copy, so the
    caller must not write to them afterwards."""
    frames: list[Any] = [msgpack.packb(header, use_bin_type=True)]
    for a in arrays:
        if not a.flags.c_contiguous:
            raise ValueError("wire arrays must be C-contiguous")
        frames.append(memoryview(a).cast("B") if a.size else b"")
    return frames


def unpack_header(data: bytes | memoryview) -> Any:
    if len(data) > protocol.MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(data)} bytes exceeds {protocol.MAX_HEADER_BYTES}")
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=protocol.MAX_STR_LEN,
            max_bin_len=0,
            max_ext_len=0,
            max_array_len=protocol.MAX_LIST_LEN,
            max_map_len=4096,
        )
    except ProtocolError:
        raise
    except Exception as e:  # msgpack raises several unrelated types on bad input
        raise ProtocolError(f"undecodable header: {type(e).__name__}: {e}") from None


def decode(frames: Sequence[Any], allowed: frozenset[str]) -> tuple[dict[str, Any], list[memoryview]]:
    """Validate and decode one message; returns (header, raw data frames). Raises ProtocolError."""
    if not frames:
        raise ProtocolError("empty message")
    if len(frames) > protocol.MAX_FRAMES:
        raise ProtocolError(f"{len(frames)} frames exceeds {protocol.MAX_FRAMES}")
    views = [f.buffer if hasattr(f, "buffer") else memoryview(f) for f in frames]
    for v in views[1:]:
        if v.nbytes > protocol.MAX_FRAME_BYTES:
            raise ProtocolError(f"data frame of {v.nbytes} bytes exceeds {protocol.MAX_FRAME_BYTES}")
    header = unpack_header(views[0])
    protocol.validate(header, allowed, len(views) - 1)
    return header, views[1:]


def frame_array(frame: memoryview, dtype: str, count: int) -> np.ndarray:
    """View a raw frame as `count` items of `dtype`, after checking its size matches exactly."""
    dt = np.dtype(dtype)
    if frame.nbytes != count * dt.itemsize:
        raise ProtocolError(f"data frame has {frame.nbytes} bytes, header says {count} x {dt.itemsize}")
    return np.frombuffer(frame, dtype=dt, count=count)
