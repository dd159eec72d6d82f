"""Video files read with PyAV (FFmpeg's libraries, in the `av` wheel: no system FFmpeg needed):
what a video is, from one pass over its packets without decoding, and the frames a plan samples,
decoded at delivery.

What `probe` reports is what transformers' default video loader (torchcodec, in its exact seek
mode) reports, so that the frames a video processor samples from it are the ones it samples from
its own loader: the frame count is the count of the stream's packets, the duration runs from the
first packet's time to the end of the last (pts plus duration), and the frame rate is the count
over that duration. Frame i is the stream's i-th frame in presentation order, as decoded.

A video recorded on its side (a phone's: its display matrix says how to rotate it) is read
upright, as torchcodec reads it: its size is the rotated one, and each decoded frame is rotated
before it is resized. PyAV reads that rotation from a decoded frame, so `probe` decodes the first.
"""

from __future__ import annotations

import bisect
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
    width: int  # as displayed: a video rotated by 90 or 270 degrees has its coded height here
    height: int
    rotation: int = 0  # degrees counter-clockwise that each decoded frame is turned by to stand upright


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
    rotation = _rotation(av, data)
    if rotation % 180:
        width, height = height, width
    return VideoInfo(count, fps, seconds, width, height, rotation)


def _rotation(av, data: bytes) -> int:
    """The rotation of the video's frames (0, 90, 180 or 270), from its first decoded frame."""
    try:
        with av.open(io.BytesIO(data)) as container:
            frame = next(container.decode(video=0), None)
    except (av.FFmpegError, ValueError, OSError) as e:
        raise VideoError(f"its first frame does not decode ({e})") from None
    if frame is None:
        raise VideoError("its first frame does not decode")
    return 90 * (round(frame.rotation / 90) % 4)


def _upright(frame) -> np.ndarray:
    """A decoded frame as uint8 [H, W, 3] RGB, turned by its display rotation as torchcodec turns it."""
    rgb = frame.to_ndarray(format="rgb24")
    turns = round(frame.rotation / 90) % 4
    return np.ascontiguousarray(np.rot90(rgb, turns)) if turns else rgb


def decode(data: bytes, indices: list[int]) -> np.ndarray:
    """uint8 [len(indices), H, W, 3] (RGB, upright): the frames at these indices (ascending, repeats allowed).
    Frame i is the frame with the i-th smallest timestamp. Decoding starts at the keyframe before
    each wanted frame whenever one lies past the frames decoded so far (a long video sampled
    sparsely decodes a group of pictures per sampled frame, not the whole video); only the wanted
    frames are converted to RGB. Where timestamps cannot be trusted, every frame is decoded in order."""
    av = _av()
    wanted = sorted(set(int(i) for i in indices))
    try:
        with av.open(io.BytesIO(data)) as container:
            got = _by_keyframes(container, wanted)
        if got is None:
            with av.open(io.BytesIO(data)) as container:
                got = _in_order(container, wanted)
    except (av.FFmpegError, ValueError, OSError, IndexError) as e:
        raise VideoError(f"its frames do not decode ({e})") from None
    missing = [i for i in wanted if i not in got]
    if missing:
        raise VideoError(f"frame {missing[0]} is past the frames that decode ({len(got)} of {len(wanted)} found)")
    return np.stack([got[int(i)] for i in indices])


def _in_order(container, wanted: list[int]) -> dict[int, np.ndarray]:
    """Every frame decoded from the start, up to the last wanted one."""
    stream = container.streams.video[0]
    stream.thread_type = "AUTO"
    got: dict[int, np.ndarray] = {}
    at = 0
    for i, frame in enumerate(container.decode(stream)):
        if i == wanted[at]:
            got[i] = _upright(frame)
            at += 1
            if at == len(wanted):
                break
    return got


def _by_keyframes(container, wanted: list[int]) -> dict[int, np.ndarray] | None:
    """The wanted frames, seeking to the keyframe before one whenever that keyframe lies past the
    frames decoded so far; None where packets lack timestamps or a decoded frame's timestamp is
    not one of theirs (then the caller decodes in order)."""
    stream = container.streams.video[0]
    packets = [(p.pts, p.is_keyframe) for p in container.demux(stream) if p.size]
    if not packets or any(pts is None for pts, _ in packets):
        return None
    times = sorted(pts for pts, _ in packets)
    keys = sorted(pts for pts, key in packets if key)
    if len(set(times)) != len(times) or not keys or keys[0] != times[0] or wanted[-1] >= len(times):
        return None
    index = {pts: i for i, pts in enumerate(times)}
    targets = {times[i]: i for i in wanted}
    got: dict[int, np.ndarray] = {}
    frames, last = None, None  # the decoder from the last seek, and the timestamp of its last frame
    for i in wanted:
        t = times[i]
        key = keys[bisect.bisect_right(keys, t) - 1]
        if frames is None or last is None or key > last:
            container.seek(key, stream=stream, backward=True, any_frame=False)
            frames, last = container.decode(stream), None
        while last is None or last < t:
            frame = next(frames, None)
            if frame is None or frame.pts not in index:
                return None
            last = frame.pts
            if last in targets and targets[last] not in got:
                got[targets[last]] = _upright(frame)
    return got
