"""Feeding a Megatron-style training loop from megascale-data.

Start a job first, e.g. `msd coordinator --config JOB.yaml` and `msd worker --coordinator ...`,
then run this once per data-parallel rank:

    python tools/megatron_example.py --coordinator tcp://127.0.0.1:5555 --rank 0 --steps 10

In Megatron-LM, pass the DataClient as the `data_iterator` of `train_step` and replace the body of
`get_batch` in pretrain_gpt.py with `trainer_client.megatron.get_batch` (and build
`PackedSeqParams(**packed_seq_params(batch))` for document-masked THD attention).
"""

from __future__ import annotations

import argparse

from trainer_client import DataClient
from trainer_client.megatron import batches


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--coordinator", default="tcp://127.0.0.1:5555")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    client = DataClient(args.coordinator, rank=args.rank)
    try:
        for i, batch in enumerate(batches(client)):
            tokens, labels, loss_mask = batch["tokens"], batch["labels"], batch["loss_mask"]
            psp = batch["packed_seq_params"]
            print(f"micro-batch {i}: tokens and labels {tuple(tokens.shape)}/{tuple(labels.shape)}, "
                  f"{int(loss_mask.sum())} loss tokens, "
                  f"{len(psp['cu_seqlens_q']) - 1} segments, longest {psp['max_seqlen_q']}")
            if client.next_step >= args.steps:
                break
        print("checkpoint state:", client.state_dict())
    finally:
        client.close()


if __name__ == "__main__":
    main()
