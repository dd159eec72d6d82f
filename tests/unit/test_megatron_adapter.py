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


def test_the_adapter_fills_megatron_cores_own_packed_seq_params_as_te_expects_them():
    """Megatron-Core cannot run a packed (THD) forward on CPU: its only attention without
    Transformer Engine, DotProductAttention, asserts `packed_seq_params is None`, and TE needs CUDA.
    So the adapter's output is checked field by field against megatron.core's PackedSeqParams and
    what TEDotProductAttention requires of it."""
    import dataclasses
    import warnings

    import torch

    from msd_common.topology import cp_share

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.packed_seq_params import PackedSeqParams

    batch = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in _batch().items()}
    params = PackedSeqParams(**packed_seq_params(batch))  # every name is a field of Megatron's class
    assert {f.name for f in dataclasses.fields(PackedSeqParams)} >= set(packed_seq_params(batch))
    assert params.qkv_format == "thd"
    for cu in (params.cu_seqlens_q, params.cu_seqlens_kv):
        assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == batch["tokens"].numel()  # TE: int32, whole batch
        assert (cu[1:] >= cu[:-1]).all()
    longest = int((params.cu_seqlens_q[1:] - params.cu_seqlens_q[:-1]).max())
    assert params.max_seqlen_q == params.max_seqlen_kv == longest

    # context parallelism (cp=2): TE's THD attention wants every padded segment divisible by 2*cp
    shared = cp_share(_batch(), cp=2, cp_rank=0, pad_id=257)
    shared = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in shared.items()}
    cp_params = PackedSeqParams(**packed_seq_params(shared))
    padded = cp_params.cu_seqlens_q_padded
    assert padded is not None and padded.dtype == torch.int32
    assert ((padded[1:] - padded[:-1]) % 4 == 0).all()
    assert (cp_params.cu_seqlens_q == shared["cu_seqlens"]).all()  # the real (unpadded) boundaries
    assert cp_params.max_seqlen_q == int((padded[1:] - padded[:-1]).max())


def test_megatron_cores_thd_batch_function_takes_our_batch_and_agrees_with_the_adapter():
    """megatron.core.utils.get_thd_batch_on_this_cp_rank (what Megatron's pretrain_gpt calls for
    packed batches) run on our batch and metadata: the batch comes back unchanged (cp=1; cp>1 needs
    Transformer Engine, hence CUDA) and its PackedSeqParams equal the adapter's, field by field."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.utils import get_thd_batch_on_this_cp_rank

    ours = next(batches(iter([{k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v
                               for k, v in _batch().items()}])))
    tensors = {k: ours[k] for k in ("tokens", "labels", "loss_mask", "position_ids")}
    mine = ours["packed_seq_params"]
    cu = mine["cu_seqlens_q"]
    out, theirs = get_thd_batch_on_this_cp_rank(dict(tensors), cu, cu, torch.tensor([mine["max_seqlen_q"]]),
                                                cp_size=1, cp_rank=0)
    assert all(torch.equal(out[k], tensors[k]) for k in tensors)
    for field in ("qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "max_seqlen_q", "max_seqlen_kv"):
        a, b = getattr(theirs, field), mine[field]
        assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), field
