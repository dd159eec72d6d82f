"""Every wire message of megascale-data, declared once, with its schema.

This module owns the message catalogue and PROTOCOL_VERSION. It lives in the trainer client
because the client is the lightest of the three parts and must not import the coordinator or
the worker; both of those import this module instead.

A message is a msgpack map (frame 0) with key "type", optionally followed by raw array frames.
`validate()` checks a decoded header against the schema of its type and the set of types a
socket role may receive, so a message in the wrong direction or with a bad field is rejected in
one place, before any handler sees it.
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass, field
from typing import Any, Callable

from .doc_keys import RECORD_MASK
from .errors import ProtocolError

# 12: host_heartbeat.pids, worker_exited.source/record/overran_s, prepare/deliver.worker_id, delivered.unserved,
# job_failed to workers, hosts and relays; 11: delivered.failed; 10: pieces.extras (a processor's arrays); 9: relays;
# 8: job_failed; 7: pieces.loss_mask, epochs of prepare and deliver, eval_*; 6: welcome.count
PROTOCOL_VERSION = 12

# Eval passes travel as steps of their own: `pieces` of step EVAL_STEP_BASE + set * 2^32 + pass, and
# their records are prepared as epoch EVAL_EPOCH (a worker reads them as epoch 0, caches them apart).
EVAL_STEP_BASE = 1 << 56
EVAL_EPOCH = 0xFFFFFFFF


def eval_step(set_index: int, pass_no: int) -> int:
    return EVAL_STEP_BASE + (set_index << 32) + pass_no

# Limits enforced on every decode (see wire.py); generous for real traffic, small enough that
# a hostile or broken peer cannot make a process allocate without bound.
MAX_HEADER_BYTES = 8 * 1024 * 1024
MAX_FRAMES = 8
MAX_FRAME_BYTES = 512 * 1024 * 1024
MAX_LIST_LEN = 1_000_000
MAX_STR_LEN = 1 << 20

INT64_MAX = (1 << 63) - 1

Check = Callable[[Any, str], None]


def _fail(path: str, what: str) -> None:
    raise ProtocolError(f"field {path!r}: {what}")


def integer(lo: int = 0, hi: int = INT64_MAX) -> Check:
    def check(value: Any, path: str) -> None:
        if type(value) is not int:
            _fail(path, f"expected int, got {type(value).__name__}")
        if not lo <= value <= hi:
            _fail(path, f"{value} outside [{lo}, {hi}]")

    return check


def number() -> Check:
    def check(value: Any, path: str) -> None:
        if type(value) not in (int, float) or value != value:
            _fail(path, f"expected a finite number, got {value!r}")

    return check


def text(max_len: int = 4096) -> Check:
    def check(value: Any, path: str) -> None:
        if type(value) is not str:
            _fail(path, f"expected str, got {type(value).__name__}")
        if len(value) > max_len:
            _fail(path, f"string longer than {max_len}")

    return check


def seq(item: Check, max_len: int = MAX_LIST_LEN, length: int | None = None) -> Check:
    def check(value: Any, path: str) -> None:
        if type(value) is not list:
            _fail(path, f"expected list, got {type(value).__name__}")
        if len(value) > max_len or (length is not None and len(value) != length):
            _fail(path, f"list of length {len(value)} not allowed")
        for i, v in enumerate(value):
            item(v, f"{path}[{i}]")

    return check


def tup(*items: Check) -> Check:
    """A fixed-length list whose positions have their own checks (compact records)."""

    def check(value: Any, path: str) -> None:
        if type(value) is not list or len(value) != len(items):
            _fail(path, f"expected a list of {len(items)} items")
        for i, (c, v) in enumerate(zip(items, value)):
            c(v, f"{path}[{i}]")

    return check


def worker_job() -> Check:
    """The job a worker is welcomed with, checked as msd_common.spec.WorkerJob reads it (imported
    on first use: only workers receive it, and the spec's parser is no load for a trainer)."""

    def check(value: Any, path: str) -> None:
        from .worker_job import WorkerJob

        try:
            WorkerJob.from_wire(value)
        except ProtocolError as e:
            _fail(path, str(e))

    return check


def anything() -> Check:
    """Free-form JSON-like data (job description, plan summary); sizes are bounded by msgpack."""

    def check(value: Any, path: str) -> None:
        return None

    return check


def _check_fields(value: Any, fields: dict[str, Check], path: str) -> None:
    if type(value) is not dict:
        _fail(path, f"expected map, got {type(value).__name__}")
    for name, c in fields.items():
        if name not in value:
            _fail(f"{path}.{name}" if path else name, "missing")
        c(value[name], f"{path}.{name}" if path else name)


TOKEN_DTYPES = ("|u1", "<u2", "<i2", "<i4", "<u4", "<i8")
MAX_PIECE_LEN = 1 << 31


def columns(name: str, *names: str) -> Any:
    """Named column indices of a table frame: `DELIVER_ITEM.doc_key == 2`, `len(DELIVER_ITEM) == 5`."""
    return namedtuple(name, names)(*range(len(names)))


# The layouts of the table frames (one row per item), named once here.
DELIVER_ITEM = columns("DeliverItem", "rank", "piece", "doc_key", "offset", "length")  # coordinator -> worker
DELIVER_TARGET = columns("DeliverTarget", "rank", "address")  # coordinator -> worker: index into `addresses`
RECIPE_PIECE = columns("RecipePiece", "doc_key", "offset", "length")  # coordinator -> trainer (step recipe)
PIECE_ITEM = columns("PieceItem", "piece", "doc_key", "offset", "length")  # worker -> trainer
RELAY_CONSUMED = columns("RelayConsumed", "rank", "step")  # relay -> coordinator


@dataclass(frozen=True)
class ArraySpec:
    """A raw frame after the header: a C-contiguous array of a fixed dtype (or, with dtype None,
    the dtype named by the header's "dtype" field, one of TOKEN_DTYPES), a plain vector or a table
    with the named `columns`. Rows are implied by the frame size, which must divide exactly."""

    name: str
    dtype: str | None
    columns: tuple = ()
    cols: int = field(init=False)  # columns per row (1: a plain vector); read on every message

    def __post_init__(self) -> None:
        object.__setattr__(self, "cols", max(1, len(self.columns)))


ArrayCheck = Callable[[dict[str, Any], dict[str, Any]], None]


@dataclass(frozen=True)
class MessageType:
    name: str
    fields: dict[str, Check]
    arrays: tuple[ArraySpec, ...] = ()
    check: ArrayCheck | None = None  # consistency of the arrays (ranges, totals), after decoding
    # up to this many more raw byte frames after the arrays (decoded as the list arrays["tail"]):
    # a processor's arrays, each its own frame, sent without being copied into one
    tail: int = 0


def _msg(name: str, *arrays: ArraySpec, check: ArrayCheck | None = None, tail: int = 0, **fields: Check) -> MessageType:
    return MessageType(name, fields, arrays, check, tail)


def _lengths_ok(lengths: Any, what: str) -> None:
    if lengths.size and (int(lengths.min()) < 1 or int(lengths.max()) >= MAX_PIECE_LEN):
        raise ProtocolError(f"{what}: piece lengths must lie in [1, {MAX_PIECE_LEN})")


def _check_prepare(header: dict, arrays: dict) -> None:
    if arrays["records"].size and int(arrays["records"].max()) > RECORD_MASK:
        raise ProtocolError("prepare: record index beyond 48 bits")
    if len(arrays["epochs"]) != len(arrays["records"]):
        raise ProtocolError("prepare: one epoch per record")


def _check_prepared(header: dict, arrays: dict) -> None:
    lengths, patches = arrays["lengths"], arrays["patches"]
    if lengths.size and (int(lengths.min()) < 0 or int(lengths.max()) >= MAX_PIECE_LEN):
        raise ProtocolError("prepared: lengths must lie in [0, 2^31)")
    if patches.size and (len(patches) != len(lengths) or int(patches.min()) < 0 or int(patches.max()) >= 1 << 40):
        raise ProtocolError("prepared: patches must be empty, or one count per record in [0, 2^40)")
    squares = arrays["patch_squares"]
    if squares.size and (len(squares) != len(patches) or int(squares.min()) < 0):
        raise ProtocolError("prepared: patch_squares must be empty, or one non-negative sum per record with patches")


def _check_deliver(header: dict, arrays: dict) -> None:
    _lengths_ok(arrays["items"][:, DELIVER_ITEM.length], "deliver")
    if len(arrays["epochs"]) != len(arrays["items"]) or len(arrays["release_epochs"]) != len(arrays["release"]):
        raise ProtocolError("deliver: one epoch per item and per released copy")
    targets = arrays["targets"]
    if targets.size and int(targets[:, DELIVER_TARGET.address].max()) >= len(header["addresses"]):
        raise ProtocolError("deliver: a rank's address index is beyond the addresses")


def _check_step_header(header: dict, arrays: dict) -> None:
    _lengths_ok(arrays["pieces"][:, RECIPE_PIECE.length], "step_header")
    if int(arrays["counts"].sum()) != len(arrays["pieces"]):
        raise ProtocolError("step_header: sequence piece counts do not add up to the pieces sent")


def _check_pieces(header: dict, arrays: dict) -> None:
    lengths = arrays["items"][:, PIECE_ITEM.length]
    _lengths_ok(lengths, "pieces")
    if int(lengths.sum()) != arrays["tokens"].size:
        raise ProtocolError(f"pieces: items cover {int(lengths.sum())} tokens, frame holds {arrays['tokens'].size}")
    mask = arrays["loss_mask"]
    if mask.size and mask.size != arrays["tokens"].size:
        raise ProtocolError(f"pieces: loss_mask holds {mask.size} entries for {arrays['tokens'].size} tokens")
    counts, patches = arrays["patch_counts"], arrays["patches"]
    if counts.size or patches.size:
        if len(counts) != len(lengths) or (counts > lengths).any() or header["patch_bytes"] < 1:
            raise ProtocolError("pieces: patch_counts must give one count per item, within its length")
        if int(counts.sum()) * header["patch_bytes"] != patches.size:
            raise ProtocolError(f"pieces: {int(counts.sum())} patches of {header['patch_bytes']} bytes, frame holds "
                                f"{patches.size}")
    _check_extras(header, arrays, lengths.astype("<i8"))


# what a piece's extra arrays may hold (a processor's outputs: pixel values, grids, token types, positions)
EXTRA_DTYPES = ("|u1", "|i1", "|b1", "<u2", "<i2", "<f2", "<u4", "<i4", "<f4", "<i8", "<u8", "<f8")
MAX_EXTRAS = 16
MAX_EXTRA_FRAMES = 8192  # a pieces message's extras frames (one per item and array that has rows)


def extra_row_bytes(spec: list) -> int:
    """Bytes of one row of an extra array [name, dtype, row shape, per_token]."""
    import numpy as np

    return int(np.dtype(spec[1]).itemsize * np.prod(spec[2], dtype=np.int64))


def _check_extras(header: dict, arrays: dict, lengths: Any) -> None:
    import numpy as np

    extras, rows, frames = header["extras"], arrays["extra_rows"], arrays["tail"]
    if not extras:
        if rows.size or frames:
            raise ProtocolError("pieces: extra arrays without their declaration")
        return
    names = [e[0] for e in extras]
    if len(set(names)) != len(names):
        raise ProtocolError("pieces: an extra array named twice")
    for name, dtype, shape, _ in extras:
        if dtype not in EXTRA_DTYPES:
            raise ProtocolError(f"pieces: extra {name!r} of dtype {dtype!r}, not one of {EXTRA_DTYPES}")
        if any(d < 1 or d > 1 << 24 for d in shape):
            raise ProtocolError(f"pieces: extra {name!r} has a row shape {shape} out of range")
    if len(rows) != len(lengths) * len(extras):
        raise ProtocolError(f"pieces: extra_rows holds {len(rows)} counts for {len(lengths)} items x {len(extras)} "
                            "extras")
    rows = rows.reshape(len(lengths), len(extras)).astype(np.int64)
    for j, (name, _, _, per_token) in enumerate(extras):
        if per_token and ((rows[:, j] != 0) & (rows[:, j] != lengths)).any():
            raise ProtocolError(f"pieces: per-token extra {name!r} must have 0 rows or one per token of its item")
    sizes = (rows * np.array([extra_row_bytes(e) for e in extras], np.int64)).reshape(-1)
    sizes = sizes[sizes > 0]  # one frame per item and array with rows, item by item, in declaration order
    if len(sizes) != len(frames):
        raise ProtocolError(f"pieces: {len(sizes)} extras frames declared, {len(frames)} sent")
    for size, frame in zip(sizes.tolist(), frames):
        if frame.size != size:
            raise ProtocolError(f"pieces: an extras frame of {size} bytes declared holds {frame.size}")


def _check_relay_step(header: dict, arrays: dict) -> None:
    n = len(header["dps"])
    if len(header["piece_counts"]) != n or len(header["rank_costs"]) != n or len(header["naive_costs"]) != n:
        raise ProtocolError("relay_step: piece_counts and costs must have one entry per DP rank")
    if sum(header["piece_counts"]) != len(arrays["pieces"]) or (n and len(arrays["counts"]) % n):
        raise ProtocolError("relay_step: piece counts do not add up, or counts are not a row per DP rank")
    if any(not 0 <= i < n for _, i in header["ranks"]):
        raise ProtocolError("relay_step: a rank's DP index is out of range")


def _check_relay_up(header: dict, arrays: dict) -> None:
    if len(arrays["waited_s"]) != len(arrays["consumed"]):
        raise ProtocolError("relay_up: one waited_s per consumed row")


# worker -> coordinator
WORKER_HELLO = _msg("worker_hello", version=integer(), host=text(), pid=integer(), incarnation=integer(),
                    agent=integer())  # the host agent that started it (its agent_id)
# busy_s: total time spent preparing and delivering; backlog: piece messages waiting for a rank's
# socket; send_waits: sends that found a rank's socket full, since registration
WORKER_HEARTBEAT = _msg("worker_heartbeat", worker_id=integer(), cached_records=integer(),
                        busy_s=number(), backlog=integer(), send_waits=integer())
PREPARED = _msg(
    "prepared",
    ArraySpec("lengths", "<i8"),  # tokens per record, in task order; 0 for a skipped record
    ArraySpec("patches", "<i8"),  # image patches per record (empty for a source without images)
    # the sum over each record's images of their patches squared (empty: the patches squared, one image)
    ArraySpec("patch_squares", "<i8"),
    check=_check_prepared,
    worker_id=integer(),
    task_id=integer(),
    # [[index into the task's records, reason, kind]] for records skipped (kind: readers.errors.SKIP_KINDS)
    skipped=seq(tup(integer(), text(MAX_STR_LEN), text(32))),
    busy_s=number(),  # seconds spent on the task: the coordinator's per-source cost estimate
)
# host agent -> coordinator: its process count and limits (`msd worker --procs auto --max-procs N`)
HOST_HELLO = _msg("host_hello", version=integer(), agent_id=integer(), host=text(), procs=integer(),
                  min_procs=integer(), max_procs=integer(), auto=integer(0, 1))
# pids: its worker processes alive and busy on one bounded piece of work (a sample, loading a
# processor): the agent vouches for them (a worker busy on one sample for minutes sends no heartbeat
# of its own, and is alive while its process is, up to its source's max_sample_s)
HOST_HEARTBEAT = _msg("host_heartbeat", agent_id=integer(), procs=integer(), pids=seq(integer(), 4096))
TASK_FAILED = _msg("task_failed", worker_id=integer(), task_id=integer(), reason=text(MAX_STR_LEN))
# worker -> coordinator, answering a welcome's `count`: the records of each source it names, as this
# host's indexes count them (problems[i]: why source i could not be opened here, "" if it could)
SOURCE_COUNTS = _msg("source_counts", worker_id=integer(), sources=seq(integer(0, 0xFFFF), 0x10000),
                     records=seq(integer(), 0x10000), problems=seq(text(MAX_STR_LEN), 0x10000))
# failed: [[source, record, reason, kind]] of samples sent with nothing to train on, their image pass
# having failed at delivery (worker/image_plan.py); kind as in prepared.skipped
# unserved: pieces it was asked for and could not send (not in its cache: its books and the
# coordinator's disagree); the coordinator then prepares what it held again elsewhere
DELIVERED = _msg("delivered", worker_id=integer(), delivery_id=integer(),
                 failed=seq(tup(integer(0, 0xFFFF), integer(), text(MAX_STR_LEN), text(32))), unserved=integer())

# coordinator -> worker
# count: sources whose record counts the coordinator asks for (a coordinator waiting for its workers
# to index them, runtime.index_on: workers); empty otherwise
WELCOME = _msg("welcome", worker_id=integer(), job=worker_job(), heartbeat_s=number(),
               count=seq(integer(0, 0xFFFF), 0x10000))
# coordinator -> host agent: run this many worker processes (within its limits)
# retire: pids to stop; heartbeat_s: how often the host heartbeats (the job's runtime.heartbeat_s)
SCALE = _msg("scale", procs=integer(), retire=seq(integer(), 4096), reason=text(), heartbeat_s=number())
# host agent -> coordinator, at once: one of its worker processes ended (exitcode: negative for a
# signal); task_id: the prepare task it was working on, -1 for none (what blames a poison record);
# source, record: the sample it was making (-1: none); overran_s > 0: the agent stopped it, that sample
# having run that long past its source's max_sample_s (poison, not a crash)
WORKER_EXITED = _msg("worker_exited", agent_id=integer(), pid=integer(), exitcode=integer(-(1 << 31), 1 << 31),
                     task_id=integer(-1), source=integer(-1, 0xFFFF), record=integer(-1), overran_s=number())
# epochs: the pass over the source of each record (a transform's ctx.epoch: its randomness and its sample)
PREPARE = _msg("prepare", ArraySpec("records", "<u8"), ArraySpec("epochs", "<u4"), check=_check_prepare,
               task_id=integer(), source=integer(0, 0xFFFF),
               worker_id=integer())  # the registration it is for: a worker registered again since drops it
DELIVER = _msg(
    "deliver",
    ArraySpec("items", "<u8", DELIVER_ITEM),  # piece: the index in the rank's recipe
    ArraySpec("release", "<u8"),  # doc keys whose prepared copy is used up (one per prepared copy)
    ArraySpec("epochs", "<u4"),  # the epoch of each item's record (the prepared copy it is cut from)
    ArraySpec("release_epochs", "<u4"),  # and of each released copy
    # where each rank's pieces go: its data address, an index into `addresses` (each address once: many
    # ranks share their relay's; a [rank, address] list of strings was 83 KB a step at DP 4,096)
    ArraySpec("targets", "<u8", DELIVER_TARGET),
    check=_check_deliver,
    worker_id=integer(),  # the registration it is for: a worker registered again since drops it
    delivery_id=integer(),
    step=integer(),
    addresses=seq(text()),
)
# the rank at this data address has gone (its heartbeats stopped, or it said bye): drop what
# waits to be sent to it
RELEASE_RANK = _msg("release_rank", rank=integer(), address=text())
REJECT = _msg("reject", reason=text(MAX_STR_LEN))
# coordinator -> any registered peer, in answer to each heartbeat: the coordinator is alive (a peer
# that hears nothing for 3 heartbeats moves on to the next coordinator address it was given)
ALIVE = _msg("alive")
SHUTDOWN = _msg("shutdown", reason=text())
# the coordinator does not know this peer (it restarted, or declared the peer dead): say hello again
UNKNOWN_PEER = _msg("unknown_peer", reason=text(MAX_STR_LEN))

# trainer -> coordinator
TRAINER_HELLO = _msg(
    "trainer_hello", version=integer(), rank=integer(), data_address=text(), resume_step=integer(),
    incarnation=integer(),
    metadata_only=integer(0, 1),  # a middle pipeline stage asking for the packing metadata
    # the coordinator's state before resume_step, from the trainer's checkpoint (None: not carried):
    # a coordinator without a state dir resumes from it
    carried=anything(),
)
# trainer -> coordinator: the coordinator's state before `step`, for the trainer's checkpoint
STATE_REQUEST = _msg("state_request", rank=integer(), step=integer())
# waited_s: total time waiting for data; compute_s: seconds each micro-batch of step compute_step took the
# trainer (balance.calibrate; compute_step -1 and [] otherwise)
CONSUMED = _msg("consumed", rank=integer(), step=integer(), waited_s=number(), compute_step=integer(-1),
                compute_s=seq(number(), 1 << 16))
TRAINER_HEARTBEAT = _msg("trainer_heartbeat", rank=integer())
TRAINER_BYE = _msg("trainer_bye", rank=integer())
# trainer -> coordinator: this rank asks for pass `pass_no` of an eval set (client.eval_batches)
EVAL_REQUEST = _msg("eval_request", rank=integer(), set=text(256), pass_no=integer())
# trainer -> coordinator: mean loss per source of one evaluation (client.report_eval), from training step `step`
EVAL_REPORT = _msg("eval_report", rank=integer(), set=text(256), step=integer(), losses=anything())

# coordinator -> trainer
TRAINER_WELCOME = _msg("trainer_welcome", rank=integer(), batch=anything(), plan_digest=text(), heartbeat_s=number())
STEP_HEADER = _msg(
    "step_header",
    ArraySpec("pieces", "<u8", RECIPE_PIECE),  # in packing order
    ArraySpec("counts", "<u4"),  # pieces per sequence, micro-batch major: [m * micro_batch_size + s]
    check=_check_step_header,
    step=integer(),
    rank=integer(),
    row_len=integer(1, MAX_PIECE_LEN),  # tokens per packed sequence of this step, padding included
    plan=anything(),
)
# coordinator -> trainer: this rank's rows of one pass over an eval set (its recipe, as step_header's);
# the pieces come from workers as `pieces` of step `step` (EVAL_STEP_BASE and up). reason: why the
# pass cannot be served ("" when it is)
EVAL_HEADER = _msg(
    "eval_header",
    ArraySpec("pieces", "<u8", RECIPE_PIECE),
    ArraySpec("counts", "<u4"),
    check=_check_step_header,
    set=text(256),
    pass_no=integer(),
    rank=integer(),
    step=integer(),
    row_len=integer(1, MAX_PIECE_LEN),
    reason=text(MAX_STR_LEN),
)
# the rank is held by another live client: keep saying hello (it is yours once that one is gone)
RANK_TAKEN = _msg("rank_taken", rank=integer(), reason=text(MAX_STR_LEN))
# no step at or after `step` will be planned (a source with on_exhausted: stop ran out)
END_OF_STREAM = _msg("end_of_stream", step=integer(), reason=text(MAX_STR_LEN))
# the job was stopped on a fatal error: every rank raises JobFailedError with the reason
JOB_FAILED = _msg("job_failed", reason=text(MAX_STR_LEN))

# worker -> trainer: items [piece, doc_key, doc_offset, length] (piece: the index in the rank's step
# recipe, checked against the recipe's reference); their tokens, concatenated in item order, in the header's dtype
# (image-text sources: per item, the patches of its image placeholders, uint8 rows of patch_bytes)
# loss_mask: empty, or one uint8 per token (1: trained on) where a piece comes from a source with masks
# extras: a processor's arrays ([name, dtype, row shape, per_token]); extra_rows: [items x extras] rows of each,
# 0 or the item's length for a per-token one; then a trailing frame per item and extra with rows (its bytes),
# item after item, extra after extra
PIECES = _msg("pieces", ArraySpec("items", "<u8", PIECE_ITEM), ArraySpec("tokens", None), ArraySpec("patch_counts",
                                                                                                    "<u4"),
              ArraySpec("patches", "|u1"), ArraySpec("loss_mask", "|u1"), ArraySpec("extra_rows", "<u4"),
              check=_check_pieces, tail=MAX_EXTRA_FRAMES, step=integer(), rank=integer(), dtype=text(8),
              patch_bytes=integer(0, 1 << 24),
              extras=seq(tup(text(64), text(8), seq(integer(1, 1 << 24), 4), integer(0, 1)), MAX_EXTRAS))

# relay (one per trainer host, `msd relay`) -> coordinator. data_address: where workers push the pieces of
# its ranks (one connection per worker process and relay, whatever the number of its ranks)
# local: the endpoint its ranks reach it at (a relay started again on a host, at the same endpoint, replaces the old
# one)
RELAY_HELLO = _msg("relay_hello", version=integer(), host=text(), data_address=text(), local=text(),
                   incarnation=integer())
# ranks: the ranks behind it that are alive (their heartbeats stop at the relay); the rest: its counters
_RELAY_COUNTERS = dict(ranks=seq(integer(), 1 << 16), bytes_in=integer(), bytes_out=integer(), queued=integer(),
                       late_steps=integer())
RELAY_HEARTBEAT = _msg("relay_heartbeat", relay_id=integer(), **_RELAY_COUNTERS)
# the messages of its ranks (TRAINER_UP messages, each checked as if the rank had sent it), gathered;
# their plain `consumed` (no compute times) as table rows, a host's of one step together: one event for
# all, where a message each cost the coordinator 15-20 us per rank and step
# It counts as a heartbeat (its counters too): a relay that sends one a step sends no heartbeats.
RELAY_UP = _msg("relay_up", ArraySpec("consumed", "<i8", RELAY_CONSUMED), ArraySpec("waited_s", "<f8"),
                check=_check_relay_up, relay_id=integer(), messages=seq(anything(), 1 << 16), **_RELAY_COUNTERS)
# coordinator -> relay: one step's recipes for its ranks (what a step_header says to each), per DP rank
# once: `dps` the DP ranks (in order), `pieces` theirs concatenated (RECIPE_PIECE rows, piece_counts of
# each), `counts` a row of pieces per sequence each, the plan's summary per DP rank; `ranks` [rank, index
# into dps]. The relay writes each rank's step_header (the coordinator's work per step grows with hosts)
RELAY_STEP = _msg("relay_step", ArraySpec("pieces", "<u8", RECIPE_PIECE), ArraySpec("counts", "<u4"),
                  check=_check_relay_step, step=integer(), row_len=integer(1, MAX_PIECE_LEN), dps=seq(integer()),
                  ranks=seq(tup(integer(), integer())), piece_counts=seq(integer()), rank_costs=seq(number()),
                  naive_costs=seq(number()), max_over_mean=number(), naive_max_over_mean=number())
RELAY_WELCOME = _msg("relay_welcome", relay_id=integer(), heartbeat_s=number(), topology=anything())
# the coordinator's messages to the relay's ranks, gathered: parts [rank, header, byte size of each array
# frame]; the array frames of every part, concatenated in part order, in `blob`
RELAY_DOWN = _msg("relay_down", ArraySpec("blob", "|u1"), parts=seq(tup(integer(), anything(), seq(integer(), 8)),
                                                                    1 << 16))

# tool (msd mix) -> coordinator, and the answer: new mixture weights from step `at_step` on
# coordinator -> trainer: the answer (state: {digest, planner, mixture_changes, quarantined})
STATE_REPLY = _msg("state_reply", step=integer(), ok=integer(0, 1), reason=text(MAX_STR_LEN), state=anything())
MIX_REQUEST = _msg("mix_request", at_step=integer(), weights=anything())
MIX_REPLY = _msg("mix_reply", ok=integer(0, 1), reason=text(MAX_STR_LEN), at_step=integer())
# tools (msd status): a snapshot of the running job, answered by the coordinator's shell
STATUS_REQUEST = _msg("status_request")
STATUS_REPLY = _msg("status_reply", status=anything())

ALL_TYPES = {
    m.name: m
    for m in (
        WORKER_HELLO, WORKER_HEARTBEAT, PREPARED, TASK_FAILED, DELIVERED, WELCOME, PREPARE, DELIVER, RELEASE_RANK,
        REJECT, ALIVE, SOURCE_COUNTS,
        HOST_HELLO, HOST_HEARTBEAT, SCALE, WORKER_EXITED,
        SHUTDOWN, UNKNOWN_PEER, TRAINER_HELLO, CONSUMED, TRAINER_HEARTBEAT, TRAINER_BYE, TRAINER_WELCOME, STEP_HEADER,
        END_OF_STREAM, RANK_TAKEN, PIECES, MIX_REQUEST, MIX_REPLY, STATE_REQUEST, STATE_REPLY, STATUS_REQUEST,
        STATUS_REPLY, EVAL_REQUEST, EVAL_REPORT, EVAL_HEADER, JOB_FAILED, RELAY_HELLO, RELAY_HEARTBEAT, RELAY_UP,
        RELAY_WELCOME, RELAY_DOWN, RELAY_STEP,
    )
}

# What each socket role may receive; anything else is rejected at decode.
COORDINATOR_INBOX = frozenset(
    m.name for m in (WORKER_HELLO, WORKER_HEARTBEAT, PREPARED, TASK_FAILED, DELIVERED, HOST_HELLO, HOST_HEARTBEAT,
                     WORKER_EXITED, SOURCE_COUNTS,
                     TRAINER_HELLO, CONSUMED, TRAINER_HEARTBEAT, TRAINER_BYE, MIX_REQUEST, STATE_REQUEST,
                     STATUS_REQUEST, EVAL_REQUEST, EVAL_REPORT, RELAY_HELLO, RELAY_HEARTBEAT, RELAY_UP)
)
# what a rank sends its coordinator (or its relay, which passes them up in RELAY_UP)
TRAINER_UP = frozenset(m.name for m in (TRAINER_HELLO, CONSUMED, TRAINER_HEARTBEAT, TRAINER_BYE, STATE_REQUEST,
                                        EVAL_REQUEST, EVAL_REPORT))
# requests that change the plan: on a CURVE job, accepted only from an operator key
CONTROL_REQUESTS = frozenset({MIX_REQUEST.name})
TOOL_INBOX = frozenset({MIX_REPLY.name, STATUS_REPLY.name})
HOST_INBOX = frozenset(m.name for m in (SCALE, REJECT, SHUTDOWN, UNKNOWN_PEER, ALIVE, JOB_FAILED))
WORKER_INBOX = frozenset(m.name for m in (WELCOME, PREPARE, DELIVER, RELEASE_RANK, REJECT, SHUTDOWN, UNKNOWN_PEER,
                                          ALIVE, JOB_FAILED))
TRAINER_CONTROL_INBOX = frozenset(m.name for m in (TRAINER_WELCOME, STEP_HEADER, END_OF_STREAM, RANK_TAKEN, REJECT,
                                                    SHUTDOWN, UNKNOWN_PEER, STATE_REPLY, ALIVE, EVAL_HEADER,
                                                    JOB_FAILED))
TRAINER_DATA_INBOX = frozenset({PIECES.name})
RELAY_INBOX = frozenset(m.name for m in (RELAY_WELCOME, RELAY_DOWN, RELAY_STEP, ALIVE, UNKNOWN_PEER, REJECT, SHUTDOWN,
                                         JOB_FAILED))


def validate(header: Any, allowed: frozenset[str], n_frames: int) -> MessageType:
    """Check a decoded header against its schema; return its type or raise ProtocolError."""
    if type(header) is not dict:
        raise ProtocolError(f"header is {type(header).__name__}, expected map")
    name = header.get("type")
    if type(name) is not str or name not in allowed:
        raise ProtocolError(f"message type {name!r} not accepted on this socket")
    kind = ALL_TYPES[name]
    _check_fields(header, kind.fields, "")
    if not len(kind.arrays) <= n_frames <= len(kind.arrays) + kind.tail:
        more = f" (and up to {kind.tail} more)" if kind.tail else ""
        raise ProtocolError(f"{name}: expected {len(kind.arrays)} data frames{more}, got {n_frames}")
    if any(spec.dtype is None for spec in kind.arrays) and header["dtype"] not in TOKEN_DTYPES:
        raise ProtocolError(f"{name}: dtype {header['dtype']!r} not one of {TOKEN_DTYPES}")
    return kind


def step_header(step: int, rank: int, row_len: int, max_over_mean: float, naive_max_over_mean: float,
                rank_cost: float, naive_rank_cost: float) -> dict[str, Any]:
    """A rank's step_header (its recipe and counts follow as arrays): written by the coordinator
    for a rank it serves directly and by a relay from a relay_step, the same either way. The plan
    summary is O(1): this rank's costs and the step's balance, never every rank's."""
    return {"type": STEP_HEADER.name, "step": step, "rank": rank, "row_len": row_len,
            "plan": {"max_over_mean": max_over_mean, "naive_max_over_mean": naive_max_over_mean,
                     "rank_cost": rank_cost, "naive_rank_cost": naive_rank_cost}}


def make(kind: MessageType, **fields: Any) -> dict[str, Any]:
    """Build a header for `kind`. Only the field names are checked here (a cheap guard against
    sender bugs); receivers validate everything, since they cannot trust the sender."""
    if fields.keys() != kind.fields.keys():
        raise ProtocolError(f"{kind.name}: fields {sorted(fields)} != schema {sorted(kind.fields)}")
    return {"type": kind.name, **fields}
