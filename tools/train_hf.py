"""A Hugging Face model fine-tuned by TRL's SFTTrainer (or transformers' Trainer) on an msd job:
a training script to copy. One process per data-parallel rank, started by torchrun:

    torchrun --nproc_per_node 2 tools/train_hf.py --coordinator tcp://127.0.0.1:5555 \\
        --out OUT --steps 20 --grad-accum 2 [--save-steps 5] [--resume OUT/checkpoint-5] [--trainer hf]

`--grad-accum` is the micro-batches the job gives a rank per step (batch.global_batch_size /
(dp x micro_batch_size)). The model here is a tiny Llama made from a config (`--vocab` ids), so
that the script runs on a CPU; give your own with `--model NAME_OR_PATH`. With `--record FILE`
each rank writes the place and documents of every micro-batch it trained on (JSON), for tests.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from trainer_client import DataClient  # noqa: E402


class RecordingClient(DataClient):
    """A DataClient that notes each micro-batch's step, place and documents (for --record)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.taken: list[dict] = []

    def __next__(self):
        batch = super().__next__()
        self.taken.append({"step": batch["step"], "micro_batch": batch["micro_batch"],
                           **{k: batch[k].tolist() for k in ("doc_keys", "doc_offsets", "piece_lengths")}})
        return batch


def tiny_llama(vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # the same weights on every rank
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096)
    return LlamaForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--out", required=True, help="the Trainer's output_dir (its checkpoints)")
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps (msd steps)")
    parser.add_argument("--grad-accum", type=int, required=True, help="micro-batches per step and rank")
    parser.add_argument("--save-steps", type=int, default=0)
    parser.add_argument("--resume", default=None, help="a checkpoint folder, or 'last'")
    parser.add_argument("--trainer", choices=("sft", "hf"), default="sft")
    parser.add_argument("--model", default=None, help="a model name or path (default: a tiny Llama)")
    parser.add_argument("--tokenizer", default=None, help="the job's tokenizer directory (SFTTrainer wants one)")
    parser.add_argument("--vocab", type=int, default=512, help="the tiny Llama's vocabulary size, at least")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--record", default=None, help="this rank's micro-batches, as JSON ({rank} in the name)")
    args = parser.parse_args()

    rank = int(os.environ.get("RANK", "0"))
    client = RecordingClient(args.coordinator, rank=rank, timeout_s=120)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model) if args.tokenizer or args.model else None
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model)
    else:
        model = tiny_llama(max(args.vocab, len(tokenizer) if tokenizer is not None else 0))
    common = dict(output_dir=args.out, max_steps=args.steps, gradient_accumulation_steps=args.grad_accum,
                  per_device_train_batch_size=1, learning_rate=args.lr, logging_steps=1, report_to=[],
                  save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
                  use_cpu=not torch.cuda.is_available(), ddp_backend="gloo" if not torch.cuda.is_available() else None,
                  seed=0, disable_tqdm=True)
    if args.trainer == "sft":
        from trl import SFTConfig

        from trainer_client.hf import MsdSFTTrainer

        trainer = MsdSFTTrainer(model=model, args=SFTConfig(**common),
                                processing_class=tokenizer, data_client=client)
    else:
        from transformers import TrainingArguments

        from trainer_client.hf import MsdTrainer

        trainer = MsdTrainer(model=model, args=TrainingArguments(**common), processing_class=tokenizer,
                             data_client=client)
    resume = True if args.resume == "last" else args.resume
    trainer.train(resume_from_checkpoint=resume)
    if args.record:
        with open(args.record.format(rank=rank), "w") as f:
            json.dump({"rank": rank, "taken": client.taken, "log": trainer.state.log_history}, f)
    client.close()


if __name__ == "__main__":
    main()
