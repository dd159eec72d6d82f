"""Run in the reference environment (.venv-vlm: transformers with torch, torchvision, PyAV and
torchcodec; FFmpeg's libraries reachable for torchcodec, see test_video.py):
`python video_check.py QWEN2_5_VL_DIR QWEN3_VL_DIR WORK_DIR`.

Conversations with videos made into samples by the worker's ProcessorChat (each video planned from
its container's metadata, its sampled frames decoded with PyAV at delivery and resized by the video
processor, sent as uint8) and finished as the trainer client finishes them, against the processor's
own `apply_chat_template` (videos decoded by transformers' default loader, torchcodec) and the
models' own `get_rope_index`: token for token, mask for mask, pixel for pixel, position for
position. Then the videos that must skip their record before planning. Prints one JSON line."""

from __future__ import annotations

import functools
import json
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import av  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import AutoProcessor  # noqa: E402

from msd_common.frames import VIDEO_FRAMES, VIDEO_RECIPE, FrameRecipe, PendingPixels, finished  # noqa: E402
from worker.processor import ImageRecordError, ProcessorChat  # noqa: E402

# (name, frames, frame rate, width, height, codec, keyframe interval: the decoder seeks between them)
VIDEOS = [("a.mp4", 75, 25, 160, 120, "libx264", 8), ("b.mp4", 31, 10, 96, 200, "mpeg4", None),
          ("c.webm", 50, 24, 320, 180, "libvpx-vp9", 6), ("d.mp4", 9, 30, 64, 64, "libx264", None)]
# recorded on its side, as a phone records: its display matrix turns it 90 degrees (a quarter turn)
ROTATED = ("e.mp4", 20, 15, 160, 96, "libx264", 6, 90)


def write_video(path: str, frames: int, fps: int, width: int, height: int, codec: str,
                gop: int | None = None, rotation: int = 0) -> None:
    """A video whose frames differ (a moving block over a drifting colour, and noise); with
    `rotation`, a display matrix that turns it by that many degrees counter-clockwise."""
    rng = np.random.default_rng(frames)
    with av.open(path, "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if gop is not None:
            stream.codec_context.gop_size = gop
        if rotation:
            stream.set_display_rotation(rotation)
        for i in range(frames):
            a = rng.integers(0, 60, (height, width, 3), dtype=np.uint8)
            a[..., 1] += np.uint8(i * 3 % 190)
            a[(i * 4) % height:(i * 4) % height + height // 4, : width // 3] = 250
            for packet in stream.encode(av.VideoFrame.from_ndarray(a, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def conversations() -> list[list[dict]]:
    def user(*parts: dict) -> dict:
        return {"role": "user", "content": list(parts)}

    def assistant(text: str) -> dict:
        return {"role": "assistant", "content": [{"type": "text", "text": text}]}

    def video(name: str) -> dict:
        return {"type": "video", "video": name}

    def text(t: str) -> dict:
        return {"type": "text", "text": t}

    return [
        [user(video("a.mp4"), text("what moves here")), assistant("a white block, going down")],
        [user(video("b.mp4"), text("and these two")), assistant("a block"),
         user(video("c.webm"), video("d.mp4"), text("compare them")), assistant("the second is shorter")],
        [user(video(ROTATED[0]), text("which way up")), assistant("the block is on the left")],
    ]


def rope_model(family: str, merge: int, tokens_per_second: float) -> tuple[object, object]:
    if family == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel as Model
    else:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel as Model
    model = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(
        spatial_merge_size=merge, tokens_per_second=tokens_per_second)))
    model.get_vision_position_ids = functools.partial(Model.get_vision_position_ids, model)
    return Model, model


def compare(family: str, path: str, work: str, fps: float | None) -> list[dict]:
    processor = AutoProcessor.from_pretrained(path)
    chat = ProcessorChat(path, backend="torchvision", video_fps=fps)
    Model, model = rope_model(family, chat.info.merge_size, chat.tokens_per_second)
    results = []
    for messages in conversations():
        sample = chat.render({"messages": messages}, work)
        planned_bytes = sample.array_bytes.get(VIDEO_FRAMES)
        problem = chat.finish(sample, "check")
        ours = finished(sample.image_arrays)
        absolute = [{**m, "content": [{**p, "video": os.path.join(work, p["video"])} if p["type"] == "video" else p
                                      for p in m["content"]]} for m in messages]
        ref = processor.apply_chat_template(absolute, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True, return_tensors="np",
                                            **({"fps": fps} if fps is not None else {}))
        ids = np.asarray(ref["input_ids"]).reshape(-1)
        vision = np.isin(ids, chat.video_token_ids) | np.isin(ids, chat.image_token_ids)
        mask = np.asarray(ref["assistant_masks"]).reshape(-1).astype(np.uint8)
        mask[vision] = 0
        kwargs = {"video_grid_thw": torch.from_numpy(np.asarray(ref["video_grid_thw"]))}
        if "second_per_grid_ts" in ref:
            kwargs["second_per_grid_ts"] = torch.tensor(np.asarray(ref["second_per_grid_ts"]), dtype=torch.float32)
        positions, _ = Model.get_rope_index(model, torch.from_numpy(ids[None]),
                                            torch.from_numpy(np.asarray(ref["mm_token_type_ids"]).reshape(1, -1)),
                                            **kwargs)
        theirs_pixels = np.asarray(ref["pixel_values_videos"])
        recipe = FrameRecipe.from_array(sample.image_arrays[VIDEO_RECIPE])
        part = (sample.image_arrays[VIDEO_FRAMES], recipe, ours["video_grid_thw"])
        on_torch = PendingPixels([part, part]).finish_on("cpu").numpy()  # the device path, two pieces
        in_one = PendingPixels([part, part]).finish()  # the CPU path, into one array
        results.append({
            "family": family, "fps": fps, "problem": problem,
            "rotated": any(p.get("video") == ROTATED[0] for m in messages for p in m["content"]),
            "tokens": bool(np.array_equal(sample.tokens, ids)),
            "mask": bool(np.array_equal(sample.loss_mask, mask)),
            "grid": bool(np.array_equal(ours["video_grid_thw"], ref["video_grid_thw"])),
            "seconds": bool("second_per_grid_ts" not in ref or np.array_equal(
                np.asarray(ours["second_per_grid_ts"], np.float64), np.asarray(ref["second_per_grid_ts"], np.float64))),
            "pixels": bool(ours["pixel_values_videos"].dtype == theirs_pixels.dtype
                           and np.array_equal(ours["pixel_values_videos"], theirs_pixels)),
            "torch": bool(np.array_equal(on_torch, np.concatenate([theirs_pixels, theirs_pixels]))),
            "one_array": bool(np.array_equal(in_one, np.concatenate([theirs_pixels, theirs_pixels]))),
            "positions": bool(np.array_equal(sample.token_arrays["position_ids"].T, positions[:, 0].numpy())),
            "grids": np.asarray(ref["video_grid_thw"]).tolist(),
            "wire_bytes": int(sample.image_arrays[VIDEO_FRAMES].nbytes), "planned_bytes": planned_bytes,
            "float_bytes": int(theirs_pixels.nbytes),
        })
    return results


def forms(path: str, work: str) -> dict:
    """The same conversation with its videos named three other ways (bytes in the part, the record's
    `videos` list, a WebDataset sample's entries): whether each gives the path form's sample."""
    import orjson

    chat = ProcessorChat(path, backend="torchvision", video_fps=2.0)

    def made(record: dict) -> tuple[np.ndarray, np.ndarray]:
        sample = chat.render(record, work)
        assert chat.finish(sample, "forms") is None
        return sample.tokens, sample.image_arrays[VIDEO_FRAMES]

    messages = conversations()[1]
    names = [p["video"] for m in messages for p in m["content"] if p["type"] == "video"]
    data = {}
    for name in names:
        with open(os.path.join(work, name), "rb") as f:
            data[name] = f.read()
    bare = [{**m, "content": [{"type": "video"} if p["type"] == "video" else p for p in m["content"]]}
            for m in messages]
    by_bytes = [{**m, "content": [{"type": "video", "video": data[p["video"]]} if p["type"] == "video" else p
                                  for p in m["content"]]} for m in messages]
    suffixes = [f"{i}.{name.rsplit('.', 1)[1]}" for i, name in enumerate(names)]
    webdataset = {"__key__": "s0", "json": orjson.dumps({"messages": bare}),
                  **{suffix: data[name] for suffix, name in zip(suffixes, names)}}
    want = made({"messages": messages})
    out = {}
    for form, record in (("bytes", {"messages": by_bytes}), ("videos_list", {"messages": bare, "videos": names}),
                         ("webdataset", webdataset)):
        got = made(record)
        out[form] = bool(np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]))
    return out


