"""Video files read with PyAV (FFmpeg's libraries, in the `av` wheel: no system FFmpeg needed):
what a video is, from one pass over its packets without decoding, and the frames a plan samples,
decoded at delivery.

What `probe` reports is what transformers' default video loader (torchcodec, in its exact seek
mode) reports, so that the frames a video processor samples from it are the ones it samples from
its own loader: the frame count is the count of the stream's packets, the duration runs from the
first packet's time to the end of the last (pts plus duration), and the frame rate is the count
over that duration. Frame i is the stream's i-th frame in presentation order, as decoded.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

VIDEO_EXTS = frozenset({"mp4", "webm", "mkv", "avi", "mov", "m4v"})


class VideoError(ValueError):
    """The bytes are not a video PyAV can read, or its frames do not decode."""


@dataclass(frozen=True)
class VideoInfo:
    """What a video is, read without decoding."""

    frames: int
    fps: float
    duration: float  # seconds
    width: int
    height: int


def _av():
    try:
        import av
    except ImportError:
        raise ImportError("videos need PyAV on worker hosts: pip install 'megascale-data[video]'") from None
    return av


def probe(data: bytes) -> VideoInfo:
    """A video's frame count, frame rate, duration and size, from its packets (nothing decoded)."""
    av = _av()
    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise VideoError("no video stream")
            stream = container.streams.video[0]
            width, height = int(stream.codec_context.width), int(stream.codec_context.height)
            count, begin, end = 0, None, None
            for packet in container.demux(stream):
                if packet.size == 0:  # the demuxer's flush packet at the end, not a frame
                    continue
                pts = packet.pts if packet.pts is not None else packet.dts
                if pts is None:
                    raise VideoError("a packet without a timestamp")
                count += 1
                begin = pts if begin is None else min(begin, pts)
                end = pts + packet.duration if end is None else max(end, pts + packet.duration)
            base = stream.time_base
    except VideoError:
        raise
    except (av.FFmpegError, ValueError, OSError) as e:
        raise VideoError(f"does not read as a video ({e})") from None
    if count == 0 or width <= 0 or height <= 0:
        raise VideoError("no frames")
    seconds = (end - begin) * float(base.numerator) / base.denominator if base is not None else 0.0
    fps = count / seconds if seconds > 0 else float(stream.average_rate or 0)
    if fps <= 0:
        raise VideoError("no frame rate")
    return VideoInfo(count, fps, seconds, width, height)


def decode(data: bytes, indices: list[int]) -> np.ndarray:
    """uint8 [len(indices), H, W, 3] (RGB): the frames at these indices (ascending, repeats allowed),
    decoded in order up to the last one; only those are converted to RGB."""
    av = _av()
    wanted = sorted(set(int(i) for i in indices))
    got: dict[int, np.ndarray] = {}
    try:
        with av.open(io.BytesIO(data)) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            at = 0
            for i, frame in enumerate(container.decode(stream)):
                if i == wanted[at]:
                    got[i] = frame.to_ndarray(format="rgb24")
                    at += 1
                    if at == len(wanted):
                        break
    except (av.FFmpegError, ValueError, OSError, IndexError) as e:
        raise VideoError(f"its frames do not decode ({e})") from None
    missing = [i for i in wanted if i not in got]
    if missing:
        raise VideoError(f"frame {missing[0]} is past the frames that decode ({len(got)} of {len(wanted)} found)")
    return np.stack([got[int(i)] for i in indices])
