"""Assembling packed micro-batches from their recipe (the step header) and the received pieces.

Pure numpy; no sockets. Layout of a sequence ("row"): its pieces back to back, then padding.
Labels are the next token within the same piece; the last position of each piece has no label
inside the piece (the next token belongs to another document or to a piece elsewhere), so its
loss_mask is 0, as is every padding position. position_ids restart at 0 at every piece (and at
the padding).

`StepAssembler` holds one step of one rank: the recipe fixes where every piece goes, so each
piece's tokens are copied into the step's token buffer as they arrive (in any order, from any
number of messages). A message names each piece by its index in the recipe, so finding where
it goes is one vectorised lookup, and pieces that lie back to back in both the message and the
step (a worker sends them in recipe order) are copied as one run. The other fields, which
depend only on the recipe, are derived in a fixed handful of numpy passes when the last piece
is in. A whole step is assembled at once: this runs on the trainer host, for every step.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Sequence

import numpy as np

from .buffers import BufferPool
from msd_common.frames import (FINISHED, FRAMES, PATCH_COUNTS, PIXEL_MASK, RECIPE, FrameRecipe, PendingPixels,
                               concat_padded, tile_mask)
from msd_common.protocol import PIECE_ITEM, RECIPE_PIECE

PieceRef = Sequence[int]  # [doc_key, doc_offset, length]

# per token of a micro-batch: int64 label and position id, float32 loss mask (after its int64 token)
FIELD_BYTES = 8 + 8 + 4


RAMP_MIN_SEGMENT = 1024  # mean tokens per segment from which position ids are copied from a ramp
_SEED_RAMP = np.arange(4096, dtype=np.int64)  # 32 KB: the start of every ramp
_SEED_RAMP.flags.writeable = False


def fill_ramps(out: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> None:
    """out[s: s + n] = 0, 1, ..., n - 1 for every segment (start s, length n). The longest is
    written first, from a short ramp doubled in place, and the others are copied from it: no
    array as long as a row is kept or allocated. A cached ramp of row length cost every client
    0.4 MB for good (a 32k row, int64, one per row length), and a temporary one stays in the
    trainer's heap as free memory once freed, since a micro-batch is built on every next()."""
    if not len(lengths):
        return
    i = int(np.argmax(lengths))
    s0, n0 = int(starts[i]), int(lengths[i])
    done = min(n0, len(_SEED_RAMP))
    out[s0: s0 + done] = _SEED_RAMP[:done]
    while done < n0:
        more = min(done, n0 - done)
        np.add(out[s0: s0 + more], done, out=out[s0 + done: s0 + done + more])
        done += more
    for s, n in zip(starts.tolist(), lengths.tolist()):
        if s != s0:
            out[s: s + n] = out[s0: s0 + n]


