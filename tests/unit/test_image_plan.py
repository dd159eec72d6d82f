"""worker/image_plan.py: a processor sample planned from its images' sizes at prepare time, its
image pass run at delivery, equals the processor run whole; an image that fails at delivery sends
its sample blank with nothing to train on, and the coordinator counts it; images are taken as
transformers takes an image's path (EXIF orientation, transparency)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from msd.testing.vlm_data import (write_gemma3_processor, write_idefics3_processor, write_image_conversations,
                                  write_internvl_processor, write_llava_next_processor,
                                  write_llava_onevision_processor, write_qwen2_5_vl_processor,
                                  write_smolvlm_processor)
from msd_common.frames import FRAMES, finished

pytest.importorskip("transformers")

from worker.processor import ProcessorChat  # noqa: E402


def _finished(sample) -> dict[str, np.ndarray]:
    """A sample's image arrays as the trainer gets them: its uint8 frames finished by their recipe."""
    return finished(sample.image_arrays)


def _same(a, b) -> None:
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
    mine, theirs = _finished(a), b.image_arrays
    assert list(a.token_arrays) == list(b.token_arrays) and sorted(mine) == sorted(theirs)
    for k in b.token_arrays:
        np.testing.assert_array_equal(a.token_arrays[k], b.token_arrays[k])
    for k in theirs:
        assert mine[k].dtype == theirs[k].dtype, k
        np.testing.assert_array_equal(mine[k], theirs[k])
    assert (a.images, a.patches, a.patch_squares) == (b.images, b.patches, b.patch_squares)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3", "idefics3", "smolvlm", "llava_next", "llava_onevision",
                                    "internvl"])
def test_a_sample_planned_from_image_sizes_equals_the_processor_run_whole(tmp_path, family):
    if family == "qwen2_5_vl":  # images from below min_pixels (3,136) to past max_pixels
        proc = write_qwen2_5_vl_processor(str(tmp_path / "p"), max_pixels=60_000)
    elif family == "idefics3":  # up to 2 x 2 tiles and the global view an image
        proc = write_idefics3_processor(str(tmp_path / "p"), longest_edge=728)
    elif family == "smolvlm":  # SmolVLM2's processor class: up to 2 x 2 tiles and the global view an image
        proc = write_smolvlm_processor(str(tmp_path / "p"), longest_edge=768)
    elif family == "llava_next":  # 3 to 5 patches an image, padded to a sample's most
        proc = write_llava_next_processor(str(tmp_path / "p"))
    elif family == "llava_onevision":  # a sample's one image in patches, each of several resized whole
        proc = write_llava_onevision_processor(str(tmp_path / "p"))
    elif family == "internvl":  # 1 to 12 tiles and a thumbnail an image
        proc = write_internvl_processor(str(tmp_path / "p"))
    else:
        proc = write_gemma3_processor(str(tmp_path / "p"))
    data = str(tmp_path / "data")
    records = write_image_conversations(data, 16, seed=7, sizes=(20, 400), max_images=3)
    planned, whole = ProcessorChat(proc), ProcessorChat(proc, plan_from_sizes=False)
    assert planned.planner is not None
    with_images = 0
    for record in records:
        a, b = planned.render(record, data), whole.render(record, data)
        assert b.pending is None
        if not b.images:
            assert a.pending is None
            _same(a, b)
            continue
        with_images += 1
        # at prepare time: the length, patches and positions, and the image files, not their pixels
        assert a.pending is not None and not a.image_arrays
        assert a.pending.nbytes == sum(os.path.getsize(os.path.join(data, p["image"])) for m in record["messages"]
                                       for p in m["content"] if p["type"] == "image")
        planned_bytes = a.array_bytes[FRAMES]  # the frame limit, planned
        assert planned.finish(a, "test") is None and a.pending is None
        frames = a.image_arrays[FRAMES]
        assert frames.dtype == np.uint8 and frames.nbytes == planned_bytes
        # on the wire: a byte per value where the processor makes float32, and Qwen-VL's temporal repeat
        # (LLaVA-NeXT's padding patches are not sent)
        whole_bytes = b.image_arrays["pixel_values"].nbytes
        if family.startswith("llava"):
            assert frames.nbytes * 4 <= whole_bytes
        else:
            assert frames.nbytes * (8 if family == "qwen2_5_vl" else 4) == whole_bytes
        _same(a, b)
    assert with_images >= 10


