"""Every wire message of megascale-data, declared once: a typed class per message, with its schema.

Each message is a frozen dataclass declared with `@message` below: its header fields (each with
the check a receiver applies) and its array frames, in order. Every role builds what it sends as
one of these and reads what it receives as one (wire.encode, wire.receive); the coordinator's
events are these classes with the sender and the time added (coordinator/events.py), and the
simulator passes them through the same encode and decode. Nothing here imports the job spec.

On the wire a message is a msgpack map (frame 0) with key "type", optionally followed by raw
array frames. `validate()` checks a decoded header against the schema of its type and the set of
types a socket role may receive, so a message in the wrong direction or with a bad field is
rejected in one place, before any handler sees it.
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import MISSING, dataclass, field
from dataclasses import fields as dataclass_fields
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from .doc_keys import RECORD_MASK
from .errors import ProtocolError

if TYPE_CHECKING:
    import numpy as np

# 13: images as uint8 frames in pieces.extras (pixel_frames, pixel_recipe), prepared.array_bytes;
# 12: host_heartbeat.pids, worker_exited.source/record/overran_s, prepare/deliver.worker_id, delivered.unserved,
# job_failed to workers, hosts and relays; 11: delivered.failed; 10: pieces.extras (a processor's arrays); 9: relays;
# 8: job_failed; 7: pieces.loss_mask, epochs of prepare and deliver, eval_*; 6: welcome.count
PROTOCOL_VERSION = 13

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
        try:
            for v in value:
                item(v, path)
        except ProtocolError:  # named by the element's own path: made only when one fails
            for i, v in enumerate(value):
                item(v, f"{path}[{i}]")
            raise

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
RELAY_LOSS = columns("RelayLoss", "rank", "step", "source", "tokens")  # relay -> coordinator (mixture.adapt)


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
    nbytes = arrays["array_bytes"]
    if nbytes.size and (len(nbytes) != len(lengths) or int(nbytes.min()) < 0):
        raise ProtocolError("prepared: array_bytes must be empty, or one non-negative count per record")


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


ArrayCheck = Callable[[dict[str, Any], dict[str, Any]], None]


@dataclass(frozen=True)
class MessageType:
    """The schema of one message, derived from its class: the header's field checks, its array
    frames in order, and the class that holds a decoded one."""

    name: str
    fields: dict[str, Check]
    arrays: tuple[ArraySpec, ...] = ()
    check: ArrayCheck | None = None  # consistency of the arrays (ranges, totals), after decoding
    # up to this many more raw byte frames after the arrays (decoded as the list arrays["tail"]):
    # a processor's arrays, each its own frame, sent without being copied into one
    tail: int = 0
    cls: Any = None


class Message:
    """A wire message: a frozen dataclass declared once below with `@message`, whose fields are
    the header's (each with its check) and its array frames (`frame`, in order). Every role builds
    the messages it sends as these, and reads the ones it receives as these (wire.receive)."""

    __slots__ = ()
    KIND: ClassVar[MessageType]
    TYPE: ClassVar[str]

    # `@message` writes these three for each class, for its own fields (_specialise).

    def header(self) -> dict[str, Any]:
        """The header map: "type" and the header fields."""
        raise NotImplementedError("declared with @message")

    def frames(self) -> tuple[Any, ...]:
        """The array frames, in order."""
        raise NotImplementedError("declared with @message")

    @classmethod
    def from_wire(cls, header: dict[str, Any], arrays: dict[str, Any]) -> "Message":
        """The message of a header and arrays that wire.decode checked against this type. Fields
        the schema does not name (a newer peer's additions) are left out."""
        raise NotImplementedError("declared with @message")


def hdr(check: Check, default: Any = MISSING) -> Any:
    """A header field and its check; a default serves messages built here (tests, old stimulus
    logs): on the wire every field is required."""
    return field(default=default, metadata={"check": check})


def frame(dtype: str | None, table: tuple = (), optional: bool = False) -> Any:
    """An array frame (see ArraySpec); `optional`: it defaults to empty where built here."""
    meta = {"array": (dtype, table)}
    if optional:
        return field(default_factory=lambda: _empty(dtype or "<u8", len(table)), metadata=meta)
    return field(metadata=meta)


def _empty(dtype: str, cols: int) -> Any:
    import numpy as np

    return np.zeros((0, cols) if cols > 1 else 0, dtype)


def message(name: str, check: ArrayCheck | None = None, tail: int = 0) -> Callable[[type], Any]:
    """Declare a message class: a frozen, slotted, keyword-only dataclass and its MessageType."""

    def wrap(cls: type) -> Any:
        cls = dataclass(frozen=True, slots=True, kw_only=True)(cls)
        checks: dict[str, Check] = {}
        arrays: list[ArraySpec] = []
        for f in dataclass_fields(cls):
            if "check" in f.metadata:
                checks[f.name] = f.metadata["check"]
            elif "array" in f.metadata:
                arrays.append(ArraySpec(f.name, *f.metadata["array"]))
        cls.TYPE = name
        cls.KIND = MessageType(name, checks, tuple(arrays), check, tail, cls)
        _specialise(cls)
        return cls

    return wrap


def _specialise(cls: type) -> None:
    """header(), frames() and from_wire() written out for the class's own fields, as dataclasses
    writes __init__: the generic versions (getattr per field) cost the coordinator about 4 us per
    step_header, 16 ms a step at DP 4,096 (tools/bench_wire.py)."""
    kind = cls.KIND
    head = ", ".join([f"'type': {kind.name!r}", *(f"{n!r}: self.{n}" for n in kind.fields)])
    names = [spec.name for spec in kind.arrays] + (["tail"] if kind.tail else [])
    args = ", ".join([*(f"{n}=h[{n!r}]" for n in kind.fields), *(f"{n}=a[{n!r}]" for n in names)])
    frames = "".join(f"self.{spec.name}, " for spec in kind.arrays)
    code = (f"def header(self):\n    return {{{head}}}\n"
            f"def frames(self):\n    return ({frames})\n"
            f"def from_wire(cls, h, a):\n    return cls({args})\n")
    namespace: dict[str, Any] = {}
    exec(code, namespace)  # noqa: S102 - our own field names, not input
    cls.header = namespace["header"]
    cls.frames = namespace["frames"]
    cls.from_wire = classmethod(namespace["from_wire"])


# ---------------------------------------------------------------- worker -> coordinator


@message("worker_hello")
class WorkerHello(Message):
    version: int = hdr(integer())
    host: str = hdr(text())
    pid: int = hdr(integer())
    incarnation: int = hdr(integer())
    agent: int = hdr(integer())  # the host agent that started it (its agent_id)


@message("worker_heartbeat")
class WorkerHeartbeat(Message):
    worker_id: int = hdr(integer())
    cached_records: int = hdr(integer())
    busy_s: float = hdr(number())  # total time spent preparing and delivering
    backlog: int = hdr(integer(), 0)  # piece messages waiting for a rank's socket
    send_waits: int = hdr(integer(), 0)  # sends that found a rank's socket full, since registration


@message("prepared", check=_check_prepared)
class Prepared(Message):
    worker_id: int = hdr(integer())
    task_id: int = hdr(integer())
    # [[index into the task's records, reason, kind]] for records skipped (kind: readers.errors.SKIP_KINDS)
    skipped: list = hdr(seq(tup(integer(), text(MAX_STR_LEN), text(32))))
    busy_s: float = hdr(number())  # seconds spent on the task: the coordinator's per-source cost estimate
    lengths: "np.ndarray" = frame("<i8")  # tokens per record, in task order; 0 for a skipped record
    patches: "np.ndarray" = frame("<i8")  # image patches per record (empty for a source without images)
    # the sum over each record's images of their patches squared (empty: the patches squared, one image)
    patch_squares: "np.ndarray" = frame("<i8", optional=True)
    # per record, the bytes of its arrays beside its tokens (image frames, a processor's arrays), which
    # runtime.ahead_bytes caps per rank; empty: none (a text source)
    array_bytes: "np.ndarray" = frame("<i8", optional=True)


@message("task_failed")
class TaskFailed(Message):
    worker_id: int = hdr(integer())
    task_id: int = hdr(integer())
    reason: str = hdr(text(MAX_STR_LEN))


@message("source_counts")
class SourceCounts(Message):
    """Answering a welcome's `count`: the records of each source it names, as this host's indexes
    count them (problems[i]: why source i could not be opened here, "" if it could)."""

    worker_id: int = hdr(integer())
    sources: list = hdr(seq(integer(0, 0xFFFF), 0x10000))
    records: list = hdr(seq(integer(), 0x10000))
    problems: list = hdr(seq(text(MAX_STR_LEN), 0x10000))


@message("delivered")
class Delivered(Message):
    worker_id: int = hdr(integer())
    delivery_id: int = hdr(integer())
    # [[source, record, reason, kind]] of samples sent with nothing to train on, their image pass having
    # failed at delivery (worker/image_plan.py); kind as in prepared.skipped
    failed: list = hdr(seq(tup(integer(0, 0xFFFF), integer(), text(MAX_STR_LEN), text(32))), ())
    # pieces it was asked for and could not send (not in its cache: its books and the coordinator's
    # disagree); the coordinator then prepares what it held again elsewhere
    unserved: int = hdr(integer(), 0)


# ---------------------------------------------------------------- host agent -> coordinator


@message("host_hello")
class HostHello(Message):
    """Its process count and limits (`msd worker --procs auto --max-procs N`)."""

    version: int = hdr(integer())
    agent_id: int = hdr(integer())
    host: str = hdr(text())
    procs: int = hdr(integer())
    min_procs: int = hdr(integer())
    max_procs: int = hdr(integer())
    auto: int = hdr(integer(0, 1))


@message("host_heartbeat")
class HostHeartbeat(Message):
    agent_id: int = hdr(integer())
    procs: int = hdr(integer())
    # its worker processes alive and busy on one bounded piece of work (a sample, loading a processor):
    # the agent vouches for them (a worker busy on one sample for minutes sends no heartbeat of its own,
    # and is alive while its process is, up to its source's max_sample_s)
    pids: list = hdr(seq(integer(), 4096), ())


@message("worker_exited")
class WorkerExited(Message):
    """At once: one of its worker processes ended (exitcode: negative for a signal)."""

    agent_id: int = hdr(integer())
    pid: int = hdr(integer())
    exitcode: int = hdr(integer(-(1 << 31), 1 << 31))
    task_id: int = hdr(integer(-1))  # the prepare task it was working on, -1: none (what blames a poison record)
    source: int = hdr(integer(-1, 0xFFFF), -1)  # the sample it was making (-1: none)
    record: int = hdr(integer(-1), -1)
    # > 0: its agent stopped it, that sample having run that long past its source's max_sample_s (poison)
    overran_s: float = hdr(number(), 0.0)


# ---------------------------------------------------------------- coordinator -> worker, host agent


@message("welcome")
class Welcome(Message):
    worker_id: int = hdr(integer())
    job: Any = hdr(worker_job())
    heartbeat_s: float = hdr(number())
    # sources whose record counts the coordinator asks for (a coordinator waiting for its workers to
    # index them, runtime.index_on: workers); empty otherwise
    count: list = hdr(seq(integer(0, 0xFFFF), 0x10000))


@message("scale")
class Scale(Message):
    """Run this many worker processes (within the host's limits)."""

    procs: int = hdr(integer())
    retire: list = hdr(seq(integer(), 4096))  # pids to stop
    reason: str = hdr(text())
    heartbeat_s: float = hdr(number())  # how often the host heartbeats (the job's runtime.heartbeat_s)


@message("prepare", check=_check_prepare)
class Prepare(Message):
    task_id: int = hdr(integer())
    source: int = hdr(integer(0, 0xFFFF))
    worker_id: int = hdr(integer())  # the registration it is for: a worker registered again since drops it
    records: "np.ndarray" = frame("<u8")
    # the pass over the source of each record (a transform's ctx.epoch: its randomness and its sample)
    epochs: "np.ndarray" = frame("<u4", optional=True)


@message("deliver", check=_check_deliver)
class Deliver(Message):
    worker_id: int = hdr(integer())  # the registration it is for: a worker registered again since drops it
    delivery_id: int = hdr(integer())
    step: int = hdr(integer())
    addresses: list = hdr(seq(text()))
    items: "np.ndarray" = frame("<u8", DELIVER_ITEM)  # piece: the index in the rank's recipe
    release: "np.ndarray" = frame("<u8")  # doc keys whose prepared copy is used up (one per prepared copy)
    # the epoch of each item's record (the prepared copy it is cut from), and of each released copy
    epochs: "np.ndarray" = frame("<u4", optional=True)
    release_epochs: "np.ndarray" = frame("<u4", optional=True)
    # where each rank's pieces go: its data address, an index into `addresses` (each address once: many
    # ranks share their relay's; a [rank, address] list of strings was 83 KB a step at DP 4,096)
    targets: "np.ndarray" = frame("<u8", DELIVER_TARGET)


@message("release_rank")
class ReleaseRank(Message):
    """The rank at this data address has gone (its heartbeats stopped, or it said bye): drop what
    waits to be sent to it."""

    rank: int = hdr(integer())
    address: str = hdr(text())


# ---------------------------------------------------------------- coordinator -> any peer


@message("reject")
class Reject(Message):
    reason: str = hdr(text(MAX_STR_LEN))


@message("alive")
class Alive(Message):
    """In answer to each heartbeat: the coordinator is alive (a peer that hears nothing for 3
    heartbeats moves on to the next coordinator address it was given)."""


@message("shutdown")
class Shutdown(Message):
    reason: str = hdr(text())


@message("unknown_peer")
class UnknownPeer(Message):
    """The coordinator does not know this peer (it restarted, or declared the peer dead): say hello again."""

    reason: str = hdr(text(MAX_STR_LEN))


@message("job_failed")
class JobFailed(Message):
    """The job was stopped on a fatal error: every rank raises JobFailedError with the reason."""

    reason: str = hdr(text(MAX_STR_LEN))


# ---------------------------------------------------------------- trainer -> coordinator


@message("trainer_hello")
class TrainerHello(Message):
    version: int = hdr(integer())
    rank: int = hdr(integer())
    data_address: str = hdr(text())
    resume_step: int = hdr(integer())
    incarnation: int = hdr(integer())
    metadata_only: int = hdr(integer(0, 1))  # a middle pipeline stage asking for the packing metadata
    # the coordinator's state before resume_step, from the trainer's checkpoint (None: not carried):
    # a coordinator without a state dir resumes from it
    carried: Any = hdr(anything(), None)


@message("state_request")
class StateRequest(Message):
    """The coordinator's state before `step`, for the trainer's checkpoint."""

    rank: int = hdr(integer())
    step: int = hdr(integer())


@message("consumed")
class Consumed(Message):
    rank: int = hdr(integer())
    step: int = hdr(integer())
    waited_s: float = hdr(number())  # total time waiting for data
    # the step whose micro-batches compute_s times, in seconds each (balance.calibrate; -1 and [] otherwise)
    compute_step: int = hdr(integer(-1), -1)
    compute_s: list = hdr(seq(number(), 1 << 16), ())
    # the trainer's training loss of step loss_step (DataClient.report_loss; -1 and [] otherwise):
    # per source index, the summed loss and the tokens it was summed over (mixture.adapt)
    loss_step: int = hdr(integer(-1), -1)
    loss_sources: list = hdr(seq(integer(), 1 << 16), ())
    loss_sums: list = hdr(seq(number(), 1 << 16), ())
    loss_tokens: list = hdr(seq(integer(), 1 << 16), ())


@message("trainer_heartbeat")
class TrainerHeartbeat(Message):
    rank: int = hdr(integer())


@message("trainer_bye")
class TrainerBye(Message):
    rank: int = hdr(integer())


@message("eval_request")
class EvalRequest(Message):
    """This rank asks for pass `pass_no` of an eval set (client.eval_batches)."""

    rank: int = hdr(integer())
    set: str = hdr(text(256))
    pass_no: int = hdr(integer())


@message("eval_report")
class EvalReport(Message):
    """Mean loss per source of one evaluation (client.report_eval), from training step `step`."""

    rank: int = hdr(integer())
    set: str = hdr(text(256))
    step: int = hdr(integer())
    losses: Any = hdr(anything())


# ---------------------------------------------------------------- coordinator -> trainer


@message("trainer_welcome")
class TrainerWelcome(Message):
    rank: int = hdr(integer())
    batch: Any = hdr(anything())
    plan_digest: str = hdr(text())
    heartbeat_s: float = hdr(number())


@message("step_header", check=_check_step_header)
class StepHeader(Message):
    """A rank's recipe for one step: written by the coordinator for a rank it serves directly and
    by a relay from a relay_step, the same either way (step_header() below)."""

    step: int = hdr(integer())
    rank: int = hdr(integer())
    row_len: int = hdr(integer(1, MAX_PIECE_LEN))  # tokens per packed sequence of this step, padding included
    plan: Any = hdr(anything())
    pieces: "np.ndarray" = frame("<u8", RECIPE_PIECE)  # in packing order
    counts: "np.ndarray" = frame("<u4")  # pieces per sequence, micro-batch major: [m * micro_batch_size + s]


@message("eval_header", check=_check_step_header)
class EvalHeader(Message):
    """This rank's rows of one pass over an eval set (its recipe, as step_header's); the pieces come
    from workers as `pieces` of step `step` (EVAL_STEP_BASE and up). reason: why the pass cannot be
    served ("" when it is)."""

    set: str = hdr(text(256))
    pass_no: int = hdr(integer())
    rank: int = hdr(integer())
    step: int = hdr(integer())
    row_len: int = hdr(integer(1, MAX_PIECE_LEN))
    reason: str = hdr(text(MAX_STR_LEN))
    pieces: "np.ndarray" = frame("<u8", RECIPE_PIECE)
    counts: "np.ndarray" = frame("<u4")


@message("rank_taken")
class RankTaken(Message):
    """The rank is held by another live client: keep saying hello (it is yours once that one is gone)."""

    rank: int = hdr(integer())
    reason: str = hdr(text(MAX_STR_LEN))


@message("end_of_stream")
class EndOfStream(Message):
    """No step at or after `step` will be planned (a source with on_exhausted: stop ran out)."""

    step: int = hdr(integer())
    reason: str = hdr(text(MAX_STR_LEN))


@message("state_reply")
class StateReply(Message):
    """The answer to a state_request (state: {digest, planner, mixture_changes, quarantined})."""

    step: int = hdr(integer())
    ok: int = hdr(integer(0, 1))
    reason: str = hdr(text(MAX_STR_LEN))
    state: Any = hdr(anything())


# ---------------------------------------------------------------- worker -> trainer


@message("pieces", check=_check_pieces, tail=MAX_EXTRA_FRAMES)
class Pieces(Message):
    """Items [piece, doc_key, doc_offset, length] (piece: the index in the rank's step recipe, checked
    against the recipe's reference); their tokens, concatenated in item order, in the header's dtype.
    Image-text sources: per item, the patches of its image placeholders, uint8 rows of patch_bytes.
    loss_mask: empty, or one uint8 per token (1: trained on) where a piece comes from a source with masks.
    extras: a processor's arrays ([name, dtype, row shape, per_token]); extra_rows: [items x extras] rows
    of each, 0 or the item's length for a per-token one; then a trailing frame per item and extra with
    rows (its bytes), item after item, extra after extra (`tail`)."""

    step: int = hdr(integer())
    rank: int = hdr(integer())
    dtype: str = hdr(text(8))
    patch_bytes: int = hdr(integer(0, 1 << 24))
    extras: list = hdr(seq(tup(text(64), text(8), seq(integer(1, 1 << 24), 4), integer(0, 1)), MAX_EXTRAS))
    items: "np.ndarray" = frame("<u8", PIECE_ITEM)
    tokens: "np.ndarray" = frame(None)
    patch_counts: "np.ndarray" = frame("<u4")
    patches: "np.ndarray" = frame("|u1")
    loss_mask: "np.ndarray" = frame("|u1")
    extra_rows: "np.ndarray" = frame("<u4")
    tail: Any = ()


# ---------------------------------------------------------------- relay <-> coordinator

# a relay's counters, in its heartbeats and relay_up
_RELAY_COUNTERS = ("ranks", "bytes_in", "bytes_out", "queued", "late_steps")


@message("relay_hello")
class RelayHello(Message):
    """A relay (one per trainer host, `msd relay`). data_address: where workers push the pieces of its
    ranks (one connection per worker process and relay, whatever the number of its ranks); local: the
    endpoint its ranks reach it at (a relay started again on a host, at the same endpoint, replaces
    the old one)."""

    version: int = hdr(integer())
    host: str = hdr(text())
    data_address: str = hdr(text())
    local: str = hdr(text())
    incarnation: int = hdr(integer())


@message("relay_heartbeat")
class RelayHeartbeat(Message):
    relay_id: int = hdr(integer())
    ranks: list = hdr(seq(integer(), 1 << 16))  # the ranks behind it that are alive (their heartbeats stop there)
    bytes_in: int = hdr(integer(), 0)
    bytes_out: int = hdr(integer(), 0)
    queued: int = hdr(integer(), 0)
    late_steps: int = hdr(integer(), 0)


@message("relay_up", check=_check_relay_up)
class RelayUp(Message):
    """The messages of its ranks (TRAINER_UP messages, each checked as if the rank had sent it),
    gathered; their plain `consumed` (no compute times) as table rows, a host's of one step together:
    one event for all, where a message each cost the coordinator 15-20 us per rank and step. It
    counts as a heartbeat (its counters too): a relay that sends one a step sends no heartbeats."""

    relay_id: int = hdr(integer())
    messages: list = hdr(seq(anything(), 1 << 16))
    ranks: list = hdr(seq(integer(), 1 << 16))
    bytes_in: int = hdr(integer(), 0)
    bytes_out: int = hdr(integer(), 0)
    queued: int = hdr(integer(), 0)
    late_steps: int = hdr(integer(), 0)
    consumed: "np.ndarray" = frame("<i8", RELAY_CONSUMED)
    waited_s: "np.ndarray" = frame("<f8")
    # the ranks' training losses that came with their `consumed` (DataClient.report_loss): a row per
    # rank, step and source, and its summed loss
    losses: "np.ndarray" = frame("<i8", RELAY_LOSS, optional=True)
    loss_sums: "np.ndarray" = frame("<f8", optional=True)


@message("relay_welcome")
class RelayWelcome(Message):
    relay_id: int = hdr(integer())
    heartbeat_s: float = hdr(number())
    topology: Any = hdr(anything())


@message("relay_down")
class RelayDown(Message):
    """The coordinator's messages to the relay's ranks, gathered: parts [rank, header, byte size of
    each array frame]; the array frames of every part, concatenated in part order, in `blob`."""

    parts: list = hdr(seq(tup(integer(), anything(), seq(integer(), 8)), 1 << 16))
    blob: "np.ndarray" = frame("|u1")


@message("relay_step", check=_check_relay_step)
class RelayStep(Message):
    """One step's recipes for its ranks (what a step_header says to each), per DP rank once: `dps` the
    DP ranks (in order), `pieces` theirs concatenated (RECIPE_PIECE rows, piece_counts of each),
    `counts` a row of pieces per sequence each, the plan's summary per DP rank; `ranks` [rank, index
    into dps]. The relay writes each rank's step_header (the coordinator's work per step grows with hosts)."""

    step: int = hdr(integer())
    row_len: int = hdr(integer(1, MAX_PIECE_LEN))
    dps: list = hdr(seq(integer()))
    ranks: list = hdr(seq(tup(integer(), integer())))
    piece_counts: list = hdr(seq(integer()))
    rank_costs: list = hdr(seq(number()))
    naive_costs: list = hdr(seq(number()))
    max_over_mean: float = hdr(number())
    naive_max_over_mean: float = hdr(number())
    pieces: "np.ndarray" = frame("<u8", RECIPE_PIECE)
    counts: "np.ndarray" = frame("<u4")


# ---------------------------------------------------------------- tools (msd mix, msd status) <-> coordinator


@message("mix_request")
class MixRequest(Message):
    """New mixture weights from step `at_step` on."""

    at_step: int = hdr(integer())
    weights: Any = hdr(anything())


@message("mix_reply")
class MixReply(Message):
    ok: int = hdr(integer(0, 1))
    reason: str = hdr(text(MAX_STR_LEN))
    at_step: int = hdr(integer())


@message("status_request")
class StatusRequest(Message):
    """A snapshot of the running job, answered by the coordinator's shell."""


@message("status_reply")
class StatusReply(Message):
    status: Any = hdr(anything())


ALL_TYPES: dict[str, MessageType] = {
    cls.TYPE: cls.KIND
    for cls in (
        WorkerHello, WorkerHeartbeat, Prepared, TaskFailed, Delivered, Welcome, Prepare, Deliver, ReleaseRank,
        Reject, Alive, SourceCounts, HostHello, HostHeartbeat, Scale, WorkerExited, Shutdown, UnknownPeer,
        TrainerHello, Consumed, TrainerHeartbeat, TrainerBye, TrainerWelcome, StepHeader, EndOfStream, RankTaken,
        Pieces, MixRequest, MixReply, StateRequest, StateReply, StatusRequest, StatusReply, EvalRequest,
        EvalReport, EvalHeader, JobFailed, RelayHello, RelayHeartbeat, RelayUp, RelayWelcome, RelayDown, RelayStep,
    )
}


def _types(*classes: type[Message]) -> frozenset[str]:
    return frozenset(cls.TYPE for cls in classes)


# What each socket role may receive; anything else is rejected at decode.
COORDINATOR_INBOX = _types(WorkerHello, WorkerHeartbeat, Prepared, TaskFailed, Delivered, HostHello, HostHeartbeat,
                           WorkerExited, SourceCounts, TrainerHello, Consumed, TrainerHeartbeat, TrainerBye,
                           MixRequest, StateRequest, StatusRequest, EvalRequest, EvalReport, RelayHello,
                           RelayHeartbeat, RelayUp)
# what a rank sends its coordinator (or its relay, which passes them up in RELAY_UP)
TRAINER_UP = _types(TrainerHello, Consumed, TrainerHeartbeat, TrainerBye, StateRequest, EvalRequest, EvalReport)
# requests that change the plan: on a CURVE job, accepted only from an operator key
CONTROL_REQUESTS = _types(MixRequest)
TOOL_INBOX = _types(MixReply, StatusReply)
HOST_INBOX = _types(Scale, Reject, Shutdown, UnknownPeer, Alive, JobFailed)
WORKER_INBOX = _types(Welcome, Prepare, Deliver, ReleaseRank, Reject, Shutdown, UnknownPeer, Alive, JobFailed)
TRAINER_CONTROL_INBOX = _types(TrainerWelcome, StepHeader, EndOfStream, RankTaken, Reject, Shutdown, UnknownPeer,
                               StateReply, Alive, EvalHeader, JobFailed)
TRAINER_DATA_INBOX = _types(Pieces)
RELAY_INBOX = _types(RelayWelcome, RelayDown, RelayStep, Alive, UnknownPeer, Reject, Shutdown, JobFailed)


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
                rank_cost: float, naive_rank_cost: float, pieces: "np.ndarray", counts: "np.ndarray") -> StepHeader:
    """A rank's step_header: written by the coordinator for a rank it serves directly and by a
    relay from a relay_step, the same either way. The plan summary is O(1): this rank's costs and
    the step's balance, never every rank's."""
    return StepHeader(step=step, rank=rank, row_len=row_len, pieces=pieces, counts=counts,
                      plan={"max_over_mean": max_over_mean, "naive_max_over_mean": naive_max_over_mean,
                            "rank_cost": rank_cost, "naive_rank_cost": naive_rank_cost})


def make(cls: type[Message], **fields: Any) -> dict[str, Any]:
    """A raw header of type `cls`, for what must send one unchecked (tests of a receiver's
    checks). Only the field names are checked here; receivers validate everything."""
    kind = cls.KIND
    if fields.keys() != kind.fields.keys():
        raise ProtocolError(f"{kind.name}: fields {sorted(fields)} != schema {sorted(kind.fields)}")
    return {"type": kind.name, **fields}
