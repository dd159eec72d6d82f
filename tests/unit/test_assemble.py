import numpy as np
import pytest

from trainer_client.assemble import assemble_micro_batch


def test_packed_micro_batch_fields():
    a = np.array([10, 11, 12, 256], np.uint16)  # a whole document ending in EOD
    b = np.array([20, 21, 22], np.uint16)  # a piece of a longer document
    pieces = {(1, 0, 4): a, ((2 << 48) | 5, 7, 3): b}
    seqs = [[[1, 0, 4], [(2 << 48) | 5, 7, 3]], [[(2 << 48) | 5, 7, 3]]]
    batch = assemble_micro_batch(seqs, pieces, seq_len=8, pad_id=257)
    assert batch["tokens"].dtype == np.int64 and batch["tokens"].shape == (2, 8)
    assert batch["tokens"][0].tolist() == [10, 11, 12, 256, 20, 21, 22, 257]
    assert batch["labels"][0, :6].tolist() == [11, 12, 256, 257, 21, 22]
    assert batch["loss_mask"][0].tolist() == [1, 1, 1, 0, 1, 1, 0, 0]
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 3, 0, 1, 2, 0]
    assert batch["tokens"][1].tolist() == [20, 21, 22] + [257] * 5
    assert batch["loss_mask"][1].tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    assert batch["position_ids"][1].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    assert batch["cu_seqlens"].dtype == np.int32
    assert batch["cu_seqlens"].tolist() == [0, 4, 7, 8, 11, 16]
    assert batch["doc_keys"].dtype == np.int64  # 63-bit keys, int64 for torch
    assert batch["doc_keys"].tolist() == [1, (2 << 48) | 5, (2 << 48) | 5]
    assert batch["doc_offsets"].tolist() == [0, 7, 7]
    assert batch["num_tokens"] == 10


def test_a_step_assembles_like_its_micro_batches_one_by_one():
    from trainer_client.assemble import assemble_step

    rng = np.random.default_rng(3)
    pieces, seqs = {}, []
    for s in range(6):  # 3 micro-batches of 2 sequences of 16; some rows padded
        seq, left = [], 16 - (s % 3)
        while left > 0:
            n = min(left, int(rng.integers(1, 7)))
            ref = [len(pieces) + (1 << 48), int(rng.integers(0, 50)), n]
            pieces[tuple(ref)] = rng.integers(0, 60000, n).astype(np.uint16)
            seq.append(ref)
            left -= n
        seqs.append(seq)
    step = assemble_step(seqs, pieces, 16, 257, 2)
    assert len(step) == 3
    for m, got in enumerate(step):
        one = assemble_micro_batch(seqs[2 * m: 2 * m + 2], pieces, seq_len=16, pad_id=257)
        assert got.keys() == one.keys()
        for k in got:
            np.testing.assert_array_equal(got[k], one[k], err_msg=k)
        assert got["cu_seqlens"][-1] == 32 and got["tokens"].shape == (2, 16)


def _random_step(rng, rows=6, row_len=16, mbs=2):
    """A recipe with some padded rows and one reference used twice (a small source repeating)."""
    refs, counts, pieces = [], [], {}
    for r in range(rows):
        left, n_pieces = row_len - (r % 3), 0
        while left > 0:
            n = min(left, int(rng.integers(1, 7)))
            ref = (len(pieces) + (1 << 48), int(rng.integers(0, 50)), n)
            if r == rows - 1 and n_pieces == 0 and refs[0][2] <= left:
                ref = refs[0]  # the step's first piece again
            pieces[ref] = rng.integers(0, 60000, ref[2]).astype(np.uint16)
            refs.append(ref)
            left -= ref[2]
            n_pieces += 1
        counts.append(n_pieces)
    return np.array(refs, dtype=np.uint64), np.array(counts), pieces


def _expected_step(refs, counts, pieces):
    """The step assembled with every piece given at once (assemble_step), rows of 16, pad 257, 2 a micro-batch."""
    from trainer_client.assemble import assemble_step

    seqs, at = [], 0
    for c in counts:
        seqs.append([list(map(int, r)) for r in refs[at:at + c]])
        at += c
    return assemble_step(seqs, pieces, 16, 257, 2)