def test_gemma3_pan_and_scan_crops_are_planned_from_image_sizes(tmp_path):
    """With pan-and-scan (the processor called with do_pan_and_scan), a wide or tall image also
    gives crops: the plan counts them from the image's size with the image processor's own
    pan_and_scan, equal to what its image pass makes, and its frames are the pass's, finished."""
    from PIL import Image

    proc = write_gemma3_processor(str(tmp_path / "p"), pan_and_scan=True)
    chat = ProcessorChat(proc)
    record = {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"}]},
                           {"role": "assistant", "content": [{"type": "text", "text": "wide"}]}]}
    Image.new("RGB", (60, 40)).save(tmp_path / "a.png")
    chat.render(record, str(tmp_path))  # the arguments the processor passes its image pass
    kwargs = {**chat._image_kwargs, "do_pan_and_scan": True}
    sizes = [(1400, 300), (300, 1400), (800, 800), (900, 500), (2000, 260), (513, 1100)]
    plan = chat.planner(sizes, kwargs)
    rng = np.random.default_rng(1)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    made, replacements = chat.processor._process_images(images, **kwargs)
    np.testing.assert_array_equal(plan.arrays["num_crops"], made["num_crops"])
    assert plan.arrays["num_crops"].sum() >= 6 and 0 in plan.arrays["num_crops"]  # crops, and images without
    assert replacements == [chat.processor.replace_image_token(plan.arrays, i, **kwargs) for i in range(len(sizes))]
    assert plan.pixel_bytes * 4 == np.asarray(made["pixel_values"]).nbytes  # frames: a byte a value


def _photo(path, size=(90, 40), orientation=None, mode="RGB"):
    from PIL import Image

    rng = np.random.default_rng(3)
    pixels = rng.integers(0, 255, (size[1], size[0], len(mode)), dtype=np.uint8)
    image = Image.fromarray(pixels, mode)
    if orientation is None:
        image.save(path)
        return
    exif = Image.Exif()
    exif[0x0112] = orientation  # Orientation: 6 = shown rotated 90 degrees clockwise
    image.save(path, exif=exif)


def test_images_are_taken_as_transformers_takes_their_paths(tmp_path):
    """A photo with an EXIF orientation and a PNG with transparency: the sample equals what the
    processor's own apply_chat_template makes of the images' paths (transformers' load_image turns
    the photo upright and drops the alpha channel), planned from sizes or run whole."""
    proc = write_qwen2_5_vl_processor(str(tmp_path / "p"), max_pixels=60_000)
    _photo(tmp_path / "rotated.jpg", orientation=6)
    _photo(tmp_path / "clear.png", mode="RGBA")
    for name in ("rotated.jpg", "clear.png"):
        record = {"messages": [{"role": "user", "content": [{"type": "image", "image": name},
                                                            {"type": "text", "text": "what is this?"}]},
                               {"role": "assistant", "content": [{"type": "text", "text": "a picture"}]}]}
        for chat in (ProcessorChat(proc), ProcessorChat(proc, plan_from_sizes=False)):
            sample = chat.render(record, str(tmp_path))
            assert chat.finish(sample, "test") is None
            messages = [{**record["messages"][0], "content": [{"type": "image", "image": str(tmp_path / name)},
                                                              record["messages"][0]["content"][1]]},
                        record["messages"][1]]
            expected = chat.processor.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                          return_assistant_tokens_mask=True, return_tensors="np")
            np.testing.assert_array_equal(sample.tokens, expected["input_ids"][0])
            np.testing.assert_array_equal(sample.image_arrays["image_grid_thw"], expected["image_grid_thw"])
            np.testing.assert_array_equal(_finished(sample)["pixel_values"], expected["pixel_values"])
        if name == "rotated.jpg":  # upright: 40 wide, 90 high, in 14-pixel patches of a 28-multiple size
            grid = sample.image_arrays["image_grid_thw"][0]
            assert grid[1] > grid[2], grid


