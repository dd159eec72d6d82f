"""DataClient: what a trainer rank imports to receive its batches.

A background thread owns both sockets (a DEALER to the coordinator, a PULL data socket that
workers push pieces to), keeps heartbeats flowing while the trainer computes, deduplicates pieces
by (step, index in the step's recipe), each checked against its recipe entry, and assembles
micro-batches as soon as a step's recipe and its pieces are in. The iterator hands them out in
training order. The client decides nothing about what data it gets; it only assembles what the
coordinator planned.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import queue
import threading
import time
from typing import Any, Iterator

import numpy as np
import zmq

from . import protocol as P
from . import wire
from . import memory, security
from .assemble import StepAssembler
from .topology import Topology, cp_share
from .errors import PeerLostError, ProtocolError, RejectedError
from .sockets import make_socket, send_nowait

log = logging.getLogger("msd.client")

STATE_VERSION = 1
HELLO_RETRY_S = 2.0
READY_STEPS_AHEAD = 1  # finished steps kept ready beyond the one being consumed
MAX_BUFFERED_STEPS = 256  # pieces for steps this far ahead are dropped (a broken or hostile sender)
MAX_BUFFERED_PIECES = 1_000_000  # and so are pieces beyond this many held for unfinished steps
_ids = itertools.count()


class _End:
    """Marker: the coordinator ended the stream."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _to_torch(batch: dict[str, Any]) -> dict[str, Any]:
    import torch

    return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in batch.items()}


