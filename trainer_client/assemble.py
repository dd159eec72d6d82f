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


def assemble_micro_batch(
    sequences: Sequence[Sequence[PieceRef]],
    pieces: Mapping[tuple[int, int, int], np.ndarray],
    seq_len: int,
    pad_id: int,
) -> dict[str, Any]:
    """Vectorised per sequence: a fixed number of numpy calls per row, whatever the piece count."""
    mbs = len(sequences)
    tokens = np.full((mbs, seq_len), pad_id, dtype=np.int64)
    labels = np.full((mbs, seq_len), pad_id, dtype=np.int64)
    loss_mask = np.zeros((mbs, seq_len), dtype=np.float32)
    position_ids = np.empty((mbs, seq_len), dtype=np.int64)
    seg_lengths: list[int] = []
    refs = [ref for seq in sequences for ref in seq]
    for row, seq in enumerate(sequences):
        lens = np.array([ref[2] for ref in seq], dtype=np.int64)
        n = int(lens.sum())
        if n:
            tokens[row, :n] = np.concatenate([pieces[(k, o, ln)] for k, o, ln in seq])
            labels[row, : n - 1] = tokens[row, 1:n]
            loss_mask[row, :n] = 1.0
            ends = np.cumsum(lens) - 1  # last position of each piece: its label is not in the piece
            labels[row, ends] = pad_id
            loss_mask[row, ends] = 0.0
            position_ids[row, :n] = np.arange(n) - np.repeat(ends + 1 - lens, lens)
        # padding is a segment of its own, so cu_seqlens covers the whole batch
        position_ids[row, n:] = np.arange(seq_len - n)
        seg_lengths.extend(lens.tolist())
        if n < seq_len:
            seg_lengths.append(seq_len - n)
    cu_seqlens = np.zeros(len(seg_lengths) + 1, dtype=np.int32)
    np.cumsum(seg_lengths, out=cu_seqlens[1:])
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
