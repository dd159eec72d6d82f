"""Assembling packed micro-batches from their recipe (the step header) and the received pieces.

Pure numpy; no sockets. Layout of a sequence ("row"): its pieces back to back, then padding.
Labels are the next token within the same piece; the last position of each piece has no label
inside the piece (the next token belongs to another document or to a piece elsewhere), so its
loss_mask is 0, as is every padding position. position_ids restart at 0 at every piece (and at
the padding).

`StepAssembler` holds one step of one rank: the recipe fixes where every piece goes, so each
piece's tokens are copied into the step's token buffer as they arrive (in any order, from any
number of messages), and the other fields, which depend only on the recipe, are derived in a
fixed handful of numpy passes when the last piece is in. A whole step is assembled at once: this
runs on the trainer host, for every step.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

PieceRef = Sequence[int]  # [doc_key, doc_offset, length]

FIELD_BYTES = 8 + 8 + 4  # per token of a finished step: int64 label and position id, float32 loss mask (one allocation)


class StepAssembler:
    def __init__(self, refs: np.ndarray, counts: np.ndarray, row_len: int, pad_id: int, micro_batch_size: int,
                 patch_bytes: int = 0) -> None:
        """refs: [doc_key, offset, length] per piece in packing order; counts: pieces per row,
        micro-batch major (consecutive groups of micro_batch_size rows form the micro-batches).
        patch_bytes > 0: the job has image-text sources, and batches carry their patches."""
        self.patch_bytes = patch_bytes
        self.patches: dict[int, np.ndarray] = {}  # piece -> its image patches (the placeholders it starts with)
        self.refs = np.asarray(refs, dtype=np.uint64).reshape(-1, 3)
        self.counts = np.asarray(counts, dtype=np.int64)
        self.row_len, self.pad_id, self.mbs = row_len, pad_id, micro_batch_size
        rows = len(self.counts)
        lengths = self.refs[:, 2].astype(np.int64)
        row_of = np.repeat(np.arange(rows), self.counts)
        ends = np.cumsum(lengths)
        row_first = np.cumsum(self.counts) - self.counts  # index of each row's first piece
        before_row = np.concatenate([[0], ends])[row_first]  # tokens of all earlier rows' pieces
        starts = ends - lengths - np.repeat(before_row, self.counts)  # offset within the row
        used = np.bincount(row_of, weights=lengths, minlength=rows).astype(np.int64)
        if (used > row_len).any():
            r = int(np.argmax(used > row_len))
            raise ValueError(f"row {r} holds {int(used[r])} tokens, more than its length {row_len}")
        self.lengths = lengths
        self.dst = row_of * row_len + starts  # where each piece's first token goes
        self.used = used
        # ref -> the pieces it fills: the same range of a record may occur twice in one step (a
        # small source repeats within a step), and one copy of its tokens fills both
        self.index: dict[tuple[int, int, int], list[int]] = {}
        for i, ref in enumerate(map(tuple, self.refs.tolist())):
            self.index.setdefault(ref, []).append(i)
        self.tokens = np.empty(rows * row_len, dtype=np.int64)  # from the header on; the other fields once done
        for r in np.flatnonzero(used < row_len).tolist():  # only padding needs a value now; pieces overwrite the rest
            self.tokens[r * row_len + used[r]:(r + 1) * row_len] = pad_id
        self.have = bytearray(len(lengths))  # plain Python containers: add() reads them once per piece
        self.dst_of = self.dst.tolist()
        self.missing = len(lengths)

    def add(self, items: np.ndarray, tokens: np.ndarray, patch_counts: np.ndarray | None = None,
            patches: np.ndarray | None = None) -> int:
        """Copy in the pieces of one message: items [doc_key, offset, length] rows whose tokens are
        concatenated in `tokens`, and (image-text pieces) the patches of each item's image
        placeholders, concatenated in `patches`. Returns how many were already here or not in
        the recipe."""
        ignored = 0
        at = at_patch = 0
        index, have, dst, out = self.index, self.have, self.dst_of, self.tokens
        with_patches = patch_counts is not None and len(patch_counts) > 0
        if with_patches:
            patches = patches.reshape(-1, self.patch_bytes)
        for n, (key, offset, length) in enumerate(items.tolist()):
            where = index.get((key, offset, length))
            n_patches = int(patch_counts[n]) if with_patches else 0
            if where is None or have[where[0]]:
                ignored += 1
            else:
                for i in where:
                    d = dst[i]
                    out[d: d + length] = tokens[at: at + length]
                    have[i] = True
                    if n_patches:
                        self.patches[i] = patches[at_patch: at_patch + n_patches]
                self.missing -= len(where)
            at += length
            at_patch += n_patches
        return ignored

    @property
    def done(self) -> bool:
        return self.missing == 0

    def batches(self) -> list[dict[str, Any]]:
        """The step's micro-batches; their arrays are views into one allocation per field."""
        rows, row_len = len(self.counts), self.row_len
        pad = row_len - self.used  # padding at the end of each row
        # segments in flat order: each row's pieces, then its padding if any
        piece_row = np.repeat(np.arange(rows), self.counts)
        seg_row = np.concatenate([piece_row, np.flatnonzero(pad > 0)])
        seg_len = np.concatenate([self.lengths, pad[pad > 0]])
        seg_pad = np.concatenate([np.zeros(len(self.lengths), bool), np.ones(int((pad > 0).sum()), bool)])
        order = np.argsort(seg_row, kind="stable")  # pieces keep their order, padding last in its row
        seg_row, seg_len, seg_pad = seg_row[order], seg_len[order], seg_pad[order]
        ends = np.cumsum(seg_len)
        starts = ends - seg_len
        total = rows * row_len
        fields = np.empty(FIELD_BYTES * total, np.uint8)
        labels, position_ids = fields[:8 * total].view(np.int64), fields[8 * total:16 * total].view(np.int64)
        loss_mask = fields[16 * total:].view(np.float32)
        tokens = self.tokens
        labels[:-1] = tokens[1:]
        labels[ends - 1] = self.pad_id  # the last position of every segment has no label inside it
        loss_mask.fill(1.0)
        loss_mask[ends - 1] = 0.0
        for s, n in zip(starts[seg_pad].tolist(), seg_len[seg_pad].tolist()):  # one per padded row
            labels[s: s + n] = self.pad_id
            loss_mask[s: s + n] = 0.0
        # position ids restart at every segment: a running count, reset at each segment's start
        position_ids.fill(1)
        position_ids[starts] = 1 - np.concatenate([[1], seg_len[:-1]])
        np.cumsum(position_ids, out=position_ids)
        shape = (rows, row_len)
        tokens, labels, loss_mask, position_ids = (a.reshape(shape) for a in (tokens, labels, loss_mask, position_ids))
        mbs = self.mbs
        seg_mb = seg_row // mbs
        seg_bounds = np.searchsorted(seg_mb, np.arange(rows // mbs + 1)).tolist()
        piece_bounds = np.concatenate([[0], np.cumsum(self.counts.reshape(-1, mbs).sum(axis=1))])
        real_tokens = np.diff(np.concatenate([[0], np.cumsum(self.lengths)])[piece_bounds]).tolist()
        piece_bounds = piece_bounds.tolist()
        out = []
        dst = self.dst
        for m in range(rows // mbs):
            s0, s1 = seg_bounds[m], seg_bounds[m + 1]
            cu_seqlens = np.empty(s1 - s0 + 1, dtype=np.int32)
            cu_seqlens[0] = 0
            cu_seqlens[1:] = ends[s0:s1] - m * mbs * row_len  # the micro-batch's segments, flattened
            p0, p1 = piece_bounds[m], piece_bounds[m + 1]
            piece_lengths = self.lengths[p0:p1]
            out.append({
                "tokens": tokens[m * mbs:(m + 1) * mbs],
                "labels": labels[m * mbs:(m + 1) * mbs],
                "loss_mask": loss_mask[m * mbs:(m + 1) * mbs],
                "position_ids": position_ids[m * mbs:(m + 1) * mbs],
                "cu_seqlens": cu_seqlens,
                "doc_keys": self.refs[p0:p1, 0].copy(),
                "doc_offsets": self.refs[p0:p1, 1].astype(np.int64),
                "piece_lengths": piece_lengths,
                "num_tokens": real_tokens[m],
            })
            if self.patch_bytes:
                out[-1].update(self._images(range(p0, p1), dst, m * mbs))
        return out

    def _images(self, pieces: range, dst: np.ndarray, first_row: int) -> dict[str, np.ndarray]:
        """pixel_patches [n, patch_bytes] of a micro-batch's pieces in packing order, the patches
        of each image (piece) in turn, and the (sequence, position) of each patch's placeholder."""
        with_images = [i for i in pieces if i in self.patches]
        counts = np.array([len(self.patches[i]) for i in with_images], dtype=np.int64)
        if not with_images:
            return {"pixel_patches": np.zeros((0, self.patch_bytes), np.uint8),
                    "patches_per_image": counts, "image_positions": np.zeros((0, 2), np.int64)}
        starts = np.repeat(dst[with_images], counts) + (np.arange(int(counts.sum())) - np.repeat(
            np.cumsum(counts) - counts, counts))
        return {
            "pixel_patches": np.concatenate([self.patches[i] for i in with_images]),
            "patches_per_image": counts,
            "image_positions": np.column_stack([starts // self.row_len - first_row, starts % self.row_len]),
        }


def assemble_step(
    sequences: Sequence[Sequence[PieceRef]],
    pieces: Mapping[tuple[int, int, int], np.ndarray],
    seq_len: int,
    pad_id: int,
    micro_batch_size: int,
) -> list[dict[str, Any]]:
    """The micro-batches of one step from its sequences (micro-batch major) and a map of each
    piece's tokens: StepAssembler with every piece given at once."""
    refs = np.array([ref for seq in sequences for ref in seq], dtype=np.uint64).reshape(-1, 3)
    counts = np.array([len(seq) for seq in sequences], dtype=np.int64)
    step = StepAssembler(refs, counts, seq_len, pad_id, micro_batch_size)
    unique = list(step.index)
    if unique:
        step.add(np.array(unique, dtype=np.uint64), np.concatenate([pieces[k] for k in unique]))
    return step.batches()


def assemble_micro_batch(
    sequences: Sequence[Sequence[PieceRef]],
    pieces: Mapping[tuple[int, int, int], np.ndarray],
    seq_len: int,
    pad_id: int,
) -> dict[str, Any]:
    """One micro-batch made of `sequences` (a step of a single micro-batch)."""
    return assemble_step(sequences, pieces, seq_len, pad_id, len(sequences))[0]
