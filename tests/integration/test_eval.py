"""Eval sets (issue 33) with real processes: a pass is the same records in the same rows every
time, covers every token of the set exactly once across the ranks, never changes the training
stream, and no held-out record is ever trained on; through a worker's death in a pass and a
coordinator restart between passes; and tools/train_tiny.py evaluating as it trains."""

import json
import os
import subprocess
import sys
import time

import pytest

from msd.testing.local import LocalJob
from msd.testing.ports import free_port
from tests.conftest import job_dict, write_job
from msd_common.doc_keys import split_doc_key

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EVAL = {"heldout": {"holdout": {"web": 0.1, "code": 20}}, "wiki": {"sources": ["long"], "max_records": 12}}


def _job(dataset_dir, **extra):
    job = job_dict(batch={"seq_len": 128, "micro_batch_size": 1, "global_batch_size": 4})
    job["eval"] = EVAL
    job.update(extra)
    return write_job(dataset_dir, job, f"eval-{os.getpid()}-{time.monotonic_ns()}.yaml")


def _rank(address, rank, steps, eval_at, out, name="heldout", gate=None, resume=None):
    """A trainer: `steps` steps, eval passes after the steps in eval_at ({step: passes}); gate:
    (an event this rank sets after its passes, an event it waits for before them), by rank."""
    from trainer_client import DataClient
    from trainer_client.batch import BATCH_KEYS

    schema = {k.key for k in BATCH_KEYS}  # the documented batch schema holds every key a batch has
    client = DataClient(address, rank=rank, as_torch=False, timeout_s=90)
    if resume is not None:
        client.load_state_dict(resume)
    try:
        training, passes = [], []
        for batch in client:
            assert set(batch) <= schema, f"batch keys not in the schema: {set(batch) - schema}"
            training.append((batch["step"], batch["micro_batch"], batch["doc_keys"].tolist(),
                             batch["doc_offsets"].tolist(), batch["piece_lengths"].tolist(), batch["tokens"].tolist()))
            last = batch["micro_batch"] == client.micro_batches_per_step - 1
            if last and batch["step"] in eval_at:
                done, go = (gate or {}).get(rank, (None, None))
                if go is not None:
                    go.wait(120)
                for _ in range(eval_at[batch["step"]]):
                    passes.append([(b["doc_keys"].tolist(), b["doc_offsets"].tolist(), b["piece_lengths"].tolist(),
                                    b["tokens"].tolist(), b["loss_mask"].tolist(), b["eval_set"])
                                   for b in client.eval_batches(name) if set(b) <= schema or
                                   _fail(f"eval batch keys not in the schema: {set(b) - schema}")])
                if done is not None:
                    done.set()
            if last and batch["step"] + 1 >= steps:
                break
        out.put((rank, training, passes, client.state_dict()))
    except Exception as e:  # noqa: BLE001 - reported to the test
        out.put((rank, f"{type(e).__name__}: {e}", None, None))
    finally:
        client.close()


def _fail(message):
    raise AssertionError(message)


def _run(path, steps, eval_at, ranks=2, workers=2, name="heldout", between=None, state_dir=None, resume=None,
         states=None):
    """between(cluster): called once rank 0 has had its passes after the first eval step and
    before rank 1 asks for its own (rank 1 waits for it)."""
    import multiprocessing as mp
    import threading

    ctx = mp.get_context("spawn")
    with LocalJob(path, workers=workers, state_dir=state_dir) as cluster:
        out = ctx.Queue()
        gate = None
        if between is not None:
            first_done, go = ctx.Event(), ctx.Event()
            gate = {0: (first_done, None), 1: (None, go)}

            def run_between():
                first_done.wait(120)
                between(cluster)
                go.set()
            threading.Thread(target=run_between, daemon=True).start()
        procs = [ctx.Process(target=_rank, args=(cluster.address, r, steps, eval_at, out, name, gate,
                                                 (resume or {}).get(r))) for r in range(ranks)]
        for p in procs:
            p.start()
        results = {}
        for _ in procs:
            rank, training, passes, state = out.get(timeout=240)
            assert passes is not None, training
            results[rank] = (training, passes)
            if states is not None:
                states[rank] = state
        for p in procs:
            p.join(30)
    return results


