import math

import pytest
from click.testing import CliRunner

from msd.cli import main
from msd_common.spec import ConfigError, parse_job
from tests.conftest import job_dict, write_job


def _problems(dataset_dir, job):
    with pytest.raises(ConfigError) as e:
        parse_job(job, "job.yaml", base_dir=dataset_dir)
    return e.value.problems


def test_valid_job_parses_with_sorted_files_and_normalised_weights(dataset_dir):
    job = parse_job(job_dict(), "job.yaml", base_dir=dataset_dir)
    assert [s.name for s in job.sources] == ["web", "code", "long"]
    assert [s.index for s in job.sources] == [0, 1, 2]
    web = job.sources[0]
    assert [f.rsplit("/", 1)[1] for f in web.files] == ["web-0.jsonl", "web-1.jsonl"]
    assert math.isclose(sum(job.weights.values()), 1.0)
    assert job.micro_batches_per_rank == 2 and job.step_tokens == 8 * 512


@pytest.mark.parametrize("mutate,expected", [
    (lambda j: j.update(bogus=1), "bogus: unknown key"),
    (lambda j: j["mixture"]["weights"].update(web=-1), "mixture.weights.web: must not be negative"),
    (lambda j: j["mixture"]["weights"].update(web=float("nan")), "mixture.weights.web: expected a finite number"),
    (lambda j: j["mixture"].update(weights={"web": 0, "code": 0, "long": 0}), "mixture.weights: all weights are zero"),
    (lambda j: j["mixture"]["weights"].update(books=0.1), "mixture.weights.books: weight for unknown source"),
    (lambda j: j["sources"]["web"].update(paths=["nothing/*.jsonl"]),
    "sources.web.paths: 'nothing/*.jsonl' matches no file"),
    (lambda j: j["sources"]["web"].update(format="csv"), "sources.web.format: unknown format 'csv'"),
    (lambda j: j["sources"]["web"].update(tokenizer="gpt9"), "sources.web.tokenizer: unknown tokenizer 'gpt9'"),
    (lambda j: j["sources"]["code"].update(colour="blue"), "sources.code.colour: unknown key"),
    (lambda j: j["batch"].update(seq_len=-4), "batch.seq_len: must be >= 2"),
    (lambda j: j["batch"].update(global_batch_size=6), "batch.global_batch_size: 6 is not a multiple"),
    (lambda j: j.update(mixture=[{"weights": {"web": 1}}, {"weights": {"code": 1}}]),
     "mixture[0].until_step: required on every stage but the last"),
    (lambda j: j.update(mixture=[{"until_step": 10, "weights": {"web": 1}}, {"until_step": 5, "weights": {"code": 1}},
                                 {"weights": {"long": 1}}]), "mixture[1].until_step: must be >= 11"),
    (lambda j: j.update(mixture=[{"until_step": 10, "weights": {"web": 1}, "ramp_steps": 3}, {"weights": {"web": 1}}]),
     "mixture[0].ramp_steps: the first stage has no previous weights"),
    (lambda j: j.update(mixture=[{"until_step": 10, "weights": {"web": 1}}, {"weights": {"web": 1}, "until_step": 20}]),
     "mixture[1].until_step: the last stage runs to the end"),
    (lambda j: j.update(mixture=[{"until_step": 10, "weights": {"web": 1}}, {"weights": {"pdf": 1}}]),
     "mixture[1].weights.pdf: weight for unknown source"),
    (lambda j: j.update(balance={"method": "magic"}), "balance.method: expected one of greedy, karmarkar_karp, none"),
    (lambda j: j.update(balance={"token_slack": -0.5}), "balance.token_slack: must not be negative"),
    (lambda j: j["sources"]["long"].update(long_docs="cut"),
    "sources.long.long_docs: expected one of split, truncate, drop"),
    (lambda j: j["sources"]["long"].update(packing="whole", long_docs="split"),
    "sources.long.long_docs: a whole-sample source is never cut"),
    (lambda j: j["sources"]["long"].update(packing="tight"), "sources.long.packing: expected one of concat, whole"),
    (lambda j: j["sources"]["web"].update(transform="no_such_module_xyz:f"),
    "sources.web.transform: transform 'no_such_module_xyz:f': cannot import module"),
    (lambda j: j["sources"]["web"].update(chat={"train_on": "assistant"}),
    "sources.web.tokenizer: chat needs a Hugging Face tokenizer"),
    (lambda j: j["sources"]["long"].update(epochs=0), "sources.long.epochs: must be >= 1"),
    (lambda j: j.update(on_exhausted="panic"), "on_exhausted: expected one of renormalize, stop"),
    (lambda j: j["sources"]["web"].update(format="parquet"), "sources.web.paths: "),  # .jsonl files are not .parquet
    (lambda j: j["sources"]["web"].update(format="webdataset"), "sources.web.image_token_id: required"),
    (lambda j: j["sources"]["web"].update(patch_size=14),
    "sources.web.patch_size: applies to webdataset sources without a processor and sources with a transform only"),
    (lambda j: j["sources"]["web"].update(tokens_key="ids"), "sources.web.tokens_key: a non-empty column name"),
    (lambda j: j.update(balance={"cost": {"patch_quadratic": -1}}), "balance.cost.patch_quadratic: must not be"),
    (lambda j: j.update(runtime={"allocation": "greedy"}), "runtime.allocation: expected one of adaptive, fixed"),
])
def test_each_problem_names_its_key(dataset_dir, mutate, expected):
    job = job_dict()
    mutate(job)
    problems = _problems(dataset_dir, job)
    assert any(p.startswith(expected) for p in problems), problems


