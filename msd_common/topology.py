"""Hybrid-parallel layout of trainer ranks: which global rank holds which (dp, pp, cp, tp)
coordinates, which ranks receive data, which fields, and each CP rank's share of a sequence.

Megatron's default rank order is "tp-cp-dp-pp": tp varies fastest, pp slowest, so global rank
r = tp + TP * (cp + CP * (dp + DP * pp)). The planner plans per DP rank; every receiving rank
with the same dp coordinate gets that DP rank's micro-batches:
- TP: with delivery "tp_leader" only tp == 0 receives (the trainer broadcasts within the TP
  group); with "all" every TP rank receives the same batches.
- PP: the first stage receives tokens and position_ids, the last stage labels and loss_mask;
  every receiving stage gets the packing metadata; middle stages receive nothing (unless they
  ask for the metadata).
- CP: each CP rank gets its share of every packed sequence (`cp_share`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

AXES = ("tp", "cp", "dp", "pp")
DEFAULT_ORDER = "tp-cp-dp-pp"
DELIVERY = ("tp_leader", "all")
METADATA = ("cu_seqlens", "doc_keys", "doc_offsets", "piece_lengths", "pieces_per_row", "num_tokens",
            "cu_seqlens_padded",
            "cp_cu_seqlens", "cp_index")
FIRST_STAGE = ("tokens", "position_ids", "pixel_patches", "patches_per_image", "image_positions")
LAST_STAGE = ("labels", "loss_mask")


class Coords(NamedTuple):
    dp: int
    pp: int
    cp: int
    tp: int


class Topology(NamedTuple):
    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    order: str = DEFAULT_ORDER
    delivery: str = "tp_leader"

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    def coords(self, rank: int) -> Coords:
        """The (dp, pp, cp, tp) coordinates of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
        out = {}
        for axis in self.order.split("-"):  # fastest-varying first
            size = getattr(self, axis)
            out[axis] = rank % size
            rank //= size
        return Coords(out["dp"], out["pp"], out["cp"], out["tp"])

    def rank_of(self, coords: Coords) -> int:
        rank, stride = 0, 1
        for axis in self.order.split("-"):
            rank += getattr(coords, axis) * stride
            stride *= getattr(self, axis)
        return rank

    def fields(self, rank: int, want_metadata: bool = False) -> tuple[str, ...]:
        """The batch fields a global rank receives; empty if it receives nothing."""
        c = self.coords(rank)
        if self.delivery == "tp_leader" and c.tp != 0:
            return ()
        fields: tuple[str, ...] = ()
        if c.pp == 0:
            fields += FIRST_STAGE
        if c.pp == self.pp - 1:
            fields += LAST_STAGE
        if fields or want_metadata:
            fields += METADATA
        return fields

    def receives(self, rank: int) -> bool:
        return bool(self.fields(rank))

    def receivers(self) -> list[int]:
        """Global ranks that receive data (metadata-only middle stages not included)."""
        return [r for r in range(self.world_size) if self.receives(r)]


def cp_share(batch: dict[str, Any], cp: int, cp_rank: int, pad_id: int) -> dict[str, Any]:
    """One CP rank's share of a packed micro-batch (Megatron's load-balanced THD split): every
    segment of `cu_seqlens` (each document piece, and each row's padding) is padded to a multiple
    of 2*cp and cut into 2*cp chunks; rank i keeps chunks i and 2*cp-1-i. tokens, labels,
    position_ids and loss_mask keep the values of the unsplit sequence; the rows are flattened
    into one packed row ([1, n]). `cu_seqlens` stays the unsplit segments' boundaries,
    `cu_seqlens_padded` gives the padded ones (what Megatron's THD context-parallel attention
    takes with them), `cp_cu_seqlens` this rank's segment boundaries, and `cp_index` the position
    of each kept token in the unsplit flattened micro-batch (-1 for padding)."""
    if cp == 1:
        return batch
    seg = np.diff(batch["cu_seqlens"]).astype(np.int64)
    unit = 2 * cp
    padded = -(-seg // unit) * unit
    starts = np.concatenate([[0], np.cumsum(seg)[:-1]])
    pstarts = np.concatenate([[0], np.cumsum(padded)[:-1]])
    total_padded = int(padded.sum())
    # the padded full sequence: every segment's values, then its padding
    src = np.full(total_padded, -1, dtype=np.int64)
    within = np.arange(total_padded) - np.repeat(pstarts, padded)
    seg_of = np.repeat(np.arange(len(seg)), padded)
    real = within < seg[seg_of]
    src[real] = starts[seg_of[real]] + within[real]
    # this rank's chunks of every segment: i and 2cp-1-i, each padded/2cp long
    chunk = padded // unit
    mine = []
    for s0, c in zip(pstarts.tolist(), chunk.tolist()):
        mine.append(np.arange(s0 + cp_rank * c, s0 + (cp_rank + 1) * c))
        mine.append(np.arange(s0 + (unit - 1 - cp_rank) * c, s0 + (unit - cp_rank) * c))
    take = src[np.concatenate(mine)] if mine else np.zeros(0, np.int64)
    out = dict(batch)
    for name, fill in (("tokens", pad_id), ("labels", pad_id), ("position_ids", -1), ("loss_mask", 0.0)):
        if name not in batch:
            continue
        flat = np.asarray(batch[name]).reshape(-1)
        values = np.full(len(take), fill, dtype=flat.dtype)
        values[take >= 0] = flat[take[take >= 0]]
        out[name] = values.reshape(1, -1)
    if "position_ids" in out:  # padding positions continue their segment's count, as unsplit
        pos = out["position_ids"].reshape(-1)
        within_take = np.concatenate(mine) - np.repeat(pstarts, 2 * chunk) if mine else np.zeros(0, np.int64)
        pos[take < 0] = within_take[take < 0]
    out["cu_seqlens_padded"] = np.concatenate([[0], np.cumsum(padded)]).astype(np.int32)
    out["cp_cu_seqlens"] = np.concatenate([[0], np.cumsum(2 * chunk)]).astype(np.int32)
    out["cp_index"] = take  # position of each kept token in the unsplit flattened micro-batch (-1: padding)
    return out
