"""Run inside the torchtune venv (`make bench-packing-env`): sample lengths as JSON on stdin ->
torchtune's PackedDataset (split_across_pack=False, as for chat data) -> its figures as JSON.
Samples are tokens of id 1, so a pack's real tokens are its 1s (padding is padding_idx 0)."""

import json
import sys

from torchtune.datasets import PackedDataset


def main() -> None:
    args = json.load(sys.stdin)
    lengths, seq_len = args["lengths"], args["seq_len"]
    ds = [{"tokens": [1] * n, "labels": [1] * n} for n in lengths]
    packs = PackedDataset(ds, max_seq_len=seq_len, padding_idx=0, split_across_pack=False)
    real, samples = 0, 0
    for p in packs:
        n = int((p["tokens"] == 1).sum())
        real += n
        samples += len(p["seq_lens"]) - (n < seq_len)  # a padded pack's last entry is its padding
    print(json.dumps({"rows": len(packs), "padding_share": round(1 - real / (len(packs) * seq_len), 4),
                      "tokens": real, "samples_dropped": len(lengths) - samples}))


if __name__ == "__main__":
    main()
