"""DataClient: what a trainer rank imports to receive its batches.

A background thread owns both sockets (a DEALER to the coordinator, a PULL data socket that
workers push pieces to) and keeps heartbeats flowing while the trainer computes; what arrives
goes to a ReceivingState (receiving.py), which deduplicates pieces by (step, index in the step's
recipe), checks each against its recipe entry, and hands a step over once its recipe and all its
pieces are in. A builder thread (prebuild.py) builds the micro-batch the trainer will take next
while it computes on the current one, into reused buffers (buffers.py), so that `next()` finds it
built. The client decides nothing about what data it gets; it only assembles what the coordinator
planned.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from typing import Any, Iterator

import msgpack
import numpy as np
import zmq

from msd_common import memory, security
from msd_common.errors import MsdError, PeerLostError, RejectedError
from msd_common.frames import PendingPixels

from .losses import LossSums
from .assemble import StepAssembler
from .batch import Batch
from .buffers import BufferPool
from .prebuild import Prebuilder
from msd_common.relay_endpoints import default_endpoint, rank_endpoint
from .rank_core import Action, CoordinatorStopping, RankCore, Send, ToEvals, ToStateReplies, ToTrainer
from .receiving import End, ReadyStep, ReceivingState, for_rank
from msd_common.session import WAITING_HINT, PeerLoop, check_address, split_addresses
from msd_common.sockets import NOWAIT, make_socket, send_nowait, waiting

log = logging.getLogger("msd.client")

STATE_VERSION = 1  # the "coordinator" key was added in protocol 5; older states load without it
STATE_TIMEOUT_S = 10.0  # state_dict() waits this long for the coordinator's state
# Image and video frames of every size come and go in the trainer's heap, and freed ones stay
# resident as holes there (the more so with keep_freed_memory's thresholds): once this many bytes of
# frames have been let go, the builder's thread gives the heap's free pages back (about 1 ms; a text
# job never does).
TRIM_AFTER_RELEASED_BYTES = 16 << 20
_ids = itertools.count()


def _to_torch(batch: dict[str, Any], pin: bool) -> Batch:
    import torch

    out = Batch({k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in batch.items()})
    return out.pin_memory() if pin else out


def _can_pin() -> bool:
    import torch

    if torch.cuda.is_available():
        return True
    log.warning("pin_memory=True: no CUDA device here, so there is nothing to pin for; tensors stay in pageable memory")
    return False


def _from_environment(coordinator: str | None, rank: int | None) -> tuple[str, int]:
    """The coordinator's address and this rank, from the arguments or else the environment
    (MSD_COORDINATOR, and RANK as torchrun and the Kubernetes training operators set it)."""
    coordinator = coordinator or os.environ.get("MSD_COORDINATOR") or None
    if coordinator is None:
        raise ValueError("DataClient: no coordinator address: pass DataClient('tcp://HOST:5555', ...) or set "
                         "MSD_COORDINATOR")
    if rank is None:
        value = os.environ.get("RANK")
        if value is None:
            raise ValueError("DataClient: no rank: pass rank= or set RANK (torchrun sets it)")
        try:
            rank = int(value)
        except ValueError:
            raise ValueError(f"DataClient: RANK={value!r} is not an integer") from None
    return coordinator, rank


class DataClient:
    """Receives the packed micro-batches of one trainer rank, in training order.

    Args:
        coordinator: the coordinator's address, e.g. "tcp://10.0.0.1:5555", or a primary's and its
            standbys', comma-separated ("tcp://a:5555,tcp://b:5555"): the client moves to the one that serves.
            Default: the environment variable MSD_COORDINATOR (the Helm chart's trainer pods set it).
        rank: this process's global trainer rank. Default: the environment variable RANK (torchrun's).
        host: the address workers use to reach this process (advertised to them); the data
            socket binds on `bind_host` (default: the same) at a free port.
        bind_host: the interface the data socket binds on, where it differs from `host` (a
            container or a NAT that workers reach at another address): "0.0.0.0" for every
            interface. Default: `host`.
        timeout_s: how long `next()` waits for a micro-batch before raising PeerLostError.
        as_torch: return torch tensors (default: when torch is importable) or numpy arrays.
        pin_memory: torch tensors in pinned host memory, so `batch.to("cuda", non_blocking=True)`
            overlaps the copy with compute (ignored, with a warning, where there is no CUDA device).
        keep_freed_memory: raise glibc's mmap/trim thresholds in this process, so that each
            step's buffers reuse memory instead of page-faulting fresh pages (msd_common.memory;
            up to ~300 MiB more resident memory, several times cheaper batch assembly), and give
            the heap's free pages back once, when the client has started (what importing and
            setting it up left free).
        metadata_only: for a middle pipeline stage, which gets no data otherwise: receive the
            packing metadata of its DP rank's micro-batches (cu_seqlens, doc_keys, ...).
        keys_dir: the job's key directory (msd keys generate) when it sets security.curve (default:
            the environment variable MSD_KEYS, if set): the
            client then speaks CURVE to the coordinator and accepts data only from workers whose
            public key is authorised (behind a relay, the relay does; its ranks speak ipc to it).
        relay: the endpoint of this host's relay (`msd relay`, one per trainer host), or "auto" for
            the default endpoint of this coordinator's relay; the rank then speaks to the relay
            only, which speaks for the host's ranks and fans out their pieces. Default: the
            environment variable MSD_RELAY, if set (for launchers that cannot change the training
            script); without it, the rank speaks to the coordinator and workers directly.
        relay_timeout_s: behind a relay, `next()` raises PeerLostError naming the relay once it has
            been silent this long (a relay that is not restarted).
        coordinator_timeout_s: `next()` raises PeerLostError naming the coordinator once it has not
            answered this long (killed, or its host lost; a warning says so after three heartbeats).
        stop_grace_s: after the coordinator says it stops (SIGTERM), how long a standby (or a
            coordinator restarted at the same address) has to welcome this rank before `next()`
            raises CoordinatorStoppedError naming the stop. A stop never ends the iteration: only
            the job's real end (end of the data) does.
        device: where `pixel_values` are made (a torch device, e.g. "cuda:0"): images arrive as
            uint8 frames, which `next()` copies to this device and finishes there (rescale,
            normalise, the processor's patch layout); the batch's other tensors stay on the CPU.
            Default: finished on the CPU by the client's builder thread, ahead of `next()` while
            the trainer computes (at `next()` they would cost it ~25 ms a micro-batch of 8,192
            tokens of images: tools/bench_next_vlm.py).

    Attributes:
        waited_s: seconds `next()` has spent waiting for data.
        bytes_received: bytes of the data messages that reached this rank (pieces and their arrays).
    """

    def __init__(self, coordinator: str | None = None, rank: int | None = None, *, host: str = "127.0.0.1",
                 bind_host: str | None = None, timeout_s: float = 300.0, as_torch: bool | None = None,
                 keep_freed_memory: bool = True, keys_dir: str | None = None, metadata_only: bool = False,
                 pin_memory: bool = False, relay: str | None = None, relay_timeout_s: float = 30.0,
                 coordinator_timeout_s: float = 30.0, stop_grace_s: float = 15.0, device: Any = None) -> None:
        coordinator, rank = _from_environment(coordinator, rank)
        split_addresses(coordinator)  # an address it cannot use is refused now, saying what form it takes
        keys_dir = keys_dir if keys_dir is not None else (os.environ.get("MSD_KEYS") or None)
        self.coordinator = coordinator
        relay = relay if relay is not None else (os.environ.get("MSD_RELAY") or None)
        self.relay = default_endpoint(coordinator) if relay == "auto" else relay
        if self.relay is not None:
            check_address(self.relay)
        self.relay_timeout_s = relay_timeout_s
        self.coordinator_timeout_s = coordinator_timeout_s
        self.stop_grace_s = stop_grace_s
        self.rank = rank
        self.host = host
        self.bind_host = bind_host or host
        self.timeout_s = timeout_s
        if as_torch is None:
            try:
                import torch  # noqa: F401

                as_torch = True
            except ImportError:
                as_torch = False
        self.as_torch = as_torch
        if device is not None and not as_torch:
            raise ValueError("DataClient: device= makes pixel values as torch tensors; it needs as_torch (and torch)")
        self.device = device
        self.pin_memory = pin_memory and as_torch and _can_pin()
        self.keep_freed_memory = keep_freed_memory
        if keep_freed_memory:
            memory.keep_freed_memory()
        self.next_step = 0
        self.waited_s = 0.0  # time __next__ spent waiting for data (the data-wait share of a training run)
        self.bytes_received = 0  # of the pieces messages that reached this rank (its data on the wire)
        self.next_micro_batch = 0
        self._plan_digest: str | None = None  # from a checkpoint, until the I/O thread knows the coordinator's
        self._carried: tuple[int, dict] | None = None  # (step, coordinator state) from a checkpoint
        self._state_replies: queue.SimpleQueue = queue.SimpleQueue()  # StateReply from the I/O thread
        self._evals: queue.SimpleQueue = queue.SimpleQueue()  # EvalReady from the I/O thread
        self._eval_passes: dict[str, int] = {}  # eval set -> passes this rank has asked for
        # balance.calibrate: seconds the trainer computed on each micro-batch, by step
        self._compute: dict[int, dict[int, float]] = {}
        self._handed: tuple[int, int] | None = None  # (step, micro-batch) handed out by the last next()
        self._handed_at = 0.0
        self._manual_compute = False  # the trainer reports its compute itself
        self._losses = LossSums()  # report_loss: per step and source, for mixture.adapt
        self._ctx = zmq.Context()
        self.keys_dir = keys_dir
        self.metadata_only = metadata_only
        self._auth = security.start_authenticator(self._ctx, keys_dir) if keys_dir else None
        # SimpleQueue (C) rather than Queue: its hand-off costs far less than Condition.notify per batch
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # finished steps, errors and the end, in order
        self._step: ReadyStep | None = None  # the step being handed out, micro-batch by micro-batch
        self._held: Any = None  # an end or an error taken from the queue while looking for the next step
        self._pool = BufferPool()
        self._released_bytes = 0  # of frames let go since the heap's free pages were last given back
        self._builder: Prebuilder | None = None
        self._wake_addr = f"inproc://msd-client-{os.getpid()}-{next(_ids)}"
        self._wake: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._receiver: _Receiver | None = None
        self._closed = False

    # ------------------------------------------------------------------ public API

    def start(self) -> None:
        """Connect and register (done by the first `next()` when not called explicitly)."""
        if self._thread is not None:
            return
        if self._closed:
            raise RuntimeError("DataClient is closed")
        ready = threading.Event()
        self._receiver = _Receiver(self, ready)
        self._thread = threading.Thread(target=self._receiver.run, name=f"msd-client-{self.rank}", daemon=True)
        self._thread.start()
        ready.wait()
        self._wake = make_socket(self._ctx, zmq.PAIR)
        self._wake.connect(self._wake_addr)
        # from here on the wake pipe is the builder thread's: commands go through its queue
        self._builder = Prebuilder(self._build, self._send_command, name=f"msd-build-{self.rank}")
        if self.keep_freed_memory:
            # Importing pyzmq and this package and setting up the client leave ~0.9 MB of freed
            # heap behind, which the raised trim threshold would keep resident for the life of the
            # trainer: given back once, now (one malloc_trim; 0.5 MB of 6 a rank, tools/bench_e2e.py).
            memory.return_freed_memory()

    @property
    def batch_shape(self) -> dict[str, Any]:
        """The job's batch shape (seq_len, micro_batch_size, micro_batches per step, dp, sources,
        ...): connects and waits for the coordinator's welcome if it has not come yet."""
        self.start()
        deadline = time.monotonic() + self.timeout_s
        while self.batch_info is None:
            error = self._pending_error()
            if error is not None:
                raise error
            if time.monotonic() > deadline:
                raise self._no_welcome()
            time.sleep(0.005)
        return self.batch_info

    def _no_welcome(self) -> PeerLostError:
        """The error of a rank the coordinator never welcomed: what it answered, if it did."""
        refused = self._receiver.state.not_welcomed if self._receiver is not None else None
        why = f"it answered: {refused}" if refused else WAITING_HINT
        via = (f" through the relay at {self.relay} (is `msd relay --coordinator {self.coordinator}` running on "
               "this host?)") if self.relay else ""
        return PeerLostError(f"rank {self.rank}: no welcome from the coordinator at {self.coordinator}{via} within "
                             f"{self.timeout_s:.0f}s ({why})")

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches this rank gets per step (the gradient accumulation count)."""
        return int(self.batch_shape["micro_batches"])

    def _pending_error(self) -> BaseException | None:
        """An error the I/O thread queued (a refusal), left in place for next() to raise too."""
        if self._held is not None:
            return self._held if isinstance(self._held, BaseException) else None
        try:
            item = self._queue.get_nowait()
        except queue.Empty:
            return None
        self._queue.put(item)  # SimpleQueue: it goes to the back; only errors and ends come before a welcome
        return item if isinstance(item, BaseException) else None

    @property
    def batch_info(self) -> dict[str, Any] | None:
        """The job's batch shape, as the coordinator sent it (known once registered)."""
        return self._receiver.state.batch_info if self._receiver is not None else None

    @property
    def plan_digest(self) -> str | None:
        """The digest of the plan this client's stream belongs to."""
        return self._receiver.state.plan_digest if self._receiver is not None else self._plan_digest

    @property
    def data_address(self) -> str | None:
        """The address workers push this rank's pieces to (known once started)."""
        return self._receiver.address if self._receiver is not None else None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        now = time.perf_counter()
        if self._handed is not None:  # the trainer's compute of the micro-batch it took last time
            step, m = self._handed
            if not self._manual_compute:
                self._compute.setdefault(step, {})[m] = now - self._handed_at
            self._handed = None
        self.start()
        if self._step is None:
            self._step = self._next_step()
        ready = self._step
        m = self.next_micro_batch  # (ready.first for the first step after a resume mid-step)
        batch = self._builder.take(ready, m)  # built ahead while the trainer computed, or built now
        for name in ("pixel_values", "pixel_values_videos"):
            if isinstance(batch.get(name), PendingPixels):  # device=: uint8 frames until the trainer takes them
                batch[name] = batch[name].finish_on(self.device)
        self._let_go(ready.assembler, m)
        if m + 1 == ready.micro_batches:
            self.next_step, self.next_micro_batch = ready.step + 1, 0
            self._command(["consumed", ready.step, self.waited_s, *self._compute_report(ready.step),
                           self._losses.report(ready.step - 1)])
            self._step = self._finished_step()  # the next step if it is in; this one's tokens are let go
        else:
            self.next_step, self.next_micro_batch = ready.step, m + 1
        if self._step is not None:
            self._builder.ask(self._step, self.next_micro_batch)
        self._handed, self._handed_at = (ready.step, m), time.perf_counter()
        self._losses.handed(ready.step, batch, m)
        return batch

    def _let_go(self, assembler: StepAssembler, m: int) -> None:
        """Micro-batch m is the trainer's: the frames it was made of go, and after enough of them
        the heap's free pages go back to the OS, in the builder's thread (TRIM_AFTER_RELEASED_BYTES)."""
        self._released_bytes += assembler.release(m)
        if self._released_bytes >= TRIM_AFTER_RELEASED_BYTES:
            self._released_bytes = 0
            self._builder.call(memory.return_freed_memory)

    def _compute_report(self, step: int) -> list:
        """[step, seconds per micro-batch] of the last step whose every micro-batch's compute is
        known (the one before `step`: its last micro-batch's compute ended with this step's first
        next()), for a job with balance.calibrate; [-1, []] otherwise."""
        info = self._receiver.state.batch_info if self._receiver is not None else None
        done = self._compute.pop(step - 1, None)
        for old in [s for s in self._compute if s < step - 1]:
            del self._compute[old]
        if not info or not info.get("calibrate") or not done:
            return [-1, []]
        return [step - 1, [float(done[m]) for m in sorted(done)]]

    def report_loss(self, loss: Any, step: int | None = None, micro_batch: int | None = None) -> None:
        """The trainer's training loss of the micro-batch `next()` returned last, before reduction:
        per token (`[rows, seq_len]`, as the batch's `tokens`; positions outside `loss_mask` are not
        counted) or one value per sample (`[pieces]`, in `doc_keys` order: each sample's mean loss).
        The client sums loss and tokens per source and sends them with the step's `consumed` (no
        message of its own); with `mixture.adapt` the coordinator's policy turns them into weights.
        numpy arrays and torch tensors (any device) are taken.

        step, micro_batch: the micro-batch the loss is of, when it is not the one taken last (a
        trainer that takes all of a step's micro-batches before computing them, as the Hugging Face
        Trainer does with gradient accumulation): the batch's `step` and `micro_batch`. Any
        micro-batch of the current or the previous step can be named; a step's sums go with the
        step after it, when that step's last micro-batch is taken."""
        self._losses.add(loss, None if step is None else (step, 0 if micro_batch is None else micro_batch))

    def report_compute_seconds(self, seconds: float, step: int | None = None, micro_batch: int | None = None) -> None:
        """The trainer's own measure of a micro-batch's compute (default: the one just taken), for
        a job with balance.calibrate whose GPU work is asynchronous (time it with CUDA events, then
        report it here). The first call turns the client's own timing off for good."""
        self._manual_compute = True
        if step is None or micro_batch is None:
            last = self._handed or ((self.next_step, self.next_micro_batch - 1) if self.next_micro_batch else
                                    (self.next_step - 1, self.micro_batches_per_step - 1))
            step, micro_batch = last
        self._compute.setdefault(int(step), {})[int(micro_batch)] = float(seconds)

    def _build(self, ready: ReadyStep, m: int, ahead: bool = False) -> Batch:
        """Micro-batch m of a finished step, as the trainer gets it (ahead: by the builder's thread,
        which may raise buffers.NoSpareBuffer)."""
        batch = ready.micro_batch(m, self._pool, ahead, pixels_to=self.device)
        return _to_torch(batch, self.pin_memory) if self.as_torch else Batch(batch)

    def _finished_step(self) -> ReadyStep | None:
        """The next finished step if the I/O thread has handed it over (an end or an error found
        instead is kept for _next_step to raise)."""
        if self._held is not None:
            return None
        try:
            item = self._queue.get_nowait()
        except queue.Empty:
            return None
        if isinstance(item, ReadyStep):
            return item
        self._held = item
        return None

    def _next_step(self) -> ReadyStep:
        """The next finished step from the I/O thread (waiting for it: counted and reported)."""
        started = time.perf_counter()
        item, self._held = self._held, None
        try:
            if item is None:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:  # the trainer waits for data: counted, and reported to the coordinator
                    item = self._queue.get(timeout=self.timeout_s)
                    self.waited_s += time.perf_counter() - started
        except queue.Empty:
            if self.batch_info is None:
                raise self._no_welcome() from None
            raise PeerLostError(f"rank {self.rank}: no micro-batch for {self.timeout_s:.0f}s (waiting for step "
                                f"{self.next_step}; the coordinator at {self.coordinator} sent nothing that "
                                f"completes it)") from None
        if isinstance(item, (BaseException, End)):
            self._held = item  # sticky: every later call raises the same error, or stops
            if isinstance(item, End):
                raise StopIteration
            raise item
        return item

    def eval_batches(self, name: str) -> Iterator[dict[str, Any]]:
        """This rank's share of one pass over eval set `name` (the job file's `eval:`): micro-batches
        of the usual schema with `eval_set` and `eval_pass` added, then the iterator stops. Every
        rank gets the same number of micro-batches (rows of padding where needed, loss_mask 0), and
        across the ranks every token of the set is in exactly one of them. The pass is the same
        records in the same rows every time; it does not change the training stream. Every rank
        must take part in a pass (the coordinator keeps its records until each has had it)."""
        self.start()
        pass_no = self._eval_passes.get(name, 0)
        self._eval_passes[name] = pass_no + 1
        self._command(["eval", name, pass_no])
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                ready = self._evals.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise PeerLostError(f"rank {self.rank}: eval pass {pass_no} of {name!r} not complete within "
                                       f"{self.timeout_s:.0f}s") from None
            if ready.set == name and ready.pass_no == pass_no:
                break
            log.warning("rank %d: eval pass %d of %r came while waiting for pass %d of %r; dropped", self.rank,
                        ready.pass_no, ready.set, pass_no, name)
        if ready.assembler is None:
            raise MsdError(f"rank {self.rank}: eval set {name!r}: {ready.reason}")
        info = self.batch_info
        for m in range(ready.assembler.micro_batches):
            batch = for_rank(ready.assembler.micro_batch(m), info, self.rank, self.metadata_only)
            self._let_go(ready.assembler, m)
            batch["eval_set"], batch["eval_pass"], batch["micro_batch"] = name, pass_no, m
            yield _to_torch(batch, False) if self.as_torch else batch

    def report_eval(self, name: str, step: int, losses: dict[str, float]) -> None:
        """Send the mean loss per source of an evaluation at training step `step` (from
        trainer_client.eval.loss_by_source) to the coordinator: it journals it and shows it in
        `msd status`, the metrics (msd_eval_loss{set, source}) and `msd report`."""
        self.start()
        self._command(["eval_report", name, int(step), {str(k): float(v) for k, v in losses.items()}])

    def state_dict(self) -> dict[str, Any]:
        """Small, JSON-serialisable: the next micro-batch this rank will consume, the plan digest,
        and the coordinator's state before that step (`coordinator`: the planner's cursors, the
        run-time mixture changes and quarantined records; a few KB with hundreds of sources), so
        that a coordinator started without its state dir resumes from the trainers' checkpoint.
        Asking the coordinator takes one round trip; if it does not answer within
        `STATE_TIMEOUT_S`, `coordinator` is None (logged) and a resume needs the state dir."""
        carried = self._coordinator_state(self.next_step)
        return {"version": STATE_VERSION, "rank": self.rank, "next_step": self.next_step,
                "next_micro_batch": self.next_micro_batch, "plan_digest": self.plan_digest, "coordinator": carried}

    def _carried_for(self, step: int) -> dict | None:
        """The coordinator state the loaded checkpoint carries, if it is of this step."""
        return self._carried[1] if self._carried is not None and self._carried[0] == step else None

    def _coordinator_state(self, step: int) -> dict | None:
        carried = self._carried_for(step)
        if carried is not None:  # loaded, and not moved since
            return carried
        if self._thread is None or self._closed or not self._thread.is_alive():
            return None
        while not self._state_replies.empty():  # answers to an earlier request that timed out
            self._state_replies.get_nowait()
        self._command(["state", step])
        try:
            reply = self._state_replies.get(timeout=STATE_TIMEOUT_S)
        except queue.Empty:
            log.warning("rank %d: the coordinator did not give its state for step %d within %.0fs; the "
                        "checkpoint does not carry it", self.rank, step, STATE_TIMEOUT_S)
            return None
        if reply.state is None:
            log.warning("rank %d: the coordinator has no state for step %d (%s); the checkpoint does not carry it",
                        self.rank, step, reply.reason)
        return reply.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a state_dict(); call before iterating."""
        if self._thread is not None:
            raise RuntimeError("load_state_dict() must be called before the client starts: before its first "
                               "next(), start(), batch_shape or micro_batches_per_step")
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported DataClient state version {state.get('version')!r}")
        self.next_step = int(state["next_step"])
        self.next_micro_batch = int(state["next_micro_batch"])
        self._plan_digest = state.get("plan_digest")
        carried = state.get("coordinator")
        self._carried = (self.next_step, carried) if isinstance(carried, dict) else None

    def close(self) -> None:
        """Deregister the rank (it may be claimed again) and release sockets."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._command(["close"])
            self._builder.close()
            self._thread.join(timeout=10)
            self._wake.close(linger=0)
            if self._thread.is_alive():  # never hang the trainer's exit on a stuck I/O thread
                log.warning("rank %d: client I/O thread did not stop; closing its sockets", self.rank)
                self._ctx.destroy(linger=0)
                return
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    def __enter__(self) -> "DataClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _command(self, cmd: list) -> None:
        """A command for the I/O thread, through the builder's queue."""
        self._builder.command(cmd)

    def _send_command(self, cmd: list) -> None:
        """The builder thread's: send a command down the wake pipe."""
        try:  # NOBLOCK: if the I/O thread has died, its end of the pipe is gone and a send would block
            self._wake.send(msgpack.packb(cmd), NOWAIT)  # our own thread's: msgpack is cheaper than JSON
        except zmq.Again:
            pass


