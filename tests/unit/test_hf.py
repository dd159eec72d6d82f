"""trainer_client.hf's batches against TRL's own padding-free collator, and the loss per token it
reports against the model's own loss (a tiny Llama made from a config, no download)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer_client.hf import IGNORE_INDEX, _per_token_loss, hf_batch

PAD = 0


def _msd_batch(rows: list[list[tuple[list[int], list[int]]]], row_len: int) -> dict[str, torch.Tensor]:
    """A micro-batch as DataClient lays one out: per row its pieces (tokens, trained flags: token j
    trained as the prediction of position j - 1), then padding. loss_mask[i] is token i+1's flag
    within the piece; labels[i] the next token of the piece."""
    tokens = np.full((len(rows), row_len), PAD, np.int64)
    labels = np.full_like(tokens, PAD)
    mask = np.zeros(tokens.shape, np.float32)
    positions = np.zeros_like(tokens)
    cu = [0]
    for r, pieces in enumerate(rows):
        at = 0
        for piece, trained in pieces:
            n = len(piece)
            tokens[r, at:at + n] = piece
            labels[r, at:at + n - 1] = piece[1:]
            mask[r, at:at + n - 1] = trained[1:]
            positions[r, at:at + n] = np.arange(n)
            at += n
            cu.append(r * row_len + at)
        if at < row_len:
            cu.append((r + 1) * row_len)
    return {"tokens": torch.from_numpy(tokens), "labels": torch.from_numpy(labels),
            "loss_mask": torch.from_numpy(mask), "position_ids": torch.from_numpy(positions),
            "cu_seqlens": torch.tensor(cu, dtype=torch.int32)}


PIECES = [([5, 6, 7, 8, 9], [0, 0, 1, 1, 1]), ([10, 11, 12], [1, 1, 1]), ([13, 14, 15, 16, 17, 18, 19, 20], [0, 1] * 4)]


def test_a_micro_batch_is_what_trls_padding_free_collator_makes_of_its_documents():
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    batch = hf_batch(_msd_batch([PIECES[:2], PIECES[2:]], row_len=8))  # two full rows, no padding
    examples = [{"input_ids": p, "labels": [t if f else IGNORE_INDEX for t, f in zip(p, trained)]}
                for p, trained in PIECES]
    trl = DataCollatorForLanguageModeling(pad_token_id=PAD, padding_free=True)(examples)
    for key in ("input_ids", "labels", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "seq_idx"):
        assert torch.equal(batch[key].to(trl[key].dtype), trl[key]), key
    assert batch["max_length_q"] == batch["max_length_k"] == trl["max_length_q"] == 8
    assert batch["use_cache"] is False


def test_row_padding_and_piece_starts_are_never_trained():
    batch = hf_batch(_msd_batch([[PIECES[1]], [PIECES[0]]], row_len=6))
    labels = batch["labels"][0]
    assert labels.tolist() == [-100, 11, 12, -100, -100, -100, -100, -100, 7, 8, 9, -100]
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 6, 11, 12]  # pieces and each row's padding
    with pytest.raises(ValueError, match="pixel_values"):
        hf_batch({**_msd_batch([[PIECES[1]]], row_len=4), "pixel_values": torch.zeros(1)})


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).train()


def test_documents_packed_in_a_row_do_not_see_each_other():
    model = _tiny_llama()
    batch = hf_batch(_msd_batch([PIECES[:2], PIECES[2:]], row_len=8))
    packed = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[0]
    alone = torch.cat([model(input_ids=torch.tensor([p])).logits[0] for p, _ in PIECES])
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)
    # without use_cache=False a model in training builds a cache, and the mask ignores the packing
    leaky = model(**{k: v for k, v in batch.items() if k not in ("labels", "use_cache")}).logits[0]
    assert (leaky - alone).abs().max() > 1e-3


def test_the_loss_per_token_is_the_models_own_loss_where_trained():
    model = _tiny_llama()
    msd = _msd_batch([PIECES[:2], [PIECES[2]]], row_len=9)
    batch = hf_batch(msd)
    out = model(**batch)
    per = _per_token_loss([out], batch["labels"]).reshape(msd["tokens"].shape)
    trained = msd["loss_mask"] > 0
    assert per[~trained].abs().max() == 0  # only where msd's loss_mask trains
    torch.testing.assert_close(per[trained].mean(), out.loss, rtol=1e-6, atol=1e-6)
    # TRL's fused head gives the log-probabilities of the next tokens, one position short
    fused = type("Fused", (), {"log_probs": -per.reshape(1, -1)[:, :-1]})()
    torch.testing.assert_close(_per_token_loss([fused], batch["labels"]).reshape(per.shape), per)


def test_the_loss_per_token_is_the_same_a_chunk_of_positions_at_a_time(monkeypatch):
    import trainer_client.hf as hf

    model = _tiny_llama()
    batch = hf_batch(_msd_batch([PIECES[:2], [PIECES[2]]], row_len=9))
    out = model(**batch)
    whole = _per_token_loss([out], batch["labels"])
    monkeypatch.setattr(hf, "LOSS_CHUNK", 5)
    torch.testing.assert_close(_per_token_loss([out], batch["labels"]), whole, rtol=0, atol=0)
