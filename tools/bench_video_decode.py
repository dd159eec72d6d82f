"""The worker's video decoder, measured: PyAV (worker/video.py: probe the packets, then decode up to
the last sampled frame, converting only the sampled ones to RGB) against torchcodec (transformers'
default loader: an exact scan, then get_frames_at), on the same H.264 video and the same sampled
frames, alternated, CPU seconds per video (median and range). Needs PyAV and torchcodec with
FFmpeg's libraries reachable (see tests/vlm/conftest.py torchcodec_env); run in .venv-vlm:

    LD_LIBRARY_PATH=... .venv-vlm/bin/python tools/bench_video_decode.py --json OUT
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

from worker.video import decode, probe  # noqa: E402


def write_video(path: str, frames: int, fps: int, width: int, height: int) -> None:
    import av

    rng = np.random.default_rng(0)
    with av.open(path, "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
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


def with_torchcodec(path: str, indices: list[int]) -> np.ndarray:
    from torchcodec.decoders import VideoDecoder

    decoder = VideoDecoder(path, seek_mode="exact", num_ffmpeg_threads=0)
    return decoder.get_frames_at(indices=indices).data.numpy().transpose(0, 2, 3, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=int, default=20)
    ap.add_argument("--fps", type=int, default=30)
    ap.add_argument("--size", default="640x360")
    ap.add_argument("--sample-fps", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    width, height = (int(v) for v in args.size.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "v.mp4")
        write_video(path, args.seconds * args.fps, args.fps, width, height)
        with open(path, "rb") as f:
            data = f.read()
        info = probe(data)
        count = max(1, int(info.frames / info.fps * args.sample_fps))
        indices = (np.arange(count) * info.frames // count).tolist()
        same = bool(np.array_equal(with_pyav(data, indices), with_torchcodec(path, indices)))
        times: dict[str, list[float]] = {"pyav": [], "torchcodec": []}
        for _ in range(args.repeats):  # alternated
            for name, run in (("pyav", lambda: with_pyav(data, indices)), ("torchcodec",
                                                                              lambda: with_torchcodec(path, indices))):
                t = time.process_time()
                run()
                times[name].append(time.process_time() - t)
    out = {"video": {"seconds": args.seconds, "fps": args.fps, "size": args.size, "frames": info.frames,
                     "sampled": count, "bytes": len(data)},
           "same_frames": same,
           **{name: {"cpu_s_median": statistics.median(v), "min": min(v), "max": max(v)} for name, v in times.items()}}
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
