"""The trainer client's receiving state, fed encoded frames without sockets, and the hello and
heartbeat rhythm every peer shares."""

import numpy as np

from msd_common import protocol as P
from msd_common import wire
from trainer_client.assemble import FIELD_BYTES
from msd_common.errors import RejectedError
from trainer_client.receiving import End, Forgotten, ReceivingState, Welcomed
from msd_common.session import Registration

BATCH = {"seq_len": 8, "micro_batch_size": 1, "micro_batches": 2, "pad_id": 0, "dp": 1,
         "topology": {"dp": 1, "pp": 1, "cp": 1, "tp": 1, "order": "tp-cp-dp-pp", "delivery": "tp_leader"},
         "sources": ["a"], "patch_bytes": 0}


def _welcome(digest="d1"):
    return wire.encode(P.make(P.TrainerWelcome, rank=0, batch=BATCH, plan_digest=digest, heartbeat_s=0.5))


def _header(step):
    recipe = np.array([[1, 0, 5], [2, 0, 3], [3, 4, 6]], dtype=np.uint64)  # doc_key, offset, length
    header = P.make(P.StepHeader, step=step, rank=0, row_len=8, plan={})
    return wire.encode(header, recipe, np.array([2, 1], dtype=np.uint32)), recipe


def _pieces(step, indices, recipe):
    items = np.array([[i, *recipe[i]] for i in indices], dtype=np.uint64)
    tokens = np.concatenate([np.arange(int(recipe[i][2]), dtype=np.uint16) + 10 * i for i in indices])
    header = P.make(P.Pieces, step=step, rank=0, dtype="<u2", patch_bytes=0, extras=[])
    return wire.encode(header, items, tokens, np.zeros(0, np.uint32), np.zeros(0, np.uint8), np.zeros(0, np.uint8),
                       np.zeros(0, np.uint32))


def test_a_step_is_finished_once_its_recipe_and_every_piece_are_in_whatever_the_order():
    state = ReceivingState(rank=0, next_step=0, next_micro_batch=0, plan_digest=None)
    assert state.on_control(_welcome()) == [Welcomed(0.5)] and state.batch_info == BATCH
    header, recipe = _header(0)
    state.on_pieces(_pieces(0, [2], recipe))  # before its recipe: buffered
    assert state.buffered == 1 and state.finished() == []
    state.on_control(header)
    state.on_pieces(_pieces(0, [0], recipe))
    assert state.finished() == []  # piece 1 is missing
    state.on_pieces(_pieces(0, [0, 1], recipe))  # piece 0 again: counted as a duplicate
    [ready] = state.finished()
    assert state.duplicates == 1
    assert (ready.step, ready.first, ready.micro_batches) == (0, 0, 2)
    first, second = ready.micro_batch(0), ready.micro_batch(1)
    assert (first["step"], first["micro_batch"], second["micro_batch"]) == (0, 0, 1) and "plan" in first
    assert first["tokens"].tolist() == [[0, 1, 2, 3, 4, 10, 11, 12]]
    assert second["tokens"].tolist()[0][:6] == [20, 21, 22, 23, 24, 25]


def test_a_resumed_rank_starts_mid_step_and_each_micro_batch_is_built_alone_when_taken():
    state = ReceivingState(rank=0, next_step=3, next_micro_batch=1, plan_digest="d1")
    state.on_control(_welcome())
    header, recipe = _header(4)  # the step after the resume point first: it waits for step 3
    state.on_control(header)
    state.on_pieces(_pieces(4, [0, 1, 2], recipe))
    assert state.finished() == []
    for step in (3, 5):
        header, recipe = _header(step)
        state.on_control(header)
        state.on_pieces(_pieces(step, [0, 1, 2], recipe))
    ready = state.finished()
    assert [(r.step, r.first) for r in ready] == [(3, 1), (4, 0), (5, 0)]  # resumed at (3, 1)
    assert not state.steps  # handed over: the I/O thread keeps nothing of them
    batch = ready[1].micro_batch(0)
    # views of one buffer of its own, one micro-batch long (the step has 16 tokens): holding it holds nothing more
    assert batch["tokens"].base is batch["labels"].base and batch["tokens"].base.nbytes == (8 + FIELD_BYTES) * 8


def test_control_messages_become_what_the_io_thread_and_the_trainer_must_do():
    state = ReceivingState(rank=0, next_step=0, next_micro_batch=0, plan_digest="from-checkpoint")
    welcomed, error = state.on_control(_welcome("other"))
    assert welcomed == Welcomed(0.5) and isinstance(error, RejectedError) and "job file changed" in str(error)
    assert state.on_control(wire.encode(P.make(P.UnknownPeer, reason="restarted"))) == [Forgotten("restarted")]
    [refused] = state.on_control(wire.encode(P.make(P.Reject, reason="no")))
    assert isinstance(refused, RejectedError)
    state.on_control(wire.encode(P.make(P.EndOfStream, step=0, reason="source ran out")))
    [end] = state.finished()
    assert isinstance(end, End) and end.reason == "source ran out"
    assert state.on_control([b"\xc1"]) == []  # undecodable: dropped


def test_registration_says_hello_until_welcomed_then_heartbeats_and_hello_at_once_when_forgotten():
    reg = Registration(lambda: {"type": "hello"}, lambda: {"type": "beat"}, heartbeat_s=1.0, retry_s=2.0)
    assert reg.due(0.0) == {"type": "hello"} and reg.due(1.0) is None and reg.due(2.0) == {"type": "hello"}
    reg.welcomed(0.5)
    assert reg.due(2.1) == {"type": "beat"} and reg.due(2.3) is None and reg.due(2.6) == {"type": "beat"}
    reg.forgotten()
    assert reg.due(2.7) == {"type": "hello"}
    reg.welcomed()
    reg.waiting()
    assert reg.due(2.8) is None and reg.due(4.7) == {"type": "hello"}


def test_a_consuming_rank_sends_no_heartbeats_and_an_idle_one_does():
    from msd_common.session import Registration

    reg = Registration(lambda: {"type": "hello"}, lambda: {"type": "beat"}, heartbeat_s=1.0)
    assert reg.due(0.0) == {"type": "hello"}
    reg.welcomed(1.0)
    assert reg.due(0.1) == {"type": "beat"}
    beats = 0
    for tenth in range(2, 60):  # consuming a step every 0.5 s for 6 s: no heartbeat is due
        now = tenth / 10
        if tenth % 5 == 0:
            reg.spoke(now)
        beats += reg.due(now) is not None
    assert beats == 0
    assert reg.due(7.0) == {"type": "beat"}  # idle for over an interval: the heartbeat comes back
