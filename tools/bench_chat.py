"""Chat rendering and tokenizing in one process: msd's worker/chat.py against transformers'
apply_chat_template(tokenize=True, return_dict=True, return_assistant_tokens_mask=True) on the
same conversations and template (rounds alternated; medians of samples/s).

    python tools/bench_chat.py [--samples 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from msd.testing.chat_data import conversation, write_tokenizer_dir
    from worker.chat import ChatTemplate

    path = write_tokenizer_dir(tempfile.mkdtemp())
    ours = ChatTemplate(path, Tokenizer.from_file(os.path.join(path, "tokenizer.json")))
    hf = AutoTokenizer.from_pretrained(path)
    rng = random.Random(0)
    convs = [conversation(rng) for _ in range(args.samples)]
    rates: dict[str, list[float]] = {"msd": [], "transformers": []}
    for _ in range(args.rounds):
        t = time.perf_counter()
        for c in convs:
            ours.render(c)
        rates["msd"].append(len(convs) / (time.perf_counter() - t))
        t = time.perf_counter()
        for c in convs:
            hf.apply_chat_template(c, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        rates["transformers"].append(len(convs) / (time.perf_counter() - t))
    out = {k: {"samples_per_s_median": round(float(np.median(v)), 1), "spread": [round(min(v), 1), round(max(v), 1)]}
           for k, v in rates.items()}
    out["samples"] = args.samples
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
