"""Conversations with images, made into samples by the model's own Hugging Face processor
(`sources.<name>.processor: DIR`): the same token ids (each image expanded into as many image tokens
as the processor says), the same assistant mask and the same pixel values as

    AutoProcessor.from_pretrained(DIR).apply_chat_template(messages, tokenize=True, return_dict=True,
                                                           return_assistant_tokens_mask=True)

because that is the call made here, on transformers' own processor classes. Needs transformers and
Pillow (`msd[vision]`), not torch: the image processor runs on its PIL backend unless the source
asks for `image_backend: torchvision`. One backend for every host of a job, named in the job file:
the two differ by about one intensity step, so a job whose hosts picked their own would not give
the same stream everywhere.

The Qwen-VL processors also hold a video processor, which transformers builds only where
torchvision is installed; images need none, so without torchvision the processor is built from
its parts with no video processor (`_processor_class`), everything else being transformers' code.

Images in a record, in the order of their turns:
- content parts `{"type": "image", "image": VALUE}` (also under "path" or "url"), VALUE a path
  relative to the record's file, an absolute path, bytes, or `{"bytes": ..., "path": ...}` (a
  Parquet struct); a part without a value takes the record's `images` field's next entry;
- the LLaVA form: `conversations` of `{"from", "value"}` with `<image>` in the text, and the
  record's `image` (one, or a list);
- a WebDataset sample: its `.json` entry is the record, and an image value names one of the
  sample's image entries by suffix (`"0.jpg"`), or a part without a value takes the sample's
  image entries in suffix order (the layout Megatron-Energon's crude datasets use).
Every image's size is read from its header and checked against `max_image_pixels` before its
pixels are decoded; a corrupt, truncated or oversized image skips its record (ImageRecordError).
Each image is then taken as transformers' `load_image` takes a path (its EXIF orientation applied,
converted to RGB), so that a rotated photo or a transparent PNG gives the pixels the processor gives
with the image's path.

For the Qwen-VL, Gemma 3, Idefics3, SmolVLM2, LLaVA-NeXT, LLaVA-OneVision and InternVL processors a
record is planned from its images' sizes and its image pass runs at delivery (worker/image_plan.py): `render`
returns the sample with `pending` images, `finish` makes their resized uint8 frames, which the
trainer client finishes into the processor's pixel values (msd_common/frames.py). Those images are
decoded once, at delivery: at prepare time a PNG or JPEG file is only checked (sized_image).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import os
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from msd_common.formats.webdataset import IMAGE_EXTS
from msd_common.mrope import mrope_position_ids
from msd_common.processor_dir import ProcessorInfo, read_processor_dir

from msd_common.frames import FRAMES, PATCH_COUNTS, PIXEL_MASK, RECIPE, VIDEO_FRAMES, VIDEO_RECIPE

from .image_plan import (QWEN_VL_PROCESSORS, TILED_PROCESSORS, FrameCapture, PendingImages, disagreement, frame_recipe,
                         planner_of)
from .video import VIDEO_EXTS, VideoError, VideoInfo, decode, probe
from .video_plan import PLANNED_VIDEO_PROCESSORS, PendingVideos, PlannedVideoProcessor, resized_frames, video_recipe

# A worker host (the `vision` extra) has transformers without torch: its "PyTorch was not found"
# advice at import is for users of its models, which a worker never loads (issue 61: printed by
# every worker process). Only transformers' advisory warnings are off; its errors are not.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

LLAVA_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
LLAVA_IMAGE = "<image>"
IMAGE_KEYS = ("image", "path", "url")
VIDEO_KEYS = ("video", "path", "url")
SAMPLE_KEYS = ("input_ids", "attention_mask", "assistant_masks")  # taken apart: the rest is passed on


class ProcessorRecordError(ValueError):
    """The record cannot be made into a sample; the message says why."""


@dataclass
class ProcessedSample:
    """One conversation as the processor made it."""

    tokens: np.ndarray  # int32 [n], image tokens expanded
    loss_mask: np.ndarray  # uint8 [n], 1 on the assistant's tokens, never on an image token
    token_arrays: dict[str, np.ndarray] = field(default_factory=dict)  # per token: first axis n
    image_arrays: dict[str, np.ndarray] = field(default_factory=dict)  # the processor's image outputs
    images: int = 0
    patches: int = 0  # what the vision encoder's cost counts: rows of a 2-D pixel_values, else image tokens
    patch_squares: int = 0  # each image's patches squared, summed (the encoder attends within an image)
    pending: PendingImages | None = None  # images whose pass runs at delivery (ProcessorChat.finish)
    pending_videos: PendingVideos | None = None  # videos whose frames are decoded at delivery

    @property
    def array_bytes(self) -> dict[str, int]:
        """Each array's bytes, the planned frames' for pending images and videos (one message frame holds each)."""
        sizes = {name: a.nbytes for name, a in {**self.token_arrays, **self.image_arrays}.items()}
        if self.pending is not None:
            sizes[FRAMES] = self.pending.plan.pixel_bytes
        if self.pending_videos is not None:
            sizes[VIDEO_FRAMES] = self.pending_videos.frame_bytes
        return sizes

    @property
    def waiting(self) -> bool:
        """Images or videos whose pass runs at delivery."""
        return self.pending is not None or self.pending_videos is not None


@functools.lru_cache(maxsize=4)
def load_processor(path: str, backend: str = "pil") -> Any:
    """transformers' processor of `path`, its image processor on `backend` ("pil" or "torchvision")."""
    from transformers import AutoImageProcessor, AutoProcessor

    image_processor = AutoImageProcessor.from_pretrained(path, backend=backend)
    got = getattr(image_processor, "backend", backend)
    if got != backend:  # transformers falls back to PIL where torchvision is missing: not the job's pixels
        raise ImportError(f"image_backend {backend} is not available on this host (transformers gave the {got} "
                          f"image processor); install {backend} here, or use the same backend on every host")
    try:
        return AutoProcessor.from_pretrained(path, image_processor=image_processor)
    except (ImportError, AttributeError, ValueError, TypeError):
        # a video processor that needs torchvision: build the processor without one
        return _processor_without_video(path, image_processor, read_processor_dir(path))


