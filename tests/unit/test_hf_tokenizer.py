import orjson
import pytest

from coordinator.config import ConfigError, parse_job
from tests.conftest import job_dict, train_tokenizer
from worker.readers import open_source

TEXTS = ["the coordinator plans every global batch", "workers tokenize each sample once", "ünïcode λ text"] * 20


def test_hf_tokenizer_source_ends_documents_with_its_eod(tmp_path):
    tok_path = train_tokenizer(str(tmp_path / "tokenizer.json"), TEXTS)
    (tmp_path / "a.jsonl").write_bytes(b"".join(orjson.dumps({"text": t}) + b"\n" for t in TEXTS[:3]))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tok_path)
    eod = tok.token_to_id("<|endoftext|>")
    reader = open_source({"name": "a", "format": "jsonl", "files": [str(tmp_path / "a.jsonl")], "text_key": "text",
                          "tokenizer": tok_path})
    ids = reader.read(1)
    assert ids[-1] == eod
    assert ids[:-1].tolist() == tok.encode(TEXTS[1], add_special_tokens=False).ids
    assert tok.decode(ids[:-1].tolist()) == TEXTS[1]


def test_hf_tokenizer_without_eod_needs_eod_id(tmp_path, dataset_dir):
    tok_path = train_tokenizer(str(tmp_path / "noeod.json"), TEXTS, eod=None)
    job = job_dict()
    job["sources"]["web"]["tokenizer"] = tok_path
    with pytest.raises(ConfigError) as e:
        parse_job(job, "job.yaml", base_dir=dataset_dir)
    assert any(p.startswith("sources.web.eod_id: ") for p in e.value.problems)
    job["sources"]["web"]["eod_id"] = 3
    assert parse_job(job, "job.yaml", base_dir=dataset_dir).sources[0].eod_id == 3