def test_a_pass_is_fixed_complete_and_leaves_training_untouched(dataset_dir):
    path = _job(dataset_dir)
    with_eval = _run(path, steps=8, eval_at={2: 2, 5: 1})
    without = _run(path, steps=8, eval_at={})
    for rank in (0, 1):
        assert with_eval[rank][0] == without[rank][0]  # the training stream, token for token
    passes = {rank: with_eval[rank][1] for rank in (0, 1)}
    assert all(len(p) == 3 for p in passes.values())
    # every rank gets the same number of micro-batches; the three passes are the same batches
    assert len(passes[0][0]) == len(passes[1][0])
    for rank in (0, 1):
        assert passes[rank][0] == passes[rank][1] == passes[rank][2]
    # across the ranks every token of every held-out record appears exactly once
    pieces = [(k, o, n) for rank in (0, 1) for b in passes[rank][0] for k, o, n in zip(b[0], b[1], b[2])]
    assert len(pieces) == len(set(pieces))
    records = {}
    for k, o, n in pieces:
        records.setdefault(k, []).append((o, n))
    for k, spans in records.items():
        spans.sort()
        assert spans[0][0] == 0 and all(a[0] + a[1] == b[0] for a, b in zip(spans, spans[1:]))
    held = {split_doc_key(k) for k in records}
    assert all(b[5] == "heldout" for rank in (0, 1) for b in passes[rank][0])
    # no held-out record is in training
    trained = {split_doc_key(k) for rank in (0, 1) for t in with_eval[rank][0] for k in t[2]}
    assert held and not (held & trained)
    web = {r for s, r in held if s == 0}
    code = {r for s, r in held if s == 1}
    assert len(code) == 20 and len(web) > 0  # a count is exact; a share is ~10% of the records


def test_train_tiny_evaluates_without_changing_training(dataset_dir, tmp_path):
    job = job_dict(batch={"seq_len": 128, "micro_batch_size": 1, "global_batch_size": 4})
    job["eval"] = EVAL
    path = write_job(dataset_dir, job, "tiny-eval.yaml")

    def train(name, *extra):
        losses, evals = tmp_path / f"{name}.json", tmp_path / f"{name}-eval.json"
        with LocalJob(path, workers=2) as cluster:
            done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "train_tiny.py"), "--coordinator",
                                   cluster.address, "--steps", "8", "--port", str(free_port()), "--losses", str(losses),
                                   "--eval-losses", str(evals), *extra], capture_output=True, text=True, timeout=240,
                                  env={**os.environ, "PYTHONPATH": ROOT})
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(losses.read_text()), json.loads(evals.read_text()), done.stdout

    plain, _, _ = train("plain")
    evaluated, evals, stdout = train("eval", "--eval-every", "3", "--eval-repeat", "2")
    assert plain == evaluated  # bit for bit
    assert [e[0] for e in evals] == [2, 2, 5, 5]
    assert evals[0][1] == evals[1][1] and evals[2][1] == evals[3][1]  # the same weights, the same loss
    assert set(evals[0][1]) == {"web", "code"} and evals[2][1] != evals[0][1]
    assert "eval heldout" in stdout


