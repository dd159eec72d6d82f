"""Assembling one packed micro-batch from its recipe (the step header) and the received pieces.

Pure numpy; no sockets. Layout of a sequence: its pieces back to back, then padding. Labels are
the next token within the same piece; the last position of each piece has no label inside the
piece (the next token belongs to another document or to a piece elsewhere), so its loss_mask is 0,
as is every padding position. position_ids restart at 0 at every piece (and at the padding).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

PieceRef = Sequence[int]  # [doc_key, doc_offset, length]


_ARANGE: dict[int, np.ndarray] = {}


def _arange(n: int) -> np.ndarray:
    a = _ARANGE.get(n)
    if a is None:
        a = _ARANGE[n] = np.arange(n, dtype=np.int64)
    return a


def assemble_micro_batch(
    sequences: Sequence[Sequence[PieceRef]],
    pieces: Mapping[tuple[int, int, int], np.ndarray],
    seq_len: int,
    pad_id: int,
) -> dict[str, Any]:
    """A fixed handful of numpy calls per sequence, whatever its piece count; every output array
    is written exactly once per position (this runs once per micro-batch on the trainer host)."""
    mbs = len(sequences)
    tokens = np.empty((mbs, seq_len), dtype=np.int64)
    labels = np.empty((mbs, seq_len), dtype=np.int64)
    loss_mask = np.empty((mbs, seq_len), dtype=np.float32)
    position_ids = np.empty((mbs, seq_len), dtype=np.int64)
    ar = _arange(seq_len)
    seg_lengths: list[int] = []
    for row, seq in enumerate(sequences):
        lens = [ln for _, _, ln in seq]
        n = sum(lens)
        if n:
            np.concatenate([pieces[(k, o, ln)] for k, o, ln in seq], out=tokens[row, :n], casting="safe")
            labels[row, : n - 1] = tokens[row, 1:n]
            loss_mask[row, :n] = 1.0
            ends = np.cumsum(lens)
            starts = ends - lens
            if len(lens) <= 8:  # positions restart at each piece: a few slice ops beat a repeat
                position_ids[row, :n] = ar[:n]
                for start, end in zip(starts[1:].tolist(), ends[1:].tolist()):
                    position_ids[row, start:end] -= start
            else:
                np.subtract(ar[:n], np.repeat(starts, lens), out=position_ids[row, :n])
            labels[row, ends - 1] = pad_id  # the last position of a piece has no label in it
            loss_mask[row, ends - 1] = 0.0
        tokens[row, n:] = pad_id
        labels[row, n:] = pad_id
        loss_mask[row, n:] = 0.0
        position_ids[row, n:] = ar[: seq_len - n]  # padding is a segment of its own
        seg_lengths.extend(lens)
        if n < seq_len:
            seg_lengths.append(seq_len - n)
    cu_seqlens = np.zeros(len(seg_lengths) + 1, dtype=np.int32)
    np.cumsum(seg_lengths, out=cu_seqlens[1:])
    refs = [ref for seq in sequences for ref in seq]
    piece_lengths = np.array([ref[2] for ref in refs], dtype=np.int64)
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": loss_mask,
        "position_ids": position_ids,
        "cu_seqlens": cu_seqlens,
        "doc_keys": np.array([ref[0] for ref in refs], dtype=np.uint64),
        "doc_offsets": np.array([ref[1] for ref in refs], dtype=np.int64),
        "piece_lengths": piece_lengths,
        "num_tokens": int(piece_lengths.sum()),
    }
