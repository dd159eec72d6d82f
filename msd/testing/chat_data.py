"""Chat data for tests, examples and benchmarks, made here (no download): a real byte-level BPE
tokenizer directory with the special tokens of common chat templates and a template, and
OpenAI-style conversations of varied lengths."""

from __future__ import annotations

import os
import random
from typing import Any

import orjson

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
           "<|end_header_id|>", "<|eot_id|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]

WORDS = ("the loader plans every global batch from sample metadata and balances attention cost across ranks "
         "workers read and transform samples once and push them straight to the trainer ranks while the "
         "coordinator keeps mixing weights curricula and read cursors in one place for the whole run "
         "question answer explain why how what when which data model token sequence packing mask").split()

# A ChatML template with generation tags (Qwen-style, as TRL's training templates mark them).
CHATML_TRAINING = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_bpe(special: list[str], vocab_size: int, added: bool = False) -> Any:
    """A byte-level BPE tokenizer (tokenizers.Tokenizer) trained here on WORDS, with `special`
    tokens in its vocabulary (and, with `added`, as added special tokens: matched whole in text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [" ".join(random.Random(i).choices(WORDS, k=40)) for i in range(200)]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if added:
        tok.add_special_tokens(special)
    return tok


def write_tokenizer_dir(path: str, template: str | None = CHATML_TRAINING, vocab_size: int = 600,
                        template_file: bool = False) -> str:
    """A tokenizer directory (tokenizer.json, tokenizer_config.json with eos/bos and the chat
    template, or chat_template.jinja beside them when template_file) that transformers'
    AutoTokenizer loads too."""
    os.makedirs(path, exist_ok=True)
    train_bpe(SPECIAL, vocab_size).save(os.path.join(path, "tokenizer.json"))
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                              "bos_token": "<|begin_of_text|>", "pad_token": "<|endoftext|>",
                              "model_max_length": 1 << 20}
    if template is not None and not template_file:
        config["chat_template"] = template
    with open(os.path.join(path, "tokenizer_config.json"), "wb") as f:
        f.write(orjson.dumps(config, option=orjson.OPT_INDENT_2))
    if template is not None and template_file:
        with open(os.path.join(path, "chat_template.jinja"), "w", encoding="utf-8") as f:
            f.write(template)
    return path


def conversation(rng: random.Random, turns: int | None = None, words: tuple[int, int] = (3, 60),
                 system: bool | None = None) -> list[dict[str, str]]:
    """A conversation of user and assistant turns (sometimes a system message first)."""
    turns = turns or rng.randint(1, 4)
    out = []
    if system if system is not None else rng.random() < 0.3:
        out.append({"role": "system", "content": " ".join(rng.choices(WORDS, k=rng.randint(3, 12)))})
    for _ in range(turns):
        out.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(*words)))})
        out.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(*words)))})
    return out


def write_conversations(path: str, n: int, seed: int = 0, words: tuple[int, int] = (3, 60)) -> list[list[dict]]:
    """n conversations as JSONL lines {"messages": [...]}; returns them."""
    rng = random.Random(seed)
    convs = [conversation(rng, words=words) for _ in range(n)]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "wb") as f:
        for c in convs:
            f.write(orjson.dumps({"messages": c}) + b"\n")
    return convs
