"""The worked example configs/sft.yaml: chat data rendered with a real chat template and trained on
the assistant's tokens only, a transform of the user's own beside it, both as whole samples.
Checked token for token and mask for mask against transformers' apply_chat_template, for a
stream that does not depend on the worker count, and run through `msd coordinator`,
`msd worker` and tools/train_tiny.py as a user would."""

import json
import os
import subprocess
import sys

import numpy as np
import orjson
import pytest

from msd.testing.ports import free_port
from tests.integration.harness import run_job
from msd_common.doc_keys import split_doc_key

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "configs")
JOB = os.path.join(CONFIGS, "sft.yaml")


PAD_ID = 257  # the job's batch.pad_id (default)


def _by_segments(received):
    """Every piece as (step, rank, doc_key, offset, tokens, loss_mask), cut from the rows by
    cu_seqlens: a row's pieces in order, then its padding (a segment of pad ids, never trained on)."""
    out = []
    for rank, batches in sorted(received.items()):
        for b in batches:
            tokens, mask = b["tokens"].reshape(-1), b["loss_mask"].reshape(-1)
            cu = b["cu_seqlens"].tolist()
            keys, offsets = b["doc_keys"].tolist(), b["doc_offsets"].tolist()
            k = 0
            for s, e in zip(cu[:-1], cu[1:]):
                if (tokens[s:e] == PAD_ID).all() and not mask[s:e].any():
                    continue
                assert e - s == b["piece_lengths"][k]
                out.append((b["step"], rank, keys[k], offsets[k], tokens[s:e].copy(), mask[s:e].copy()))
                k += 1
            assert k == len(keys)
    return out


@pytest.fixture(scope="module")
def stream_two_workers():
    sys.path.insert(0, CONFIGS)  # spawned workers get this process's sys.path: they import sft_transforms
    try:
        return run_job(JOB, workers=2, ranks=2, steps=8, timeout_s=120)
    finally:
        sys.path.remove(CONFIGS)


def test_chat_samples_match_transformers_token_for_token_and_mask_for_mask(stream_two_workers):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(os.path.join(CONFIGS, "tokenizers", "chatml"))
    with open(os.path.join(CONFIGS, "data", "chat", "conversations.jsonl"), "rb") as f:
        conversations = [orjson.loads(line)["messages"] for line in f]
    checked = 0
    for step, rank, key, offset, tokens, mask in _by_segments(stream_two_workers):
        source, record = split_doc_key(key)
        if source != 0:
            continue
        ref = hf.apply_chat_template(conversations[record], tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
        assert offset == 0  # whole samples: never a continuation
        assert tokens.tolist() == list(ref["input_ids"])  # never cut, nothing added
        expected = np.asarray(ref["assistant_masks"][1:] + [0], dtype=np.float32)  # position i predicts token i+1
        np.testing.assert_array_equal(mask, expected)
        assert mask.sum() > 0
        checked += 1
    assert checked >= 8


def test_the_transform_runs_on_workers_and_the_stream_does_not_depend_on_their_number(stream_two_workers):
    sys.path.insert(0, CONFIGS)
    try:
        one = run_job(JOB, workers=1, ranks=2, steps=8, timeout_s=120)
    finally:
        sys.path.remove(CONFIGS)
    a, b = _by_segments(stream_two_workers), _by_segments(one)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x[:4] == y[:4]
        np.testing.assert_array_equal(x[4], y[4])
        np.testing.assert_array_equal(x[5], y[5])
    notes = [p for p in a if split_doc_key(p[2])[0] == 1]
    assert notes, "no sample of the transformed source"
    with open(os.path.join(CONFIGS, "data", "chat", "notes.jsonl"), "rb") as f:
        records = [orjson.loads(line) for line in f]
    for _, _, key, offset, tokens, mask in notes:
        record = records[split_doc_key(key)[1]]
        assert record["lang"] != "fr"  # skipped by the transform (Skip)
        assert offset == 0 and len(tokens) <= 64 + 40  # the prompt, and a window of at most 64 body tokens
        assert mask.sum() > 0


def test_the_example_trains_through_the_commands(tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([CONFIGS, ROOT])}
    msd = [sys.executable, "-m", "msd.cli"]
    coordinator = subprocess.Popen(msd + ["coordinator", "--config", JOB, "--bind", f"tcp://127.0.0.1:{port}"],
                                   env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "coordinator.log", "w"))
    worker = subprocess.Popen(msd + ["worker", "--coordinator", f"tcp://127.0.0.1:{port}", "--procs", "1"],
                              env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "worker.log", "w"))
    try:
        losses = tmp_path / "losses.json"
        done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "train_tiny.py"), "--coordinator",
                               f"tcp://127.0.0.1:{port}", "--steps", "12", "--vocab", "500", "--port",
                               str(free_port()), "--losses", str(losses)], env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        values = [v for _, v in json.loads(losses.read_text())]
        assert len(values) == 12 and np.mean(values[-3:]) < np.mean(values[:3]) * 0.95, values
    finally:
        for p in (worker, coordinator):
            p.terminate()
        for p in (worker, coordinator):
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


def test_manifest_where_and_plan_answer_for_chat_transformed_and_whole_sources(tmp_path):
    """msd manifest runs the transform and renders the chat as workers do: it recomputes exactly
    what the ranks received (whole samples, deferred ones included), and msd where finds them."""
    from click.testing import CliRunner

    from msd.cli import main
    from msd.testing.local import LocalJob
    from tests.integration.harness import run_ranks

    state = str(tmp_path / "state")
    sys.path.insert(0, CONFIGS)
    try:
        with LocalJob(JOB, workers=2, state_dir=state) as cluster:
            received, _ = run_ranks(cluster, ranks=2, steps=10, timeout_s=120)
        got = {}
        for rank, batches in received.items():
            for b in batches:
                got[(b["step"], rank)] = got.get((b["step"], rank), []) + list(
                    zip(b["doc_keys"].tolist(), b["doc_offsets"].tolist(), b["piece_lengths"].tolist()))
        runner = CliRunner()
        for step in range(10):
            r = runner.invoke(main, ["manifest", "--state-dir", state, "--step", str(step), "--json"])
            assert r.exit_code == 0, r.output
            m = orjson.loads(r.output)
            for rank, pieces in m["ranks"].items():
                assert [(p["doc_key"], p["offset"], p["length"]) for p in pieces] == got[(step, int(rank))]
        key, _, _ = got[(3, 0)][0]
        r = runner.invoke(main, ["where", str(key), "--state-dir", state, "--json"])
        assert r.exit_code == 0, r.output
        assert any(hit["step"] == 3 for hit in orjson.loads(r.output)["deliveries"]), r.output
    finally:
        sys.path.remove(CONFIGS)
