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
    mbs = len(sequences)
    tokens = np.full((mbs, seq_len), pad_id, dtype=np.int64)
    labels = np.full((mbs, seq_len), pad_id, dtype=np.int64)
    loss_mask = np.zeros((mbs, seq_len), dtype=np.float32)
    position_ids = np.zeros((mbs, seq_len), dtype=np.int64)
    seg_lengths: list[int] = []
    doc_keys: list[int] = []
    doc_offsets: list[int] = []
    piece_lengths: list[int] = []
    for row, seq in enumerate(sequences):
        at = 0
        for key, offset, length in seq:
            chunk = pieces[(key, offset, length)]
            end = at + length
            tokens[row, at:end] = chunk
            labels[row, at: end - 1] = chunk[1:]
            loss_mask[row, at: end - 1] = 1.0
            position_ids[row, at:end] = np.arange(length)
            seg_lengths.append(length)
            doc_keys.append(key)
            doc_offsets.append(offset)
            piece_lengths.append(length)
            at = end
        if at < seq_len:  # padding is a segment of its own, so cu_seqlens covers the whole batch
            position_ids[row, at:] = np.arange(seq_len - at)
            seg_lengths.append(seq_len - at)
    cu_seqlens = np.zeros(len(seg_lengths) + 1, dtype=np.int32)
    np.cumsum(seg_lengths, out=cu_seqlens[1:])
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": loss_mask,
        "position_ids": position_ids,
        "cu_seqlens": cu_seqlens,
        "doc_keys": np.array(doc_keys, dtype=np.uint64),
        "doc_offsets": np.array(doc_offsets, dtype=np.int64),
        "piece_lengths": np.array(piece_lengths, dtype=np.int64),
        "num_tokens": int(sum(piece_lengths)),
    }