def _processor_without_video(path: str, image_processor: Any, info: ProcessorInfo) -> Any:
    import transformers
    from transformers import AutoTokenizer

    from msd_common.usercode import find_template

    cls = getattr(transformers, info.processor_class, None)
    if cls is None:
        raise ValueError(f"{path}: transformers has no processor class {info.processor_class}")
    attributes = cls.get_attributes()
    if set(attributes) - {"image_processor", "tokenizer", "video_processor"}:
        raise ValueError(f"{path}: {info.processor_class} needs {', '.join(attributes)}; only its video processor "
                         "can be left out here")
    extra = {}
    config = os.path.join(path, "processor_config.json")
    if os.path.isfile(config):  # the processor's own arguments (image_seq_length and the like)
        import orjson

        with open(config, "rb") as f:
            extra = {k: v for k, v in orjson.loads(f.read()).items()
                     if k not in ("processor_class", *attributes) and not isinstance(v, dict)}
    template, _ = find_template(path)
    processor = _processor_class(cls)(image_processor=image_processor, tokenizer=AutoTokenizer.from_pretrained(path),
                                      video_processor=None, chat_template=template, **extra)
    if info.processor_class in READS_VIDEO_DEFAULTS:
        processor.video_processor = NoVideoProcessor()
    return processor


# processors whose apply_chat_template reads their video processor's sampling defaults, even for images
READS_VIDEO_DEFAULTS = frozenset({"SmolVLMProcessor"})


class NoVideoProcessor:
    """In place of a video processor that transformers builds only with torchvision, for a processor
    that reads its sampling defaults even for images: none, since no video is sampled without one
    (a record with a video is refused, ProcessorChat._planned_videos)."""

    num_frames = None
    fps = None


def _processor_class(cls: type) -> type:
    """`cls` accepting no video processor (its check looks up a class that exists only with torchvision)."""

    def check_argument_for_proper_class(self: Any, argument_name: str, argument: Any) -> Any:
        if argument is None and argument_name == "video_processor":
            return None
        return cls.check_argument_for_proper_class(self, argument_name, argument)

    return type(cls.__name__, (cls,), {"check_argument_for_proper_class": check_argument_for_proper_class})


