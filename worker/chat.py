"""Chat data: a record's messages rendered with the model's chat template, tokenized, and the
mask of the tokens to train on. Needs jinja2 and `tokenizers`, not transformers.

The template is rendered as Hugging Face renders it (`apply_chat_template`): jinja2's
`ImmutableSandboxedEnvironment` with `trim_blocks`, `lstrip_blocks` and loop controls,
`raise_exception`, `tojson` as `json.dumps(ensure_ascii=False)`, and the tokenizer's special
tokens in the context. The rendered text is tokenized without special tokens added.

Which tokens are trained on (`train_on`):
- `assistant`: with `{% generation %}` tags in the template, every token overlapping a tagged
  span (as transformers' `return_assistant_tokens_mask` marks them); without them, each
  assistant message's own text, found by rendering growing prefixes of the conversation:
  message i's text is what `messages[:i+1]` renders beyond `messages[:i]` with the generation
  prompt. A template that renders earlier messages differently once later ones exist gives no
  such prefixes: the record is refused with that reason, never given an all-zero mask.
- `last`: the same, for the last assistant message only.
- `all`: every token.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from msd_common.usercode import TEMPLATE_FILE, TRAIN_ON, ChatError, environment, find_template  # noqa: F401 - their old home


def special_tokens(tokenizer_path: str) -> dict[str, Any]:
    """The special tokens tokenizer_config.json names (bos_token, eos_token, ...), as the template
    context holds them in transformers (`special_tokens_map`)."""
    base = tokenizer_path if os.path.isdir(tokenizer_path) else os.path.dirname(tokenizer_path)
    config = os.path.join(base, "tokenizer_config.json")
    if not os.path.isfile(config):
        return {}
    with open(config, "rb") as f:
        raw = orjson.loads(f.read())
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key.endswith("_token") and key != "chat_template":
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                out[key] = value
    extra = raw.get("additional_special_tokens")
    if isinstance(extra, list):
        out["additional_special_tokens"] = [t.get("content") if isinstance(t, dict) else t for t in extra]
    return out


@dataclass(frozen=True)
class Rendered:
    tokens: np.ndarray
    loss_mask: np.ndarray  # uint8, 1 where the token is trained on


class ChatTemplate:
    """A tokenizer directory's chat template, ready to render conversations into (tokens, mask)."""

    def __init__(self, tokenizer_path: str, hf_tokenizer: Any, train_on: str = "assistant",
                 template_path: str | None = None) -> None:
        if train_on not in TRAIN_ON:
            raise ChatError(f"train_on: expected one of {', '.join(TRAIN_ON)}, got {train_on!r}")
        self.source_text, self.origin = find_template(template_path or tokenizer_path)
        self.env = environment()
        try:
            self.template = self.env.from_string(self.source_text)
        except Exception as e:  # jinja2's TemplateSyntaxError, named with where the template came from
            raise ChatError(f"{self.origin}: the chat template does not compile ({e})") from None
        self.context = special_tokens(tokenizer_path)
        self.tokenizer = hf_tokenizer  # a `tokenizers.Tokenizer`
        self.train_on = train_on
        self.tagged = "generation" in self.source_text and "endgeneration" in self.source_text

    def render_text(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
                    spans: list | None = None, **extra: Any) -> str:
        """The template's text for these messages; `spans` collects the generation tags' spans."""
        context = {**self.context, **extra, "messages": messages, "add_generation_prompt": add_generation_prompt}
        if spans is None:
            return self.template.render(context)
        blocks: list[str] = []
        token = self.env.generation_spans.set((blocks, spans))
        try:
            for block in self.template.generate(context):
                blocks.append(block)
        finally:
            self.env.generation_spans.reset(token)
        return "".join(blocks)

    def render(self, messages: Any, tools: Any = None) -> Rendered:
        """Tokens and training mask of one conversation. Raises ChatError naming what is wrong."""
        messages = _check_messages(messages)
        extra = {"tools": tools} if tools is not None else {}
        spans: list[tuple[int, int]] = []
        try:
            text = self.render_text(messages, spans=spans, **extra)
        except ChatError:
            raise
        except Exception as e:  # the template's own raise_exception, or a bad value it met
            raise ChatError(f"the chat template failed: {type(e).__name__}: {e}") from None
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        tokens = np.asarray(encoding.ids, dtype=np.int32)
        if self.train_on == "all":
            return Rendered(tokens, np.ones(len(tokens), np.uint8))
        assistant = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        if not assistant:
            return Rendered(tokens, np.zeros(len(tokens), np.uint8))
        if self.tagged:
            if not spans:  # tags that mark nothing would train on nothing, silently
                raise ChatError(f"the template's generation tags marked nothing in {len(assistant)} assistant "
                                "message(s)")
            if self.train_on == "last":  # the spans from where the last assistant message starts
                try:
                    start = len(self.render_text(messages[:assistant[-1]], add_generation_prompt=True, **extra))
                except Exception:  # noqa: BLE001 - a template that cannot render a prefix: its last span
                    start = spans[-1][0]
                spans = [sp for sp in spans if sp[0] >= start] or spans[-1:]
        else:
            spans = self._message_spans(messages, assistant, text, extra)
            if self.train_on == "last":
                spans = spans[-1:]
        offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
        return Rendered(tokens, _overlap_mask(offsets, spans))

    def _message_spans(self, messages: list[dict], assistant: list[int], text: str,
                       extra: dict[str, Any]) -> list[tuple[int, int]]:
        """Each assistant message's own characters in `text`, by rendering growing prefixes."""
        spans = []
        for i in assistant:
            try:
                before = self.render_text(messages[:i], add_generation_prompt=True, **extra)
                upto = self.render_text(messages[:i + 1], **extra)
            except Exception as e:
                raise ChatError(f"the chat template failed on the first {i + 1} messages: {e}") from None
            if not upto.startswith(before) or not text.startswith(upto):
                raise ChatError(f"the template renders message {i} differently once later messages follow, so its "
                                "tokens cannot be found; use a template with {% generation %} tags")
            spans.append((len(before), len(upto)))
        return spans


def _overlap_mask(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for every token whose characters overlap a span (transformers' rule)."""
    mask = np.zeros(len(offsets), np.uint8)
    for lo, hi in spans:
        if hi > lo:
            mask |= ((offsets[:, 1] > lo) & (offsets[:, 0] < hi)).astype(np.uint8)
    return mask


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise ChatError(f"messages: expected a non-empty list of messages, got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ChatError(f"messages[{i}]: expected a mapping with a string 'role'")
        out.append({k: v for k, v in m.items() if v is not None})  # as transformers normalises them
    return out
