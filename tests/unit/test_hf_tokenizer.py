import orjson
import pytest

from msd_common.spec import ConfigError, parse_job
from tests.conftest import job_dict, train_tokenizer
from worker.samples import open_source

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


def test_a_tokenizer_directory_reads_eos_token_from_its_config(tmp_path, dataset_dir):
    """`tokenizer:` may name a directory as Hugging Face model repositories ship it (tokenizer.json
    with tokenizer_config.json); its eos_token is the end-of-document id when eod_id is not given,
    even where another usual special token exists."""
    model = tmp_path / "model"
    model.mkdir()
    from tokenizers import Tokenizer

    train_tokenizer(str(model / "tokenizer.json"), TEXTS)
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    tok.add_special_tokens(["</s>"])
    tok.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_bytes(orjson.dumps({"eos_token": {"content": "</s>", "special": True}}))
    job = job_dict()
    job["sources"]["web"]["tokenizer"] = str(model)
    parsed = parse_job(job, "job.yaml", base_dir=dataset_dir)
    reader = open_source(parsed.worker_job().sources[0])
    assert reader.read(0)[-1] == tok.token_to_id("</s>") != tok.token_to_id("<|endoftext|>")
    # a config naming a token the vocabulary lacks is refused, saying so
    (model / "tokenizer_config.json").write_bytes(orjson.dumps({"eos_token": "<nope>"}))
    with pytest.raises(ConfigError) as e:
        parse_job(job, "job.yaml", base_dir=dataset_dir)
    assert any("eos_token '<nope>'" in p for p in e.value.problems)
