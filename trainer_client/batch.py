"""What a DataClient hands out: one micro-batch as a dict of arrays (numpy or torch) and plain values.

`Batch.to(device)` moves every tensor and leaves the rest (`step`, `micro_batch`, `num_tokens`,
`plan`), so the usual one-line move to the GPU works on it. The keys, their dtypes and shapes are
listed in README ("The batch").
"""

from __future__ import annotations

from typing import Any


class Batch(dict):
    def to(self, device: Any, non_blocking: bool = False) -> "Batch":
        """A new Batch with every tensor on `device` (torch's `Tensor.to`); other values as they are."""
        return Batch({k: v.to(device, non_blocking=non_blocking) if hasattr(v, "to") and hasattr(v, "device") else v
                      for k, v in self.items()})

    def pin_memory(self) -> "Batch":
        """A new Batch with every tensor in pinned (page-locked) host memory."""
        return Batch({k: v.pin_memory() if hasattr(v, "pin_memory") else v for k, v in self.items()})
