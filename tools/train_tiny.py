"""A small causal transformer trained with DistributedDataParallel from DataClient: a training
script to copy.

    python tools/train_tiny.py --coordinator tcp://127.0.0.1:5555 --steps 20 [--world-size 2]
        [--save CKPT_DIR] [--resume CKPT_DIR] [--losses LOSSES.json]
        [--eval-every N --eval-set heldout [--eval-losses EVAL.json]] [--report-loss]

Each data-parallel rank is a process (gloo on CPU here; NCCL on GPUs is the same code with
`--backend nccl` and a device per rank). What it shows:
- document masking: attention stays within each packed document, built from `cu_seqlens`;
- `position_ids` from the batch (they restart at 0 with each document piece);
- the loss weighted by `loss_mask` (no loss on padding or across document ends);
- gradient accumulation over the step's micro-batches (`client.micro_batches_per_step`), with
  DDP's gradient all-reduce only on the last one (`no_sync`);
- checkpoints that hold the model, the optimizer and the client's state (one file per rank), so
  that a resumed run continues bit for bit (the per-step losses equal an uninterrupted run's);
- evaluation every N steps on an eval set of the job file (`client.eval_batches`), loss per
  source (`trainer_client.eval.loss_by_source`), reported to the coordinator (`report_eval`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

VOCAB = 258  # the byte tokenizer: 256 bytes, end-of-document 256, padding 257 (--vocab for another)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.out(attn.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, dim: int = 64, layers: int = 2, heads: int = 4, max_len: int = 4096, vocab: int = VOCAB) -> None:
        super().__init__()
        self.vocab = vocab
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(position_ids)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)


def document_mask(cu_seqlens: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """[batch, 1, length, length] bool: token i may attend to token j when both lie in the same
    segment of `cu_seqlens` (a document piece, or a row's padding) and j <= i."""
    segments = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1), torch.diff(cu_seqlens.long()))
    segments = segments.view(batch, length)
    same = segments[:, :, None] == segments[:, None, :]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    return (same & causal)[:, None]


def micro_batch_loss(model: nn.Module, batch: dict, client=None) -> torch.Tensor:
    """The micro-batch's mean loss over `loss_mask`; with `client`, its loss per token is reported
    first (client.report_loss: per source, for the job's mixture.adapt)."""
    tokens = batch["tokens"]
    b, n = tokens.shape
    logits = model(tokens, batch["position_ids"], document_mask(batch["cu_seqlens"], b, n))
    per_token = F.cross_entropy(logits.view(-1, logits.shape[-1]), batch["labels"].view(-1), reduction="none")
    if client is not None:
        client.report_loss(per_token.detach().view(b, n))
    mask = batch["loss_mask"].view(-1)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def evaluate(model: nn.Module, client, name: str, world_size: int) -> dict[str, float]:
    """One pass over eval set `name` (every rank its share): mean loss per source over all ranks."""
    from trainer_client.eval import add, loss_by_source

    sources = client.batch_info["sources"]
    total: dict = {}
    model.eval()
    with torch.no_grad():
        for batch in client.eval_batches(name):
            tokens = batch["tokens"]
            b, n = tokens.shape
            logits = model(tokens, batch["position_ids"], document_mask(batch["cu_seqlens"], b, n))
            per_token = F.cross_entropy(logits.view(-1, logits.shape[-1]), batch["labels"].view(-1), reduction="none")
            total = add(total, loss_by_source(batch, per_token, sources))
    model.train()
    sums = torch.tensor([[total.get(s, (0.0, 0))[0], total.get(s, (0.0, 0))[1]] for s in sources], dtype=torch.float64)
    dist.all_reduce(sums)  # every rank holds a share of the set: sums and counts add up
    return {s: float(sums[i, 0] / sums[i, 1]) for i, s in enumerate(sources) if sums[i, 1] > 0}


def train(rank: int, args: argparse.Namespace) -> None:
    from trainer_client import DataClient

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    dist.init_process_group(args.backend, rank=rank, world_size=args.world_size)
    torch.manual_seed(args.seed)  # the same initial model on every rank (DDP also broadcasts it)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    model = nn.parallel.DistributedDataParallel(TinyLM(dim=args.dim, vocab=args.vocab))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    client = DataClient(args.coordinator, rank=rank, timeout_s=120)
    start = 0
    if args.resume:
        ckpt = torch.load(os.path.join(args.resume, f"rank{rank}.pt"), weights_only=False)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        client.load_state_dict(ckpt["data"])
        start = ckpt["step"]
    accumulate = client.micro_batches_per_step  # known before the first batch
    reporter = client if args.report_loss else None
    losses, evals = [], []
    for step in range(start, args.steps):
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for m in range(accumulate):
            batch = next(client)
            assert batch["step"] == step and batch["micro_batch"] == m
            if m < accumulate - 1:
                with model.no_sync():  # gradients all-reduced once, with the last micro-batch
                    loss = micro_batch_loss(model, batch, reporter) / accumulate
                    loss.backward()
            else:
                loss = micro_batch_loss(model, batch, reporter) / accumulate
                loss.backward()
            total += loss.detach()
        optimizer.step()
        dist.all_reduce(total)
        losses.append((step, (total / args.world_size).item()))
        if rank == 0:
            print(f"step {step}: loss {losses[-1][1]:.4f}", flush=True)
        if args.eval_every and (step + 1) % args.eval_every == 0:
            for _ in range(args.eval_repeat):  # the same weights: the same loss each time
                by_source = evaluate(model.module, client, args.eval_set, args.world_size)
                evals.append((step, by_source))
                if rank == 0:
                    client.report_eval(args.eval_set, step, by_source)
                    print(f"step {step}: eval {args.eval_set}: " +
                          ", ".join(f"{k} {v:.4f}" for k, v in sorted(by_source.items())), flush=True)
    if args.save:
        os.makedirs(args.save, exist_ok=True)
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "data": client.state_dict(), "step": args.steps}, os.path.join(args.save, f"rank{rank}.pt"))
    client.close()
    if rank == 0 and args.losses:
        with open(args.losses, "w") as f:
            json.dump(losses, f)
    if rank == 0 and args.eval_losses:
        with open(args.eval_losses, "w") as f:
            json.dump(evals, f)
    # Both ranks reach the end before the group goes, and DDP's reducer (which holds the group's
    # work) goes before the group: one CI run had rank 0 abort in teardown ("terminate called
    # without an active exception") while rank 1 was still leaving.
    dist.barrier()
    del model, optimizer
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--steps", type=int, required=True, help="train until this step (from the checkpoint's, if any)")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--port", type=int, default=29512)
    ap.add_argument("--save", default=None, help="directory for the checkpoint written at the end")
    ap.add_argument("--resume", default=None, help="directory of a checkpoint to resume from")
    ap.add_argument("--losses", default=None, help="write [[step, loss], ...] here (JSON)")
    ap.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary size (the job's tokenizer's)")
    ap.add_argument("--eval-every", type=int, default=0, help="evaluate on --eval-set every N steps (0: never)")
    ap.add_argument("--eval-set", default="heldout", help="the job's eval set to evaluate on")
    ap.add_argument("--eval-repeat", type=int, default=1, help="passes per evaluation (the same weights each)")
    ap.add_argument("--eval-losses", default=None, help="write [[step, {source: loss}], ...] here (JSON)")
    ap.add_argument("--report-loss", action="store_true", help="report each micro-batch's loss per token "
                    "(client.report_loss), for a job with mixture.adapt")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0, help="the model's initial weights")
    args = ap.parse_args()
    torch.multiprocessing.spawn(train, args=(args,), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
