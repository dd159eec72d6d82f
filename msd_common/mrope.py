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

TEXT, IMAGE = 0, 1  # token types, as the processors' mm_token_type_ids


def mrope_position_ids(token_types: np.ndarray, image_grid_thw: np.ndarray, spatial_merge_size: int) -> np.ndarray:
    """int64 [3, n] position ids of one sample whose tokens have `token_types` (TEXT or IMAGE, n
    of them) and whose images, in order, have the patch grids `image_grid_thw` ([images, 3]).
    Raises ValueError when the image tokens and the grids disagree."""
    types = np.asarray(token_types)
    grids = np.asarray(image_grid_thw, dtype=np.int64).reshape(-1, 3)
    n = len(types)
    out = np.empty((3, n), dtype=np.int64)
    if n == 0:
        return out
    # runs of one type: [start, end)
    change = np.flatnonzero(types[1:] != types[:-1]) + 1
    starts = np.concatenate([[0], change])
    ends = np.concatenate([change, [n]])
    position, image = 0, 0
    m = spatial_merge_size
    for start, end in zip(starts.tolist(), ends.tolist()):
        if types[start] == TEXT:
            out[:, start:end] = np.arange(position, position + end - start)
            position += end - start
            continue
        if image >= len(grids):
            raise ValueError(f"more images in the tokens than the {len(grids)} grids given")
        t, h, w = grids[image].tolist()
        ht, wt = h // m, w // m
        if t * ht * wt != end - start:
            raise ValueError(f"image {image}: {end - start} image tokens, but its grid {t}x{h}x{w} merged "
                             f"{m}x{m} makes {t * ht * wt}")
        out[0, start:end] = np.repeat(np.arange(t), ht * wt) + position
        out[1, start:end] = np.tile(np.repeat(np.arange(ht), wt), t) + position
        out[2, start:end] = np.tile(np.arange(wt), t * ht) + position
        position += max(h, w) // m
        image += 1
    if image != len(grids):
        raise ValueError(f"{len(grids)} image grids for {image} images in the tokens")
    return out
