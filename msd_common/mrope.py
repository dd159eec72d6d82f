"""Three-row multimodal RoPE position ids (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) of one sample, from its
token types and its images' grids, without torch: what the model's own `get_rope_index` computes
for a sample of text and images, so that a packed row can restart them at each sample.

Text tokens advance all three rows by one. An image of grid (t, h, w) patches, merged m x m by the
vision encoder, is t x (h/m) x (w/m) tokens: the first row counts its temporal index, the second
its row, the third its column, each from the position where the image starts; the text after it
continues at that position plus max(h, w) / m. Consecutive image tokens are one image, as in the
model's code (the chat templates put <|vision_start|> and <|vision_end|> around each).
"""

from __future__ import annotations

import numpy as np

TEXT, IMAGE, VIDEO = 0, 1, 2  # token types, as the processors' mm_token_type_ids


def mrope_position_ids(token_types: np.ndarray, image_grid_thw: np.ndarray, spatial_merge_size: int,
                       video_grid_thw: np.ndarray | None = None,
                       video_intervals: np.ndarray | None = None) -> np.ndarray:
    """int64 [3, n] position ids of one sample whose tokens have `token_types` (TEXT, IMAGE or
    VIDEO, n of them) and whose images, in order, have the patch grids `image_grid_thw` ([images, 3]).
    Videos: one grid per run of video tokens (Qwen3-VL's timestamps cut a video into a run per
    temporal patch, each of grid (1, h, w)), and each run's temporal spacing (Qwen2.5-VL:
    tokens_per_second x second_per_grid_ts, in float32 as its get_rope_index computes it; else 1).
    Raises ValueError when the vision tokens and the grids disagree."""
    types = np.asarray(token_types)
    by_type = {IMAGE: np.asarray(image_grid_thw, dtype=np.int64).reshape(-1, 3),
               VIDEO: np.asarray(video_grid_thw if video_grid_thw is not None else np.zeros((0, 3)),
                                 dtype=np.int64).reshape(-1, 3)}
    spacing = np.ones(len(by_type[VIDEO]), np.float32) if video_intervals is None else \
        np.asarray(video_intervals, np.float32).reshape(-1)
    n = len(types)
    out = np.empty((3, n), dtype=np.int64)
    if n == 0:
        return out
    # runs of one type: [start, end)
    change = np.flatnonzero(types[1:] != types[:-1]) + 1
    starts = np.concatenate([[0], change])
    ends = np.concatenate([change, [n]])
    position = 0
    used = {IMAGE: 0, VIDEO: 0}
    m = spatial_merge_size
    for start, end in zip(starts.tolist(), ends.tolist()):
        kind = int(types[start])
        if kind == TEXT:
            out[:, start:end] = np.arange(position, position + end - start)
            position += end - start
            continue
        what = "image" if kind == IMAGE else "video"
        grids, k = by_type[kind], used[kind]
        if k >= len(grids):
            raise ValueError(f"more {what}s in the tokens than the {len(grids)} grids given")
        t, h, w = grids[k].tolist()
        ht, wt = h // m, w // m
        if t * ht * wt != end - start:
            raise ValueError(f"{what} {k}: {end - start} tokens, but its grid {t}x{h}x{w} merged "
                             f"{m}x{m} makes {t * ht * wt}")
        temporal = np.arange(t)
        if kind == VIDEO and spacing[k] != 1:
            temporal = (np.arange(t, dtype=np.float32) * spacing[k]).astype(np.int64)
        out[0, start:end] = np.repeat(temporal, ht * wt) + position
        out[1, start:end] = np.tile(np.repeat(np.arange(ht), wt), t) + position
        out[2, start:end] = np.tile(np.arange(wt), t * ht) + position
        position += max(h, w) // m
        used[kind] += 1
    for kind, grids in by_type.items():
        if used[kind] != len(grids):
            what = "image" if kind == IMAGE else "video"
            raise ValueError(f"{len(grids)} {what} grids for {used[kind]} {what}s in the tokens")
    return out
