import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer_client import protocol as P
from trainer_client import wire
from trainer_client.errors import ProtocolError


def _frames(header, *arrays):
    return [bytes(f) for f in wire.encode(header, *arrays)]


def test_pieces_round_trip_keeps_arrays_exact():
    tokens = np.arange(10, dtype="<u2")
    header = P.make(P.PIECES, step=3, rank=1, dtype="<u2", items=[[0, (2 << 48) | 7, 5, 4], [1, 9, 0, 6]])
    got, data = wire.decode(_frames(header, tokens), P.TRAINER_DATA_INBOX)
    assert got == header
    np.testing.assert_array_equal(wire.frame_array(data[0], got["dtype"], 10), tokens)


def test_message_for_another_role_is_rejected():
    header = P.make(P.PREPARE, task_id=1, source=0, records=[1, 2])
    with pytest.raises(ProtocolError, match="not accepted"):
        wire.decode(_frames(header), P.TRAINER_CONTROL_INBOX)


@pytest.mark.parametrize("field,value,why", [
    ("step", -1, "outside"),
    ("step", "3", "expected int"),
    ("rank", True, "expected int"),
    ("items", [[0, 1, 2]], "list of 4"),
    ("items", [[0, -1, 0, 4]], "outside"),
    ("dtype", "<f8", "dtype"),
])
def test_bad_fields_are_named(field, value, why):
    header = P.make(P.PIECES, step=0, rank=0, dtype="<u2", items=[[0, 1, 0, 2]])
    header[field] = value
    with pytest.raises(ProtocolError, match=why):
        wire.decode(_frames(header, np.zeros(2, "<u2")), P.TRAINER_DATA_INBOX)


def test_missing_field_and_frame_count():
    header = P.make(P.PIECES, step=0, rank=0, dtype="<u2", items=[])
    del header["rank"]
    with pytest.raises(ProtocolError, match="rank.*missing"):
        wire.decode(_frames(header, np.zeros(0, "<u2")), P.TRAINER_DATA_INBOX)
    ok = P.make(P.PIECES, step=0, rank=0, dtype="<u2", items=[])
    with pytest.raises(ProtocolError, match="data frames"):
        wire.decode(_frames(ok), P.TRAINER_DATA_INBOX)


def test_frame_size_must_match_header():
    with pytest.raises(ProtocolError, match="bytes"):
        wire.frame_array(memoryview(b"\x00" * 7), "<u2", 4)


def test_oversized_and_undecodable_headers():
    with pytest.raises(ProtocolError, match="exceeds"):
        wire.decode([b"\x00" * (P.MAX_HEADER_BYTES + 1)], P.COORDINATOR_INBOX)
    with pytest.raises(ProtocolError, match="undecodable"):
        wire.decode([b"\xc1"], P.COORDINATOR_INBOX)
    with pytest.raises(ProtocolError, match="frames"):
        wire.decode([b"x"] * (P.MAX_FRAMES + 1), P.COORDINATOR_INBOX)
    # binary blobs are never accepted in headers (nothing may smuggle payloads or objects there)
    with pytest.raises(ProtocolError):
        wire.decode([msgpack.packb({"type": "consumed", "rank": 0, "step": b"\x00"}, use_bin_type=True)],
                    P.COORDINATOR_INBOX)


def test_make_checks_field_names():
    with pytest.raises(ProtocolError):
        P.make(P.CONSUMED, rank=0)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), min_size=1, max_size=3))
def test_random_bytes_never_crash_the_decoder(frames):
    try:
        wire.decode(frames, P.COORDINATOR_INBOX)
    except ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.text(max_size=8) | st.floats(),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                    max_leaves=20))
def test_random_headers_are_rejected_cleanly(obj):
    for inbox in (P.COORDINATOR_INBOX, P.WORKER_INBOX, P.TRAINER_CONTROL_INBOX):
        try:
            wire.decode([msgpack.packb(obj)], inbox)
        except ProtocolError:
            pass