def test_all_problems_are_reported_at_once(dataset_dir):
    job = job_dict()
    job["sources"]["web"]["format"] = "csv"
    job["mixture"]["weights"]["books"] = 1
    job["topology"]["dp"] = 0
    problems = _problems(dataset_dir, job)
    assert len(problems) >= 3


def test_msd_validate_exit_codes(dataset_dir):
    runner = CliRunner()
    good = write_job(dataset_dir, job_dict(), "good.yaml")
    r = runner.invoke(main, ["validate", good])
    assert r.exit_code == 0, r.output
    assert r.output.count("\n") == 1 and "OK" in r.output and "web=jsonl" in r.output
    bad_job = job_dict()
    bad_job["mixture"]["weights"]["web"] = -2
    bad_job["sources"]["long"]["format"] = "parquet9"
    bad = write_job(dataset_dir, bad_job, "bad.yaml")
    r = runner.invoke(main, ["validate", bad])
    assert r.exit_code == 1
    assert "mixture.weights.web" in r.output and "sources.long.format" in r.output


def test_truncated_megatron_is_refused_naming_the_file(dataset_dir, tmp_path):
    import shutil

    root = tmp_path / "d"
    shutil.copytree(dataset_dir, root)
    bin_path = root / "code" / "code_text_document.bin"
    with open(bin_path, "r+b") as f:
        f.truncate(bin_path.stat().st_size - 10)
    path = write_job(str(root), job_dict())
    r = CliRunner().invoke(main, ["validate", path])
    assert r.exit_code == 1
    assert "code_text_document.bin" in r.output and "truncated" in r.output


def test_curriculum_weights_ramp_between_stages(dataset_dir):
    job = job_dict(mixture=[{"until_step": 10, "weights": {"web": 1.0}},
                            {"weights": {"code": 3, "long": 1}, "ramp_steps": 4, "seq_len": 1024}])
    cfg = parse_job(job, "job.yaml", base_dir=dataset_dir)
    assert cfg.weights_at(9) == [1.0, 0.0, 0.0]
    assert cfg.weights_at(10) == pytest.approx([0.75, 0.75 * 0.25, 0.25 * 0.25])  # a quarter of the way
    assert cfg.weights_at(13) == pytest.approx([0.0, 0.75, 0.25])
    assert cfg.seq_len_at(9) == 512 and cfg.seq_len_at(10) == 1024 and cfg.step_tokens_at(10) == 8 * 1024


def test_shuffle_block_is_checked_and_enters_the_digest_only_when_set(dataset_dir):
    plain = parse_job(job_dict(), "job.yaml", base_dir=dataset_dir)
    job = job_dict()
    job["sources"]["web"]["shuffle_block"] = 1
    assert parse_job(job, "job.yaml", base_dir=dataset_dir).digest() == plain.digest()  # the default: same stream
    job["sources"]["web"]["shuffle_block"] = 16
    blocked = parse_job(job, "job.yaml", base_dir=dataset_dir)
    assert blocked.sources[0].shuffle_block == 16 and blocked.digest() != plain.digest()
    for bad, why in ((0, "must be >= 1"), ("16", "expected an integer"), (1 << 20, "at most 65536")):
        job["sources"]["web"]["shuffle_block"] = bad
        assert any(p.startswith("sources.web.shuffle_block: ") and why in p for p in _problems(dataset_dir, job))
