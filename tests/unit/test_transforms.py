"""Transforms of the user's own (worker/transforms.py) as the readers run them: the record they
get, deterministic randomness, skips, errors, masks; and their place in the job's identity."""

import sys

import numpy as np
import orjson
import pytest

from msd_common.spec import ConfigError, parse_job
from tests.conftest import job_dict
from msd_common.formats.errors import RecordError
from worker.samples import open_source
from worker.transforms import record_rng

MODULE = '''
import numpy as np
from worker.transforms import Sample, Skip

def crop(record, ctx, n=8):
    tokens = ctx.tokenizer.encode(record["text"])
    start = int(ctx.rng.integers(0, max(1, len(tokens) - n + 1)))
    return Sample(tokens[start:start + n], loss_mask=np.ones(min(n, len(tokens)), np.uint8))

def picky(record, ctx):
    if "skip" in record["text"]:
        raise Skip("asked to")
    if "none" in record["text"]:
        return None
    if "boom" in record["text"]:
        raise KeyError("no such field")
    if "zero" in record["text"]:
        return Sample([1, 2, 3], loss_mask=[0, 0, 0])
    return Sample(np.arange(3))

def fields(record, ctx):
    return Sample(np.array([len(record)], np.int32))
'''


@pytest.fixture
def module(tmp_path, monkeypatch):
    (tmp_path / "my_transforms.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_transforms"
    sys.modules.pop("my_transforms", None)


def _jsonl(tmp_path, texts):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"text": t, "n": i}) + b"\n" for i, t in enumerate(texts)))
    return str(path)


def _reader(path, transform, args=None, seed=5):
    return open_source({"name": "t", "index": 3, "format": "jsonl", "files": [path], "tokenizer": "byte",
                        "transform": transform, "transform_args": args, "seed": seed})


def test_randomness_depends_on_seed_source_record_and_epoch_only(tmp_path, module):
    path = _jsonl(tmp_path, ["a fairly long document to crop somewhere"] * 4)
    a, b = _reader(path, f"{module}:crop"), _reader(path, f"{module}:crop")
    first = [a.read_full(r)[0].tolist() for r in range(4)]
    assert first == [b.read_full(r)[0].tolist() for r in reversed(range(4))][::-1]  # any order, any reader
    assert len({tuple(x) for x in first}) > 1  # records differ
    assert a.read_full(0, epoch=1)[0].tolist() != first[0] or a.read_full(0, epoch=2)[0].tolist() != first[0]
    assert _reader(path, f"{module}:crop", seed=6).read_full(0)[0].tolist() != first[0] or \
        _reader(path, f"{module}:crop", seed=7).read_full(0)[0].tolist() != first[0]
    tokens, patches, mask = a.read_full(1)
    assert patches is None and mask.dtype == np.uint8 and len(mask) == len(tokens) == 8
    g1, g2 = record_rng(1, 2, 3, 4), record_rng(1, 2, 3, 4)
    assert g1.integers(0, 1 << 30) == g2.integers(0, 1 << 30)


def test_skips_errors_and_empty_masks_are_skips_of_their_kind(tmp_path, module):
    path = _jsonl(tmp_path, ["ok", "skip me", "none", "boom", "zero"])
    r = _reader(path, f"{module}:picky")
    assert r.read_full(0)[0].tolist() == [0, 1, 2]
    kinds = {}
    for i in range(1, 5):
        with pytest.raises(RecordError) as e:
            r.read_full(i)
        kinds[i] = (e.value.kind, str(e.value), getattr(e.value, "traceback", ""))
    assert kinds[1][0] == "skipped" and "asked to" in kinds[1][1] and "t.jsonl:2" in kinds[1][1]
    assert kinds[2][0] == "skipped"
    assert kinds[3][0] == "transform_error" and "KeyError" in kinds[3][1] and "t.jsonl:4" in kinds[3][1]
    assert "Traceback" in kinds[3][2] and "no such field" in kinds[3][2]  # named to the coordinator if it stops
    assert kinds[4][0] == "no_trainable_tokens"


def test_the_record_is_every_field_of_the_line(tmp_path, module):
    path = _jsonl(tmp_path, ["x"])
    assert _reader(path, f"{module}:fields").read_full(0)[0].tolist() == [2]  # text and n


def test_the_transform_is_part_of_the_jobs_identity(dataset_dir, tmp_path, module):
    job = job_dict()
    job["sources"]["web"]["transform"] = f"{module}:crop"
    job["sources"]["web"]["transform_args"] = {"n": 16}
    parsed = parse_job(job, "job.yaml", base_dir=dataset_dir)
    assert parsed.sources[0].transform_hash
    digest = parsed.digest()
    job["sources"]["web"]["transform_args"] = {"n": 17}
    assert parse_job(job, "job.yaml", base_dir=dataset_dir).digest() != digest
    (tmp_path / "my_transforms.py").write_text(MODULE + "\n# changed\n")
    sys.modules.pop(module, None)
    job["sources"]["web"]["transform_args"] = {"n": 16}
    assert parse_job(job, "job.yaml", base_dir=dataset_dir).digest() != digest  # the code changed
    del job["sources"]["web"]["transform"]
    del job["sources"]["web"]["transform_args"]
    plain = parse_job(job, "job.yaml", base_dir=dataset_dir)
    assert plain.digest() == parse_job(job_dict(), "job.yaml", base_dir=dataset_dir).digest()


