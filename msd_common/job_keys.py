"""Every key of the job file, with its type, default and meaning.

The single list that `msd_common.spec` checks job files against (the keys a mapping allows
and requires come from here) and that the documentation's job-file reference is generated from
(docs/hooks.py), so a key cannot be accepted without an entry, and the page cannot drift.

Paths use `<name>` for a mapping key chosen by the user (a source's or an eval set's name) and
`[]` for an item of a list (a curriculum stage).
"""

from __future__ import annotations

from dataclasses import dataclass

from .doc_keys import MAX_SOURCES
from .formats.limits import (DEFAULT_CAPTION_KEY, DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_PIXELS,
                             DEFAULT_MAX_RECORD_BYTES,
                             DEFAULT_MAX_SAMPLE_S, DEFAULT_PATCH_SIZE)
from .topology import DEFAULT_ORDER, DELIVERY

METHODS = ("greedy", "karmarkar_karp", "none")  # balance.method: how a step's rows are assigned to ranks


@dataclass(frozen=True)
class Key:
    path: str
    type: str
    default: str  # as the user would write it; "required" for a key that must be given
    meaning: str

    @property
    def required(self) -> bool:
        return self.default == "required"

    @property
    def parent(self) -> str:
        return self.path.rpartition(".")[0]

    @property
    def name(self) -> str:
        return self.path.rpartition(".")[2]


SRC = "sources.<name>"
EVAL = "eval.<name>"

