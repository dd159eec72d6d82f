"""DataClient as the data of a Hugging Face `transformers.Trainer` or TRL `SFTTrainer`.

    from trainer_client.hf import MsdSFTTrainer            # or MsdTrainer, or MsdTrainerMixin
    trainer = MsdSFTTrainer(model=model, args=SFTConfig(max_steps=..., gradient_accumulation_steps=...),
                            data_client=DataClient(...))
    trainer.train(resume_from_checkpoint=...)

What the Trainer would otherwise do to a dataset, and what it gets instead:
- **Sharding.** The Trainer wraps its data loader with Accelerate, which shards or dispatches it
  across processes. msd already gives each data-parallel rank its own micro-batches, so
  `get_train_dataloader` returns the client's stream as it is: no sampler, no Accelerate wrapper.
- **Batch keys.** Each micro-batch arrives as TRL's padding-free collator gives one. Its rows are
  flattened into one sequence `[1, rows * seq_len]`, with `input_ids`, `position_ids` (they restart
  with each document piece) and `labels`: -100 where msd's `loss_mask` says the token is not
  trained, and at each piece's first token. It also carries `cu_seq_lens_q`/`_k`,
  `max_length_q`/`_k` and `seq_idx` for variable-length kernels, and `use_cache=False`. Without
  that flag a model in training mode still builds a cache, and the attention mask then ignores
  the packing: documents would see each other.
- **Steps.** One optimizer step is one msd step: `gradient_accumulation_steps` must equal the
  micro-batches the job gives a rank per step (`client.micro_batches_per_step`), and `max_steps`
  must be set (the stream has no length).
- **Checkpoints.** `MsdCallback` writes the client's state into each checkpoint the Trainer saves
  (`msd-data-rank{rank}.json`). `train(resume_from_checkpoint=...)` loads it before the first
  batch, and the Trainer's own skipping of trained batches is turned off (`ignore_data_skip`): the
  client resumes the stream where the checkpoint left it.
- **Loss per source.** Each training micro-batch's loss per token is taken from the model's own
  output (TRL's per-token log-probabilities, or the logits otherwise) and reported by
  `MsdCallback` with `client.report_loss` when the micro-batch's substep or step ends, for
  `mixture.adapt`, `msd status` and the `msd_train_loss` metric.

Text jobs only: a micro-batch with pixel values is refused with a message. Needs transformers and
accelerate (`pip install megascale-data[hf]`), and TRL for `MsdSFTTrainer`.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from .client import DataClient

log = logging.getLogger("msd.hf")

IGNORE_INDEX = -100
MICRO_BATCH_KEY = "msd_micro_batch"  # (step, micro-batch, rows): popped before the model sees the batch
PIXEL_KEYS = ("pixel_values", "pixel_values_videos", "pixel_patches", "video_frames")


def state_file(rank: int) -> str:
    """The client's state in a Trainer checkpoint folder, one file per rank."""
    return f"msd-data-rank{rank}.json"


def hf_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """A DataClient micro-batch (torch) as TRL's padding-free collator gives one: rows flattened to
    one sequence, labels as Hugging Face models take them (they shift them inside the loss)."""
    present = [k for k in PIXEL_KEYS if k in batch]
    if present:
        raise ValueError(f"trainer_client.hf takes text micro-batches; this one has {', '.join(present)} (a "
                         "vision-language source): read it from DataClient directly")
    tokens = batch["tokens"].reshape(1, -1)
    trained = batch["loss_mask"].reshape(1, -1) > 0  # loss_mask[i]: labels[i] (token i + 1) is trained
    labels = torch.full_like(tokens, IGNORE_INDEX)
    labels[:, 1:] = torch.where(trained[:, :-1], batch["labels"].reshape(1, -1)[:, :-1], IGNORE_INDEX)
    cu = batch["cu_seqlens"].to(torch.int32)
    lengths = cu.diff()
    max_length = int(lengths.max()) if len(lengths) else 0
    return {"input_ids": tokens, "labels": labels, "position_ids": batch["position_ids"].reshape(1, -1),
            "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max_length, "max_length_k": max_length,
            "seq_idx": torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), lengths)[None],
            "use_cache": False}