class StepAssembler:
    def __init__(self, refs: np.ndarray, counts: np.ndarray, row_len: int, pad_id: int, micro_batch_size: int,
                 patch_bytes: int = 0, rope: str = "plain") -> None:
        """refs: [doc_key, offset, length] per piece in packing order; counts: pieces per row,
        micro-batch major (consecutive groups of micro_batch_size rows form the micro-batches).
        patch_bytes > 0: the job has image-text sources, and batches carry their patches.
        rope "mrope": position_ids have three rows (the Qwen-VL models), [3, B, L]."""
        self.patch_bytes = patch_bytes
        self.patches: dict[int, np.ndarray] = {}  # piece -> its image patches (the placeholders it starts with)
        self.rope = rope
        # piece -> a processor's arrays of it, by name; name -> (dtype, row shape, per_token)
        self.extras: dict[int, dict[str, np.ndarray]] = {}
        self.extra_specs: dict[str, tuple[np.dtype, tuple, bool]] = {}
        self.refs = np.asarray(refs, dtype=np.uint64).reshape(-1, len(RECIPE_PIECE))
        self.counts = np.asarray(counts, dtype=np.int64)
        self.row_len, self.pad_id, self.mbs = row_len, pad_id, micro_batch_size
        rows = len(self.counts)
        lengths = self.refs[:, RECIPE_PIECE.length].astype(np.int64)
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
        # Received tokens wait in the senders' dtype (2 or 4 bytes, not int64): the coordinator's
        # look-ahead delivers several steps early, and a finished step is built only when it is due.
        self.tokens: np.ndarray | None = None  # allocated by the first message, in its dtype
        # 1 where a token is trained on (as a label), for steps with pieces of sources that have
        # masks (transforms, chat): allocated by the first message that carries one
        self.mask: np.ndarray | None = None
        self.have = np.zeros(len(lengths), dtype=bool)
        self.missing = len(lengths)

    def add(self, items: np.ndarray, tokens: np.ndarray, patch_counts: np.ndarray | None = None,
            patches: np.ndarray | None = None, loss_mask: np.ndarray | None = None, extras: list | None = None,
            extra_rows: np.ndarray | None = None, extra_frames: list[np.ndarray] | None = None) -> int:
        """Copy in the pieces of one message: items [piece, doc_key, offset, length] rows (piece:
        the index of the piece in this step's recipe) whose tokens are concatenated in `tokens`,
        and (image-text pieces) the patches of each item's image placeholders, concatenated in
        `patches`. An item is taken only if the recipe holds its exact reference at that index
        and the piece is not here yet. `loss_mask`: empty, or one entry per token of `tokens`
        (1: trained on). Returns how many items were not taken."""
        items = np.asarray(items, dtype=np.uint64).reshape(-1, len(PIECE_ITEM))
        lengths = items[:, PIECE_ITEM.length].astype(np.int64)
        at = np.zeros(len(items), dtype=np.int64)  # where each item's tokens start in `tokens`
        np.cumsum(lengths[:-1], out=at[1:])
        in_recipe = items[:, PIECE_ITEM.piece] < len(self.lengths)
        piece = np.where(in_recipe, items[:, PIECE_ITEM.piece], 0).astype(np.intp)
        # an item's [doc_key, offset, length] are the recipe's columns, in the recipe's order
        same = (self.refs[piece] == items[:, PIECE_ITEM.doc_key:]).all(axis=1)
        take = np.flatnonzero(in_recipe & same & ~self.have[piece])
        if len(take) > 1 and (np.diff(np.sort(piece[take])) == 0).any():  # one piece twice in a message:
            take = take[np.sort(np.unique(piece[take], return_index=True)[1])]  # its first copy counts
        piece = piece[take]
        src, dst, n = at[take], self.dst[piece], lengths[take]
        # One copy per run of pieces that lie back to back both in the message and in the step (a
        # worker sends a rank's pieces in recipe order, so a run is usually a whole row).
        breaks = np.flatnonzero((src[1:] != src[:-1] + n[:-1]) | (dst[1:] != dst[:-1] + n[:-1])) + 1
        first = np.concatenate([[0], breaks]).astype(np.intp)
        last = np.concatenate([breaks, [len(take)]]).astype(np.intp) - 1
        out = self._buffer_for(tokens.dtype)
        masked = loss_mask is not None and len(loss_mask) > 0
        if masked and self.mask is None:
            self.mask = np.ones(len(self.counts) * self.row_len, dtype=np.uint8)
        if len(take):
            for s, d, e in zip(src[first].tolist(), dst[first].tolist(), (src[last] + n[last]).tolist()):
                out[d: d + e - s] = tokens[s:e]
                if masked:
                    self.mask[d: d + e - s] = loss_mask[s:e]
        self.have[piece] = True
        self.missing -= len(take)
        if patch_counts is not None and len(patch_counts) > 0:
            patches = patches.reshape(-1, self.patch_bytes)
            counts = np.asarray(patch_counts, dtype=np.int64)
            patch_at = np.cumsum(counts) - counts
            for k, i in zip(take.tolist(), piece.tolist()):
                if counts[k]:
                    self.patches[i] = patches[patch_at[k]: patch_at[k] + counts[k]]
        if extras:
            self._add_extras(take, piece, len(items), extras, extra_rows, extra_frames or [])
        return len(items) - len(take)

    def _add_extras(self, take: np.ndarray, piece: np.ndarray, n_items: int, extras: list,
                    extra_rows: np.ndarray, frames: list[np.ndarray]) -> None:
        """Keep the processor's arrays of the taken items (views of the message's frames: one per
        item and array with rows, item by item in declaration order)."""
        specs = []
        for name, dtype, shape, per_token in extras:
            spec = (np.dtype(dtype), tuple(shape), bool(per_token))
            self.extra_specs.setdefault(name, spec)
            specs.append((name, *spec))
        rows = np.asarray(extra_rows, np.int64).reshape(n_items, len(specs))
        first = np.concatenate([[0], np.cumsum((rows > 0).sum(axis=1))])  # each item's first frame
        for k, i in zip(take.tolist(), piece.tolist()):
            mine, f = {}, int(first[k])
            for j, (name, dtype, shape, _) in enumerate(specs):
                if rows[k, j]:
                    mine[name] = frames[f].view(dtype).reshape(-1, *shape)
                    f += 1
            if mine:
                self.extras[i] = mine

    def _buffer_for(self, dtype: np.dtype) -> np.ndarray:
        """The step's token buffer, able to hold tokens of `dtype` (widened if a message needs it)."""
        if self.tokens is None:
            self.tokens = np.empty(len(self.counts) * self.row_len, dtype=dtype)
        elif not np.can_cast(dtype, self.tokens.dtype, casting="safe"):
            self.tokens = self.tokens.astype(np.promote_types(self.tokens.dtype, dtype))
        return self.tokens

    @property
    def done(self) -> bool:
        return self.missing == 0

    @property
    def micro_batches(self) -> int:
        return len(self.counts) // self.mbs

    def batches(self) -> list[dict[str, Any]]:
        """All the step's micro-batches."""
        return [self.micro_batch(m) for m in range(self.micro_batches)]

    @functools.cached_property
    def _layout(self) -> dict[str, np.ndarray]:
        """The step's segments (each row's pieces, then its padding if any), in flat order: their
        lengths, their ends in the step's tokens, which are padding, and where each row's segments
        end; and where each row's pieces and each piece's tokens end. Computed once, when the
        first micro-batch is built."""
        rows = len(self.counts)
        pad = self.row_len - self.used  # padding at the end of each row
        has_pad = (pad > 0).astype(np.int64)
        segs_per_row = self.counts + has_pad
        seg_row_end = np.cumsum(segs_per_row)
        pad_seg = (seg_row_end - 1)[has_pad > 0]  # a row's padding is its last segment
        n_segs = int(seg_row_end[-1]) if rows else 0
        piece_seg = np.arange(len(self.lengths)) + np.repeat(np.cumsum(has_pad) - has_pad, self.counts)
        seg_len = np.empty(n_segs, np.int64)
        seg_len[piece_seg] = self.lengths
        seg_len[pad_seg] = pad[has_pad > 0]
        seg_pad = np.zeros(n_segs, bool)
        seg_pad[pad_seg] = True
        ends = np.cumsum(seg_len)
        piece_ends = np.zeros(len(self.lengths) + 1, np.int64)
        np.cumsum(self.lengths, out=piece_ends[1:])
        row_pieces = np.zeros(rows + 1, np.int64)
        np.cumsum(self.counts, out=row_pieces[1:])
        return {"seg_len": seg_len, "seg_pad": seg_pad, "ends": ends, "seg_row_end": seg_row_end,
                "piece_ends": piece_ends, "row_pieces": row_pieces}

    def micro_batch(self, m: int, pool: BufferPool | None = None, ahead: bool = False,
                    pixels_later: bool = False) -> dict[str, Any]:
        """Micro-batch m of the step, in arrays of its own (views of one buffer: from `pool` where
        given, else allocated), so that a trainer holding it holds only it: a client builds each
        micro-batch just before the trainer takes it, not the whole step at once."""
        lay = self._layout
        row_len, mbs = self.row_len, self.mbs
        first_row, last_row = m * mbs, (m + 1) * mbs
        total, base = mbs * row_len, first_row * row_len
        seg_lo = int(lay["seg_row_end"][first_row - 1]) if first_row else 0
        seg_hi = int(lay["seg_row_end"][last_row - 1])
        seg_len, seg_pad = lay["seg_len"][seg_lo:seg_hi], lay["seg_pad"][seg_lo:seg_hi]
        ends = lay["ends"][seg_lo:seg_hi] - base
        starts = ends - seg_len
        n_segs = seg_hi - seg_lo
        nbytes = (8 + FIELD_BYTES) * total
        buf = pool.take(nbytes, ahead) if pool is not None else np.empty(nbytes, np.uint8)
        tokens = buf[:8 * total].view(np.int64)
        if self.tokens is not None:
            tokens[:] = self.tokens[base:base + total]
        for r in np.flatnonzero(self.used[first_row:last_row] < row_len).tolist():  # the padding was never written
            tokens[r * row_len + int(self.used[first_row + r]):(r + 1) * row_len] = self.pad_id
        fields = buf[8 * total:]
        labels, position_ids = fields[:8 * total].view(np.int64), fields[8 * total:16 * total].view(np.int64)
        loss_mask = fields[16 * total:].view(np.float32)
        labels[:-1] = tokens[1:]
        labels[ends - 1] = self.pad_id  # the last position of every segment has no label inside it
        if self.mask is None:
            loss_mask.fill(1.0)
        else:  # position i predicts token i + 1: trained on where that token is
            loss_mask[:-1] = self.mask[base + 1: base + total]
            loss_mask[-1] = 0.0
        loss_mask[ends - 1] = 0.0
        for s, n in zip(starts[seg_pad].tolist(), seg_len[seg_pad].tolist()):  # one per padded row
            labels[s: s + n] = self.pad_id
            loss_mask[s: s + n] = 0.0
        # position ids restart at every segment: for long segments one copy of a ramp each, for
        # short ones (a per-segment Python step would cost more) a running count reset at each start
        if n_segs * RAMP_MIN_SEGMENT <= total:
            fill_ramps(position_ids, starts, seg_len)
        elif n_segs:
            position_ids.fill(1)
            position_ids[starts] = 1 - np.concatenate([[1], seg_len[:-1]])
            np.cumsum(position_ids, out=position_ids)
        cu = np.zeros(n_segs + 1, np.int32)  # a 0, then the segments' ends
        cu[1:] = ends
        p0, p1 = int(lay["row_pieces"][first_row]), int(lay["row_pieces"][last_row])
        shape = (mbs, row_len)
        out = {
            "tokens": tokens.reshape(shape),
            "labels": labels.reshape(shape),
            "loss_mask": loss_mask.reshape(shape),
            "position_ids": position_ids.reshape(shape),
            "cu_seqlens": cu,
            "doc_keys": self.refs[p0:p1, RECIPE_PIECE.doc_key].astype(np.int64),  # 63-bit keys: int64 for torch
            "doc_offsets": self.refs[p0:p1, RECIPE_PIECE.offset].astype(np.int64),
            "piece_lengths": self.lengths[p0:p1],
            "pieces_per_row": self.counts[first_row:last_row],  # the pieces of each row, in doc_keys order
            "num_tokens": int(lay["piece_ends"][p1] - lay["piece_ends"][p0]),
        }
        if self.patch_bytes:
            out.update(self._images(range(p0, p1), self.dst, first_row))
        if self.rope == "mrope" or self.extras:
            out.update(self._processor_arrays(range(p0, p1), base, out["position_ids"], pixels_later))
        return out

    def release(self, m: int) -> int:
        """Micro-batch m was handed to the trainer, which never asks for it again: let go of its
        pieces' received arrays (image frames, a processor's arrays, patches), which the batch no
        longer needs, and return their bytes. A step's frames were otherwise held until its last
        micro-batch was taken: with images, the whole step's uint8 frames beside the float
        micro-batch (49 of tools/bench_vlm.py's 162 MB of trainer growth)."""
        if not self.extras and not self.patches:  # a text step: nothing to let go (next()'s hot path)
            return 0
        lay = self._layout
        released = 0
        for i in range(int(lay["row_pieces"][m * self.mbs]), int(lay["row_pieces"][(m + 1) * self.mbs])):
            released += sum(a.nbytes for a in self.extras.pop(i, {}).values())
            patches = self.patches.pop(i, None)
            released += 0 if patches is None else patches.nbytes
        return released

    def _processor_arrays(self, pieces: range, base: int, position_ids: np.ndarray,
                          pixels_later: bool = False) -> dict[str, np.ndarray]:
        """A processor's arrays of a micro-batch's pieces: per-token ones laid out as the tokens
        ([B, L], 0 elsewhere), image ones concatenated in packing order, the images of each piece,
        and for mrope jobs position_ids [3, B, L]: a piece's own three rows where it has them (a
        conversation with images), its plain positions on all three rows elsewhere."""
        shape = position_ids.shape
        out: dict[str, np.ndarray] = {}
        with_extras = [i for i in pieces if i in self.extras]
        if self.rope == "mrope":
            rows3 = np.broadcast_to(position_ids, (3, *shape)).copy()
            flat = rows3.reshape(3, -1)
            for i in with_extras:
                three = self.extras[i].get("position_ids")
                if three is not None:
                    d = int(self.dst[i]) - base
                    flat[:, d: d + len(three)] = three.T
            out["position_ids"] = rows3
        made_here = {"position_ids", PATCH_COUNTS}
        for frames, recipe, grids, name in FINISHED:
            pixels = self._pixel_values(with_extras, frames, recipe, grids, name)
            if pixels is not None:
                out[name] = pixels if pixels_later else pixels.finish()
                if pixels.tiled:  # Idefics3's mask, a batch of one as its pixel values
                    out[PIXEL_MASK] = self._tile_mask(with_extras)
                    made_here.add(PIXEL_MASK)
            made_here.update((frames, recipe, name))
        for name, (dtype, row_shape, per_token) in sorted(self.extra_specs.items()):
            if name in made_here or not any(name in self.extras[i] for i in with_extras):
                continue
            if per_token:
                laid = np.zeros((shape[0] * shape[1], *row_shape), dtype=np.int64 if dtype.kind in "iub" else dtype)
                for i in with_extras:
                    a = self.extras[i].get(name)
                    if a is not None:
                        d = int(self.dst[i]) - base
                        laid[d: d + len(a)] = a
                out[name] = laid.reshape(*shape, *row_shape)
            else:
                out[name] = concat_padded([self.extras[i][name] for i in with_extras if name in self.extras[i]])
        out["images_per_sample"] = np.array([self._images_of(i) for i in pieces], np.int64)
        if "video_grid_thw" in self.extra_specs:
            out["videos_per_sample"] = np.array([len(self.extras.get(i, {}).get("video_grid_thw", ()))
                                                 for i in pieces], np.int64)
        return out

    def _images_of(self, piece: int) -> int:
        """A piece's images: its rows of image_grid_thw, else of its pixel values (Gemma 3: one per
        image, and one per crop with pan-and-scan)."""
        mine = self.extras.get(piece, {})
        if "image_grid_thw" in self.extra_specs:
            return len(mine.get("image_grid_thw", ()))
        if PATCH_COUNTS in mine:  # LLaVA-NeXT: its images, whose patches it counts
            return len(mine[PATCH_COUNTS])
        if FRAMES in mine:
            recipe = FrameRecipe.from_array(mine[RECIPE])
            return len(recipe.shapes(len(mine[FRAMES]), None))
        return len(mine.get("pixel_values", ()))

    def _pixel_values(self, pieces: list[int], frames: str = FRAMES, recipe: str = RECIPE,
                      grids: str = "image_grid_thw", name: str = "pixel_values") -> PendingPixels | None:
        """The processor's pixel values (`name`: of images, or of videos) of these pieces, in packing
        order, to be made (msd_common/frames.py): a piece's own, or its uint8 frames finished; here,
        or on the trainer's device."""
        parts = []
        for i in pieces:
            mine = self.extras[i]
            if frames in mine:  # (LLaVA-NeXT's: each image's patches where a grid would be)
                layout = mine.get(grids, mine.get(PATCH_COUNTS))
                parts.append((mine[frames], FrameRecipe.from_array(mine[recipe]), layout))
            elif name in mine:
                parts.append(mine[name])
        return PendingPixels(parts, tiled=any(PIXEL_MASK in self.extras[i] for i in pieces)) if parts else None

    def _tile_mask(self, pieces: list[int]) -> np.ndarray:
        """pixel_attention_mask [1, tiles, S, S] of these pieces' tiles: a piece's own (its processor
        run whole at prepare time), else all ones (tiles planned from sizes: none padded)."""
        parts = []
        for i in pieces:
            mine = self.extras[i]
            if PIXEL_MASK in mine:
                parts.append(mine[PIXEL_MASK].astype(bool, copy=False))
            elif FRAMES in mine:
                parts.append(tile_mask(mine[FRAMES], FrameRecipe.from_array(mine[RECIPE])))
        return np.concatenate(parts)[None]

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
    refs = np.array([ref for seq in sequences for ref in seq], dtype=np.uint64).reshape(-1, len(RECIPE_PIECE))
    counts = np.array([len(seq) for seq in sequences], dtype=np.int64)
    step = StepAssembler(refs, counts, seq_len, pad_id, micro_batch_size)
    if len(refs):
        items = np.column_stack([np.arange(len(refs), dtype=np.uint64), refs])
        step.add(items, np.concatenate([pieces[tuple(ref)] for ref in refs.tolist()]))
    return step.batches()


def assemble_micro_batch(
    sequences: Sequence[Sequence[PieceRef]],
    pieces: Mapping[tuple[int, int, int], np.ndarray],
    seq_len: int,
    pad_id: int,
) -> dict[str, Any]:
    """One micro-batch made of `sequences` (a step of a single micro-batch)."""
    return assemble_step(sequences, pieces, seq_len, pad_id, len(sequences))[0]
