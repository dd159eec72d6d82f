"""worker.processor: the forms a conversation with images comes in (content parts with paths,
bytes or Parquet structs, the record's `images` list, LLaVA's `conversations`) give the same
sample; what is wrong with a record is named; and the job file's checks of `processor:`. The
processor is transformers' own (its PIL backend, and no torchvision in this environment: the
Qwen-VL processor is built here without its video processor)."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from msd.testing.vlm_data import write_image_conversations, write_qwen2_5_vl_processor, write_video_config
from msd_common.frames import FRAMES, finished
from msd_common.spec import ConfigError, parse_job

pytest.importorskip("transformers")

from worker.processor import ImageRecordError, ProcessorChat, ProcessorRecordError  # noqa: E402


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("proc")
    proc = write_qwen2_5_vl_processor(str(root / "qwen"), max_pixels=60_000)
    records = write_image_conversations(str(root / "data"), 4, seed=5, sizes=(40, 120), max_images=2)
    return proc, str(root / "data"), records


def _first_image_record(records):
    """A conversation of one image and a question, and an answer, with the first image made."""
    image = next(p["image"] for p in records[0]["messages"][0]["content"] if p["type"] == "image")
    return {"messages": [{"role": "user", "content": [{"type": "image", "image": image},
                                                      {"type": "text", "text": "what is in the picture?"}]},
                         {"role": "assistant", "content": [{"type": "text", "text": "noise, in colour"}]}]}


def _made(chat, record, base):
    """A sample whole: rendered, and its image pass (a worker runs it at delivery) done."""
    sample = chat.render(record, base)
    assert chat.finish(sample, "test") is None
    return sample


def _same(a, b) -> None:
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
    mine, theirs = finished(a.image_arrays), finished(b.image_arrays)  # frames as the trainer gets them
    assert mine.keys() == theirs.keys()
    for k in mine:
        np.testing.assert_array_equal(mine[k], theirs[k])
    for k in a.token_arrays:
        np.testing.assert_array_equal(a.token_arrays[k], b.token_arrays[k])


def test_a_sample_holds_the_processor_arrays_and_masks_image_tokens(made):
    proc, data, records = made
    chat = ProcessorChat(proc)
    sample = _made(chat, records[0], data)
    images = sum(p["type"] == "image" for m in records[0]["messages"] for p in m["content"])
    grids = sample.image_arrays["image_grid_thw"]
    assert sample.images == images == len(grids)
    assert sample.patches == int(grids.prod(axis=1).sum()) == len(finished(sample.image_arrays)["pixel_values"])
    assert sample.patch_squares == int((grids.prod(axis=1) ** 2).sum())  # the encoder attends within each image
    is_image = np.isin(sample.tokens, chat.image_token_ids)
    assert int(is_image.sum()) == sample.patches // 4  # merge 2 x 2
    assert not sample.loss_mask[is_image].any() and sample.loss_mask.any()
    assert sample.token_arrays["position_ids"].shape == (len(sample.tokens), 3)
    np.testing.assert_array_equal(sample.token_arrays["mm_token_type_ids"], is_image)
    everything = _made(ProcessorChat(proc, train_on="all"), records[0], data)
    np.testing.assert_array_equal(everything.loss_mask, ~is_image)  # all but the image tokens


def test_bytes_structs_the_images_list_and_llava_form_give_the_same_sample(made):
    proc, data, records = made
    chat = ProcessorChat(proc)
    record = _first_image_record(records)
    expected = _made(chat, record, data)
    user = record["messages"][0]
    image_part = next(p for p in user["content"] if p["type"] == "image")
    path = os.path.join(data, image_part["image"])
    raw = open(path, "rb").read()

    def with_part(part, **extra):
        content = [part if p["type"] == "image" else p for p in user["content"]]
        return {**extra, "messages": [{**user, "content": content}, *record["messages"][1:]]}

    as_bytes = _made(chat, with_part({"type": "image", "image": raw}), "/nowhere")
    as_struct = _made(chat, with_part({"type": "image", "image": {"bytes": raw, "path": "x.png"}}), "/nowhere")
    as_listed = _made(chat, with_part({"type": "image"}, images=[{"bytes": raw, "path": None}]), "/nowhere")
    absolute = _made(chat, with_part({"type": "image", "path": path}), "/nowhere")
    for other in (as_bytes, as_struct, as_listed, absolute):
        _same(other, expected)

    # LLaVA: {"from", "value"} turns, <image> in the text, the record's `image`
    turns = [{"from": "human", "value": "<image>\nwhat is in the picture?"}, {"from": "gpt",
                                                                              "value": "noise, in colour"}]
    _same(_made(chat, {"conversations": turns, "image": image_part["image"]}, data), expected)


@pytest.mark.parametrize("record,message", [
    ({"text": "no messages"}, "no 'messages' field"),
    ({"messages": []}, "non-empty list"),
    ({"messages": [{"content": "x"}]}, "messages[0]: expected a mapping with a string 'role'"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "no 'images' entry left"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "image": "https://x.org/a.png"}]}]},
     "URLs are not fetched"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "image": "nope.png"}]}]}, "no such image file"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "image": b"not an image"}]}]}, "does not decode"),
    ({"conversations": [{"from": "human", "value": "<image> and <image>"}], "image": "a.png"},
     "more <image> than images"),
    ({"conversations": [{"from": "human", "value": "hi"}], "image": "a.png"}, "more image(s) than"),
    ({"conversations": [{"from": "robot", "value": "hi"}]}, "conversations[0]: expected"),
])
def test_a_bad_record_is_named(made, record, message):
    proc, data, _ = made
    with pytest.raises(ProcessorRecordError) as e:
        _made(ProcessorChat(proc), record, data)
    assert message in str(e.value)


def test_an_image_over_the_limit_is_refused_before_decoding(made):
    proc, data, records = made
    record = _first_image_record(records)
    with pytest.raises(ImageRecordError) as e:
        _made(ProcessorChat(proc, max_image_pixels=100), record, data)
    assert e.value.kind == "over_limit" and "over max_image_pixels (100)" in str(e.value)


def _job(tmp_path, proc, **source):
    data = tmp_path / "c.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    return {"seed": 1, "sources": {"vqa": {"format": "jsonl", "paths": [str(data)], "processor": proc, **source}},
            "batch": {"seq_len": 256, "micro_batch_size": 1, "global_batch_size": 2}, "topology": {"dp": 2},
            "mixture": {"weights": {"vqa": 1.0}}}


def test_the_job_file_checks_a_processor_source(made, tmp_path):
    proc, _, _ = made
    job = parse_job(_job(tmp_path, proc), str(tmp_path / "job.yaml"))
    (source,) = job.sources
    assert source.packing == "whole" and source.image_backend == "pil" and len(source.processor_hash) >= 16
    assert job.rope == "mrope" and source.has_encoder_cost
    for extra, where, says in [
        ({"tokenizer": "gpt2"}, "sources.vqa.tokenizer", "does not go with processor"),
        ({"packing": "concat"}, "sources.vqa.packing", ""),
        ({"image_backend": "opencv"}, "sources.vqa.image_backend", ""),
        ({"chat": {"train_on": "last"}}, "sources.vqa.chat.train_on", "assistant or all"),
    ]:
        with pytest.raises(ConfigError) as e:
            parse_job(_job(tmp_path, proc, **extra), str(tmp_path / "job.yaml"))
        assert any(p.startswith(where) and says in p for p in e.value.problems), e.value.problems
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError) as e:
        parse_job(_job(tmp_path, str(empty)), str(tmp_path / "job.yaml"))
    assert any(p.startswith("sources.vqa.processor") and str(empty) in p for p in e.value.problems), e.value.problems
    context = _job(tmp_path, proc)
    context["topology"]["cp"] = 2
    with pytest.raises(ConfigError) as e:
        parse_job(context, str(tmp_path / "job.yaml"))
    assert any("cp" in p for p in e.value.problems), e.value.problems


def test_a_template_without_generation_tags_is_refused_unless_a_training_template_is_named(made, tmp_path):
    """Qwen's published processors carry a template without {% generation %} tags: transformers'
    assistant mask would be all zeros. The job check says so; chat.template names TRL's instead."""
    import shutil

    proc, data, records = made
    published = tmp_path / "published"
    shutil.copytree(proc, published)
    tagged = (published / "chat_template.jinja").read_text()
    untagged = re.sub(r"{%-?\s*(end)?generation\s*-?%}", "", tagged)
    assert untagged != tagged and "endgeneration" not in untagged
    (published / "chat_template.jinja").write_text(untagged)
    (tmp_path / "training.jinja").write_text(tagged)
    with pytest.raises(ConfigError) as e:
        parse_job(_job(tmp_path, str(published)), str(tmp_path / "job.yaml"))
    assert any(p.startswith("sources.vqa.chat.template") and "no {% generation %} tags" in p
               for p in e.value.problems), e.value.problems
    parse_job(_job(tmp_path, str(published), chat={"train_on": "all"}), str(tmp_path / "job.yaml"))
    job = parse_job(_job(tmp_path, str(published), chat={"template": "training.jinja"}), str(tmp_path / "job.yaml"))
    (source,) = job.sources
    assert source.chat["template"] == str(tmp_path / "training.jinja") and source.chat["template_hash"]
    with pytest.raises(ConfigError) as e:
        parse_job(_job(tmp_path, str(published), chat={"template": "nope.jinja"}), str(tmp_path / "job.yaml"))
    assert any(p.startswith("sources.vqa.chat.template") and "nope.jinja" in p for p in e.value.problems)
    # rendered with the named template: the sample of the processor whose own template has the tags
    np.testing.assert_array_equal(
        ProcessorChat(str(published), template=source.chat["template"]).render(records[1], data).loss_mask,
        _made(ProcessorChat(proc), records[1], data).loss_mask)


