import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from msd_common import protocol as P
from msd_common import wire
from msd_common.errors import ProtocolError


def _frames(header, *arrays, tail=()):
    return [bytes(f) for f in wire.encode(header, *arrays, tail=tail)]


def _pieces(items, tokens, **header):
    h = P.make(P.Pieces, step=3, rank=1, dtype=tokens.dtype.str, patch_bytes=0, extras=[])
    h.update(header)
    return _frames(h, np.array(items, dtype="<u8").reshape(-1, 4), tokens, np.zeros(0, "<u4"), np.zeros(0, "|u1"),
                   np.zeros(0, "|u1"), np.zeros(0, "<u4"))


def test_pieces_round_trip_keeps_arrays_exact():
    tokens = np.arange(10, dtype="<u2")
    items = [[0, (2 << 48) | 7, 5, 4], [1, 9, 0, 6]]
    got, arrays = wire.decode(_pieces(items, tokens), P.TRAINER_DATA_INBOX)
    assert got == {"type": "pieces", "step": 3, "rank": 1, "dtype": "<u2", "patch_bytes": 0, "extras": []}
    assert arrays["items"].tolist() == items
    np.testing.assert_array_equal(arrays["tokens"], tokens)


def test_message_for_another_role_is_rejected():
    header = P.make(P.Prepare, task_id=1, source=0, worker_id=0)
    with pytest.raises(ProtocolError, match="not accepted"):
        wire.decode(_frames(header, np.array([1, 2], "<u8"), np.zeros(2, "<u4")), P.TRAINER_CONTROL_INBOX)


@pytest.mark.parametrize("field,value,why", [
    ("step", -1, "outside"),
    ("step", "3", "expected int"),
    ("rank", True, "expected int"),
    ("dtype", "<f8", "dtype"),
    ("dtype", "O", "dtype"),
])
def test_bad_header_fields_are_named(field, value, why):
    with pytest.raises(ProtocolError, match=why):
        wire.decode(_pieces([[0, 1, 0, 2]], np.zeros(2, "<u2"), **{field: value}), P.TRAINER_DATA_INBOX)


def test_array_frames_are_checked():
    # items that do not cover the tokens frame exactly
    with pytest.raises(ProtocolError, match="cover 3 tokens"):
        wire.decode(_pieces([[0, 1, 0, 3]], np.zeros(2, "<u2")), P.TRAINER_DATA_INBOX)
    # zero-length piece
    with pytest.raises(ProtocolError, match="piece lengths"):
        wire.decode(_pieces([[0, 1, 0, 0]], np.zeros(0, "<u2")), P.TRAINER_DATA_INBOX)
    # a frame that is not a whole number of rows
    frames = _pieces([[0, 1, 0, 2]], np.zeros(2, "<u2"))
    frames[1] = frames[1][:-3]
    with pytest.raises(ProtocolError, match="whole number"):
        wire.decode(frames, P.TRAINER_DATA_INBOX)
    # step header whose per-sequence counts do not add up
    h = P.make(P.StepHeader, step=0, rank=0, row_len=8, plan={})
    bad = _frames(h, np.array([[1, 0, 5]], "<u8"), np.array([2], "<u4"))
    with pytest.raises(ProtocolError, match="add up"):
        wire.decode(bad, P.TRAINER_CONTROL_INBOX)
    # record index beyond 48 bits
    with pytest.raises(ProtocolError, match="48 bits"):
        wire.decode(_frames(P.make(P.Prepare, task_id=1, source=0, worker_id=0), np.array([1 << 50], "<u8"),
                            np.zeros(1, "<u4")),
                    P.WORKER_INBOX)


def test_missing_field_and_frame_count():
    header = P.make(P.Pieces, step=0, rank=0, dtype="<u2", patch_bytes=0, extras=[])
    del header["rank"]
    with pytest.raises(ProtocolError, match="rank.*missing"):
        wire.decode(_frames(header, np.zeros((0, 4), "<u8"), np.zeros(0, "<u2"), np.zeros(0, "<u4"),
                            np.zeros(0, "|u1"), np.zeros(0, "|u1"), np.zeros(0, "<u4")),
                    P.TRAINER_DATA_INBOX)
    ok = P.make(P.Pieces, step=0, rank=0, dtype="<u2", patch_bytes=0, extras=[])
    with pytest.raises(ProtocolError, match="data frames"):
        wire.decode(_frames(ok), P.TRAINER_DATA_INBOX)


