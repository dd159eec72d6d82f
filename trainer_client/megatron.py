"""Megatron adapter: batches in the form Megatron-LM's `get_batch` (pretrain_gpt.py) returns.

    from trainer_client import DataClient
    from trainer_client.megatron import get_batch
    data_iterator = DataClient(addr, rank=global_rank)   # a rank that receives data (see topology)
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)

Sequences are packed, so attention must be document-masked: use `packed_seq_params(batch)`
(cu_seqlens and max_seqlen for THD / variable-length attention) instead of a dense mask;
`attention_mask` is therefore None, as Megatron passes it when it builds no mask.
"""

from __future__ import annotations

from typing import Any, Iterator


def get_batch(data_iterator: Iterator[dict[str, Any]]) -> tuple[Any, Any, Any, None, Any]:
    """(tokens, labels, loss_mask, attention_mask=None, position_ids) of the next micro-batch.
    Fields a pipeline stage does not receive are None, as in Megatron's get_batch."""
    batch = next(data_iterator)
    return batch.get("tokens"), batch.get("labels"), batch.get("loss_mask"), None, batch.get("position_ids")


def packed_seq_params(batch: dict[str, Any]) -> dict[str, Any]:
    """Arguments for megatron.core.packed_seq_params.PackedSeqParams(qkv_format="thd", ...)."""
    cu = batch["cu_seqlens"]
    padded = batch.get("cu_seqlens_padded", cu)  # context parallelism pads every segment
    lengths = padded[1:] - padded[:-1]
    max_len = int(lengths.max()) if len(lengths) else 0
    params = {"qkv_format": "thd", "cu_seqlens_q": cu, "cu_seqlens_kv": cu, "max_seqlen_q": max_len,
              "max_seqlen_kv": max_len}
    if "cu_seqlens_padded" in batch:
        params.update(cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded)
    return params


def batches(data_iterator: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """The client's batches as the dicts Megatron's data iterators yield, with packing metadata."""
    for batch in data_iterator:
        yield {
            "tokens": batch.get("tokens"),
            "labels": batch.get("labels"),
            "loss_mask": batch.get("loss_mask"),
            "attention_mask": None,
            "position_ids": batch.get("position_ids"),
            "packed_seq_params": packed_seq_params(batch),
        }
