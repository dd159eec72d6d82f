"""The trainer's training loss per source, summed per step for the step's `consumed`
(`DataClient.report_loss`; the coordinator's mixture.adapt turns them into weights).

A micro-batch's pieces name their documents (`doc_keys`, whose high bits are the source) and lie
in its rows in `doc_keys` order (`pieces_per_row`, `piece_lengths`): each piece's span of a
per-token loss is summed where `loss_mask` is set. A step's sums go with the `consumed` of the step
after it, when every micro-batch of the step has been trained on (its last one's loss is reported
after the next step's first `next()`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from msd_common.doc_keys import split_doc_key


def _numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor, on any device
        value = value.detach().float().cpu().numpy()
    return np.asarray(value)


class LossSums:
    def __init__(self) -> None:
        self.by_step: dict[int, dict[int, list[float]]] = {}  # step -> source -> [loss sum, tokens]
        # (step, micro-batch) -> its layout, for the micro-batches of this step and the one before: a
        # trainer that takes a step's micro-batches before computing any (the Hugging Face Trainer's
        # gradient accumulation) reports each one's loss after the next has been taken
        self.layouts: dict[tuple[int, int], dict[str, Any]] = {}
        self.last: tuple[int, int] | None = None  # the micro-batch handed last

    def handed(self, step: int, batch: dict[str, Any], micro_batch: int = 0) -> None:
        """next() returned this micro-batch: what report_loss will need of it."""
        for old in [at for at in self.layouts if at[0] < step - 1]:
            del self.layouts[old]
        self.last = (step, micro_batch)
        self.layouts[self.last] = {k: batch[k] for k in ("doc_keys", "pieces_per_row", "piece_lengths", "loss_mask")
                                   if k in batch}

    def add(self, loss: Any, at: tuple[int, int] | None = None) -> None:
        """The loss of micro-batch `at` (step, micro-batch), by default the one handed last."""
        if self.last is None:
            raise RuntimeError("report_loss: no micro-batch was taken yet (call it after next())")
        at = self.last if at is None else (int(at[0]), int(at[1]))
        if at not in self.layouts:
            raise ValueError(f"report_loss: micro-batch {at[1]} of step {at[0]} is not among those taken in this "
                             f"step or the one before (the last taken: step {self.last[0]}, micro-batch "
                             f"{self.last[1]})")
        step, batch = at[0], self.layouts[at]
        keys = _numpy(batch["doc_keys"]).astype(np.uint64)
        sources = split_doc_key(keys)[0].astype(np.int64)
        lengths = _numpy(batch["piece_lengths"]).astype(np.int64)
        mask = _numpy(batch["loss_mask"])
        loss = _numpy(loss).astype(np.float64)
        counts = _numpy(batch["pieces_per_row"]).astype(np.int64)
        rows = np.repeat(np.arange(len(counts)), counts)
        firsts = np.cumsum(counts) - counts  # each row's first piece
        ends = np.cumsum(lengths) - np.repeat(np.cumsum(lengths)[firsts - 1] * (firsts > 0), counts)
        trained = mask.reshape(mask.shape[0], -1) > 0
        cum_tok = np.concatenate([np.zeros((len(trained), 1), np.int64), np.cumsum(trained, axis=1)], axis=1)
        tokens = cum_tok[rows, ends] - cum_tok[rows, ends - lengths]
        if loss.shape == mask.shape:  # per token
            flat = np.where(trained, loss.reshape(trained.shape), 0.0)
            cum = np.concatenate([np.zeros((len(flat), 1)), np.cumsum(flat, axis=1)], axis=1)
            sums = cum[rows, ends] - cum[rows, ends - lengths]
        elif loss.shape == (len(lengths),):  # one mean per sample: weighted by its trained tokens
            sums = loss * tokens
        else:
            raise ValueError(f"report_loss: expected a loss per token {tuple(mask.shape)} (as the batch's tokens) "
                             f"or one per sample ({len(lengths)},), got {tuple(loss.shape)}")
        if not np.isfinite(sums).all():
            raise ValueError("report_loss: the loss holds NaN or infinite values")
        mine = self.by_step.setdefault(step, {})
        for s, x, n in zip(sources.tolist(), sums.tolist(), tokens.tolist()):
            entry = mine.setdefault(s, [0.0, 0])
            entry[0] += x
            entry[1] += int(n)

    def report(self, step: int) -> list:
        """[step, sources, loss sums, tokens] of `step` for its `consumed` ([-1, [], [], []] without),
        and older steps let go."""
        for old in [s for s in self.by_step if s < step]:
            del self.by_step[old]
        mine = self.by_step.pop(step, None)
        if not mine:
            return [-1, [], [], []]
        sources = sorted(mine)
        return [step, sources, [float(mine[s][0]) for s in sources], [int(mine[s][1]) for s in sources]]