def _job(tmp_path, **source_extra):
    """A job of one processor source over tmp_path's data/conversations.jsonl and processor p
    (a key given as None is left out)."""
    from msd_common.spec import parse_job

    source = {"format": "jsonl", "paths": ["data/conversations.jsonl"], "processor": "p", **source_extra}
    source = {k: v for k, v in source.items() if v is not None}
    return parse_job({"seed": 1, "sources": {"vqa": source},
                      "batch": {"seq_len": 4096, "micro_batch_size": 1, "global_batch_size": 1},
                      "topology": {"dp": 1}, "mixture": {"weights": {"vqa": 1.0}}},
                     str(tmp_path / "job.yaml"), base_dir=str(tmp_path))


def _processor_core(tmp_path):
    from msd_common import protocol as P
    from worker.core import WorkerCore

    write_qwen2_5_vl_processor(str(tmp_path / "p"), max_pixels=60_000)
    records = write_image_conversations(str(tmp_path / "data"), 6, seed=2, sizes=(40, 200), max_images=2)
    job = _job(tmp_path)
    core = WorkerCore()
    core.handle(P.Welcome(worker_id=1, heartbeat_s=0.5, job=job.worker_job().to_wire(), count=[]))
    return core, records


def test_an_image_that_fails_at_delivery_sends_its_sample_blank_with_nothing_to_train_on(tmp_path):
    """Its tokens are planned already: the sample goes with black images of the planned sizes and an
    all-zero loss mask, the next sample goes whole, and DELIVERED names the record for the count."""
    from msd_common import protocol as P
    from msd_common.doc_keys import doc_key
    from worker.core import ToRank

    core, records = _processor_core(tmp_path)
    [reply] = core.handle(P.Prepare(task_id=1, source=0, worker_id=core.worker_id or 0,
                                    records=np.array([0, 1], dtype=np.uint64)))
    assert reply.message.skipped == []
    spoiled, good = core.cache[doc_key(0, 0)], core.cache[doc_key(0, 1)]
    assert spoiled.processed.pending is not None and good.processed.pending is not None
    # what each record will send beside its tokens (its planned frames: runtime.ahead_bytes counts them)
    planned = [e.processed.pending.plan.pixel_bytes for e in (spoiled, good)]
    assert min(planned) > 0 and reply.message.array_bytes.tolist() == [e.array_bytes for e in (spoiled, good)]
    assert all(e.array_bytes >= p for e, p in zip((spoiled, good), planned))
    grids = spoiled.processed.pending.plan.arrays["image_grid_thw"]
    spoiled.processed.pending.files[0] = spoiled.processed.pending.files[0][:40]  # cut after prepare
    items = np.array([[0, 0, doc_key(0, 0), 0, spoiled.length], [0, 1, doc_key(0, 1), 0, good.length]], np.uint64)
    actions = core.handle(P.Deliver(worker_id=core.worker_id or 0, delivery_id=3, step=0, addresses=["tcp://r"],
                                    items=items, release=np.zeros(0, np.uint64), targets=np.array([[0, 0]], np.uint64)))
    [message] = [a for a in actions if isinstance(a, ToRank)]
    mask = message.message.loss_mask
    assert not mask[:spoiled.length].any() and mask[spoiled.length:].any()
    pixels = _finished(spoiled.processed)["pixel_values"]
    assert len(pixels) == int(grids.prod(axis=1).sum())  # the planned patches, blank
    np.testing.assert_array_equal(spoiled.processed.image_arrays["image_grid_thw"], grids)
    [failed] = actions[-1].message.failed
    assert failed[:2] == [0, 0] and failed[3] == "corrupt" and "image does not decode" in failed[2]
    assert "conversations.jsonl:1" in failed[2]  # names the file and line
    assert good.processed.image_arrays[FRAMES].any()


