"""Per-source limits that turn a poison record into a skip before it is decoded (job file keys
`max_record_bytes` and `max_image_pixels`). A record over a limit is the same in every run, so
the skip is deterministic."""

from __future__ import annotations

from .errors import RecordError

DEFAULT_MAX_RECORD_BYTES = 64 << 20  # a record's stored bytes
DEFAULT_MAX_IMAGE_PIXELS = 1 << 26  # pixels an image's header declares (Pillow's own bomb check is at 2 x 89M)
# the job file's defaults for an image source's max_pixels, patch_size and text_key
DEFAULT_MAX_PIXELS = 256 * 256  # images are scaled down to at most this many pixels
DEFAULT_PATCH_SIZE = 16  # square patches of this many pixels a side
# seconds one record's sample may take (read, transform, processor, an image pass) before it is
# poison: generous, since a video or a model called by a transform takes seconds, not minutes
DEFAULT_MAX_SAMPLE_S = 600.0
DEFAULT_CAPTION_KEY = "caption"  # the caption text's key in a JSON caption entry


def check_bytes(size: int, limit: int, where: str) -> None:
    if size > limit:
        raise RecordError(f"{where}: record of {size} bytes is over max_record_bytes ({limit})", kind="over_limit")


def check_pixels(width: int, height: int, limit: int, where: str) -> None:
    if width * height > limit:
        raise RecordError(f"{where}: image of {width}x{height} pixels is over max_image_pixels ({limit})",
                          kind="over_limit")