def test_an_import_error_names_the_module_and_the_exception(dataset_dir, tmp_path, monkeypatch):
    (tmp_path / "broken_mod.py").write_text("import not_installed_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    job = job_dict()
    job["sources"]["web"]["transform"] = "broken_mod:f"
    with pytest.raises(ConfigError) as e:
        parse_job(job, "job.yaml", base_dir=dataset_dir)
    [problem] = [p for p in e.value.problems if p.startswith("sources.web.transform")]
    assert "broken_mod" in problem and "ModuleNotFoundError" in problem and "not_installed_anywhere" in problem


def _image_transform_source(tmp_path, monkeypatch, module: str, sample: str):
    """A JSONL source of one record whose transform (module `module`) returns `sample`."""
    (tmp_path / f"{module}.py").write_text(
        "import numpy as np\nfrom worker.transforms import Sample\n"
        f"def f(record, ctx):\n    return {sample}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)
    path = _jsonl(tmp_path, ["x"])
    return open_source({"name": "t", "index": 0, "format": "jsonl", "files": [path], "tokenizer": "byte",
                        "transform": f"{module}:f", "image_token_id": 300, "patch_size": 14, "max_pixels": 50176})


def test_images_from_a_transform_take_the_image_path(tmp_path, monkeypatch):
    r = _image_transform_source(tmp_path, monkeypatch, "img_mod",
                                "Sample(np.array([7, 8]), images=[np.full((28, 42, 3), 9, np.uint8)])")
    tokens, patches, mask = r.read_full(0)
    assert patches.shape == (6, 14 * 14 * 3) and (patches == 9).all()
    assert tokens.tolist() == [300] * 6 + [7, 8] and mask is None


def test_a_transforms_several_images_are_squared_one_by_one(tmp_path, monkeypatch):
    """The vision encoder attends within each image: a record of two images of 6 and 1 patches
    costs the encoder's quadratic term 6^2 + 1^2, not (6 + 1)^2 (PREPARED's patch_squares)."""
    r = _image_transform_source(tmp_path, monkeypatch, "img2_mod", "Sample(np.array([7]), images=["
                                "np.zeros((28, 42, 3), np.uint8), np.zeros((14, 14, 3), np.uint8)])")
    prepared = r.read_prepared(0)
    assert prepared.image_patches == (6, 1)
    assert prepared.patch_count == 7 and prepared.patch_squares == 37


def test_a_worker_whose_transform_differs_from_the_coordinators_does_not_serve(dataset_dir, tmp_path, module):
    from msd_common import protocol as P
    from worker.core import Quit, Registered, WorkerCore

    job = job_dict()
    job["sources"]["web"]["transform"] = f"{module}:crop"
    spec = parse_job(job, "job.yaml", base_dir=dataset_dir).worker_job().to_wire()
    welcome = P.Welcome(worker_id=1, heartbeat_s=0.5, job=spec, count=[])
    assert WorkerCore().handle(welcome) == [Registered(1, 0.5)]
    spec["sources"][0]["transform_hash"] = "0" * 16  # the coordinator saw other code
    [action] = WorkerCore().handle(P.Welcome(worker_id=1, heartbeat_s=0.5, job=spec, count=[]))
    assert isinstance(action, Quit) and "differs from the coordinator's" in action.reason


def test_a_webdataset_record_holds_every_entry_of_its_sample(tmp_path, monkeypatch):
    """WebDataset samples carry more than an image and a caption (segmentation masks, class
    labels, metadata JSON): a transform gets every entry by its suffix, and a sample without a
    caption is the transform's to judge; the built-in image-text path still refuses it by name."""
    import io
    import tarfile

    def add(tar, name, data):
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))

    shard = tmp_path / "s.tar"
    with tarfile.open(shard, "w") as tar:
        add(tar, "a/000.jpg", b"jpeg bytes")
        add(tar, "a/000.seg.png", b"mask")
        add(tar, "a/000.txt", b"a caption")
        add(tar, "a/000.json", b'{"source": "x"}')
        add(tar, "a/001.jpg", b"more jpeg bytes")
        add(tar, "a/001.cls", b"7")
    (tmp_path / "wds_mod.py").write_text(
        "from worker.transforms import Sample\n"
        "def names(record, ctx):\n"
        "    return Sample(ctx.tokenizer.encode(','.join(f'{k}={len(v)}' for k, v in sorted(record.items()))))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = {"name": "w", "index": 0, "format": "webdataset", "files": [str(shard)], "tokenizer": "byte",
            "image_token_id": 300, "patch_size": 14, "max_pixels": 50176, "cache_dir": str(tmp_path / "cache")}
    r = open_source({**spec, "transform": "wds_mod:names"})
    got = [bytes(r.read_full(i)[0][:-1].astype(np.uint8)).decode() for i in range(2)]  # the end-of-document id
    assert got == ["__key__=5,jpg=10,json=15,seg.png=4,txt=9", "__key__=5,cls=1,jpg=15"]
    with pytest.raises(RecordError, match=r"'a/001'.*no caption entry"):
        open_source(spec).read_full(1)
    sys.modules.pop("wds_mod", None)
