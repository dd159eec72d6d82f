"""Evaluation helpers for the trainer: per-source loss from an eval micro-batch."""

from __future__ import annotations

from typing import Any

import numpy as np

from msd_common.doc_keys import split_doc_key


def loss_by_source(batch: dict[str, Any], token_loss: Any, source_names: list[str] | None = None
                   ) -> dict[str, tuple[float, int]]:
    """Per source: (sum of the per-token losses where loss_mask is 1, tokens counted), from one
    micro-batch and its per-token losses (any array-like of the batch's [micro_batch_size,
    seq_len] shape: a torch tensor or numpy). Sums and counts add up across micro-batches and
    ranks (an all-reduce); `mean_losses` turns them into means. Sources are named by
    `source_names` (the client's `batch_info["sources"]`), or by index."""
    loss = np.asarray(token_loss.detach().float().cpu() if hasattr(token_loss, "detach") else token_loss,
                      dtype=np.float64).reshape(-1)
    mask = np.asarray(batch["loss_mask"].cpu() if hasattr(batch["loss_mask"], "cpu") else batch["loss_mask"],
                      dtype=np.float64).reshape(-1)
    lengths = np.asarray(batch["piece_lengths"].cpu() if hasattr(batch["piece_lengths"], "cpu")
                         else batch["piece_lengths"], dtype=np.int64)
    keys = np.asarray(batch["doc_keys"].cpu() if hasattr(batch["doc_keys"], "cpu") else batch["doc_keys"],
                      dtype=np.int64)
    counts = np.asarray(batch["pieces_per_row"].cpu() if hasattr(batch["pieces_per_row"], "cpu")
                        else batch["pieces_per_row"], dtype=np.int64)
    row_len = len(loss) // max(1, len(counts))
    # where each piece starts: its row's start, plus the pieces before it in the row
    row_of = np.repeat(np.arange(len(counts)), counts)
    ends = np.cumsum(lengths)
    row_first = np.cumsum(counts) - counts
    before_row = np.concatenate([[0], ends])[row_first]
    starts = row_of * row_len + (ends - lengths - np.repeat(before_row, counts))
    sources = split_doc_key(keys)[0] if len(keys) else keys
    source_of_token = np.full(len(loss), -1, np.int64)
    for st, n, s in zip(starts.tolist(), lengths.tolist(), sources.tolist()):
        source_of_token[st:st + n] = s
    out: dict[str, tuple[float, int]] = {}
    for s in np.unique(sources).tolist():
        on = (source_of_token == s) & (mask > 0)
        name = source_names[s] if source_names is not None and s < len(source_names) else str(s)
        out[name] = (float(loss[on].sum()), int(on.sum()))
    return out


def add(total: dict[str, tuple[float, int]], more: dict[str, tuple[float, int]]) -> dict[str, tuple[float, int]]:
    """Sums and counts of two loss_by_source results (or of a running total and one more)."""
    out = dict(total)
    for k, (s, n) in more.items():
        s0, n0 = out.get(k, (0.0, 0))
        out[k] = (s0 + s, n0 + n)
    return out


def mean_losses(total: dict[str, tuple[float, int]]) -> dict[str, float]:
    """Mean loss per source from (sum, count) totals (after an all-reduce over the data-parallel
    ranks), for `DataClient.report_eval`; sources with no token are left out."""
    return {k: s / n for k, (s, n) in total.items() if n > 0}
