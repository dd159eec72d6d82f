"""Host memory over an epoch of thousands of videos: a worker's ProcessorChat plans each conversation
from its video's container (prepare), decodes and resizes its sampled frames (delivery), and the
trainer client's finishing makes pixel_values_videos from the uint8 frames, video after video, in
one process, which gives its freed heap pages back every 100 videos as a worker process does every
few seconds; the resident set size is sampled as it goes. A leak of a few kilobytes a video (a
decoder context, a frame buffer, a cached tensor) shows as growth over the second half.

Needs transformers with torch and torchvision, and PyAV (`make .venv-vlm`); writes its own
processor-free videos, and takes a Qwen-VL processor directory with a video processor
configuration (msd.testing.vlm_data.write_qwen2_5_vl_processor + write_video_config):

    .venv-vlm/bin/python tools/soak_video.py PROCESSOR_DIR --distinct 200 --videos 3000 --json OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def main() -> None:
    from msd_common import memory
    from msd_common.frames import finished
    from tests.vlm.video_check import write_video
    from worker.processor import ProcessorChat

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("processor")
    ap.add_argument("--distinct", type=int, default=200, help="different video files, taken in turn")
    ap.add_argument("--videos", type=int, default=3000, help="conversations made, one video each")
    ap.add_argument("--fps", type=float, default=2.0)
    ap.add_argument("--every", type=int, default=100, help="videos between memory samples")
    ap.add_argument("--no-trim", dest="trim", action="store_false", help="never give freed heap pages back "
                    "(a worker process does every few seconds, msd_common.memory): shows what the allocator keeps")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rng = np.random.default_rng(9)
    if args.trim:
        memory.keep_freed_memory()  # a worker process's allocator settings
    chat = ProcessorChat(args.processor, backend="torchvision", video_fps=args.fps)
    samples, frames_bytes = [], 0
    with tempfile.TemporaryDirectory() as work:
        for i in range(args.distinct):
            write_video(os.path.join(work, f"{i}.mp4"), int(rng.integers(20, 90)), int(rng.choice([24, 30])),
                        16 * int(rng.integers(6, 24)), 16 * int(rng.integers(6, 16)), "libx264")
        started = time.monotonic()
        for i in range(args.videos):
            record = {"messages": [
                {"role": "user", "content": [{"type": "video", "video": f"{i % args.distinct}.mp4"},
                                             {"type": "text", "text": "what happens"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "things move"}]}]}
            sample = chat.render(record, work)
            problem = chat.finish(sample, f"video {i}")
            if problem is not None:
                raise SystemExit(f"video {i}: {problem}")
            pixels = finished(sample.image_arrays)["pixel_values_videos"]
            frames_bytes += int(sample.image_arrays["video_frames"].nbytes)
            del sample, pixels
            if (i + 1) % args.every == 0:
                if args.trim:  # as worker/loop.py does every few seconds (about 100 videos here)
                    memory.return_freed_memory()
                samples.append([i + 1, round(rss_mb(), 1)])
        seconds = time.monotonic() - started
    half = [mb for n, mb in samples if n > args.videos // 2]
    out = {"videos": args.videos, "trim": args.trim, "distinct_files": args.distinct, "seconds": round(seconds, 1),
           "videos_per_s": round(args.videos / seconds, 1), "frame_bytes_made": frames_bytes,
           "rss_mb": samples, "rss_first_mb": samples[0][1], "rss_last_mb": samples[-1][1],
           "second_half_growth_mb": round(half[-1] - half[0], 1) if half else None,
           "second_half_growth_kb_per_video": round((half[-1] - half[0]) * 1000 / max(1, args.videos // 2), 2)
           if half else None}
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
