"""What a DataClient hands out: one micro-batch as a dict of arrays (numpy or torch) and plain values.

`Batch.to(device)` moves every tensor and leaves the rest (`step`, `micro_batch`, `num_tokens`,
`plan`), so the usual one-line move to the GPU works on it. `BATCH_KEYS` lists every key, with its
dtype, shape and meaning (the documentation's batch schema is generated from it; a test checks
that every key a real batch holds is listed).
"""

from __future__ import annotations

from typing import Any, NamedTuple


class BatchKey(NamedTuple):
    key: str
    dtype: str
    shape: str
    present: str
    meaning: str


# B: micro_batch_size; L: the row length (seq_len, or the stage's or eval set's, times 1 + token_slack);
# P: document pieces in the micro-batch; S: segments (each piece, and each row's padding).
BATCH_KEYS: tuple[BatchKey, ...] = (
    BatchKey("tokens", "int64", "[B, L]", "first pipeline stage", "Token ids, documents packed into rows; padding "
             "is `batch.pad_id`."),
    BatchKey("position_ids", "int64", "[B, L]; [3, B, L] for mrope", "first pipeline stage", "Positions, restarting "
             "at 0 with each document piece. For a job whose processor uses multimodal rotary positions (Qwen2-VL, "
             "Qwen2.5-VL, Qwen3-VL: `client.batch_shape[\"rope\"] == \"mrope\"`): the model's temporal, height and "
             "width rows, as its "
             "`get_rope_index` gives them for each conversation; a text piece has its plain positions on all three."),
    BatchKey("labels", "int64", "[B, L]", "last pipeline stage", "The next token within the same document; "
             "`pad_id` elsewhere."),
    BatchKey("loss_mask", "float32", "[B, L]", "last pipeline stage", "1 where `labels` is trained on: 0 on "
             "padding, at the end of each piece, and where a chat source's or a transform's mask says so "
             "(`loss_mask[i]` is the mask of token i+1)."),
    BatchKey("cu_seqlens", "int32", "[S + 1]", "always", "Segment boundaries over the flattened micro-batch, for "
             "variable-length attention (flash-attn `varlen`, `torch` document masks)."),
    BatchKey("doc_keys", "int64", "[P]", "always", "Each piece's document: `source_index << 48 | record_index`."),
    BatchKey("doc_offsets", "int64", "[P]", "always", "Where each piece starts in its document (tokens)."),
    BatchKey("piece_lengths", "int64", "[P]", "always", "Tokens of each piece."),
    BatchKey("pieces_per_row", "int64", "[B]", "always", "Pieces of each row, in `doc_keys` order."),
    BatchKey("num_tokens", "int", "", "always", "Real (non-padding) tokens in the micro-batch."),
    BatchKey("step", "int", "", "always", "The training step (for an eval batch, the pass's internal step)."),
    BatchKey("micro_batch", "int", "", "always", "Index of the micro-batch within its step (or eval pass)."),
    BatchKey("plan", "dict", "", "micro-batch 0 of each step", "This rank's cost and the step's balance: "
             "`rank_cost`, `naive_rank_cost`, `max_over_mean`, `naive_max_over_mean`."),
    BatchKey("eval_set", "str", "", "eval batches", "The eval set's name (`client.eval_batches(name)`)."),
    BatchKey("eval_pass", "int", "", "eval batches", "Which pass over the set this is (0, 1, ...)."),
    BatchKey("pixel_patches", "uint8", "[patches, patch_size * patch_size * 3]", "jobs with images, first stage",
             "The images' patches, image after image in packing order."),
    BatchKey("patches_per_image", "int64", "[images]", "jobs with images, first stage", "Patches of each image."),
    BatchKey("image_positions", "int64", "[patches, 2]", "jobs with images, first stage", "(row, position) of each "
             "patch's placeholder token."),
    BatchKey("pixel_values", "float32", "the processor's: [patches, 1176] (Qwen2.5-VL), [images, 3, 896, 896] "
             "(Gemma 3), [1, tiles, 3, 364, 364] (Idefics3), [images, patches, 3, 336, 336] (LLaVA-NeXT), "
             "[patches, 3, 448, 448] (InternVL)",
             "jobs with a processor source, "
             "micro-batches with images", "The processor's pixel values, image after image in packing order "
             "(concatenated along the first axis, as the model's forward takes them, each padded with zeros to "
             "the widest where their shapes differ, as transformers pads a batch; Idefics3: every "
             "piece's tiles along the second axis of one batch, which their forward flattens). Images planned "
             "from their sizes (Qwen-VL, Gemma 3, Idefics3, SmolVLM2, the LLaVA models, InternVL) arrive as "
             "uint8 frames, resized by the processor; the client makes "
             "these values from them with the processor's own rescale and normalise (the workers' image "
             "backend, bit for bit) and its patch layout: on the CPU, ahead of `next()`, or at `next()` on "
             "`DataClient(device=...)`, where this tensor then lives."),
    BatchKey("pixel_attention_mask", "bool", "[1, tiles, 364, 364]", "jobs with an Idefics3 or SmolVLM2 "
             "processor source, micro-batches with images", "Which pixels of each tile of `pixel_values` are the "
             "image's: all of them (the image processor pads none within a sample). The processor's values as "
             "bool, not int64: an eighth of the bytes; the model's forward takes either."),
    BatchKey("image_sizes", "int64", "[images, 2]", "jobs with a processor source that gives them (LLaVA-NeXT), "
             "micro-batches with images", "Each image's (height, width) before the processor resized it, in "
             "packing order; the model's forward finds each image's patches among the padding of `pixel_values` "
             "by them."),
    BatchKey("batch_num_images", "int64", "[samples]", "jobs with a LLaVA-OneVision processor source, "
             "micro-batches with images", "The images of each sample with images, in packing order: the model "
             "cuts a sample's one image into patches, and takes each of several whole."),
    BatchKey("image_grid_thw", "int64", "[images, 3]", "jobs with a processor source, micro-batches with images",
             "Each image's (temporal, height, width) patch grid, in packing order (processors that report it)."),
    BatchKey("mm_token_type_ids", "int64", "[B, L]", "jobs with a processor source, micro-batches with images",
             "The processor's per-token modality ids (1 on image tokens; Qwen-VL), laid out as `tokens`, 0 "
             "elsewhere."),
    BatchKey("token_type_ids", "int64", "[B, L]", "jobs with a processor source, micro-batches with images",
             "The same for processors that name it so (Gemma 3: 1 on image tokens, which its attention lets see "
             "each other both ways)."),
    BatchKey("images_per_sample", "int64", "[P]", "jobs with a processor source", "Images of each piece, in "
             "`doc_keys` order (0 for text): its rows of `image_grid_thw`, or for processors without one its rows "
             "of `pixel_values` (Gemma 3: one per image, and one per crop with pan-and-scan; Idefics3: "
             "its tiles, each image's global view among them; InternVL: its patches, thumbnails among them)."),
    BatchKey("pixel_values_videos", "float32", "[patches, 1176] (Qwen2.5-VL)", "jobs with a processor source, "
             "micro-batches with videos", "The video processor's pixel values, video after video in packing order. "
             "Only the sampled frames are decoded (PyAV), resized by the video processor and sent as uint8; the "
             "client rescales, normalises and patchifies them as the video processor does (torchvision, bit for "
             "bit), on the CPU ahead of `next()` or at `next()` on `DataClient(device=...)`."),
    BatchKey("video_grid_thw", "int64", "[videos, 3]", "jobs with a processor source, micro-batches with videos",
             "Each video's (temporal, height, width) patch grid, in packing order."),
    BatchKey("second_per_grid_ts", "float32", "[videos]", "Qwen2.5-VL, micro-batches with videos",
             "Seconds of video per temporal patch, as the processor reports it (the model spaces the temporal "
             "positions by it; `position_ids` already do)."),
    BatchKey("videos_per_sample", "int64", "[P]", "jobs whose processor takes videos", "Videos of each piece, in "
             "`doc_keys` order: its rows of `video_grid_thw`."),
    BatchKey("cu_seqlens_padded", "int32", "[S + 1]", "cp > 1", "Segment boundaries with each segment padded to a "
             "multiple of 2 x cp (rows are flattened to `[1, n]`)."),
    BatchKey("cp_cu_seqlens", "int32", "[S + 1]", "cp > 1", "This context-parallel rank's share of each segment."),
    BatchKey("cp_index", "int64", "[n]", "cp > 1",
             "Position of each of this rank's tokens in the unsplit flattened micro-batch (-1: padding)."),
)


class Batch(dict):
    def to(self, device: Any, non_blocking: bool = False) -> "Batch":
        """A new Batch with every tensor on `device` (torch's `Tensor.to`); other values as they are."""
        return Batch({k: v.to(device, non_blocking=non_blocking) if hasattr(v, "to") and hasattr(v, "device") else v
                      for k, v in self.items()})

    def pin_memory(self) -> "Batch":
        """A new Batch with every tensor in pinned (page-locked) host memory."""
        return Batch({k: v.pin_memory() if hasattr(v, "pin_memory") else v for k, v in self.items()})