def test_oversized_and_undecodable_headers():
    with pytest.raises(ProtocolError, match="exceeds"):
        wire.decode([b"\x00" * (P.MAX_HEADER_BYTES + 1)], P.COORDINATOR_INBOX)
    with pytest.raises(ProtocolError, match="undecodable"):
        wire.decode([b"\xc1"], P.COORDINATOR_INBOX)
    with pytest.raises(ProtocolError, match="frames"):
        wire.decode([b"x"] * (P.MAX_FRAMES + P.MAX_EXTRA_FRAMES + 1), P.COORDINATOR_INBOX)
    # only a type that takes trailing frames (pieces' extras) may have more than its arrays
    with pytest.raises(ProtocolError, match="expected 4 data frames, got 5"):
        wire.decode(_frames(P.make(P.RelayUp, relay_id=1, messages=[], ranks=[], bytes_in=0, bytes_out=0, queued=0,
                                   late_steps=0), np.zeros((0, len(P.RELAY_CONSUMED)), "<i8"), np.zeros(0, "<f8"),
                            np.zeros((0, len(P.RELAY_LOSS)), "<i8"), np.zeros(0, "<f8"))
                    + [b"x"], P.COORDINATOR_INBOX)
    # binary blobs are never accepted in headers (nothing may smuggle payloads or objects there)
    with pytest.raises(ProtocolError):
        wire.decode([msgpack.packb({"type": "consumed", "rank": 0, "step": b"\x00"}, use_bin_type=True)],
                    P.COORDINATOR_INBOX)


def test_pieces_with_image_patches_must_add_up():
    items = np.array([[0, 7, 0, 4], [0, 9, 0, 2]], dtype="<u8")
    tokens = np.zeros(6, "<u2")
    patches = np.arange(3 * 12, dtype=np.uint8)

    def frames(counts, patch_bytes=12, data=patches):
        h = P.make(P.Pieces, step=0, rank=0, dtype="<u2", patch_bytes=patch_bytes, extras=[])
        return _frames(h, items, tokens, np.array(counts, "<u4"), data, np.zeros(0, "|u1"), np.zeros(0, "<u4"))

    _, arrays = wire.decode(frames([3, 0]), P.TRAINER_DATA_INBOX)
    assert arrays["patch_counts"].tolist() == [3, 0] and arrays["patches"].size == 36
    for bad, why in [(frames([2, 0]), "patches of 12 bytes"), (frames([3]), "one count per item"),
                     (frames([3, 0], patch_bytes=0), "one count per item")]:
        with pytest.raises(ProtocolError, match=why):
            wire.decode(bad, P.TRAINER_DATA_INBOX)


def test_pieces_with_a_processors_arrays_must_add_up():
    items = np.array([[0, 7, 0, 4], [1, 9, 0, 2]], dtype="<u8")
    tokens = np.zeros(6, "<u2")
    extras = [["mm_token_type_ids", "<i8", [], 1], ["pixel_values", "<f4", [6], 0]]
    pixels = np.arange(3 * 6, dtype="<f4")  # 3 rows of the first item, none of the second

    def frames(rows, data=pixels, declared=extras, tail=None):
        h = P.make(P.Pieces, step=0, rank=0, dtype="<u2", patch_bytes=0, extras=declared)
        tail = [np.zeros(4, "<i8").view(np.uint8), data.view(np.uint8)] if tail is None else tail
        return _frames(h, items, tokens, np.zeros(0, "<u4"), np.zeros(0, "|u1"), np.zeros(0, "|u1"),
                       np.array(rows, "<u4"), tail=tail)

    _, arrays = wire.decode(frames([4, 3, 0, 0]), P.TRAINER_DATA_INBOX)
    assert arrays["extra_rows"].tolist() == [4, 3, 0, 0] and [f.size for f in arrays["tail"]] == [32, 72]
    np.testing.assert_array_equal(arrays["tail"][1].view("<f4"), pixels)
    for bad, why in [(frames([4, 2, 0, 0]), "72 bytes declared holds|48 bytes declared holds 72"),
                     (frames([3, 3, 0, 0]), "one per token"),
                     (frames([4, 3, 0]), "counts for 2 items"),
                     (frames([4, 3, 0, 0], tail=[np.zeros(32, np.uint8)]), "2 extras frames declared, 1 sent"),
                     (frames([4, 3, 0, 0], declared=[extras[0], ["pixel_values", "object", [6], 0]]), "dtype"),
                     (frames([4, 3, 0, 0], declared=[extras[0], extras[0]]), "named twice")]:
        with pytest.raises(ProtocolError, match=why):
            wire.decode(bad, P.TRAINER_DATA_INBOX)


def test_make_checks_field_names():
    with pytest.raises(ProtocolError):
        P.make(P.Consumed, rank=0)


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
    # also as the value of "type", where an unhashable value once escaped as TypeError
    for inbox in (P.COORDINATOR_INBOX, P.WORKER_INBOX, P.TRAINER_CONTROL_INBOX):
        for header in (obj, {"type": obj}):
            try:
                wire.decode([msgpack.packb(header)], inbox)
            except ProtocolError:
                pass