def test_the_coordinator_counts_a_sample_that_failed_at_delivery(tmp_path):
    from coordinator.events import Delivered
    from tests.unit.coordinator_driver import Driver

    write_image_conversations(str(tmp_path / "data"), 4, seed=2, sizes=(40, 80), max_images=1)
    write_qwen2_5_vl_processor(str(tmp_path / "p"), max_pixels=60_000)
    job = _job(tmp_path)
    driver = Driver(job)
    peer = driver.add_worker("w0")
    driver.flush()
    worker_id = driver.workers[peer].worker_id
    driver.handle(Delivered(at=1.0, peer=peer, worker_id=worker_id, delivery_id=99,
                            failed=[[0, 2, "data/conversations.jsonl:3: image does not decode", "corrupt"]]))
    assert driver.state.skipped_by_kind[0] == {"corrupt": 1}


def test_image_pass_prepare_runs_the_processor_whole_and_the_key_is_checked(tmp_path):
    from msd_common.spec import ConfigError
    from worker.samples import SourceReader

    write_qwen2_5_vl_processor(str(tmp_path / "p"), max_pixels=60_000)
    write_image_conversations(str(tmp_path / "data"), 2, seed=1, sizes=(40, 80), max_images=1)
    planned, whole = _job(tmp_path), _job(tmp_path, image_pass="prepare")
    assert planned.digest() == whole.digest()  # when the image pass runs is not part of the stream
    (spec,) = whole.worker_job().sources
    prepared = SourceReader(spec).read_prepared(0, 0)
    assert prepared.processed.pending is None and "pixel_values" in prepared.processed.image_arrays
    (spec,) = planned.worker_job().sources
    assert SourceReader(spec).read_prepared(0, 0).processed.pending is not None
    with pytest.raises(ConfigError) as e:
        _job(tmp_path, image_pass="later")
    assert any(p.startswith("sources.vqa.image_pass") for p in e.value.problems), e.value.problems
    with pytest.raises(ConfigError) as e:
        _job(tmp_path, processor=None, image_pass="prepare")
    assert any("sources.vqa.image_pass" in p and "processor only" in p for p in e.value.problems), e.value.problems


def test_the_video_keys_are_checked_and_decide_the_stream(tmp_path):
    """sources.<name>.video_fps and max_video_s: numbers > 0, with a processor only; both change
    which frames or records the stream holds, so the job's digest changes with them (and not for
    jobs that leave them out)."""
    from msd_common.spec import ConfigError

    write_qwen2_5_vl_processor(str(tmp_path / "p"), max_pixels=60_000)
    write_image_conversations(str(tmp_path / "data"), 2, seed=1, sizes=(40, 80), max_images=1)
    plain, sampled, capped = _job(tmp_path), _job(tmp_path, video_fps=2), _job(tmp_path, max_video_s=60)
    assert len({plain.digest(), sampled.digest(), capped.digest()}) == 3
    (spec,) = sampled.worker_job().sources
    assert (spec.video_fps, spec.max_video_s) == (2.0, None)
    for key, value, why in (("video_fps", 0, "must be > 0"), ("max_video_s", -1, "must not be negative"),
                            ("video_fps", "2", "expected a finite number")):
        with pytest.raises(ConfigError) as e:
            _job(tmp_path, **{key: value})
        assert any(p.startswith(f"sources.vqa.{key}") and why in p for p in e.value.problems), e.value.problems
    with pytest.raises(ConfigError) as e:
        _job(tmp_path, processor=None, max_video_s=10)
    assert any("sources.vqa.max_video_s" in p and "processor only" in p for p in e.value.problems), e.value.problems
