import numpy as np

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
    assert batch["doc_keys"].dtype == np.uint64
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