class MsdTrainData:
    """What `get_train_dataloader` returns: this rank's micro-batches from the client, as
    `hf_batch` makes them, each tagged with its place in the stream. No length, no sampler."""

    def __init__(self, client: DataClient) -> None:
        self.client = client

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.client:
            out = hf_batch(batch)
            out[MICRO_BATCH_KEY] = (int(batch["step"]), int(batch["micro_batch"]), int(batch["tokens"].shape[0]))
            yield out


class MsdCallback(TrainerCallback):
    """Reports each trained micro-batch's loss per token to the client (`report_loss`, summed per
    source there) once its step or substep ends, and writes the client's state into every
    checkpoint the Trainer saves, beside its own `rng_state_{process}.pth`, so that
    `train(resume_from_checkpoint=...)` resumes the stream too."""

    def __init__(self, client: DataClient) -> None:
        self.client = client
        self.pending: list[tuple[torch.Tensor, int, int]] = []  # (loss per token, step, micro-batch)

    def _report(self) -> None:
        for loss, step, micro_batch in self.pending:
            self.client.report_loss(loss, step=step, micro_batch=micro_batch)
        self.pending.clear()

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._report()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._report()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, state_file(self.client.rank))
        with open(path + ".tmp", "w") as f:
            json.dump(self.client.state_dict(), f)
        os.replace(path + ".tmp", path)


