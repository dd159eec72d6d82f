"""A transform of the user's own, for configs/sft.yaml: build a prompt from a note's fields, train
on the answer only, crop long notes at a random place, drop the French ones. Workers import it
from their Python path (PYTHONPATH=configs, or an installed package)."""

import numpy as np

from worker.transforms import Sample, Skip


def note_to_sample(record, ctx, max_body_tokens=64, skip_lang="fr"):
    if record.get("lang") == skip_lang:
        raise Skip(f"language {skip_lang}")
    prompt = ctx.tokenizer.encode(f"Title: {record['title']}\nSummary:")[:-1]  # without its end-of-document id
    body = ctx.tokenizer.encode(" " + record["body"])
    if len(body) > max_body_tokens:  # a random window: the same one for this record and epoch on any worker
        start = int(ctx.rng.integers(0, len(body) - max_body_tokens + 1))
        body = body[start:start + max_body_tokens]
    tokens = np.concatenate([prompt, body])
    loss_mask = np.concatenate([np.zeros(len(prompt), np.uint8), np.ones(len(body), np.uint8)])
    return Sample(tokens, loss_mask)
