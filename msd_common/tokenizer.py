"""Tokenizers: the built-in byte tokenizer and HF `tokenizers` files. Every tokenized document
ends with the end-of-document id."""

from __future__ import annotations

import os

import numpy as np
import orjson

BYTE_EOD_ID = 256
BYTE_PAD_ID = 257
# Special tokens tried, in order, when a HF tokenizer's eod_id is not given in the job file.
_EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]")


class ByteTokenizer:
    """ids 0-255 are the UTF-8 bytes, 256 is end-of-document, 257 is padding."""

    eod_id = BYTE_EOD_ID
    pad_id = BYTE_PAD_ID
    dtype = np.dtype("<u2")

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", "replace")

    def encode(self, text: str) -> np.ndarray:
        data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        out = np.empty(len(data) + 1, dtype=self.dtype)
        out[:-1] = data
        out[-1] = self.eod_id
        return out


def resolve(path: str) -> tuple[str, str | None]:
    """(the tokenizer.json to load, the eos_token its tokenizer_config.json names, if any). `path`
    is a tokenizer.json, or a directory holding one as Hugging Face model repositories ship it."""
    if not os.path.isdir(path):
        return path, None
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        raise ValueError(f"{path}: a directory without tokenizer.json")
    eos = None
    config = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(config):
        try:
            with open(config, "rb") as f:
                eos = orjson.loads(f.read()).get("eos_token")
        except (OSError, orjson.JSONDecodeError, AttributeError) as e:
            raise ValueError(f"{config}: unreadable ({e})") from None
        if isinstance(eos, dict):  # an AddedToken written out: {"content": "</s>", ...}
            eos = eos.get("content")
    return file, eos if isinstance(eos, str) else None


class HFTokenizer:
    """A HF `tokenizer.json` (or a directory holding one, with tokenizer_config.json); uses its
    own special tokens for end-of-document and padding."""

    dtype = np.dtype("<i4")

    def __init__(self, path: str, eod_id: int | None = None, pad_id: int | None = None) -> None:
        from tokenizers import Tokenizer

        file, eos = resolve(path)
        self.path = path  # a tokenizer.json, or the directory (with its tokenizer_config.json, chat template)
        self._tok = Tokenizer.from_file(file)
        self.eod_id = eod_id if eod_id is not None else find_eod_id(self._tok, path, eos)
        self.pad_id = pad_id if pad_id is not None else self.eod_id

    @property
    def raw(self):
        """The `tokenizers.Tokenizer` (chat rendering needs its offsets)."""
        return self._tok

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def encode(self, text: str) -> np.ndarray:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        out = np.empty(len(ids) + 1, dtype=self.dtype)
        out[:-1] = ids
        out[-1] = self.eod_id
        return out


def find_eod_id(tok, path: str, eos_token: str | None = None) -> int:
    """The end-of-document id: the eos_token of tokenizer_config.json if given, else the first of
    the usual special tokens the vocabulary has."""
    if eos_token is not None:
        tid = tok.token_to_id(eos_token)
        if tid is None:
            raise ValueError(f"{path}: tokenizer_config.json names eos_token {eos_token!r}, which the vocabulary lacks")
        return int(tid)
    for name in _EOD_CANDIDATES:
        tid = tok.token_to_id(name)
        if tid is not None:
            return int(tid)
    raise ValueError(f"{path}: no end-of-document token found ({', '.join(_EOD_CANDIDATES)}); set eod_id")


def make_tokenizer(name: str, eod_id: int | None = None, pad_id: int | None = None) -> ByteTokenizer | HFTokenizer:
    if name == "byte":
        return ByteTokenizer()
    return HFTokenizer(name, eod_id, pad_id)