def test_a_job_with_a_processor_source_prepares_fewer_records_a_task(made, tmp_path):
    """A prepared sample is held until delivered, and a processor's carries megabytes of pixels."""
    from msd_common.spec import PROCESSOR_PREPARE_BATCH

    proc, _, _ = made
    assert parse_job(_job(tmp_path, proc), str(tmp_path / "job.yaml")).runtime.prepare_batch == PROCESSOR_PREPARE_BATCH
    given = _job(tmp_path, proc)
    given["runtime"] = {"prepare_batch": 32}
    assert parse_job(given, str(tmp_path / "job.yaml")).runtime.prepare_batch == 32


def test_a_parquet_source_with_image_bytes_in_a_column(made, tmp_path):
    """The Hugging Face datasets layout: an `images` column of {bytes, path} structs and messages
    whose image parts hold no value (Parquet gives every struct field, None where absent); read
    through the worker's own SourceReader, the sample is the one the same conversation gives with
    paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from worker.samples import SourceReader

    proc, data, records = made
    record = _first_image_record(records)
    image = next(p["image"] for p in record["messages"][0]["content"] if p["type"] == "image")
    raw = open(os.path.join(data, image), "rb").read()
    messages = [{"role": m["role"], "content": [{"type": p["type"], "text": p.get("text")} for p in m["content"]]}
                for m in record["messages"]]
    pq.write_table(pa.table({"messages": [messages, messages],
                             "images": [[{"bytes": raw, "path": "a.png"}], [{"bytes": b"not an image",
                                                                             "path": None}]]}),
                   tmp_path / "vqa.parquet")
    job = {"seed": 1, "sources": {"vqa": {"format": "parquet", "paths": [str(tmp_path / "vqa.parquet")],
                                          "processor": proc}},
           "batch": {"seq_len": 2048, "micro_batch_size": 1, "global_batch_size": 1}, "topology": {"dp": 1},
           "mixture": {"weights": {"vqa": 1.0}}}
    (spec,) = parse_job(job, str(tmp_path / "job.yaml")).worker_job().sources
    reader = SourceReader(spec)
    tokens, patches, mask, processed = reader.read_prepared(0, 0)[:4]
    assert reader.finish(processed, 0) is None  # its image pass, as at delivery
    expected = _made(ProcessorChat(proc), record, data)
    np.testing.assert_array_equal(tokens, expected.tokens)
    np.testing.assert_array_equal(mask, expected.loss_mask)
    np.testing.assert_array_equal(processed.image_arrays[FRAMES], expected.image_arrays[FRAMES])
    from msd_common.formats.errors import RecordError

    with pytest.raises(RecordError, match="does not decode"):  # the bad image skips its record only
        reader.read_prepared(1, 0)
    from msd_common import protocol as P

    with pytest.MonkeyPatch.context() as m:  # image frames past one frame of PIECES: skipped at prepare, by name
        m.setattr(P, "MAX_FRAME_BYTES", processed.image_arrays[FRAMES].nbytes - 1)
        with pytest.raises(RecordError, match="pixel_frames is .* bytes, more than a message frame holds") as e:
            reader.read_prepared(0, 0)
        assert e.value.kind == "over_limit"


def test_a_webdataset_source_of_conversations_and_their_images(made, tmp_path):
    """WebDataset shards as Megatron-Energon's crude datasets hold them: per sample a `.json`
    conversation whose image parts name the sample's image entries (`0.jpg`), or name none and
    take them in order. The sample equals the JSONL one; a missing entry skips its sample."""
    import io
    import tarfile

    import orjson

    from msd_common.formats.errors import RecordError
    from worker.samples import SourceReader

    proc, data, records = made
    record = records[0]
    named, unnamed, files = [], [], {}
    for m in record["messages"]:
        parts, bare = [], []
        for p in m["content"]:
            if p["type"] == "image":
                name = f"{len(files)}.png"
                files[name] = open(os.path.join(data, p["image"]), "rb").read()
                parts.append({"type": "image", "image": name})
                bare.append({"type": "image"})
            else:
                parts.append(p)
                bare.append(p)
        named.append({**m, "content": parts})
        unnamed.append({**m, "content": bare})
    with tarfile.open(tmp_path / "shard-0.tar", "w") as tar:
        for key, messages, entries in (("a", named, files), ("b", unnamed, files), ("c", named, {})):
            for suffix, payload in [("json", orjson.dumps({"messages": messages})), *entries.items()]:
                info = tarfile.TarInfo(f"{key}.{suffix}")
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    job = {"seed": 1, "sources": {"vqa": {"format": "webdataset", "paths": [str(tmp_path / "shard-0.tar")],
                                          "processor": proc}},
           "batch": {"seq_len": 4096, "micro_batch_size": 1, "global_batch_size": 1}, "topology": {"dp": 1},
           "mixture": {"weights": {"vqa": 1.0}}}
    parsed = parse_job(job, str(tmp_path / "job.yaml"))
    (spec,) = parsed.worker_job().sources
    assert not parsed.sources[0].has_images and parsed.sources[0].has_encoder_cost  # the processor's, not patches
    reader = SourceReader(spec)
    expected = _made(ProcessorChat(proc), record, data)
    for i in (0, 1):
        tokens, patches, mask, processed = reader.read_prepared(i, 0)[:4]
        assert patches is None and reader.finish(processed, i) is None
        np.testing.assert_array_equal(tokens, expected.tokens)
        np.testing.assert_array_equal(mask, expected.loss_mask)
        np.testing.assert_array_equal(processed.image_arrays[FRAMES], expected.image_arrays[FRAMES])
    with pytest.raises(RecordError, match="no such image file"):  # "0.png" names no entry of sample c
        reader.read_prepared(2, 0)
    with pytest.raises(ConfigError) as e:  # the built-in patchifier's keys do not apply
        parse_job({**job, "sources": {"vqa": {**job["sources"]["vqa"], "image_token_id": 5}}}, str(tmp_path / "j.yaml"))
    assert any(p.startswith("sources.vqa.image_token_id") for p in e.value.problems), e.value.problems


def test_a_host_without_torchvision_refuses_the_torchvision_backend(made):
    """transformers falls back to its PIL image processor where torchvision is missing, and the
    two backends' pixels differ: the job's one backend for every host would be broken silently."""
    pytest.importorskip("PIL")
    try:
        import torchvision  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("torchvision is installed here: the backend is available")
    from worker.core import _processor_problem
    from worker.processor import load_processor

    proc, _, _ = made
    with pytest.raises(ImportError, match="image_backend torchvision is not available on this host"):
        load_processor(proc, "torchvision")
    from msd_common.worker_job import SourceSpec

    spec = SourceSpec(name="vqa", index=0, format="jsonl", files=(), processor=proc, image_backend="torchvision")
    assert "image_backend torchvision is not available" in _processor_problem(spec)


def test_a_transform_makes_samples_with_the_sources_processor(made, tmp_path, monkeypatch):
    """A record form msd does not know, made into a conversation by the user's transform, which
    calls the source's processor (ctx.processor) and returns its outputs: the sample equals the
    one msd makes of the same conversation."""
    import sys

    import orjson

    from worker.samples import SourceReader

    proc, data, records = made
    (tmp_path / "vqa_mod.py").write_text(
        "from PIL import Image\nfrom worker.transforms import Sample\n"
        "def f(record, ctx):\n"
        "    messages = [{'role': 'user', 'content': [{'type': 'image', 'image': Image.open(record['img'])},\n"
        "                                             {'type': 'text', 'text': record['q']}]},\n"
        "                {'role': 'assistant', 'content': [{'type': 'text', 'text': record['a']}]}]\n"
        "    out = ctx.processor.apply_chat_template(messages, tokenize=True, return_dict=True,\n"
        "                                            return_assistant_tokens_mask=True, return_tensors='np')\n"
        "    return Sample(out['input_ids'][0], processed=dict(out))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    record = _first_image_record(records)
    image = os.path.join(data, record["messages"][0]["content"][0]["image"])
    (tmp_path / "vqa.jsonl").write_bytes(orjson.dumps({"img": image, "q": "what is in the picture?",
                                                       "a": "noise, in colour"}) + b"\n")
    job = {"seed": 1, "sources": {"vqa": {"format": "jsonl", "paths": [str(tmp_path / "vqa.jsonl")],
                                          "processor": proc, "transform": "vqa_mod:f"}},
           "batch": {"seq_len": 2048, "micro_batch_size": 1, "global_batch_size": 1}, "topology": {"dp": 1},
           "mixture": {"weights": {"vqa": 1.0}}}
    parsed = parse_job(job, str(tmp_path / "job.yaml"))
    assert parsed.rope == "mrope" and parsed.sources[0].has_encoder_cost
    (spec,) = parsed.worker_job().sources
    tokens, patches, mask, processed = SourceReader(spec).read_prepared(0, 0)[:4]
    expected = _made(ProcessorChat(proc), record, data)
    np.testing.assert_array_equal(tokens, expected.tokens)
    np.testing.assert_array_equal(mask, expected.loss_mask)  # the processor's assistant mask, passed on
    assert processed.patches == expected.patches and processed.images == 1
    _same(processed, expected)
    sys.modules.pop("vqa_mod", None)


def test_the_processor_digest_covers_the_video_configuration_and_the_models_video_timing(tmp_path):
    """A host whose video processor samples other frames, or whose model spaces video positions
    otherwise (Qwen2.5-VL's tokens_per_second), makes other samples: its digest differs. Another
    dtype in config.json makes none: the digest stays."""
    import shutil

    from msd_common.processor_dir import processor_digest

    base = write_qwen2_5_vl_processor(str(tmp_path / "base"), max_pixels=60_000)
    with open(os.path.join(base, "config.json"), "w") as f:
        json.dump({"torch_dtype": "bfloat16", "vision_config": {"tokens_per_second": 2}}, f)
    digest = processor_digest(base)

    def changed(name: str, value: dict) -> str:
        copy = str(tmp_path / f"copy-{len(os.listdir(tmp_path))}")
        shutil.copytree(base, copy)
        with open(os.path.join(copy, name), "w") as f:
            json.dump(value, f)
        return processor_digest(copy)

    assert changed("config.json", {"torch_dtype": "float32", "vision_config": {"tokens_per_second": 2}}) == digest
    assert changed("config.json", {"torch_dtype": "bfloat16", "vision_config": {"tokens_per_second": 4}}) != digest
    assert changed("video_preprocessor_config.json", {"fps": 2.0}) != digest


def test_a_job_started_by_0_4_with_a_video_configuration_is_still_this_job(tmp_path):
    """0.4.0 hashed a processor directory without its video configuration: the digest it gave a job
    (in its state dir and its trainers' checkpoints) is among this job's earlier digests."""
    import shutil

    with_video = write_video_config(write_qwen2_5_vl_processor(str(tmp_path / "q25"), max_pixels=60_000),
                                    "qwen2_5_vl", 12_000)
    with open(os.path.join(with_video, "config.json"), "w") as f:
        json.dump({"vision_config": {"tokens_per_second": 2}}, f)
    without = str(tmp_path / "as-0.4-saw-it")
    shutil.copytree(with_video, without, ignore=shutil.ignore_patterns("video_preprocessor_config.json",
                                                                       "config.json"))
    job = parse_job(_job(tmp_path, with_video), str(tmp_path / "job.yaml"))
    as_0_4_saw_it = parse_job(_job(tmp_path, without), str(tmp_path / "job.yaml"))
    assert job.digest() != as_0_4_saw_it.digest()
    assert as_0_4_saw_it.digest() in job.earlier_digests()
    assert as_0_4_saw_it.earlier_digests() == [as_0_4_saw_it.digest_before_0_4()]  # nothing else to take


def _image_file(fmt: str, width: int, height: int, orientation: int = 0) -> bytes:
    import io

    from PIL import Image

    pixels = np.random.default_rng(width + orientation).integers(0, 256, (height, width, 3), dtype=np.uint8)
    options = {"quality": 90} if fmt == "JPEG" else {}
    if orientation:  # (0: no EXIF at all)
        exif = Image.Exif()
        exif[0x0112] = orientation
        options["exif"] = exif.tobytes()
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt, **options)
    return out.getvalue()


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
@pytest.mark.parametrize("orientation", range(0, 9))
def test_a_planned_image_pass_reads_the_upright_size_without_decoding(fmt, orientation):
    """At prepare time a planned image pass needs sizes only: sized_image gives decode_image's
    (upright) size, and leaves the file undecoded (decoded at delivery) where no EXIF orientation
    can turn it on its side (a JPEG's upright ones; a PNG with no EXIF)."""
    from worker.processor import decode_image, sized_image

    data = _image_file(fmt, 96, 40, orientation)
    image = sized_image(data, "a.img", None)
    assert image.size == decode_image(data, "a.img", None).size == ((40, 96) if orientation >= 5 else (96, 40))
    undecoded = orientation < 5 if fmt == "JPEG" else orientation == 0
    assert bool(getattr(image, "tile", None)) == undecoded  # tiles left to decode


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
@pytest.mark.parametrize("kept", [0.3, 0.9, 0.99])
def test_a_truncated_or_corrupt_file_is_found_at_prepare_time_without_a_whole_decode(fmt, kept):
    from worker.processor import sized_image

    data = _image_file(fmt, 640, 480)
    with pytest.raises(ImageRecordError, match="a.img: image does not decode") as e:
        sized_image(data[:int(len(data) * kept)], "a.img", None)
    assert e.value.kind == "corrupt"
    spoiled = bytearray(data)
    spoiled[int(len(data) * kept)] ^= 0xFF
    if fmt == "PNG":  # (a JPEG's flipped byte decodes to other pixels, without an error, as in a whole decode)
        with pytest.raises(ImageRecordError, match="a.img: image does not decode"):
            sized_image(bytes(spoiled), "a.img", None)
    with pytest.raises(ImageRecordError, match="640x480 pixels is over max_image_pixels") as e:
        sized_image(data, "a.img", 640 * 480 - 1)
    assert e.value.kind == "over_limit"