def refused(path: str, work: str) -> dict:
    """What happens to videos that must skip their record before planning: (kind, message)."""
    out = {}
    with open(os.path.join(work, "corrupt.mp4"), "wb") as f:
        f.write(np.random.default_rng(1).integers(0, 256, 5000, dtype=np.uint8).tobytes())
    with open(os.path.join(work, "a.mp4"), "rb") as f:
        whole = f.read()
    with open(os.path.join(work, "truncated.mp4"), "wb") as f:
        f.write(whole[: len(whole) * 2 // 3])
    cases = {"corrupt": ("corrupt.mp4", None), "truncated": ("truncated.mp4", None), "too_long": ("a.mp4", 2.0),
             "missing": ("nowhere.mp4", None)}
    for case, (name, limit) in cases.items():
        chat = ProcessorChat(path, backend="torchvision", max_video_s=limit)
        record = {"messages": [{"role": "user", "content": [{"type": "video", "video": name},
                                                            {"type": "text", "text": "what"}]},
                               {"role": "assistant", "content": [{"type": "text", "text": "this"}]}]}
        try:
            chat.render(record, work)
            out[case] = ["rendered", ""]
        except ImageRecordError as e:
            out[case] = [e.kind, str(e)]
    return out


def main(q25: str, q3: str, work: str) -> None:
    for name, frames, fps, width, height, codec, gop in VIDEOS:
        write_video(os.path.join(work, name), frames, fps, width, height, codec, gop)
    write_video(os.path.join(work, ROTATED[0]), *ROTATED[1:])
    results = compare("qwen2_5_vl", q25, work, 2.0) + compare("qwen2_5_vl", q25, work, None) + \
        compare("qwen3_vl", q3, work, None) + compare("qwen3_vl", q3, work, 4.0)
    print(json.dumps({"results": results, "refused": refused(q25, work), "forms": forms(q25, work)}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