LOSS_CHUNK = 1024  # positions whose float32 logits are made at once (1024 x a 150k vocabulary: 600 MB)


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-position cross-entropy (0 where ignored), without gradients, a chunk of positions at a
    time so that the float32 copy of the logits stays small."""
    out = torch.zeros(labels.shape, dtype=torch.float32, device=logits.device)
    with torch.no_grad():
        for i in range(0, len(labels), LOSS_CHUNK):
            out[i:i + LOSS_CHUNK] = F.cross_entropy(logits[i:i + LOSS_CHUNK].float(), labels[i:i + LOSS_CHUNK],
                                                    ignore_index=IGNORE_INDEX, reduction="none")
    return out


def _per_token_loss(outputs: list[Any], labels: torch.Tensor | None) -> torch.Tensor | None:
    """The loss per position of the flattened micro-batch, position i the loss of token i + 1 (as
    msd's loss_mask is laid out), from the first model output that has it: TRL's fused head gives
    log-probabilities (0 where not trained), a plain model its logits."""
    for out in outputs:
        log_probs = getattr(out, "log_probs", None)
        if log_probs is not None:
            per = -log_probs.detach().float()
            break
        logits = getattr(out, "logits", None)
        if logits is not None and labels is not None:
            per = _cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()).view(labels.shape[0], -1)
            break
    else:
        return None
    if labels is not None and per.shape[-1] == labels.shape[-1] - 1:
        per = F.pad(per, (0, 1))  # the last position predicts nothing
    return per


class MsdTrainerMixin:
    """Put before `Trainer` or `SFTTrainer` in the bases; takes `data_client=` (this rank's
    DataClient) and `report_loss=` (default True) beside the Trainer's own arguments."""

    def __init__(self, *args: Any, data_client: DataClient, report_loss: bool = True, **kwargs: Any) -> None:
        if not data_client.as_torch:
            raise ValueError("an msd Trainer needs DataClient(as_torch=True): the Trainer takes torch tensors")
        self.data_client = data_client
        self.report_loss_per_source = report_loss
        training_args = kwargs["args"] if "args" in kwargs else (args[1] if len(args) > 1 else None)
        if training_args is None:
            raise ValueError("an msd Trainer needs args= (TrainingArguments or SFTConfig) with max_steps set: the "
                             "stream has no length")
        if training_args.max_steps is None or training_args.max_steps <= 0:
            raise ValueError(f"args.max_steps is {training_args.max_steps}: set it, in optimizer steps (one msd "
                             "step each); an msd stream has no length to count epochs by")
        training_args.ignore_data_skip = True  # the client resumes the stream itself
        if _is_sft_trainer(type(self)):
            if not hasattr(training_args, "dataset_kwargs"):
                raise TypeError(f"an msd SFTTrainer takes args=SFTConfig(...), got {type(training_args).__name__}")
            # SFTTrainer needs a dataset to look at: one placeholder row; it is never trained on
            if kwargs.get("train_dataset") is None:
                kwargs["train_dataset"] = _placeholder_dataset()
            training_args.dataset_kwargs = {**(training_args.dataset_kwargs or {}), "skip_prepare_dataset": True}
        super().__init__(*args, **kwargs)
        self.data_callback = MsdCallback(data_client)
        self.add_callback(self.data_callback)

    def get_train_dataloader(self) -> MsdTrainData:
        per_step = self.data_client.micro_batches_per_step
        if self.args.gradient_accumulation_steps != per_step:
            raise ValueError(f"args.gradient_accumulation_steps is {self.args.gradient_accumulation_steps}, but the "
                             f"job gives rank {self.data_client.rank} {per_step} micro-batches per step (batch."
                             "global_batch_size / (dp x micro_batch_size)): set gradient_accumulation_steps="
                             f"{per_step}, so that one optimizer step is one msd step")
        return MsdTrainData(self.data_client)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
        if resume_from_checkpoint:
            path = os.path.join(resume_from_checkpoint, state_file(self.data_client.rank))
            if not os.path.exists(path):
                raise FileNotFoundError(f"{path}: the checkpoint has no data state for rank "
                                        f"{self.data_client.rank}; it was not saved by an msd Trainer (MsdCallback)")
            with open(path) as f:
                self.data_client.load_state_dict(json.load(f))
            log.info("rank %d: the stream resumes at step %d (%s)", self.data_client.rank,
                     self.data_client.next_step, path)
        return super().train(resume_from_checkpoint or None, *args, **kwargs)

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        at = inputs.pop(MICRO_BATCH_KEY, None)
        if at is None or not self.report_loss_per_source or not model.training:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        outputs: list[Any] = []
        hook = self.accelerator.unwrap_model(model).register_forward_hook(lambda m, a, out: outputs.append(out))
        try:
            result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                          num_items_in_batch=num_items_in_batch)
        finally:
            hook.remove()
        per_token = _per_token_loss(outputs, inputs.get("labels"))
        if per_token is not None:  # MsdCallback reports it when the micro-batch's substep or step ends
            step, micro_batch, rows = at
            self.data_callback.pending.append((per_token.reshape(rows, -1), step, micro_batch))
        return result


class MsdTrainer(MsdTrainerMixin, Trainer):
    """`transformers.Trainer` fed by a DataClient (`data_client=`)."""


def _is_sft_trainer(cls: type) -> bool:
    return any(c.__name__ == "SFTTrainer" and c.__module__.startswith("trl") for c in cls.__mro__)


def _placeholder_rows() -> Iterator[dict[str, list[int]]]:
    yield {"input_ids": [0], "labels": [0]}


def _placeholder_dataset() -> Any:
    import datasets

    return datasets.IterableDataset.from_generator(_placeholder_rows)


def __getattr__(name: str) -> Any:
    if name == "MsdSFTTrainer":  # defined on first use: TRL is needed only for it
        from trl import SFTTrainer

        cls = type("MsdSFTTrainer", (MsdTrainerMixin, SFTTrainer),
                   {"__doc__": "TRL's `SFTTrainer` fed by a DataClient (`data_client=`).", "__module__": __name__})
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
