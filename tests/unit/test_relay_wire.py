"""The relay's messages: what the coordinator packs for a relay's ranks comes out, at the relay, as
the very messages it would have sent each rank; malformed ones are refused at decode."""

import msgpack
import numpy as np
import pytest

from coordinator.relaying import RelayEnvelopes, relay_down, relayed_identity
from msd_common import protocol as P
from msd_common import wire
from msd_common.errors import ProtocolError
from relay.core import step_headers


def _split(frames: list) -> list[tuple[int, dict, dict]]:
    """What the relay does with a relay_down: (rank, header, arrays) of each part, as the rank decodes it."""
    msg, arrays = wire.decode(frames, P.RELAY_INBOX)
    view, at, out = memoryview(arrays["blob"]).cast("B"), 0, []
    for rank, header, sizes in msg["parts"]:
        parts = [msgpack.packb(header)]
        for n in sizes:
            parts.append(view[at:at + n])
            at += n
        out.append((rank, *wire.decode(parts, P.TRAINER_CONTROL_INBOX)))
    return out


def test_relay_down_carries_each_rank_its_own_message():
    pieces = np.array([[1, 0, 5], [2, 5, 7]], dtype=np.uint64)
    header = P.StepHeader(step=3, rank=5, row_len=16, plan={"max_over_mean": 1.0}, pieces=pieces,
                          counts=np.array([1, 1]))
    welcome = P.TrainerWelcome(rank=4, batch={"seq_len": 16}, plan_digest="d", heartbeat_s=1.0)
    parts = _split(wire.encode(relay_down([(4, welcome), (5, header)])))
    assert [(rank, msg["type"], msg["rank"]) for rank, msg, _ in parts] == [(4, "trainer_welcome", 4),
                                                                           (5, "step_header", 5)]
    np.testing.assert_array_equal(parts[1][2]["pieces"], pieces)
    assert parts[1][2]["counts"].dtype == np.dtype("<u4") and parts[1][2]["counts"].tolist() == [1, 1]


def test_relay_step_gives_each_rank_the_step_header_of_its_dp_rank():
    pieces = np.arange(5 * 3, dtype=np.uint64).reshape(5, 3)
    counts = np.array([[2, 0], [1, 2]], dtype=np.uint32)  # DP ranks 6 and 9: 2 and 3 pieces
    relay_step = P.RelayStep(step=7, row_len=64, dps=[6, 9], ranks=[[12, 0], [13, 0], [18, 1]],
                             piece_counts=[2, 3], rank_costs=[1.5, 2.5], naive_costs=[1.0, 3.0], max_over_mean=1.1,
                             naive_max_over_mean=1.3, pieces=pieces, counts=counts)
    msg = wire.receive(wire.encode(relay_step), P.RELAY_INBOX)
    out = {rank: wire.decode(frames, P.TRAINER_CONTROL_INBOX) for rank, frames in step_headers(msg)}
    assert sorted(out) == [12, 13, 18]
    for rank, lo, hi, row, cost in ((12, 0, 2, 0, 1.5), (13, 0, 2, 0, 1.5), (18, 2, 5, 1, 2.5)):
        h, a = out[rank]
        assert h["rank"] == rank and h["step"] == 7 and h["row_len"] == 64
        assert h["plan"] == {"max_over_mean": 1.1, "naive_max_over_mean": 1.3, "rank_cost": cost,
                             "naive_rank_cost": [1.0, 3.0][row]}
        np.testing.assert_array_equal(a["pieces"], pieces[lo:hi])
        np.testing.assert_array_equal(a["counts"], counts[row])


NO_LOSSES = (np.zeros((0, 4), np.int64), np.zeros(0))  # relay_up's loss tables (mixture.adapt), empty


def test_malformed_relay_messages_are_refused():
    bad_step = P.make(P.RelayStep, step=0, row_len=8, dps=[0], ranks=[[0, 1]], piece_counts=[1], rank_costs=[1.0],
                      naive_costs=[1.0], max_over_mean=1.0, naive_max_over_mean=1.0)
    with pytest.raises(ProtocolError, match="DP index"):
        wire.decode(wire.encode(bad_step, np.zeros((1, 3), np.uint64), np.zeros(1, np.uint32)), P.RELAY_INBOX)
    up = P.make(P.RelayUp, relay_id=0, messages=[], ranks=[0], bytes_in=0, bytes_out=0, queued=0, late_steps=0)
    with pytest.raises(ProtocolError, match="one waited_s"):
        wire.decode(wire.encode(up, np.zeros((2, 2), np.int64), np.zeros(1), *NO_LOSSES), P.COORDINATOR_INBOX)
    # a relay passes up its ranks' messages; each is checked as the rank's own, and one that is not a
    # rank's (here a worker's) is dropped, the rest kept
    header, arrays = wire.decode(wire.encode({**up, "messages": [
        P.make(P.TrainerHeartbeat, rank=3), P.make(P.WorkerHeartbeat, worker_id=1, cached_records=0, busy_s=0.0,
                                                    backlog=0, send_waits=0)]},
        np.array([[3, 9]], np.int64), np.array([0.5]), *NO_LOSSES), P.COORDINATOR_INBOX)
    events = RelayEnvelopes().unpack(b"relay", 1.0, header, arrays)
    assert [type(e).__name__ for e in events] == ["TrainerHeartbeat", "RelayReport"]
    assert events[0].peer == relayed_identity(b"relay", 3) and events[0].via == b"relay"
    assert events[1].consumed.tolist() == [[3, 9]]


def test_a_second_welcome_of_the_same_registration_changes_nothing(caplog):
    """Issue 61: the relay logged "welcomed" twice: a hello sent again before the coordinator's
    answer came is answered with a welcome too. The second one also told every rank that the
    relay had registered again, and each said hello again for nothing."""
    import logging

    from relay.core import RelayCore, ToRank

    core = RelayCore("tcp://relay:1", "ipc://local", "host", 1)
    hello = P.TrainerHello(version=P.PROTOCOL_VERSION, rank=0, data_address="ipc://rank0", resume_step=0,
                           incarnation=1, metadata_only=0)
    core.on_local(b"r0", wire.encode(hello), now=0.0)
    welcome = wire.encode(P.RelayWelcome(relay_id=3, heartbeat_s=1.0, topology={"dp": 2, "tp": 1, "pp": 1, "cp": 1,
                                                                               "order": "tp-cp-dp-pp"}))
    with caplog.at_level(logging.INFO, logger="msd.relay"):
        assert core.on_up(welcome, now=1.0) == []
        assert core.on_up(welcome, now=1.1) == []  # the answer to the hello sent again
    assert [r.message for r in caplog.records].count("relay 3: welcomed by the coordinator") == 1
    # registered again (a broken connection): the new welcome tells the ranks to say hello again
    core.connection_lost("the connection broke")
    out = core.on_up(wire.encode(P.RelayWelcome(relay_id=4, heartbeat_s=1.0, topology={
        "dp": 2, "tp": 1, "pp": 1, "cp": 1, "order": "tp-cp-dp-pp"})), now=2.0)
    assert [type(a) for a in out] == [ToRank]