def test_pieces_in_any_order_and_messages_give_the_same_step():
    from trainer_client.assemble import StepAssembler

    rng = np.random.default_rng(5)
    refs, counts, pieces = _random_step(rng)
    expected = _expected_step(refs, counts, pieces)
    step = StepAssembler(refs, counts, 16, 257, 2)
    order = rng.permutation(len(refs))
    for chunk in np.array_split(order, 4):  # four messages, pieces shuffled
        items = np.column_stack([chunk.astype(np.uint64), refs[chunk]])
        assert step.add(items, np.concatenate([pieces[tuple(refs[i].tolist())] for i in chunk])) == 0
    assert step.done
    for got, want in zip(step.batches(), expected):
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_a_step_waits_in_its_messages_dtype_and_widens_for_a_wider_message():
    """Steps delivered ahead hold their tokens in the wire's 2 bytes, not int64; a later message
    of 4-byte tokens (values past 65535) widens the buffer, and the finished step is the same."""
    from trainer_client.assemble import StepAssembler

    rng = np.random.default_rng(7)
    refs, counts, pieces = _random_step(rng)
    last = tuple(refs[-1].tolist())
    pieces[last] = pieces[last].astype(np.uint32) + 70_000
    expected = _expected_step(refs, counts, pieces)
    step = StepAssembler(refs, counts, 16, 257, 2)
    first = np.arange(len(refs) - 1)
    step.add(np.column_stack([first.astype(np.uint64), refs[first]]),
             np.concatenate([pieces[tuple(refs[i].tolist())] for i in first]))
    assert step.tokens.dtype == np.uint16 and step.tokens.nbytes == 2 * len(counts) * 16
    step.add(np.array([[len(refs) - 1, *refs[-1]]], np.uint64), pieces[last])
    assert step.done and step.tokens.dtype == np.uint32
    for got, want in zip(step.batches(), expected):
        assert got["tokens"].dtype == np.int64
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_items_that_do_not_match_the_recipe_are_not_taken():
    from trainer_client.assemble import StepAssembler

    rng = np.random.default_rng(6)
    refs, counts, pieces = _random_step(rng)
    step = StepAssembler(refs, counts, 16, 257, 2)
    good = [pieces[tuple(r.tolist())] for r in refs]
    bad_ref = refs[1].copy()
    bad_ref[1] += 1  # the right index, another offset
    items = np.array([[0, *refs[0]], [1, *bad_ref], [len(refs) + 7, *refs[2]], [0, *refs[0]], [2, *refs[2]]],
                     dtype=np.uint64)
    tokens = np.concatenate([good[0], np.full(refs[1][2], 9, np.uint16), good[2], np.full(refs[0][2], 9, np.uint16),
                             good[2]])
    # index 1 names another reference, len+7 is outside the recipe, piece 0 comes twice: 3 not taken
    assert step.add(items, tokens) == 3
    assert step.missing == len(refs) - 2
    assert step.add(items[:1], good[0]) == 1  # piece 0 is here already: a re-sent message changes nothing
    rest = [i for i in range(len(refs)) if i not in (0, 2)]
    step.add(np.column_stack([np.array(rest, np.uint64), refs[rest]]), np.concatenate([good[i] for i in rest]))
    assert step.done
    tokens_out = np.concatenate([b["tokens"].reshape(-1) for b in step.batches()])
    at, row = 0, 0
    for r, c in enumerate(counts):  # every piece's own tokens, the first copy of piece 0 included
        for i in range(at, at + c):
            n = int(refs[i][2])
            np.testing.assert_array_equal(tokens_out[r * 16 + row: r * 16 + row + n], good[i])
            row += n
        at, row = at + c, 0


@pytest.mark.parametrize("piece_len", [3, 3000])  # short pieces: a running count; long ones: ramp copies
def test_position_ids_restart_at_every_piece_and_at_the_padding(piece_len):
    from trainer_client.assemble import RAMP_MIN_SEGMENT, assemble_step

    rng = np.random.default_rng(piece_len)
    row_len, seqs, pieces = 4096, [], {}
    for r in range(4):
        seq, left = [], row_len - 100 * (r % 2)  # odd rows end in 100 tokens of padding
        while left > 0:
            n = min(left, int(rng.integers(1, 2 * piece_len)))
            ref = [len(pieces), 0, n]
            pieces[tuple(ref)] = np.zeros(n, np.uint16)
            seq.append(ref)
            left -= n
        seqs.append(seq)
    segments = sum(len(s) for s in seqs) + 2
    assert (segments * RAMP_MIN_SEGMENT <= 4 * row_len) == (piece_len > RAMP_MIN_SEGMENT)
    got = np.concatenate([b["position_ids"].reshape(-1) for b in assemble_step(seqs, pieces, row_len, 257, 2)])
    want = []
    for r, seq in enumerate(seqs):
        want += [np.arange(ref[2]) for ref in seq] + ([np.arange(100)] if r % 2 else [])
    np.testing.assert_array_equal(got, np.concatenate(want))


def test_ramps_longer_than_the_seed_ramp_and_in_any_order():
    from trainer_client.assemble import _SEED_RAMP, fill_ramps

    rng = np.random.default_rng(5)
    cases = [[3 * len(_SEED_RAMP) + 7], [1, 40_000, 5], [len(_SEED_RAMP), len(_SEED_RAMP) + 1, 2]]
    cases += [rng.integers(1, 20_000, size=int(rng.integers(1, 9))).tolist() for _ in range(200)]
    for lengths in cases:
        lengths = np.asarray(lengths, dtype=np.int64)
        ends = np.cumsum(lengths)
        out = np.full(int(ends[-1]), -1, np.int64)
        fill_ramps(out, ends - lengths, lengths)
        np.testing.assert_array_equal(out, np.concatenate([np.arange(n) for n in lengths]))


def test_a_handed_micro_batch_lets_go_of_its_pieces_arrays_and_the_others_keep_theirs():
    """release(m): the frames a micro-batch was made of go once the trainer has it (a step's frames
    were held until its last micro-batch, beside the float pixel values), and only its own."""
    from trainer_client.assemble import StepAssembler

    refs = np.array([[1 << 48, 0, 4], [(1 << 48) + 1, 0, 3], [(1 << 48) + 2, 0, 5]], np.uint64)
    step = StepAssembler(refs, np.array([1, 1, 1]), row_len=8, pad_id=0, micro_batch_size=1)
    items = np.column_stack([np.arange(3, dtype=np.uint64), refs])
    grids = [np.array([[1, 2 * (i + 1), 2]], np.int64) for i in range(3)]  # a grid per piece, 24 bytes each
    step.add(items, np.arange(12, dtype=np.uint16), extras=[("image_grid_thw", "<i8", [3], False)],
             extra_rows=np.ones((3, 1), np.int64), extra_frames=[g.view(np.uint8).reshape(-1) for g in grids])
    first = step.micro_batch(0)
    assert step.release(0) == 24
    assert 0 not in step.extras and {1, 2} <= set(step.extras)
    np.testing.assert_array_equal(first["image_grid_thw"], grids[0])  # the handed batch keeps what it holds
    for m in (1, 2):
        np.testing.assert_array_equal(step.micro_batch(m)["image_grid_thw"], grids[m])
    assert step.release(0) == 0  # nothing twice