class ProcessorChat:
    """A source's processor, ready to make records into samples."""

    def __init__(self, path: str, backend: str = "pil", train_on: str = "assistant",
                 messages_key: str = "messages", tools_key: str = "tools", max_image_pixels: int | None = None,
                 template: str | None = None, plan_from_sizes: bool = True, video_fps: float | None = None,
                 max_video_s: float | None = None) -> None:
        self.info = read_processor_dir(path)
        self.processor = load_processor(path, backend)
        # a processor whose image outputs follow from image sizes is planned from them (image_plan.py)
        self.planner = planner_of(self.processor) if plan_from_sizes else None
        self._image_kwargs: dict[str, Any] = {}  # the image pass's arguments, as the processor calls it
        self.template = None  # the processor's own, unless the job names a template file (chat.template)
        if template is not None:
            with open(template, encoding="utf-8") as f:
                self.template = f.read()
        self.train_on, self.messages_key, self.tools_key = train_on, messages_key, tools_key
        self.max_image_pixels = max_image_pixels
        self.video_fps, self.max_video_s = video_fps, max_video_s
        # the tokens that stand for image features: Qwen's <|image_pad|>, Gemma 3's <image_soft_token>
        # (not its image_token_id, which is the <start_of_image> marker the template writes)
        ids = [i for i in getattr(self.processor, "image_token_ids", None) or () if i is not None]
        token = getattr(self.processor, "image_token", None)
        if not ids and token is not None:
            ids = [self.processor.tokenizer.convert_tokens_to_ids(token)]
        if not ids:
            raise ValueError(f"{path}: the processor names no image token")
        self.image_token_ids = np.array(sorted(set(ids)), np.int32)
        ids = [i for i in getattr(self.processor, "video_token_ids", None) or () if i is not None]
        self.video_token_ids = np.array(sorted(set(ids)), np.int32)
        self.tokens_per_second = _tokens_per_second(path)

    def render(self, record: dict[str, Any], base_dir: str) -> ProcessedSample:
        """The sample of one record; raises ProcessorRecordError (or ImageRecordError) naming what is wrong.
        For a processor planned from image sizes the sample's images are `pending` (see finish)."""
        entries: dict[str, bytes] = {}
        if "__key__" in record:  # a WebDataset sample: its JSON entry is the record, its images entries
            record, entries = _webdataset_record(record)
        messages, files, videos = self._messages(record, base_dir, entries)
        tools = record.get(self.tools_key)
        planned: list[PendingImages] = []  # the plan the image pass made of the images' sizes
        sampling = {"fps": self.video_fps} if videos and self.video_fps is not None else {}
        try:
            with self._planned_image_pass(files if self.planner is not None else [], planned), \
                    self._planned_videos(videos) as planned_videos:
                out = self.processor.apply_chat_template(messages, chat_template=self.template, tools=tools,
                                                         tokenize=True, return_dict=True,
                                                         return_assistant_tokens_mask=True, return_tensors="np",
                                                         **sampling)
        except ImageRecordError:
            raise
        except Exception as e:  # the template's raise_exception, a count the processor refuses, ...
            first = (str(e).splitlines() or [""])[0]
            raise ProcessorRecordError(f"the processor failed: {type(e).__name__}: {first}") from None
        planned_arrays = dict(planned[-1].plan.arrays) if planned else {}
        if planned:  # what the processor's call drops of the plan (Idefics3's rows and cols) is not sent
            planned[-1] = dataclasses.replace(planned[-1], plan_only=frozenset(planned_arrays) - set(out))
        out = {k: v for k, v in out.items() if k not in planned_arrays}
        sample = self.sample_of(out, len(files), planned=planned_arrays, videos=len(videos))
        sample.pending = planned[-1] if planned else None
        sample.pending_videos = planned_videos.planned if planned_videos is not None else None
        return sample

    @contextlib.contextmanager
    def _planned_videos(self, videos: list[tuple[bytes, VideoInfo]]) -> Iterator[PlannedVideoProcessor | None]:
        """While the processor runs, its video processor plans from the videos' probed metadata."""
        if not videos:
            yield None
            return
        real = getattr(self.processor, "video_processor", None)
        if real is None or isinstance(real, NoVideoProcessor):
            raise ProcessorRecordError("the record has videos, and this host's processor has no video processor "
                                       "(transformers builds it only with torchvision: install msd[video])")
        if type(real).__name__ not in PLANNED_VIDEO_PROCESSORS:
            raise ProcessorRecordError(f"videos of {type(real).__name__} are not supported yet")
        planner = PlannedVideoProcessor(real, videos)
        self.processor.video_processor = planner  # this instance only, for this call
        try:
            yield planner
        finally:
            self.processor.video_processor = real

    @contextlib.contextmanager
    def _planned_image_pass(self, files: list[bytes], planned: list[PendingImages]) -> Iterator[None]:
        """While the processor runs, its image pass plans from the images' sizes (with the arguments
        the processor passes it), and returns the plan's arrays and expansions instead of processing
        the images; the plan is appended to `planned`."""
        if not files:
            yield
            return
        processor = self.processor

        def plan_images(images: Any, **kwargs: Any) -> tuple[dict[str, Any], list[str]]:
            self._image_kwargs = kwargs  # the same on every call: the image pass at delivery takes them
            from transformers.image_utils import make_flat_list_of_images  # as _process_images flattens them

            sizes = [image.size for image in make_flat_list_of_images(images)]
            plan = self.planner(sizes, kwargs)  # ValueError: smart_resize refuses an aspect past 200, as it would
            # each image token's text, as the processor's own replace_image_token expands it for the plan
            replacements = [processor.replace_image_token(plan.arrays, i, **kwargs) for i in range(len(sizes))]
            planned.append(PendingImages(files, sizes, plan, replacements))
            return dict(plan.arrays), list(replacements)

        processor._process_images = plan_images  # this instance only, for this call
        try:
            yield
        finally:
            del processor._process_images

    def finish(self, sample: ProcessedSample, where: str) -> tuple[str, str] | None:
        """Run a planned sample's image pass on its kept image files, once, and check it made what
        the plan said. Returns None, or (reason, kind) when it failed or disagrees: the sample's
        tokens are already planned, so it is delivered with images of the planned sizes left blank
        and nothing to train on (its whole loss mask 0), and the failure is counted by its caller."""
        video_problem = self._finish_videos(sample, where)
        pending = sample.pending
        if pending is None:
            return video_problem
        problem = None
        try:
            images = [decode_image(data, where, None) for data in pending.files]
            made, replacements, frames = self._frames_pass(images, pending.plan.patches)
            why = disagreement(pending, made, replacements)
            if why is not None:
                problem = (f"{where}: planned from its images' sizes, but {why}", "error")
        except ImageRecordError as e:
            problem = (str(e), e.kind)
        except Exception as e:  # noqa: BLE001 - one bad image never stops the job
            first = (str(e).splitlines() or [""])[0]
            problem = (f"{where}: the image processor failed at delivery: {type(e).__name__}: {first}", "corrupt")
        if problem is not None:
            from PIL import Image

            blank = [Image.new("RGB", size) for size in pending.sizes]
            made, _, frames = self._frames_pass(blank, pending.plan.patches)
            sample.loss_mask[:] = 0
        # what the processor's call leaves out (the pixel values go as frames; Idefics3's pixel mask is made by
        # the client: all ones, every tile whole)
        unused = {*(getattr(self.processor, "unused_input_names", ()) or ()), *pending.plan_only, PIXEL_MASK}
        arrays = {name: np.ascontiguousarray(np.asarray(value)) for name, value in made.items() if name not in unused}
        arrays[FRAMES] = np.concatenate([f.reshape(-1) for f in frames]) if frames else np.zeros(0, np.uint8)
        arrays[RECIPE] = frame_recipe(self.processor, self._image_kwargs).to_array()
        if pending.plan.patches is not None:  # how the client lays them out: each image's patches, padded
            arrays[PATCH_COUNTS] = pending.plan.patches
        sample.image_arrays = {**sample.image_arrays, **arrays}
        sample.pending = None
        return problem or video_problem

    def _finish_videos(self, sample: ProcessedSample, where: str) -> tuple[str, str] | None:
        """Decode a planned sample's sampled video frames and resize them with the video processor;
        on a failure or a disagreement with the plan, blank frames of the planned sizes and nothing
        to train on. Returns None or (reason, kind)."""
        pending = sample.pending_videos
        if pending is None:
            return None
        real = self.processor.video_processor
        problem = None
        try:
            decoded = [decode(data, indices) for data, indices in zip(pending.files, pending.indices)]
            grids, frames = resized_frames(real, decoded, pending)
            if not np.array_equal(grids, pending.grids):
                problem = (f"{where}: planned from its videos' metadata, but its video_grid_thw {grids.tolist()} "
                           f"differs from the planned {pending.grids.tolist()}", "error")
        except VideoError as e:
            problem = (f"{where}: a video's {e}", "corrupt")
        except Exception as e:  # noqa: BLE001 - one bad video never stops the job
            first = (str(e).splitlines() or [""])[0]
            problem = (f"{where}: the video processor failed at delivery: {type(e).__name__}: {first}", "corrupt")
        if problem is not None:
            frames = pending.blank()
            sample.loss_mask[:] = 0
        sample.image_arrays = {**sample.image_arrays, "video_grid_thw": pending.grids,
                               VIDEO_FRAMES: np.concatenate([f.reshape(-1) for f in frames]),
                               VIDEO_RECIPE: video_recipe(real).to_array()}
        sample.pending_videos = None
        return problem

    def _frames_pass(self, images: list[Any], patches: np.ndarray | None = None
                     ) -> tuple[dict[str, Any], list[str], list[np.ndarray]]:
        """The processor's image pass up to each image's resized uint8 frame: its outputs (their
        pixel values left out), its image tokens' expansions, and the frames [3, H, W] in order.
        `patches`: LLaVA-NeXT's planned patches of each image (its pixel values pad them to the most)."""
        kwargs = {**self._image_kwargs, "do_rescale": False, "do_normalize": False}
        image_processor = self.processor.image_processor
        images = [images]  # one conversation's, as apply_chat_template passes them (LLaVA-OneVision counts them)
        if type(self.processor).__name__ in QWEN_VL_PROCESSORS:
            with FrameCapture(image_processor) as capture:
                made, replacements = self.processor._process_images(images, **kwargs)
            frames = capture.in_order(np.asarray(made["image_grid_thw"]), int(image_processor.patch_size))
        else:  # resized to one size, nothing after normalisation: the pixel values are the frames (or tiles)
            made, replacements = self.processor._process_images(images, **kwargs)
            pixels = np.asarray(made["pixel_values"])
            if pixels.dtype != np.uint8:  # Idefics3's torchvision backend pads into float32: whole values
                whole = pixels.astype(np.uint8)
                if not np.array_equal(whole, pixels):
                    raise ValueError(f"the image pass without rescale and normalise gave {pixels.dtype} pixels, "
                                     "not uint8")
                pixels = whole
            mask = made.get(PIXEL_MASK)
            if mask is not None and not np.asarray(mask).all():
                raise ValueError("the image pass padded a tile (a pixel mask not all ones)")
            if patches is not None:  # LLaVA-NeXT: [images, most patches, 3, S, S], each image's own patches
                if pixels.shape[1] != patches.max():
                    raise ValueError(f"the image pass cut up to {pixels.shape[1]} patches an image, the plan "
                                     f"{patches.tolist()}")
                pixels = np.concatenate([pixels[i, :n] for i, n in enumerate(patches.tolist())])
            frames = list(pixels.reshape(-1, *pixels.shape[-3:]))  # Idefics3: [1, tiles, 3, S, S]
        made = {k: v for k, v in made.items() if k != "pixel_values"}
        return made, replacements, [np.ascontiguousarray(f, np.uint8) for f in frames]

    def sample_of(self, out: Any, images: int, mask: np.ndarray | None = None,
                  planned: dict[str, np.ndarray] | None = None, videos: int = 0) -> ProcessedSample:
        """The sample of what the processor returned (`input_ids`, `assistant_masks` and its other
        arrays, batch of one), or of a transform's Sample made with it (`mask`: its loss mask, or
        None for every token but the image tokens). `planned`: the image outputs a plan from
        image sizes computed (its image pass not run yet)."""
        tokens = np.asarray(out["input_ids"]).reshape(-1).astype(np.int32)
        n = len(tokens)
        is_image = np.isin(tokens, self.image_token_ids)
        is_video = np.isin(tokens, self.video_token_ids)
        if mask is not None:
            mask = np.asarray(mask).reshape(-1).astype(np.uint8)
        elif self.train_on == "all" or "assistant_masks" not in out:
            mask = (~(is_image | is_video)).astype(np.uint8)
        else:
            mask = np.asarray(out["assistant_masks"]).reshape(-1).astype(np.uint8)
        mask[is_image | is_video] = 0
        token_arrays: dict[str, np.ndarray] = {}
        image_arrays: dict[str, np.ndarray] = {}
        for name, value in out.items():
            if name in SAMPLE_KEYS:
                continue
            value = np.asarray(value)
            if value.dtype == object:
                raise ProcessorRecordError(f"{name}: not an array of numbers")
            if value.ndim in (1, 2) and value.shape in ((n,), (1, n)) and name.endswith("_ids"):
                token_arrays[name] = np.ascontiguousarray(value.reshape(n))
            else:
                image_arrays[name] = np.ascontiguousarray(value)
        if type(self.processor).__name__ in TILED_PROCESSORS:  # a batch of one: its tiles, which the client batches
            for name in ("pixel_values", PIXEL_MASK):
                a = image_arrays.get(name)
                if a is not None and a.ndim in (4, 5) and len(a) == 1:
                    image_arrays[name] = a[0].astype(bool) if name == PIXEL_MASK else a[0]
        known = {**image_arrays, **(planned or {})}
        video_grids = np.asarray(known.get("video_grid_thw", np.zeros((0, 3))), np.int64).reshape(-1, 3)
        if self.info.rope == "mrope":
            types = is_image.astype(np.int8) + 2 * is_video.astype(np.int8)
            try:
                positions = mrope_position_ids(types, known.get("image_grid_thw", np.zeros((0, 3), np.int64)),
                                               self.info.merge_size, *self._video_runs(video_grids, known))
            except ValueError as e:
                raise ProcessorRecordError(f"vision tokens and grids disagree: {e}") from None
            token_arrays["position_ids"] = np.ascontiguousarray(positions.T.astype(np.int32))  # [n, 3]
        pixels, grids = image_arrays.get("pixel_values"), known.get("image_grid_thw")
        if pixels is not None and pixels.ndim == 2:
            patches = int(pixels.shape[0])
        elif pixels is None and grids is not None:  # planned: a 2-D pixel_values has a row per grid patch
            patches = int(np.asarray(grids, np.int64).prod(axis=1).sum())
        else:
            patches = int(is_image.sum())
        per_video = video_grids.prod(axis=1)  # the encoder attends within a video
        if not images and not videos:
            return ProcessedSample(tokens, mask, token_arrays, image_arrays)
        if not images:
            per_image = np.zeros(0)
        elif grids is not None and grids.ndim == 2 and len(grids) == images:  # each image's own patches
            per_image = grids.astype(np.int64).prod(axis=1)
        else:  # images of one size (Gemma 3: 256 tokens each)
            per_image = np.full(images, patches / images)
        squares = float((per_image.astype(np.float64) ** 2).sum() + (per_video.astype(np.float64) ** 2).sum())
        return ProcessedSample(tokens, mask, token_arrays, image_arrays, images, patches + int(per_video.sum()),
                               int(round(squares)))

    def _video_runs(self, grids: np.ndarray, known: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray | None]:
        """The grid of each run of video tokens, and its temporal spacing, as the model's get_rope_index
        takes them: Qwen3-VL's timestamps cut each video into runs of one temporal patch; Qwen2.5-VL
        spaces a video's temporal patches by tokens_per_second x second_per_grid_ts."""
        if self.info.processor_class.startswith("Qwen3VL"):
            runs = np.repeat(grids, grids[:, 0], axis=0)
            runs[:, 0] = 1
            return runs, None
        seconds = known.get("second_per_grid_ts")
        if seconds is None or not len(grids):
            return grids, None
        return grids, np.float32(self.tokens_per_second) * np.asarray(seconds, np.float32).reshape(-1)

    def _messages(self, record: dict[str, Any], base_dir: str, entries: dict[str, bytes] | None = None
                  ) -> tuple[list[dict[str, Any]], list[bytes], list[tuple[bytes, VideoInfo]]]:
        """The record's messages, each image part's value opened (checked and decoded), each
        image's file bytes, in order, and each video's bytes and probed metadata, in order (its part
        left with a name the template does not read). `entries`: a WebDataset sample's image and
        video entries (suffix -> bytes), which a value may name; they are also the spare images and
        videos of parts without one."""
        entries = entries or {}
        by_kind = {"image": {k: v for k, v in entries.items() if k.rsplit(".", 1)[-1] not in VIDEO_EXTS},
                   "video": {k: v for k, v in entries.items() if k.rsplit(".", 1)[-1] in VIDEO_EXTS}}
        spare = {"image": _as_list(record.get("images")) or [by_kind["image"][k] for k in sorted(by_kind["image"])],
                 "video": _as_list(record.get("videos")) or [by_kind["video"][k] for k in sorted(by_kind["video"])]}
        if self.messages_key in record:
            messages = record[self.messages_key]
        elif "conversations" in record:
            messages, spare["image"] = _llava_messages(record["conversations"], record.get("image")), []
        else:
            raise ProcessorRecordError(f"no {self.messages_key!r} field (nor LLaVA-style 'conversations')")
        if not isinstance(messages, list) or not messages:
            raise ProcessorRecordError(f"{self.messages_key}: expected a non-empty list of messages")
        out, files, videos = [], [], []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ProcessorRecordError(f"{self.messages_key}[{i}]: expected a mapping with a string 'role'")
            content = message.get("content")
            if isinstance(content, list):
                parts = []
                for j, part in enumerate(content):
                    kind = part.get("type") if isinstance(part, dict) else None
                    if kind in ("image", "video"):
                        where = f"{self.messages_key}[{i}].content[{j}]"
                        value = next((part[k] for k in (IMAGE_KEYS if kind == "image" else VIDEO_KEYS)
                                      if part.get(k) is not None), None)
                        if value is None:
                            if not spare[kind]:
                                raise ProcessorRecordError(f"{where}: an {kind} part without a value, and no "
                                                           f"'{kind}s' entry left for it")
                            value = spare[kind].pop(0)
                        if isinstance(value, str) and value in by_kind[kind]:
                            value = by_kind[kind][value]
                        data, name = read_media_file(value, base_dir, where, kind)
                        if kind == "image":  # a planned image pass reads sizes only, and decodes at delivery
                            opened = decode_image if self.planner is None else sized_image
                            part = {"type": "image", "image": opened(data, name, self.max_image_pixels)}
                            files.append(data)
                        else:
                            videos.append((data, self._probe(data, name)))
                            part = {"type": "video", "video": f"msd-video-{len(videos) - 1}"}
                    parts.append(part)
                message = {**message, "content": parts}
            out.append({k: v for k, v in message.items() if v is not None})
        return out, files, videos

    def _probe(self, data: bytes, name: str) -> VideoInfo:
        """A video's metadata, read without decoding; a corrupt video, or one over max_video_s, skips
        its record before its step is planned."""
        try:
            info = probe(data)
        except VideoError as e:
            raise ImageRecordError(f"{name}: {e}") from None
        if self.max_video_s is not None and info.duration > self.max_video_s:
            raise ImageRecordError(f"{name}: video of {info.duration:.1f} s is over max_video_s ({self.max_video_s:g})",
                                   "over_limit")
        return info


