"""Assembling packed micro-batches from their recipe (the step header) and the received pieces.

Pure numpy; no sockets. Layout of a sequence: its pieces back to back, then padding. Labels are
the next token within the same piece; the last position of each piece has no label inside the
piece (the next token belongs to another document or to a piece elsewhere), so its loss_mask is 0,
as is every padding position. position_ids restart at 0 at every piece (and at the padding).

A whole step is assembled at once, vectorised over all its sequences: a fixed handful of numpy
passes per step, whatever its piece count (this runs on the trainer host, for every step).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

PieceRef = Sequence[int]  # [doc_key, doc_offset, length]


def assemble_step(
    sequences: Sequence[Sequence[PieceRef]],
    pieces: Mapping[tuple[int, int, int], np.ndarray],
    seq_len: int,
    pad_id: int,
    micro_batch_size: int,
) -> list[dict[str, Any]]:
    """The micro-batches of one step: `sequences` lists every sequence of the step, micro-batch
    major; consecutive groups of `micro_batch_size` form the micro-batches. The returned arrays of
    all micro-batches are views into one allocation per field."""
    rows = len(sequences)
    # segments in flat order: every piece, and after a row's pieces its padding (if any)
    seg_len: list[int] = []
    seg_pad: list[bool] = []
    chunks: list[np.ndarray] = []
    segs_per_row: list[int] = []
    for seq in sequences:
        n = 0
        for key, offset, length in seq:
            chunks.append(pieces[(key, offset, length)])
            seg_len.append(length)
            seg_pad.append(False)
            n += length
        if n > seq_len:
            raise ValueError(f"sequence holds {n} tokens, more than seq_len {seq_len}")
        if n < seq_len:
            chunks.append(np.full(seq_len - n, pad_id, dtype=np.int64))
            seg_len.append(seq_len - n)
            seg_pad.append(True)
        segs_per_row.append(len(seq) + (n < seq_len))
    total = rows * seq_len
    lengths = np.array(seg_len, dtype=np.int64)
    ends = np.cumsum(lengths)
    starts = ends - lengths

    tokens = np.empty(total, dtype=np.int64)
    if chunks:
        np.concatenate(chunks, out=tokens, casting="safe")
    labels = np.empty(total, dtype=np.int64)
    labels[:-1] = tokens[1:]
    labels[ends - 1] = pad_id  # the last position of every segment has no label inside it
    loss_mask = np.ones(total, dtype=np.float32)
    loss_mask[ends - 1] = 0.0
    position_ids = np.arange(total, dtype=np.int64)
    position_ids -= np.repeat(starts, lengths)
    padded = np.array(seg_pad, dtype=bool)
    if padded.any():
        pad_positions = np.repeat(padded, lengths)
        labels[pad_positions] = pad_id
        loss_mask[pad_positions] = 0.0

    shape = (rows, seq_len)
    tokens, labels, loss_mask, position_ids = (a.reshape(shape) for a in (tokens, labels, loss_mask, position_ids))
    out = []
    seg_row_end = np.cumsum(segs_per_row).tolist()
    for m in range(rows // micro_batch_size):
        r0, r1 = m * micro_batch_size, (m + 1) * micro_batch_size
        s0 = seg_row_end[r0 - 1] if r0 else 0
        s1 = seg_row_end[r1 - 1]
        mb_lengths = lengths[s0:s1]
        cu_seqlens = np.zeros(len(mb_lengths) + 1, dtype=np.int32)
        np.cumsum(mb_lengths, out=cu_seqlens[1:])
        refs = [ref for seq in sequences[r0:r1] for ref in seq]
        piece_lengths = mb_lengths[~padded[s0:s1]]
        out.append({
            "tokens": tokens[r0:r1],
            "labels": labels[r0:r1],
            "loss_mask": loss_mask[r0:r1],
            "position_ids": position_ids[r0:r1],
            "cu_seqlens": cu_seqlens,
            "doc_keys": np.array([ref[0] for ref in refs], dtype=np.uint64),
            "doc_offsets": np.array([ref[1] for ref in refs], dtype=np.int64),
            "piece_lengths": piece_lengths,
            "num_tokens": int(piece_lengths.sum()),
        })
    return out


def assemble_micro_batch(
    sequences: Sequence[Sequence[PieceRef]],
    pieces: Mapping[tuple[int, int, int], np.ndarray],
    seq_len: int,
    pad_id: int,
) -> dict[str, Any]:
    """One micro-batch made of `sequences` (a step of a single micro-batch)."""
    return assemble_step(sequences, pieces, seq_len, pad_id, len(sequences))[0]
