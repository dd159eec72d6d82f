"""trainer_client.hf through a real TRL SFTTrainer: a tiny Llama fine-tuned on a chat job by two
processes over gloo (torchrun, tools/train_hf.py), each rank trained on exactly the micro-batches
msd planned for it (no second sharding by Accelerate), the run resumed from the Trainer's own
checkpoint bit for bit (weights, losses and stream), and the per-source loss reaching the
coordinator's mixture.adapt."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import orjson
import pytest
import yaml

from coordinator.journal import read_mixture_journal
from msd.testing.local import LocalJob
from msd.testing.ports import free_port
from tests.integration.harness import manifest, manifest_pieces

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "configs")
TOKENIZER = os.path.join(CONFIGS, "tokenizers", "chatml")
STEPS, SAVE, GRAD_ACCUM = 6, 3, 2


def _job(tmp_path) -> str:
    chat = {"format": "jsonl", "tokenizer": TOKENIZER, "packing": "whole", "long_docs": "truncate"}
    job = {"seed": 3,
           "sources": {"chat": {**chat, "paths": [os.path.join(CONFIGS, "data", "chat", "conversations.jsonl")],
                                "chat": {"messages_key": "messages", "train_on": "assistant"}},
                       "notes": {**chat, "paths": [os.path.join(CONFIGS, "data", "chat", "notes.jsonl")],
                                 "text_key": "body"}},
           "batch": {"seq_len": 256, "micro_batch_size": 2, "global_batch_size": 8},  # 2 micro-batches a rank
           "topology": {"dp": 2},
           "mixture": {"weights": {"chat": 0.7, "notes": 0.3},
                       "adapt": {"policy": "loss_share", "every_steps": 2, "max_step_change": 0.05}},
           "runtime": {"heartbeat_s": 0.5, "prepare_batch": 16, "lookahead_steps": 2}}
    path = str(tmp_path / "hf.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(job, f)
    return path


def _train(address: str, out: str, record: str, *extra: str, steps: int = STEPS) -> dict[int, dict]:
    """torchrun, 2 processes: tools/train_hf.py; what each rank recorded."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           os.path.join(ROOT, "tools", "train_hf.py"), "--coordinator", address, "--out", out,
           "--steps", str(steps), "--grad-accum", str(GRAD_ACCUM), "--save-steps", str(SAVE),
           "--tokenizer", TOKENIZER, "--record", record, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-6000:]
    runs = {}
    for rank in (0, 1):
        with open(record.format(rank=rank)) as f:
            runs[rank] = json.load(f)
    return runs


def _sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _pieces(runs: dict[int, dict], step: int) -> dict[tuple[int, int], list[tuple[int, int, int]]]:
    return {(rank, t["micro_batch"]): list(zip(t["doc_keys"], t["doc_offsets"], t["piece_lengths"]))
            for rank, run in runs.items() for t in run["taken"] if t["step"] == step}


def _losses(run: dict) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in run["log"] if "loss" in e}


def test_sft_trainer_trains_each_rank_its_stream_and_resumes_bit_for_bit(tmp_path):
    state = str(tmp_path / "state")
    first, resumed = str(tmp_path / "first"), str(tmp_path / "resumed")
    with LocalJob(_job(tmp_path), workers=1, state_dir=state) as cluster:
        a = _train(cluster.address, first, str(tmp_path / "a-{rank}.json"))
        # the resumed run starts from a copy of the first run's checkpoint at step 3, in its own directory
        shutil.copytree(os.path.join(first, f"checkpoint-{SAVE}"), os.path.join(resumed, f"checkpoint-{SAVE}"))
        b = _train(cluster.address, resumed, str(tmp_path / "b-{rank}.json"),
                   "--resume", os.path.join(resumed, f"checkpoint-{SAVE}"))

    # each rank trained on what msd planned for it, micro-batch by micro-batch: nothing re-sharded
    for rank in (0, 1):
        assert [(t["step"], t["micro_batch"]) for t in a[rank]["taken"]] == \
            [(s, m) for s in range(STEPS) for m in range(GRAD_ACCUM)]
    for step in range(STEPS):
        assert _pieces(a, step) == manifest_pieces(manifest(state, step)), step

    # the checkpoint carries each rank's data state, and the resumed run continues where it left off
    for rank in (0, 1):
        with open(os.path.join(first, f"checkpoint-{SAVE}", f"msd-data-rank{rank}.json")) as f:
            saved = json.load(f)
        assert (saved["next_step"], saved["next_micro_batch"]) == (SAVE, 0)
        assert [t["step"] for t in b[rank]["taken"]][0] == SAVE
    for step in range(SAVE, STEPS):
        assert _pieces(b, step) == _pieces(a, step), step
    # bit for bit: the same losses per step and the same weights at the end
    for rank in (0, 1):
        after = [{s: x for s, x in _losses(run[rank]).items() if s > SAVE} for run in (a, b)]
        assert after[0] == after[1] and len(after[0]) == STEPS - SAVE
    assert _sha(os.path.join(first, f"checkpoint-{STEPS}", "model.safetensors")) == \
        _sha(os.path.join(resumed, f"checkpoint-{STEPS}", "model.safetensors"))
    assert _losses(a[0])[STEPS] < _losses(a[0])[1]  # and it learnt

    # the per-token loss reached the coordinator, per source: mixture.adapt decided on it
    status = orjson.loads(open(os.path.join(state, "status.json"), "rb").read())
    last = status["adapt"]["last_loss"]
    assert set(last) == {"chat", "notes"} and all(x is not None and 3.0 < x < 8.0 for x in last.values()), last
    assert read_mixture_journal(state)


def test_transformers_trainer_takes_the_stream_as_it_is(tmp_path):
    """The plain `transformers.Trainer` (MsdTrainer): the same stream per rank, its loss (from the
    logits) reported per source."""
    state = str(tmp_path / "state")
    with LocalJob(_job(tmp_path), workers=1, state_dir=state) as cluster:
        a = _train(cluster.address, str(tmp_path / "out"), str(tmp_path / "a-{rank}.json"), "--trainer", "hf",
                   steps=3)
    for step in range(3):
        assert _pieces(a, step) == manifest_pieces(manifest(state, step)), step
    assert len(_losses(a[0])) == 3
    status = orjson.loads(open(os.path.join(state, "status.json"), "rb").read())
    last = status["adapt"]["last_loss"]  # steps 0 and 1 (a step's sums go with the next step's)
    assert set(last) == {"chat", "notes"} and all(x is not None and 3.0 < x < 8.0 for x in last.values()), last