class ImageRecordError(ProcessorRecordError):
    """An image or video of the record is missing, corrupt, truncated (kind "corrupt") or over the
    size or duration limit ("over_limit")."""

    def __init__(self, message: str, kind: str = "corrupt") -> None:
        super().__init__(message)
        self.kind = kind


def read_media_file(value: Any, base_dir: str, where: str, kind: str = "image") -> tuple[bytes, str]:
    """(the bytes, a name for messages) of an image or video part's value: a path (relative to
    `base_dir`), bytes, or {"bytes", "path"}."""
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value), f"{where} (bytes)"
    if not isinstance(value, str) or not value:
        raise ImageRecordError(f"{where}: expected an {kind} path or bytes, got {type(value).__name__}")
    if "://" in value:
        raise ImageRecordError(f"{where}: {value!r}: URLs are not fetched by workers; store the {kind} with the data")
    path = value if os.path.isabs(value) else os.path.join(base_dir, value)
    try:
        with open(path, "rb") as f:
            return f.read(), f"{where}: {path}"
    except OSError:
        raise ImageRecordError(f"{where}: {path}: no such {kind} file") from None


EXIF_ORIENTATION = 0x0112
SIDEWAYS = (5, 6, 7, 8)  # EXIF orientations that swap an image's width and height


