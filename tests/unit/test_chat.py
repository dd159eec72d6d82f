"""Chat rendering (worker/chat.py) against transformers' own apply_chat_template, token for token
and mask for mask, on real templates shipped in the TRL wheel (with generation tags, and the
plain twins without them), with a real tokenizer made here."""

import os
import random

import numpy as np
import pytest

from msd.testing.chat_data import conversation, write_tokenizer_dir
from worker.chat import ChatError, ChatTemplate

trl = pytest.importorskip("trl")  # a test dependency (pyproject [test]); CI installs it
TEMPLATES = os.path.join(os.path.dirname(trl.__file__), "chat_templates")


def _pair(tmp_path, name, template):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    path = write_tokenizer_dir(str(tmp_path / name), template=template)
    return ChatTemplate(path, Tokenizer.from_file(os.path.join(path,
                                                               "tokenizer.json"))), AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("name", ["llama3_training.jinja", "qwen3_training.jinja", "phi3_training.jinja"])
def test_tagged_templates_match_transformers(tmp_path, name):
    with open(os.path.join(TEMPLATES, name)) as f:
        template = f.read()
    ours, hf = _pair(tmp_path, name, template)
    assert ours.tagged
    rng = random.Random(0)
    for _ in range(30):
        messages = conversation(rng)
        got = ours.render(messages)
        ref = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert got.tokens.tolist() == list(ref["input_ids"])
        assert got.loss_mask.tolist() == list(ref["assistant_masks"])
        assert got.loss_mask.any()


def test_a_plain_template_finds_each_assistant_message_by_rendering_prefixes(tmp_path):
    """llama3.jinja has no generation tags: its masks equal what transformers marks with the tagged twin."""
    with open(os.path.join(TEMPLATES, "llama3.jinja")) as f:
        plain = f.read()
    with open(os.path.join(TEMPLATES, "llama3_training.jinja")) as f:
        tagged = f.read()
    ours, hf = _pair(tmp_path, "llama3", plain)
    assert not ours.tagged
    rng = random.Random(1)
    for _ in range(30):
        messages = conversation(rng)
        got = ours.render(messages)
        ref = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                     chat_template=tagged)
        assert got.tokens.tolist() == list(ref["input_ids"])
        assert got.loss_mask.tolist() == list(ref["assistant_masks"])  # never all zeros


def test_train_on_last_and_all(tmp_path):
    with open(os.path.join(TEMPLATES, "llama3_training.jinja")) as f:
        ours, _ = _pair(tmp_path, "llama3", f.read())
    messages = conversation(random.Random(2), turns=3)
    every = ours.render(messages).loss_mask
    ours.train_on = "last"
    last = ours.render(messages).loss_mask
    assert 0 < last.sum() < every.sum() and not (last & ~every).any()
    on = np.flatnonzero(last)
    assert (np.diff(on) == 1).all()  # the last message's tokens: one run
    ours.train_on = "all"
    assert ours.render(messages).loss_mask.all()


def test_a_template_that_rewrites_earlier_messages_is_refused_not_given_a_zero_mask(tmp_path):
    """qwen3.jinja drops earlier thinking once later turns exist: without tags no prefix holds."""
    template = ("{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}<|im_start|>assistant\\n"
                "(earlier)<|im_end|>{% else %}<|im_start|>{{ m.role }}\\n{{ m.content }}<|im_end|>{% endif %}"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\\n{% endif %}")
    ours, _ = _pair(tmp_path, "rewrites", template)
    with pytest.raises(ChatError, match="generation"):
        ours.render(conversation(random.Random(3), turns=2))


def test_bad_conversations_are_named(tmp_path):
    ours, _ = _pair(tmp_path, "bad", open(os.path.join(TEMPLATES, "llama3_training.jinja")).read())
    with pytest.raises(ChatError, match="non-empty list"):
        ours.render("hello")
    with pytest.raises(ChatError, match=r"messages\[1\]"):
        ours.render([{"role": "user", "content": "a"}, {"content": "b"}])


def test_the_sandbox_refuses_what_templates_must_not_do(tmp_path):
    ours, _ = _pair(tmp_path, "evil", "{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatError):
        ours.render([{"role": "user", "content": "x"}])


def test_a_named_template_file_replaces_the_tokenizers(tmp_path):
    """chat.template: the tokenizer carries the plain llama3 template, the job names the tagged
    twin; the job check reads and hashes it, and the samples are transformers' with that template."""
    from msd_common.spec import parse_job
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    with open(os.path.join(TEMPLATES, "llama3.jinja")) as f:
        plain = f.read()
    path = write_tokenizer_dir(str(tmp_path / "tok"), template=plain)
    tagged = os.path.join(TEMPLATES, "llama3_training.jinja")
    data = tmp_path / "c.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    raw = {"seed": 1, "sources": {"chat": {"format": "jsonl", "paths": [str(data)], "tokenizer": path,
                                           "chat": {"template": tagged}}},
           "batch": {"seq_len": 256, "micro_batch_size": 1, "global_batch_size": 1}, "topology": {"dp": 1},
           "mixture": {"weights": {"chat": 1.0}}}
    (source,) = parse_job(raw, str(tmp_path / "job.yaml")).sources
    assert source.chat["template"] == tagged
    ours = ChatTemplate(path, Tokenizer.from_file(os.path.join(path, "tokenizer.json")), "assistant",
                        source.chat["template"])
    assert ours.tagged and ours.origin == tagged
    hf = AutoTokenizer.from_pretrained(path)
    rng = random.Random(2)
    for _ in range(10):
        messages = conversation(rng)
        ref = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                     chat_template=open(tagged).read())
        got = ours.render(messages)
        assert got.tokens.tolist() == list(ref["input_ids"]) and got.loss_mask.tolist() == list(ref["assistant_masks"])