KEYS: tuple[Key, ...] = (
    # top level
    Key("seed", "integer >= 0", "required", "The job's seed: with the job file and the data it fixes the whole "
        "stream of batches (order of records, mixing draws, held-out records, transform randomness)."),
    Key("sources", "mapping", "required", f"Source name -> definition; at most {MAX_SOURCES:,} sources."),
    Key("batch", "mapping", "required", "The shape of a global batch."),
    Key("topology", "mapping", "required", "The trainer's parallel layout."),
    Key("mixture", "mapping or list", "required", "The mix of sources: `{weights: {...}}`, or a list of "
        "curriculum stages."),
    Key("balance", "mapping", "{}", "How rows are spread over data-parallel ranks (cost model, method)."),
    Key("runtime", "mapping", "{}", "Operational knobs: lookahead, heartbeats, caches, indexing."),
    Key("long_docs", "split | truncate | drop", "split", "Job-wide default of `sources.<name>.long_docs`."),
    Key("on_exhausted", "renormalize | stop", "renormalize", "Job-wide default of `sources.<name>.on_exhausted`."),
    Key("security", "mapping", "{}", "CurveZMQ encryption and authentication of every socket."),
    Key("eval", "mapping", "{}", "Evaluation set name -> definition (held-out records or eval-only sources)."),
    # sources
    Key(f"{SRC}.format", "jsonl | megatron | parquet | arrow | webdataset", "required", "How the files are read."),
    Key(f"{SRC}.paths", "list of strings (or one string)", "required", "Glob patterns of the shards, relative to "
        "the job file, or URLs (`s3://`, `gs://`, ...). Megatron: the `.bin`/`.idx` prefix or the `.bin` files."),
    Key(f"{SRC}.text_key", "string", f"text (webdataset: {DEFAULT_CAPTION_KEY})",
        "JSONL key or Parquet/Arrow column of the text; "
        "WebDataset: the key of the caption in a JSON caption entry."),
    Key(f"{SRC}.tokenizer", "string", "byte", "`byte` (bytes as ids 0-255, end of document 256), or the path of a "
        "Hugging Face `tokenizer.json` or of a directory holding one (and `tokenizer_config.json` with a chat "
        "template)."),
    Key(f"{SRC}.eod_id", "integer", "the tokenizer's", "End-of-document id appended to every document."),
    Key(f"{SRC}.long_docs", "split | truncate | drop", "split (whole: truncate)", "A document longer than a row: "
        "cut into pieces (`split`), cut to one row (`truncate`), or skipped and counted (`drop`)."),
    Key(f"{SRC}.epochs", "integer >= 1", "none (repeat forever)", "Passes over the source; each epoch has a new "
        "order."),
    Key(f"{SRC}.on_exhausted", "renormalize | stop", "renormalize", "When a finite source runs out: share its weight "
        "among the others, or stop the job."),
    Key(f"{SRC}.tokens_key", "string", "none", "Parquet/Arrow: a list-of-integers column of token ids, used as "
        "stored (no tokenizer)."),
    Key(f"{SRC}.image_token_id", "integer", "none", "Image sources: the placeholder id, one per image patch."),
    Key(f"{SRC}.max_pixels", "integer", str(DEFAULT_MAX_PIXELS),
        "Image sources: images are scaled down to at most this many "
        "pixels."),
    Key(f"{SRC}.patch_size", "integer", str(DEFAULT_PATCH_SIZE),
        "Image sources: square patches of this many pixels a side; the same "
        "for every image source of a job."),
    Key(f"{SRC}.max_record_bytes", "integer", str(DEFAULT_MAX_RECORD_BYTES),
        "A record with more stored bytes is skipped as poison "
        "(checked before it is decoded)."),
    Key(f"{SRC}.max_image_pixels", "integer", str(DEFAULT_MAX_IMAGE_PIXELS), "WebDataset and processor sources: an "
        "image whose header declares more pixels skips its record as poison."),
    Key(f"{SRC}.max_sample_s", "number > 0", str(DEFAULT_MAX_SAMPLE_S), "Seconds one record's sample may take "
        "(reading, transform, processor, an image pass at delivery). A worker busy longer is stopped by its host "
        "agent and the record is quarantined as poison (counted, skipped, named); a worker busy for less is alive, "
        "however long."),
    Key(f"{SRC}.storage", "mapping", "none", "Object storage: the file system's options (`endpoint_url`, "
        "`region`, `profile`, ...; never secrets) and msd's (`max_retries`, `share_indexes`, `whole_objects`)."),
    Key(f"{SRC}.shuffle_block", "integer >= 1", "1", "Records are shuffled in runs of this many consecutive ones "
        "(one request to object storage per run); 1 shuffles every record on its own."),
    Key(f"{SRC}.transform", "string `package.module:function`", "none", "A function of the user's own, called by "
        "workers as `function(record, ctx, **transform_args)`; returns `worker.transforms.Sample` or `None`."),
    Key(f"{SRC}.transform_args", "mapping", "{}", "Keyword arguments of the transform (part of the job's identity)."),
    Key(f"{SRC}.max_transform_errors", "integer >= 1", "100", "This many consecutive transform errors on the "
        "source stop the job (a bug, not poison); fewer skip their records."),
    Key(f"{SRC}.chat", "mapping", "none", "Chat data, rendered with the tokenizer's chat template (jinja2, "
        "sandboxed), with a loss mask."),
    Key(f"{SRC}.chat.messages_key", "string", "messages", "The record's list of `{role, content}` messages."),
    Key(f"{SRC}.chat.train_on", "assistant | all | last", "assistant", "Which tokens are trained on: every "
        "assistant turn, every token, or the last assistant turn."),
    Key(f"{SRC}.chat.tools_key", "string", "tools", "The record's tool definitions, passed to the template."),
    Key(f"{SRC}.chat.template", "path", "the tokenizer's (or processor's) own", "A jinja chat template file used "
        "instead of the tokenizer's or processor's own, e.g. a training template with `{% generation %}` tags (TRL "
        "ships one per model family). Relative to the job file; every worker host reads the same path. Its content "
        "is part of the stream's identity. A processor source training on `assistant` needs a template with these "
        "tags: transformers' assistant mask comes from them alone."),
    Key(f"{SRC}.packing", "concat | whole", "concat (with a processor: whole)", "`concat`: documents are cut where a "
        "row or a step ends (pretraining); `whole`: a sample is never cut, rows are padded."),
    Key(f"{SRC}.processor", "string", "none", "Conversations with images: the path of a Hugging Face processor "
        "directory (tokenizer, image processor configuration, chat template); workers make each record what the "
        "processor's `apply_chat_template(..., tokenize=True, return_assistant_tokens_mask=True)` returns. For "
        "jsonl, parquet and arrow records, and webdataset samples (a `.json` conversation whose image parts name "
        "the sample's image entries, e.g. `0.jpg`); with a `transform`, records of any format, made into "
        "samples by the transform with the processor (`ctx.processor`). Needs `msd[vision]` on worker hosts."),
    Key(f"{SRC}.image_backend", "pil | torchvision", "pil", "With a processor: the image processor's backend, the "
        "same on every host (`torchvision` needs torch and torchvision on worker hosts)."),
    Key(f"{SRC}.image_pass", "delivery | prepare", "delivery", "With a processor: when workers run its image pass. "
        "`delivery`: the Qwen-VL and Gemma 3 (without pan-and-scan) processors are planned from each image's "
        "size at prepare time and a worker keeps the image files, not their pixel values, until delivery; "
        "other processors run whole at prepare time. `prepare`: every processor runs whole at prepare time. "
        "The samples are the same."),
    Key(f"{SRC}.video_fps", "number > 0", "the video processor's", "With a processor that takes videos (Qwen2-VL, "
        "Qwen2.5-VL, Qwen3-VL): frames sampled per second of video, within the video processor's min and max "
        "frames, as `apply_chat_template(..., fps=N)` samples them. Unset: the video processor's own sampling "
        "(Qwen3-VL: 2 per second; Qwen2-VL and Qwen2.5-VL: every frame). Needs `msd[video]` on worker hosts."),
    Key(f"{SRC}.max_video_s", "number > 0", "none", "With a processor: a video longer than this many seconds "
        "(read from its container, nothing decoded) skips its record as over the limit, before its step is planned."),
    # batch
    Key("batch.seq_len", "integer >= 2", "required", "Tokens per row (packed sequence)."),
    Key("batch.micro_batch_size", "integer >= 1", "required", "Rows per micro-batch."),
    Key("batch.global_batch_size", "integer >= 1", "required", "Rows per step, a multiple of topology.dp x "
        "micro_batch_size."),
    Key("batch.pad_id", "integer >= 0", "257", "The id of padding tokens."),
    # topology
    Key("topology.dp", "integer >= 1", "required", "Data-parallel ranks."),
    Key("topology.pp", "integer >= 1", "1", "Pipeline-parallel stages."),
    Key("topology.cp", "integer >= 1", "1", "Context-parallel ranks (each gets its share of every row)."),
    Key("topology.tp", "integer >= 1", "1", "Tensor-parallel ranks."),
    Key("topology.order", "string", DEFAULT_ORDER, "The axes, fastest first, as the trainer numbers its ranks "
        "(Megatron's default)."),
    Key("topology.delivery", " | ".join(DELIVERY), "tp_leader", "Which ranks receive data: the first of each "
        "tensor-parallel group (which broadcasts), or every rank (`all`)."),
    # mixture
    Key("mixture.weights", "mapping source -> number >= 0", "required", "Relative weight of each source (a single "
        "stage); sources left out have weight 0."),
    Key("mixture.adapt", "mapping", "none", "Mixing that learns from the trainer's loss (single-stage mixtures): "
        "the ranks report training loss per source (`DataClient.report_loss`), and every `every_steps` steps a "
        "policy maps the losses to new weights, journaled as a mixture change (exact on resume). A decision taken "
        "after step k applies from step k + runtime.lookahead_steps + 2."),
    Key("mixture.adapt.policy", "odm | ado | loss_share | package.module:function", "required", "The policy: "
        "`odm` (EXP3 on per-source loss, Albalak et al. 2023), `ado` (per-source power-law fits), `loss_share` "
        "(weights in proportion to loss), or your own function `(step, history) -> {source: weight}`."),
    Key("mixture.adapt.every_steps", "integer >= 1", "required", "Steps between decisions (a window of losses)."),
    Key("mixture.adapt.warmup_steps", "integer >= 0", "0", "No decision before this many steps have run."),
    Key("mixture.adapt.min_weight", "number >= 0", "0", "No adapted source's weight goes below this."),
    Key("mixture.adapt.max_step_change", "number > 0", "1", "The most one decision moves a source's weight."),
    Key("mixture.adapt.sources", "list of source names", "all", "The sources adapted; the others keep their "
        "weights."),
    Key("mixture[].weights", "mapping source -> number >= 0", "required", "A curriculum stage's weights."),
    Key("mixture[].until_step", "integer", "required but on the last", "The stage plans steps up to this one "
        "(exclusive); the last stage runs to the end."),
    Key("mixture[].ramp_steps", "integer >= 0", "0", "Weights move linearly from the previous stage's over this "
        "many steps."),
    Key("mixture[].seq_len", "integer >= 2", "batch.seq_len", "Row length during this stage (a long-context "
        "phase)."),
    # balance
    Key("balance.cost", "mapping", "{}", "The cost model of a piece of `len` tokens with `patches` image patches: "
        "quadratic x len^2 + linear x len + patch_quadratic x patches^2 + patch_linear x patches."),
    Key("balance.cost.quadratic", "number", "1.0", "Weight of len^2 (attention)."),
    Key("balance.cost.linear", "number", "0.0", "Weight of len (MLPs, embeddings)."),
    Key("balance.cost.patch_quadratic", "number", "0.0", "Weight of patches^2, image by image (a sample of "
        "several images costs the sum of each one's patches squared: the vision encoder attends within an image)."),
    Key("balance.cost.patch_linear", "number", "0.0", "Weight of patches."),
    Key("balance.method", " | ".join(METHODS), "greedy", "How a step's rows are assigned to "
        "data-parallel ranks."),
    Key("balance.token_slack", "number >= 0", "0.0", "A rank may hold up to (1 + slack) x its token capacity, "
        "so costs can be evened out (rows are padded to the longest)."),
    Key("balance.calibrate", "boolean", "false", "Fit the cost model to the compute times the trainers report, "
        "and adopt a clearly better one while the job runs (journaled in `cost.journal`)."),
    # runtime
    Key("runtime.lookahead_steps", "integer >= 1", "4", "Steps planned and prepared ahead of the slowest rank."),
    Key("runtime.ahead_bytes", "integer >= 1", "4294967296 (4 GiB)", "Per rank, the bytes of image frames and "
        "a processor's arrays delivered ahead of the slowest rank: once the steps planned ahead hold this much, "
        "no further step is planned until ranks consume (the next step a rank needs always is). Bounds a "
        "trainer's memory whatever the image sizes; text-only jobs never reach it."),
    Key("runtime.heartbeat_s", "number > 0", "1.0", "Heartbeat period of workers and clients; a peer silent for "
        "several periods is presumed dead."),
    Key("runtime.prepare_batch", "integer >= 1", "64; 8 with a processor source", "Documents per prepare request "
        "to a worker. A worker holds what it prepared until it is delivered: a processor's sample carries "
        "megabytes of pixel values, hence the smaller default there."),
    Key("runtime.status_every_s", "number", "30.0", "How often `STATE/status.json` is written."),
    Key("runtime.allocation", "adaptive | fixed", "adaptive", "Workers assigned to sources by measured cost "
        "(adaptive) or evenly (fixed)."),
    Key("runtime.shrink_after_s", "number", "10.0", "Idle seconds before the coordinator lets a worker "
        "process go (autoscaling)."),
    Key("runtime.stimulus_log_mb", "number >= 0", "4.0", "Size of the stimulus log kept for replays of the "
        "coordinator's decisions; 0 turns it off."),
    Key("runtime.cache_dir", "string", "$MSD_CACHE_DIR or ~/.cache/megascale-data", "Where indexes and local copies "
        "of remote shards are kept (relative to the job file)."),
    Key("runtime.cache_bytes", "integer >= 1", "68719476736 (64 GiB)", "Bound of the local copies of remote compressed "
        "shards (least recently used evicted first)."),
    Key("runtime.index_on", "coordinator | workers", "coordinator", "Who builds missing shard indexes at start-up."),
    Key("runtime.failed_linger_s", "number >= 0", "600.0", "After a fatal error the coordinator keeps its address "
        "this long (or until SIGTERM): every hello is answered with `job_failed` and the reason, `/readyz` says "
        "failed, and `msd status` shows it."),
    Key("runtime.copies", "plain | seekable", "plain", "How a compressed JSONL shard is kept for random access: "
        "decompressed (fast), or in the Zstandard seekable format (3x smaller)."),
    # security
    Key("security.curve", "string", "none (plain TCP)", "A key directory made by `msd keys generate DIR`: every "
        "socket is encrypted and every peer authenticated."),
    # eval sets
    Key(f"{EVAL}.holdout", "mapping source -> share or count", "{}", "Records held out of a training source by a "
        "keyed hash of (seed, source, record): a share (0 < x < 1) or a count (integer). Never trained on."),
    Key(f"{EVAL}.sources", "list of source names", "[]", "Sources read for this set (a source named only in eval "
        "sets, with weight 0, is read for evaluation only)."),
    Key(f"{EVAL}.max_records", "integer >= 1", "none (all)", "A fixed sample of at most this many records."),
    Key(f"{EVAL}.seq_len", "integer >= 2", "batch.seq_len", "Row length of the set."),
    Key(f"{EVAL}.prepare_ahead", "boolean", "false", "Prepare the set at start-up rather than at its first pass."),
)

BY_PATH = {k.path: k for k in KEYS}


def allowed(parent: str) -> set[str]:
    """The keys a mapping at `parent` (a path as in KEYS; "" for the top level) may hold."""
    return {k.name for k in KEYS if k.parent == parent}


def required(parent: str) -> set[str]:
    return {k.name for k in KEYS if k.parent == parent and k.required}
