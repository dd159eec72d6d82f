import numpy as np

from trainer_client.assemble import assemble_micro_batch
from trainer_client.megatron import batches, get_batch, packed_seq_params


def _batch():
    pieces = {(1, 0, 3): np.array([5, 6, 256], np.uint16), (2, 4, 4): np.array([7, 8, 9, 10], np.uint16)}
    return assemble_micro_batch([[[1, 0, 3], [2, 4, 4]]], pieces, seq_len=8, pad_id=257)


def test_get_batch_returns_megatron_tuple():
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(iter([_batch()]))
    assert tokens.shape == labels.shape == loss_mask.shape == position_ids.shape == (1, 8)
    assert attention_mask is None
    assert labels[0, :2].tolist() == [6, 256]


def test_packed_seq_params_for_thd_attention():
    p = packed_seq_params(_batch())
    assert p["qkv_format"] == "thd"
    assert p["cu_seqlens_q"].tolist() == [0, 3, 7, 8]
    assert p["max_seqlen_q"] == 4
    out = next(batches(iter([_batch()])))
    assert out["packed_seq_params"]["max_seqlen_kv"] == 4 and out["attention_mask"] is None