def decode_image(data: bytes, name: str, max_pixels: int | None) -> Any:
    """A PIL image of an image file's bytes: its size (from the header) checked against
    `max_pixels` before decoding, decoded (a truncated file is found here, as this record's
    problem), then its EXIF orientation applied and converted to RGB, as transformers'
    load_image does with a path."""
    with _opened(data, name, max_pixels) as image:
        return _upright_rgb(image)


def sized_image(data: bytes, name: str, max_pixels: int | None) -> Any:
    """For an image pass planned from sizes (its pixels decoded at delivery): a PIL image of the
    file not yet decoded, whose size is the upright image's, with the file checked at a fraction of
    a decode's cost, so that a truncated or corrupt file is still found before its step is planned:
    a PNG's chunks against their checksums (Pillow's verify, about 1/25 of a decode), a JPEG decoded
    at an eighth of its size (about half: libjpeg still reads every block). An image that EXIF may
    turn on its side, or of another format, is decoded whole (an undecoded image has the file's size)."""
    from PIL import Image

    with _opened(data, name, max_pixels) as image:
        if image.format == "JPEG" and image.getexif().get(EXIF_ORIENTATION, 1) not in SIDEWAYS:
            image.draft("RGB", ((image.width + 7) // 8, (image.height + 7) // 8))
            image.load()
        elif image.format == "PNG" and b"eXIf" not in data:  # (a PNG's EXIF chunk may follow its pixels)
            image.verify()
        else:
            return _upright_rgb(image)
        return Image.open(io.BytesIO(data))


@contextlib.contextmanager
def _opened(data: bytes, name: str, max_pixels: int | None) -> Iterator[Any]:
    """An image file opened (not decoded), the size its header declares checked against
    `max_pixels`; Pillow's decode errors within become this record's ImageRecordError."""
    from PIL import Image, UnidentifiedImageError

    Image.MAX_IMAGE_PIXELS = None  # the limit is ours, per source: Pillow's would raise before we see the size
    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if max_pixels is not None and width * height > max_pixels:
            raise ImageRecordError(f"{name}: image of {width}x{height} pixels is over max_image_pixels "
                                   f"({max_pixels})", "over_limit")
        yield image
    except ImageRecordError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:  # Pillow's decode errors
        raise ImageRecordError(f"{name}: image does not decode ({e})") from None


def _upright_rgb(image: Any) -> Any:
    """Decoded, its EXIF orientation applied and converted to RGB, as transformers' load_image does."""
    from PIL import ImageOps

    image.load()
    return ImageOps.exif_transpose(image).convert("RGB")


def _webdataset_record(sample: dict[str, Any]) -> tuple[dict[str, Any], dict[str, bytes]]:
    """(the conversation, the image entries) of a WebDataset sample: a `json` entry holding the
    record, and image entries (`jpg`, `0.png`, ...) that its image parts name by suffix."""
    import orjson

    if "json" not in sample:
        raise ProcessorRecordError(f"sample {sample['__key__']!r}: no .json entry (the conversation)")
    try:
        record = orjson.loads(sample["json"])
    except orjson.JSONDecodeError as e:
        raise ProcessorRecordError(f"sample {sample['__key__']!r}: its .json entry is not JSON ({e})") from None
    if not isinstance(record, dict):
        raise ProcessorRecordError(f"sample {sample['__key__']!r}: its .json entry is not an object")
    media = {k: v for k, v in sample.items() if k.rsplit(".", 1)[-1] in {*IMAGE_EXTS, *VIDEO_EXTS}}
    return record, media


def _tokens_per_second(path: str) -> float:
    """Qwen2.5-VL's temporal spacing of video positions: the model configuration's
    vision_config.tokens_per_second where the directory holds it, else transformers' default."""
    import orjson

    config = os.path.join(path, "config.json")
    if os.path.isfile(config):
        with open(config, "rb") as f:
            value = (orjson.loads(f.read()).get("vision_config") or {}).get("tokens_per_second")
        if isinstance(value, (int, float)):
            return float(value)
    return 4.0  # Qwen2_5_VLVisionConfig's default


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _llava_messages(conversations: Any, images: Any) -> list[dict[str, Any]]:
    """LLaVA's `conversations` ({"from", "value"}, `<image>` in the text) as messages with content parts."""
    if not isinstance(conversations, list) or not conversations:
        raise ProcessorRecordError("conversations: expected a non-empty list of {from, value} turns")
    images = _as_list(images)
    out = []
    for i, turn in enumerate(conversations):
        if not isinstance(turn, dict) or turn.get("from") not in LLAVA_ROLES or not isinstance(turn.get("value"), str):
            raise ProcessorRecordError(f"conversations[{i}]: expected {{from: human|gpt|system, value: text}}")
        pieces = turn["value"].split(LLAVA_IMAGE)
        parts: list[dict[str, Any]] = []
        for k, text in enumerate(pieces):
            if k:
                if not images:
                    raise ProcessorRecordError(f"conversations[{i}]: more {LLAVA_IMAGE} than images in 'image'")
                parts.append({"type": "image", "image": images.pop(0)})
            text = text.strip("\n") if len(pieces) > 1 else text
            if text:
                parts.append({"type": "text", "text": text})
        out.append({"role": LLAVA_ROLES[turn["from"]], "content": parts})
    if images:
        raise ProcessorRecordError(f"'image' holds {len(images)} more image(s) than the {LLAVA_IMAGE} marks")
    return out