class DataClient:
    """Receives the packed micro-batches of one trainer rank, in training order.

    Args:
        coordinator: the coordinator's address, e.g. "tcp://10.0.0.1:5555".
        rank: this process's global trainer rank.
        host: the address workers use to reach this process (advertised to them); the data
            socket binds on `bind_host` (default: the same) at a free port.
        timeout_s: how long `next()` waits for a micro-batch before raising PeerLostError.
        as_torch: return torch tensors (default: when torch is importable) or numpy arrays.
        keep_freed_memory: raise glibc's mmap/trim thresholds in this process, so that each
            step's buffers reuse memory instead of page-faulting fresh pages (trainer_client.memory;
            up to ~300 MiB more resident memory, several times cheaper batch assembly).
        metadata_only: for a middle pipeline stage, which gets no data otherwise: receive the
            packing metadata of its DP rank's micro-batches (cu_seqlens, doc_keys, ...).
        keys_dir: the job's key directory (msd keys generate) when it sets security.curve: the
            client then speaks CURVE to the coordinator and accepts data only from workers whose
            public key is authorised.
    """

    def __init__(self, coordinator: str, rank: int, *, host: str = "127.0.0.1", bind_host: str | None = None,
                 timeout_s: float = 300.0, as_torch: bool | None = None, keep_freed_memory: bool = True,
                 keys_dir: str | None = None, metadata_only: bool = False) -> None:
        self.coordinator = coordinator
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
        if keep_freed_memory:
            memory.keep_freed_memory()
        self.next_step = 0
        self.waited_s = 0.0  # time __next__ spent waiting for data (the data-wait share of a training run)
        self.next_micro_batch = 0
        self.plan_digest: str | None = None
        self.batch_info: dict[str, Any] | None = None
        self._ctx = zmq.Context()
        self.keys_dir = keys_dir
        self.metadata_only = metadata_only
        self._auth = security.start_authenticator(self._ctx, keys_dir) if keys_dir else None
        # SimpleQueue (C) rather than Queue: its hand-off costs far less than Condition.notify per batch
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # whole steps, errors and the end, in order
        self._ready: collections.deque = collections.deque()  # micro-batches of the step being handed out
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

    @property
    def data_address(self) -> str | None:
        """The address workers push this rank's pieces to (known once started)."""
        return self._receiver.address if self._receiver is not None else None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        self.start()
        if not self._ready:
            started = time.perf_counter()
            try:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:  # the trainer waits for data: counted, and reported to the coordinator
                    item = self._queue.get(timeout=self.timeout_s)
                    self.waited_s += time.perf_counter() - started
            except queue.Empty:
                raise PeerLostError(f"rank {self.rank}: no micro-batch for {self.timeout_s:.0f}s "
                                    f"(waiting for step {self.next_step})") from None
            if isinstance(item, BaseException):
                self._queue.put(item)  # sticky: every later call raises the same error
                raise item
            if isinstance(item, _End):
                self._queue.put(item)
                raise StopIteration
            self._ready.extend(item)  # one item per step: one hand-over between the threads, not one per micro-batch
        step, m, batch = self._ready.popleft()
        self.next_step, self.next_micro_batch = (step, m + 1)
        if self.next_micro_batch == self.batch_info["micro_batches"]:
            self.next_step, self.next_micro_batch = step + 1, 0
            self._command(["consumed", step, self.waited_s])
        return _to_torch(batch) if self.as_torch else batch

    def state_dict(self) -> dict[str, Any]:
        """Small, JSON-serialisable: the next micro-batch this rank will consume, and the plan digest."""
        return {"version": STATE_VERSION, "rank": self.rank, "next_step": self.next_step,
                "next_micro_batch": self.next_micro_batch, "plan_digest": self.plan_digest}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a state_dict(); call before iterating."""
        if self._thread is not None:
            raise RuntimeError("load_state_dict() must be called before the first batch is requested")
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported DataClient state version {state.get('version')!r}")
        self.next_step = int(state["next_step"])
        self.next_micro_batch = int(state["next_micro_batch"])
        self.plan_digest = state.get("plan_digest")

    def close(self) -> None:
        """Deregister the rank (it may be claimed again) and release sockets."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._command(["close"])
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
        try:  # NOBLOCK: if the I/O thread has died, its end of the pipe is gone and a send would block
            self._wake.send_json(cmd, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass


class _Receiver:
    """The client's I/O thread. Owns every socket except the main thread's end of the wake pipe."""

    def __init__(self, client: DataClient, ready: threading.Event) -> None:
        self.c = client
        self.ready = ready
        self.steps: dict[int, tuple[StepAssembler, Any]] = {}  # step -> (its assembler, plan summary)
        self.early: dict[int, list[tuple[np.ndarray, ...]]] = {}  # pieces that came before their recipe
        self.step = client.next_step  # next micro-batch to assemble
        self.micro_batch = client.next_micro_batch
        self.registered = False
        self.duplicates = 0
        self.buffered = 0  # pieces held in self.early
        self.end: tuple[int, str] | None = None  # (first step that will not come, why)

    def run(self) -> None:
        c = self.c
        ctx = c._ctx
        wake = make_socket(ctx, zmq.PAIR)
        wake.bind(c._wake_addr)
        control = make_socket(ctx, zmq.DEALER)
        data = make_socket(ctx, zmq.PULL, hwm=10_000)
        if c.keys_dir:
            keys = security.load(c.keys_dir, "trainer")
            security.as_client(control, keys, security.public_key(c.keys_dir, "coordinator"))
            security.as_server(data, keys)
        port = data.bind_to_random_port(f"tcp://{c.bind_host}")
        self.address = f"tcp://{c.host}:{port}"
        control.connect(c.coordinator)
        self.control = control
        self.ready.set()
        poller = zmq.Poller()
        for s in (wake, control, data):
            poller.register(s, zmq.POLLIN)
        incarnation = int.from_bytes(os.urandom(6), "little")
        heartbeat_s, last_hello, last_beat = 1.0, 0.0, 0.0
        try:
            while True:
                now = time.monotonic()
                if not self.registered and now - last_hello > HELLO_RETRY_S:
                    self._send(P.make(P.TRAINER_HELLO, version=P.PROTOCOL_VERSION, rank=c.rank,
                                      data_address=self.address, resume_step=self.step, incarnation=incarnation,
                                      metadata_only=int(c.metadata_only)))
                    last_hello = now
                if self.registered and now - last_beat > heartbeat_s:
                    self._send(P.make(P.TRAINER_HEARTBEAT, rank=c.rank))
                    last_beat = now
                events = dict(poller.poll(timeout=int(heartbeat_s * 250)))
                if wake in events:
                    cmd = wake.recv_json()
                    if cmd[0] == "consumed":
                        self._send(P.make(P.CONSUMED, rank=c.rank, step=cmd[1], waited_s=float(cmd[2])))
                    elif cmd[0] == "close":
                        if self.registered:
                            self._send(P.make(P.TRAINER_BYE, rank=c.rank))
                        return
                if control in events:
                    heartbeat_s = self._on_control(control.recv_multipart(copy=False), heartbeat_s)
                if data in events:
                    # Drain what is there: many small piece messages may queue up behind one poll.
                    for _ in range(1000):
                        try:
                            frames = data.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._on_pieces(frames)
                self._assemble()
        except Exception as e:  # surface I/O-thread failures to the trainer instead of hanging it
            log.exception("rank %d: client I/O thread failed", c.rank)
            c._queue.put(e)
        finally:
            for s in (wake, control, data):
                s.close(linger=0 if s is not control else 1000)

    def _send(self, header: dict[str, Any]) -> None:
        if not send_nowait(self.control, header):
            log.warning("rank %d: coordinator not reading; %s dropped", self.c.rank, header["type"])

    def _on_control(self, frames, heartbeat_s: float) -> float:
        try:
            msg, arrays = wire.decode(frames, P.TRAINER_CONTROL_INBOX)
        except ProtocolError as e:
            log.warning("rank %d: dropped message from coordinator: %s", self.c.rank, e)
            return heartbeat_s
        kind = msg["type"]
        if kind == "trainer_welcome":
            c = self.c
            if c.plan_digest is not None and c.plan_digest != msg["plan_digest"]:
                c._queue.put(RejectedError(f"plan digest {msg['plan_digest']} differs from the checkpoint's "
                                           f"{c.plan_digest}: the job file changed"))
            c.plan_digest = msg["plan_digest"]
            c.batch_info = msg["batch"]
            self.registered = True
            return float(msg["heartbeat_s"])
        if kind == "step_header":
            self._on_step_header(msg, arrays)
        elif kind == "rank_taken":
            log.warning("rank %d: %s; asking again", self.c.rank, msg["reason"])
        elif kind == "end_of_stream":
            log.info("rank %d: the stream ends before step %d: %s", self.c.rank, msg["step"], msg["reason"])
            self.end = (msg["step"], msg["reason"])
        elif kind == "unknown_peer":
            log.warning("rank %d: coordinator does not know this rank (%s); registering again", self.c.rank,
                        msg["reason"])
            self.registered = False
        elif kind == "reject":
            self.c._queue.put(RejectedError(f"rank {self.c.rank}: coordinator refused: {msg['reason']}"))
        elif kind == "shutdown":
            self.c._queue.put(_End(msg["reason"]))
        return heartbeat_s

    def _on_step_header(self, msg: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        info = self.c.batch_info
        step = msg["step"]
        if info is None or msg["rank"] != self.c.rank or not self.step <= step < self.step + MAX_BUFFERED_STEPS:
            log.warning("rank %d: step header for rank %d step %d dropped", self.c.rank, msg["rank"], step)
            return
        mbs, n_mb = info["micro_batch_size"], info["micro_batches"]
        if len(arrays["counts"]) != mbs * n_mb:
            log.warning("rank %d: step %d header has %d sequences, expected %d; dropped", self.c.rank, step,
                        len(arrays["counts"]), mbs * n_mb)
            return
        if step in self.steps:
            return  # a repeated header: the plan of a step never changes
        try:
            assembler = StepAssembler(arrays["pieces"], arrays["counts"], msg["row_len"], info["pad_id"], mbs,
                                      info.get("patch_bytes", 0))
        except ValueError as e:
            log.warning("rank %d: step %d header dropped: %s", self.c.rank, step, e)
            return
        self.steps[step] = (assembler, msg["plan"])
        for items, *payload in self.early.pop(step, []):  # pieces that came before their recipe
            self.buffered -= len(items)
            self.duplicates += assembler.add(items, *payload)

    def _on_pieces(self, frames) -> None:
        try:
            msg, arrays = wire.decode(frames, P.TRAINER_DATA_INBOX)
            if msg["rank"] != self.c.rank:
                raise ProtocolError(f"pieces for rank {msg['rank']} sent to rank {self.c.rank}")
        except ProtocolError as e:
            log.warning("rank %d: dropped data message: %s", self.c.rank, e)
            return
        step = msg["step"]
        if not self.step <= step < self.step + MAX_BUFFERED_STEPS:
            self.duplicates += 1  # an old step (a re-sent delivery) or absurdly far ahead
            return
        items = arrays["items"]  # [piece, doc_key, offset, length]; piece: its index in the step's recipe
        payload = (arrays["tokens"], arrays["patch_counts"], arrays["patches"])
        if len(payload[1]) and msg["patch_bytes"] != (self.c.batch_info or {}).get("patch_bytes"):
            log.warning("rank %d: dropped data message: patches of %d bytes, the job's are %s", self.c.rank,
                        msg["patch_bytes"], (self.c.batch_info or {}).get("patch_bytes"))
            return
        if step in self.steps:
            self.duplicates += self.steps[step][0].add(items, *payload)
            return
        if self.buffered + len(items) > MAX_BUFFERED_PIECES:
            log.warning("rank %d: %d pieces already buffered; data message for step %d dropped", self.c.rank,
                        self.buffered, step)
            return
        self.early.setdefault(step, []).append((items, *payload))
        self.buffered += len(items)

    def _for_this_rank(self, batch: dict[str, Any]) -> dict[str, Any]:
        """What this global rank gets of its DP rank's micro-batch: its CP share, and the fields
        of its pipeline stage (trainer_client.topology)."""
        info = self.c.batch_info
        topo = Topology(**info["topology"])
        if topo.world_size == topo.dp:
            return batch
        coords = topo.coords(self.c.rank)
        if topo.cp > 1:
            batch = cp_share(batch, topo.cp, coords.cp, info["pad_id"])
        keep = set(topo.fields(self.c.rank, want_metadata=self.c.metadata_only))
        return {k: v for k, v in batch.items() if k in keep}

    def _assemble(self) -> None:
        """Finish the next step once every piece of its recipe is in (a whole step in one
        vectorised pass), and queue its micro-batches from where the client resumes. Steps are
        finished at most READY_STEPS_AHEAD beyond the one the trainer is consuming: a finished
        step (int64 tokens, labels, position ids, float32 loss mask) takes ~14x the memory of
        its received tokens, and the coordinator's look-ahead may deliver several steps early."""
        while (self.step in self.steps and self.steps[self.step][0].done
               and self.step <= self.c.next_step + READY_STEPS_AHEAD):
            assembler, plan = self.steps.pop(self.step)
            batches = assembler.batches()
            ready = []
            for m in range(self.micro_batch, len(batches)):
                batch = self._for_this_rank(batches[m])
                batch["step"], batch["micro_batch"] = self.step, m
                if m == 0:
                    batch["plan"] = plan
                ready.append((self.step, m, batch))
            self.c._queue.put(ready)
            self.step, self.micro_batch = self.step + 1, 0
        if self.end is not None and self.step >= self.end[0]:
            self.c._queue.put(_End(self.end[1]))
            self.end = None
