"""Tokenizers: the built-in byte tokenizer and HF `tokenizers` files. Every tokenized document
ends with the end-of-document id."""

from __future__ import annotations

import numpy as np

BYTE_EOD_ID = 256
BYTE_PAD_ID = 257
# Special tokens tried, in order, when a HF tokenizer's eod_id is not given in the job file.
_EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]")


class ByteTokenizer:
    """ids 0-255 are the UTF-8 bytes, 256 is end-of-document, 257 is padding."""

    eod_id = BYTE_EOD_ID
    pad_id = BYTE_PAD_ID
    dtype = np.dtype("<u2")

    def encode(self, text: str) -> np.ndarray:
        data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        out = np.empty(len(data) + 1, dtype=self.dtype)
        out[:-1] = data
        out[-1] = self.eod_id
        return out


class HFTokenizer:
    """A HF `tokenizer.json`; uses its own special tokens for end-of-document and padding."""

    dtype = np.dtype("<i4")

    def __init__(self, path: str, eod_id: int | None = None, pad_id: int | None = None) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(path)
        self.eod_id = eod_id if eod_id is not None else find_eod_id(self._tok, path)
        self.pad_id = pad_id if pad_id is not None else self.eod_id

    def encode(self, text: str) -> np.ndarray:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        out = np.empty(len(ids) + 1, dtype=self.dtype)
        out[:-1] = ids
        out[-1] = self.eod_id
        return out


def find_eod_id(tok, path: str) -> int:
    for name in _EOD_CANDIDATES:
        tid = tok.token_to_id(name)
        if tid is not None:
            return int(tid)
    raise ValueError(f"{path}: no end-of-document token found ({', '.join(_EOD_CANDIDATES)}); set eod_id")


def make_tokenizer(name: str, eod_id: int | None = None, pad_id: int | None = None) -> ByteTokenizer | HFTokenizer:
    if name == "byte":
        return ByteTokenizer()
    return HFTokenizer(name, eod_id, pad_id)
