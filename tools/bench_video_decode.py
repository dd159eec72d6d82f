"""The worker's video decoder, measured: PyAV as the worker runs it (worker/video.py: probe the
packets, then decode from the keyframe before each sampled frame that lies past the frames decoded
so far, converting only the sampled ones to RGB), PyAV decoding every frame in order up to the last
sampled one (the first version), and torchcodec (transformers' default loader: an exact scan, then
get_frames_at), on the same H.264 video and the same sampled frames, alternated, CPU seconds per
video (median and range). Needs PyAV and torchcodec with
FFmpeg's libraries reachable (see tests/vlm/conftest.py torchcodec_env); run in .venv-vlm:

    LD_LIBRARY_PATH=... .venv-vlm/bin/python tools/bench_video_decode.py --sample-fps 0.25 --json OUT
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from worker.video import _in_order, decode, probe  # noqa: E402


def write_video(path: str, frames: int, fps: int, width: int, height: int, gop: int) -> None:
    import av

    rng = np.random.default_rng(0)
    with av.open(path, "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.gop_size = gop
        for i in range(frames):
            a = rng.integers(0, 40, (height, width, 3), dtype=np.uint8)
            a[(i * 3) % height:(i * 3) % height + 40, :120] = 240
            for packet in stream.encode(av.VideoFrame.from_ndarray(a, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def with_pyav(data: bytes, indices: list[int]) -> np.ndarray:
    probe(data)
    return decode(data, indices)


def with_pyav_in_order(data: bytes, indices: list[int]) -> np.ndarray:
    import io

    import av

    probe(data)
    with av.open(io.BytesIO(data)) as container:
        got = _in_order(container, sorted(set(indices)))
    return np.stack([got[i] for i in indices])


def with_torchcodec(path: str, indices: list[int]) -> np.ndarray:
    from torchcodec.decoders import VideoDecoder

    decoder = VideoDecoder(path, seek_mode="exact", num_ffmpeg_threads=0)
    return decoder.get_frames_at(indices=indices).data.numpy().transpose(0, 2, 3, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=int, default=60)
    ap.add_argument("--gop", type=int, default=60, help="frames between keyframes (2 s at 30 fps)")
    ap.add_argument("--fps", type=int, default=30)
    ap.add_argument("--size", default="640x360")
    ap.add_argument("--sample-fps", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    width, height = (int(v) for v in args.size.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "v.mp4")
        write_video(path, args.seconds * args.fps, args.fps, width, height, args.gop)
        with open(path, "rb") as f:
            data = f.read()
        info = probe(data)
        count = max(1, int(info.frames / info.fps * args.sample_fps))
        indices = (np.arange(count) * info.frames // count).tolist()
        ours = with_pyav(data, indices)
        same = bool(np.array_equal(ours, with_torchcodec(path, indices))
                    and np.array_equal(ours, with_pyav_in_order(data, indices)))
        runs = {"pyav": lambda: with_pyav(data, indices), "pyav_in_order": lambda: with_pyav_in_order(data, indices),
                "torchcodec": lambda: with_torchcodec(path, indices)}
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.repeats):  # alternated
            for name, run in runs.items():
                t = time.process_time()
                run()
                times[name].append(time.process_time() - t)
    out = {"video": {"seconds": args.seconds, "fps": args.fps, "gop": args.gop, "size": args.size,
                     "frames": info.frames, "sampled": count, "sample_fps": args.sample_fps, "bytes": len(data)},
           "same_frames": same,
           **{name: {"cpu_s_median": statistics.median(v), "min": min(v), "max": max(v)} for name, v in times.items()}}
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
