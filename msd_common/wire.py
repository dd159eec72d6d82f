"""Encoding and decoding of multipart messages: frame 0 a msgpack header, then raw array frames.

Decoding never trusts the sender: frame count and sizes are checked before msgpack or numpy
touch the bytes, msgpack runs with explicit length limits, and the header is validated against
its schema (protocol.validate). Nothing here ever unpickles.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import msgpack

from . import protocol
from .errors import ProtocolError

if TYPE_CHECKING:
    import numpy as np


def encode(message: "protocol.Message | dict[str, Any]", *arrays: "np.ndarray",
           tail: Sequence["np.ndarray"] = ()) -> list[Any]:
    """Frames for one message (a protocol.Message; or a raw header dict and its arrays, for
    what must send one unchecked): the header, then the arrays in the order of the type's
    ArraySpecs, each as the spec's little-endian dtype (converted only where it differs) and
    C-contiguous, then the `tail` arrays' bytes, a frame each (a type that takes them: Pieces'
    extras). Arrays are sent without a copy, so the caller must not write to them afterwards."""
    if isinstance(message, protocol.Message):
        header, arrays, tail = message.header(), message.frames(), getattr(message, "tail", ())
    else:
        header = message
    frames: list[Any] = [msgpack.packb(header, use_bin_type=True)]
    if not arrays and not tail:
        return frames
    import numpy as np  # here, not at the top: the host agent's messages carry no arrays

    specs = protocol.ALL_TYPES[header["type"]].arrays
    if len(arrays) != len(specs):
        raise ValueError(f"{header['type']}: {len(arrays)} arrays given, the type has {len(specs)}")
    for spec, a in zip(specs, arrays):
        a = np.ascontiguousarray(a, dtype=spec.dtype or header["dtype"])
        if spec.cols > 1 and a.size and (a.ndim != 2 or a.shape[1] != spec.cols):
            raise ValueError(f"{header['type']}.{spec.name}: expected {spec.cols} columns, got shape {a.shape}")
        frames.append(memoryview(a).cast("B") if a.size else b"")
    frames += [memoryview(np.ascontiguousarray(t)).cast("B") for t in tail]
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


def decode(frames: Sequence[Any], allowed: frozenset[str]) -> tuple[dict[str, Any], dict[str, "np.ndarray"]]:
    """Validate and decode one message: (header, {array name: read-only array}). Raises
    ProtocolError for anything malformed: frame count or size, header schema, array consistency."""
    if not frames:
        raise ProtocolError("empty message")
    if len(frames) > protocol.MAX_FRAMES + protocol.MAX_EXTRA_FRAMES:
        raise ProtocolError(f"{len(frames)} frames exceeds {protocol.MAX_FRAMES + protocol.MAX_EXTRA_FRAMES}")
    views = [f.buffer if hasattr(f, "buffer") else memoryview(f) for f in frames]
    for v in views[1:]:
        if v.nbytes > protocol.MAX_FRAME_BYTES:
            raise ProtocolError(f"data frame of {v.nbytes} bytes exceeds {protocol.MAX_FRAME_BYTES}")
    header = unpack_header(views[0])
    kind = protocol.validate(header, allowed, len(views) - 1)
    arrays: dict[str, "np.ndarray"] = {}
    if kind.arrays:
        import numpy as np  # here, not at the top: the host agent's messages carry no arrays
    for spec, view in zip(kind.arrays, views[1:]):
        dtype = np.dtype(spec.dtype or header["dtype"])
        row_bytes = dtype.itemsize * spec.cols
        if view.nbytes % row_bytes:
            raise ProtocolError(f"{kind.name}.{spec.name}: {view.nbytes} bytes is not a whole number of "
                                f"{spec.cols} x {dtype.str} rows")
        a = np.frombuffer(view, dtype=dtype) if view.nbytes else np.zeros(0, dtype)
        arrays[spec.name] = a.reshape(-1, spec.cols) if spec.cols > 1 else a
    if kind.tail:
        import numpy as np

        arrays["tail"] = [np.frombuffer(v, dtype=np.uint8) if v.nbytes else np.zeros(0, np.uint8)
                          for v in views[1 + len(kind.arrays):]]
    if kind.check is not None:
        kind.check(header, arrays)
    return header, arrays


def receive(frames: Sequence[Any], allowed: frozenset[str]) -> "protocol.Message":
    """Validate and decode one message into its typed class (see decode)."""
    header, arrays = decode(frames, allowed)
    return protocol.ALL_TYPES[header["type"]].cls.from_wire(header, arrays)