def test_a_worker_killed_and_a_coordinator_restarted_between_ranks_passes_change_nothing(dataset_dir, tmp_path):
    """Rank 0 has its pass; then a worker holding the set's copies is SIGKILLed (or the
    coordinator is restarted on its state dir) before rank 1 asks for its own: the records are
    prepared again elsewhere and the pass is the one an undisturbed run serves."""
    import signal

    path = _job(dataset_dir)
    reference = _run(path, steps=5, eval_at={2: 1})

    def kill_a_worker(cluster):
        os.kill(cluster.worker_pids()[0], signal.SIGKILL)

    killed = _run(path, steps=5, eval_at={2: 1}, between=kill_a_worker)
    restarted = _run(path, steps=5, eval_at={2: 1}, between=lambda cluster: cluster.restart_coordinator(),
                     state_dir=str(tmp_path / "state"))
    for rank in (0, 1):
        assert killed[rank][1] == reference[rank][1]
        assert restarted[rank][1] == reference[rank][1]
        assert killed[rank][0] == reference[rank][0] and restarted[rank][0] == reference[rank][0]


def test_an_elastic_resume_over_more_ranks_serves_the_same_set_and_never_trains_on_it(dataset_dir, tmp_path):
    """A dp=2 job evaluates at step 1 and stops at step 4; resumed with dp=4 on the same state dir,
    it evaluates again: the same records and tokens, now over four ranks (the same number of
    micro-batches on each), and no held-out record is trained on before or after."""
    state, states = str(tmp_path / "state"), {}
    two = _run(_job(dataset_dir), steps=4, eval_at={1: 1}, state_dir=state, states=states)
    job = job_dict(batch={"seq_len": 128, "micro_batch_size": 1, "global_batch_size": 4}, topology={"dp": 4})
    job["eval"] = EVAL
    resume = {r: dict(states[0], rank=r, next_step=4, next_micro_batch=0) for r in range(4)}
    four = _run(write_job(dataset_dir, job, "eval-dp4.yaml"), steps=7, eval_at={5: 1}, ranks=4, state_dir=state,
                resume=resume)
    assert min(t[0] for r in four for t in four[r][0]) == 4  # resumed, not started again

    def pieces(results):
        return sorted((k, o, n) for rank in results for b in results[rank][1][0] for k, o, n in zip(b[0], b[1], b[2]))

    assert {k for k, _, _ in pieces(two)} == {k for k, _, _ in pieces(four)}
    assert sum(n for _, _, n in pieces(two)) == sum(n for _, _, n in pieces(four))
    assert len({len(four[r][1][0]) for r in four}) == 1  # the same number of micro-batches on every rank
    held = {k for k, _, _ in pieces(two)}
    trained = {k for run in (two, four) for rank in run for t in run[rank][0] for k in t[2]}
    assert not (held & trained)


def test_torchtitans_validator_takes_an_eval_set_as_its_data_loader(dataset_dir):
    """torchtitan 0.3.0's Validator builds its loader from Validator.Config.dataloader at each
    validation (replace(..., infinite=steps != -1), then build(dp_rank=..., ...)): ours is one
    pass. (torchtitan.components.validate itself imports triton, which a CPU host lacks: its two
    calls are made here as it makes them.)"""
    import threading
    from dataclasses import replace

    from torchtitan.components.dataloader import BaseDataLoader

    from trainer_client import DataClient
    from trainer_client.torchtitan import IGNORE_INDEX, MsdEvalDataLoader

    path = _job(dataset_dir)
    got = {}

    def rank(r, address):
        with DataClient(address, rank=r, timeout_s=60) as client:
            next(client)
            dataloader, steps = MsdEvalDataLoader.Config(client=client), -1  # Validator.Config's fields
            for _ in range(2):  # two validations: two passes, the same batches
                loader = replace(dataloader, infinite=steps != -1).build(
                    dp_world_size=2, dp_rank=r, tokenizer=None, seq_len=128, local_batch_size=1)
                assert isinstance(loader, BaseDataLoader)
                got.setdefault(r, []).append([(d["input"].tolist(), labels.tolist()) for d, labels in loader])

    with LocalJob(path, workers=2) as cluster:
        threads = [threading.Thread(target=rank, args=(r, cluster.address)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert set(got) == {0, 1}
    for r in (0, 1):
        first, second = got[r]
        assert first == second and len(first) == len(got[1 - r][0])
        assert any(v != IGNORE_INDEX for _, labels in first for row in labels for v in row)