class _Receiver:
    """The client's I/O thread: it owns every socket except the main thread's end of the wake pipe,
    and only moves bytes: frames go to the rank's core (rank_core.RankCore), whose actions it
    carries out (messages to the coordinator, items for the trainer's queues)."""

    def __init__(self, client: DataClient, ready: threading.Event) -> None:
        self.c = client
        self.ready = ready
        self.core: RankCore | None = None
        self.state: ReceivingState | None = None  # the core's: set by run() before start() returns
        self.address: str | None = None

    def run(self) -> None:
        c = self.c
        ctx = c._ctx
        wake = make_socket(ctx, zmq.PAIR)
        wake.bind(c._wake_addr)
        control = make_socket(ctx, zmq.DEALER)
        data = make_socket(ctx, zmq.PULL, hwm=10_000)
        if c.relay:  # both on this host, to the relay (which holds the job's keys, if it has any)
            self.address = rank_endpoint(c.relay, c.rank)
            data.bind(self.address)
        else:
            if c.keys_dir:
                keys = security.load(c.keys_dir, "trainer")
                security.as_client(control, keys, security.public_key(c.keys_dir, "coordinator"))
                security.as_server(data, keys)
            port = data.bind_to_random_port(f"tcp://{c.bind_host}")
            self.address = f"tcp://{c.host}:{port}"
        self.control = control
        self.core = core = RankCore(
            c.rank, c.next_step, c.next_micro_batch, c._plan_digest, data_address=self.address,
            incarnation=int.from_bytes(os.urandom(6), "little"), metadata_only=c.metadata_only,
            carried_for=c._carried_for, via_relay=bool(c.relay), relay_timeout_s=c.relay_timeout_s,
            coordinator_timeout_s=c.coordinator_timeout_s, stop_grace_s=c.stop_grace_s,
            where=lambda: c.relay if c.relay else self.loop.address, addresses=lambda: self.loop.addresses)
        self.state = core.state
        self.ready.set()
        self.handshakes = security.HandshakeWatch(control)
        loop = PeerLoop(control, core.registration, c.relay or c.coordinator, who=f"rank {c.rank}")
        self.loop = loop
        loop.on(wake, self._on_wake)
        loop.on(control, self._on_control)
        loop.on(data, self._on_data)
        loop.on(self.handshakes.socket, self._on_handshake)
        try:
            loop.run(lambda: not core.closing, self._turn)
        except Exception as e:  # surface I/O-thread failures to the trainer instead of hanging it
            log.exception("rank %d: client I/O thread failed", c.rank)
            c._queue.put(e)
        finally:
            self.handshakes.close()
            for s in (wake, control, data):
                s.close(linger=0 if s is not control else 1000)

    def _do(self, actions: list[Action], now: float) -> None:
        for a in actions:
            if isinstance(a, Send):
                if not send_nowait(self.control, a.message):
                    log.warning("rank %d: coordinator not reading; %s dropped", self.c.rank, a.message.TYPE)
                    self.core.connection_lost(f"{a.message.TYPE} dropped")
            elif isinstance(a, ToTrainer):
                self.c._queue.put(a.item)
            elif isinstance(a, ToEvals):
                self.c._evals.put(a.item)
            elif isinstance(a, ToStateReplies):
                self.c._state_replies.put(a.item)
            elif isinstance(a, CoordinatorStopping):
                self.loop.coordinator_stopping(now)

    def _on_wake(self, wake: zmq.Socket) -> None:
        self._do(self.core.command(msgpack.unpackb(wake.recv()), time.monotonic()), time.monotonic())

    def _on_control(self, control: zmq.Socket) -> None:
        now = time.monotonic()
        self._do(self.core.on_control(control.recv_multipart(copy=False), now), now)

    def _on_handshake(self, _: zmq.Socket) -> None:
        reason = self.handshakes.refused()
        if self.handshakes.broke():
            self.core.connection_lost(f"the connection to {self.loop.address} broke")
        if reason is not None:  # the coordinator will never talk to this client: say so, and stop
            hint = "pass keys_dir= the job's key directory" if not self.c.keys_dir else "check keys_dir="
            self.c._queue.put(RejectedError(f"rank {self.c.rank}: {self.c.coordinator}: {reason}; the job sets "
                                            f"security.curve? {hint}"))
            self.core.closing = True

    def _on_data(self, data: zmq.Socket) -> None:
        for frames in waiting(data):
            self.c.bytes_received += sum(len(f) for f in frames)
            self.core.on_pieces(frames)

    def _turn(self, now: float) -> None:
        self._do(self.core.turn(now), now)
