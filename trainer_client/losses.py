"""The trainer's training loss per source, summed per step for the step's `consumed`
(`DataClient.report_loss`; the coordinator's mixture.adapt turns them into weights).

A micro-batch's pieces name their documents (`doc_keys`, whose high bits are the source) and lie
in its rows in `doc_keys` order (`pieces_per_row`, `piece_lengths`): each piece's span of a
per-token loss is summed where `loss_mask` is set. A step's sums go with the `consumed` of the step
after it, when every micro-batch of the step has been trained on (its last one's loss is reported
after the next step's first `next()`).

On the trainer's thread `report_loss` costs little: a micro-batch's layout is made once, and a
per-token loss on a GPU is summed per piece there (no copy to the host and no wait for the GPU
then); the few sums are read when the step's report goes, a step later."""

from __future__ import annotations

import logging
import math
from typing import Any, NamedTuple

import numpy as np

from msd_common.doc_keys import split_doc_key


log = logging.getLogger("msd.client")


def _numpy(value: Any) -> np.ndarray:
    """A batch's array (torch tensors on the CPU, as the client hands them), dtype kept: doc keys
    are 63-bit integers."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value)


class Layout(NamedTuple):
    """What summing a micro-batch's loss per piece needs, made once per micro-batch."""

    sources: list[int]  # each piece's source
    rows: np.ndarray  # each piece's row
    ends: np.ndarray  # each piece's end in its row
    lengths: np.ndarray
    trained: np.ndarray  # [rows, row length] bool: loss_mask set
    tokens: list[int]  # trained tokens per piece
    on_device: dict  # device -> (trained, rows, ends, starts) as torch tensors there


def _layout(batch: dict[str, Any]) -> Layout:
    keys = _numpy(batch["doc_keys"]).astype(np.uint64)
    lengths = _numpy(batch["piece_lengths"]).astype(np.int64)
    mask = _numpy(batch["loss_mask"])
    counts = _numpy(batch["pieces_per_row"]).astype(np.int64)
    rows = np.repeat(np.arange(len(counts)), counts)
    firsts = np.cumsum(counts) - counts  # each row's first piece
    ends = np.cumsum(lengths) - np.repeat(np.cumsum(lengths)[firsts - 1] * (firsts > 0), counts)
    trained = mask.reshape(mask.shape[0], -1) > 0
    cum_tok = np.concatenate([np.zeros((len(trained), 1), np.int64), np.cumsum(trained, axis=1)], axis=1)
    tokens = cum_tok[rows, ends] - cum_tok[rows, ends - lengths]
    return Layout(split_doc_key(keys)[0].astype(np.int64).tolist(), rows, ends, lengths, trained, tokens.tolist(), {})


def _piece_sums_torch(loss: Any, layout: Layout) -> Any:
    """Each piece's summed loss, computed where the loss is (a GPU's: no copy and no wait now;
    the few sums are read a step later, when the step's report goes)."""
    import torch

    device = loss.device
    if device not in layout.on_device:
        layout.on_device[device] = tuple(torch.as_tensor(a).to(device, non_blocking=True) for a in (
            layout.trained, layout.rows, layout.ends, layout.ends - layout.lengths))
    trained, rows, ends, starts = layout.on_device[device]
    flat = torch.where(trained, loss.detach().reshape(trained.shape).to(torch.float64), 0.0)
    cum = torch.nn.functional.pad(torch.cumsum(flat, dim=1), (1, 0))
    return cum[rows, ends] - cum[rows, starts]


class LossSums:
    def __init__(self) -> None:
        # step -> [(sources, their loss sums: a list, or a torch tensor read when the step is reported, tokens)]
        self.by_step: dict[int, list[tuple[list[int], Any, list[int]]]] = {}
        # (step, micro-batch) -> its arrays, then its Layout once a loss is reported for it; for the
        # micro-batches of this step and the one before: a trainer that takes a step's micro-batches
        # before computing any (the Hugging Face Trainer's gradient accumulation) reports each one's
        # loss after the next has been taken
        self.layouts: dict[tuple[int, int], Any] = {}
        self.last: tuple[int, int] | None = None  # the micro-batch handed last

    def handed(self, step: int, batch: dict[str, Any], micro_batch: int = 0) -> None:
        """next() returned this micro-batch: what report_loss will need of it (its layout is made
        only if a loss is reported for it)."""
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
        layout = self.layouts[at]
        if not isinstance(layout, Layout):
            layout = self.layouts[at] = _layout(layout)
        shape = tuple(getattr(loss, "shape", np.shape(loss)))
        if shape == layout.trained.shape:  # per token
            if hasattr(loss, "detach") and loss.device.type != "cpu":
                sums = _piece_sums_torch(loss, layout)
            else:  # (numpy: torch's CPU kernels cost more here, and may start threads)
                values = loss.detach().float().numpy() if hasattr(loss, "detach") else np.asarray(loss)
                sums = _piece_sums_numpy(values.astype(np.float64), layout)
        elif shape == (len(layout.lengths),):  # one mean per sample: weighted by its trained tokens
            values = loss.detach().float().cpu().numpy() if hasattr(loss, "detach") else np.asarray(loss)
            sums = (values.astype(np.float64) * np.asarray(layout.tokens)).tolist()
        else:
            raise ValueError(f"report_loss: expected a loss per token {layout.trained.shape} (as the batch's tokens) "
                             f"or one per sample ({len(layout.lengths)},), got {shape}")
        self.by_step.setdefault(at[0], []).append((layout.sources, sums, layout.tokens))

    def report(self, step: int) -> list:
        """[step, sources, loss sums, tokens] of `step` for its `consumed` ([-1, [], [], []] without),
        and older steps let go. A micro-batch whose loss holds NaN or infinite values is left out
        (logged): one bad loss never stops the report."""
        for old in [s for s in self.by_step if s < step]:
            del self.by_step[old]
        totals: dict[int, list] = {}
        for sources, sums, tokens in self.by_step.pop(step, ()):
            values = sums.tolist() if hasattr(sums, "tolist") else sums
            if not all(math.isfinite(x) for x in values):
                log.warning("report_loss: a micro-batch of step %d has NaN or infinite losses; left out", step)
                continue
            for source, x, n in zip(sources, values, tokens):
                entry = totals.setdefault(source, [0.0, 0])
                entry[0] += x
                entry[1] += n
        if not totals:
            return [-1, [], [], []]
        ordered = sorted(totals)
        return [step, ordered, [float(totals[s][0]) for s in ordered], [int(totals[s][1]) for s in ordered]]


def _piece_sums_numpy(loss: np.ndarray, layout: Layout) -> list[float]:
    flat = np.where(layout.trained, loss.reshape(layout.trained.shape), 0.0)
    cum = np.concatenate([np.zeros((len(flat), 1)), np.cumsum(flat, axis=1)], axis=1)
    return (cum[layout.rows, layout.ends] - cum[layout.rows, layout.ends - layout.lengths]).tolist()
