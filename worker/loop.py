"""One worker process: a plain synchronous loop around a poller.

It registers with the coordinator, receives the source definitions, then serves two kinds of
work: PREPARE (read + tokenize records, keep the tokens in a bounded cache, reply with lengths
only) and DELIVER (send token ranges of cached records straight to trainer ranks, one message
per rank, then acknowledge). Everything it holds is a cache the coordinator can rebuild
elsewhere, so the process may be killed at any moment. It exits when its host agent dies.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

import numpy as np
import zmq

from trainer_client import memory, security
from trainer_client import protocol as P
from trainer_client import wire
from trainer_client.errors import ProtocolError
from trainer_client.logs import setup_logging
from trainer_client.sockets import make_socket, send_nowait

from .readers import RecordError, SourceReader, open_source

log = logging.getLogger("msd.worker")

HELLO_RETRY_S = 2.0
_RECORD_MASK = (1 << 48) - 1
SEND_TIMEOUT_MS = 30_000
# Below this, copying a frame is cheaper than zero-copy bookkeeping (pyzmq tracks zero-copy
# frames through a garbage-collector thread).
ZERO_COPY_BYTES = 1 << 20


class Worker:
    def __init__(self, coordinator: str, parent_pid: int | None = None, keys_dir: str | None = None,
                 agent_id: int = 0) -> None:
        self.agent_id = agent_id
        self.coordinator = coordinator
        self.parent_pid = parent_pid
        self.ctx = zmq.Context()
        self.control = make_socket(self.ctx, zmq.DEALER)
        # CURVE: this host's worker key pair; the coordinator's and trainers' public keys
        self.keys = security.load(keys_dir, "worker") if keys_dir else None
        self.trainer_key = security.public_key(keys_dir, "trainer") if keys_dir else None
        if self.keys:
            security.as_client(self.control, self.keys, security.public_key(keys_dir, "coordinator"))
        self.control.connect(coordinator)
        self.data: dict[str, zmq.Socket] = {}  # trainer data address -> PUSH socket
        self.worker_id: int | None = None
        self.heartbeat_s = 1.0
        self.readers: dict[int, SourceReader] = {}
        self.specs: list[dict[str, Any]] = []
        # doc_key -> [tokens, prepared copies, length, image patches or None] (memory-mapped records
        # are never cached: their tokens are read from the map at delivery)
        self.cache: dict[int, list] = {}
        self.incarnation = int.from_bytes(os.urandom(6), "little")
        self.running = True
        self.forgotten_at = 0.0
        self.busy_s = 0.0  # total time spent on prepare and deliver work (reported in heartbeats)

    def close(self) -> None:
        for s in self.data.values():
            s.close(linger=1000)
        self.control.close(linger=0)
        self.ctx.term()

    # ------------------------------------------------------------------ main loop

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.control, zmq.POLLIN)
        last_hello = last_beat = 0.0
        while self.running:
            now = time.monotonic()
            if self.worker_id is None and (now - last_hello > HELLO_RETRY_S or last_hello < self.forgotten_at):
                self._send(P.make(P.WORKER_HELLO, version=P.PROTOCOL_VERSION, host=socket.gethostname(),
                                  pid=os.getpid(), incarnation=self.incarnation, agent=self.agent_id))
                last_hello = now
            if self.worker_id is not None and now - last_beat > self.heartbeat_s:
                self._send(P.make(P.WORKER_HEARTBEAT, worker_id=self.worker_id, cached_records=len(self.cache),
                                  busy_s=self.busy_s))
                last_beat = now
            if self.parent_pid is not None and not _alive(self.parent_pid):
                log.info("host agent is gone; exiting")
                return
            if not poller.poll(timeout=int(self.heartbeat_s * 250)):
                continue
            frames = self.control.recv_multipart(copy=False)
            try:
                header, arrays = wire.decode(frames, P.WORKER_INBOX)
            except ProtocolError as e:
                log.warning("dropped message from coordinator: %s", e)
                continue
            started = time.perf_counter()
            self._handle(header, arrays)
            self.busy_s += time.perf_counter() - started

    def _send(self, header: dict[str, Any], *arrays: np.ndarray) -> None:
        if not send_nowait(self.control, header, *arrays):
            log.warning("coordinator not reading; %s dropped", header["type"])

    def _handle(self, msg: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        kind = msg["type"]
        if kind == "welcome":
            self._on_welcome(msg)
        elif kind == "prepare":
            if self.worker_id is not None:
                self._on_prepare(msg, arrays["records"])
        elif kind == "deliver":
            if self.worker_id is not None:
                self._on_deliver(msg, arrays["items"], arrays["release"].tolist())
        elif kind == "unknown_peer":
            # The coordinator forgot us (restart, or we were silent too long): everything we hold
            # may have been re-prepared elsewhere, so start clean and register again.
            log.warning("coordinator does not know this worker (%s); registering again", msg["reason"])
            self.worker_id = None
            self.cache.clear()
            self.forgotten_at = time.monotonic()
        elif kind == "reject":
            log.error("coordinator rejected this worker: %s", msg["reason"])
            self.running = False
        elif kind == "shutdown":
            log.info("coordinator asked us to stop: %s", msg["reason"])
            self.running = False

    def _on_welcome(self, msg: dict[str, Any]) -> None:
        job = msg["job"]
        if not isinstance(job, dict) or not isinstance(job.get("sources"), list):
            log.error("welcome without a usable job description; ignored")
            return
        self.worker_id = msg["worker_id"]
        self.heartbeat_s = float(msg["heartbeat_s"])
        self.specs = job["sources"]
        self.busy_s = 0.0  # counted from registration: the coordinator compares heartbeats over time
        self.readers.clear()
        self.cache.clear()
        # The coordinator hands out records of memory-mapped sources without asking first, so a
        # worker that cannot open one must not serve: it stops, and its deliveries go elsewhere.
        for s, spec in enumerate(self.specs):
            if spec.get("format") == "megatron":
                try:
                    self._reader(s)
                except Exception as e:
                    log.error("cannot open source %s on this host (%s); this worker cannot serve the job, stopping",
                              spec.get("name"), e)
                    self.running = False
                    return
        log.info("registered as worker %d with %d sources", self.worker_id, len(self.specs))

    def _reader(self, source: int) -> SourceReader:
        reader = self.readers.get(source)
        if reader is None:
            reader = self.readers[source] = open_source(self.specs[source])
        return reader

    # ------------------------------------------------------------------ work

    def _on_prepare(self, msg: dict[str, Any], records: np.ndarray) -> None:
        started = time.perf_counter()
        s = msg["source"]
        try:
            reader = self._reader(s)
        except Exception as e:  # a source this host cannot open: tell the coordinator, keep serving
            self._send(P.make(P.TASK_FAILED, worker_id=self.worker_id, task_id=msg["task_id"],
                              reason=f"cannot prepare records of source {s}: {e}"))
            return
        # (The coordinator prepares memory-mapped sources itself, from their index; their tokens
        # are read straight from the map at delivery.)
        skipped: list[list] = []
        patches = np.zeros(len(records) if reader.has_images else 0, dtype="<i8")
        lengths = np.zeros(len(records), dtype="<i8")
        base = s << 48
        for i in np.argsort(records, kind="stable").tolist():  # record order: Parquet row groups decode once
            record = int(records[i])
            key = base | record
            entry = self.cache.get(key)
            if entry is None:
                try:
                    tokens, images = reader.read_sample(record)
                except (RecordError, IndexError) as e:
                    log.warning("skipped record: %s", e)
                    skipped.append([i, str(e)])
                    continue
                entry = self.cache[key] = [tokens, 0, len(tokens), images]
            entry[1] += 1
            lengths[i] = entry[2]
            if entry[3] is not None:
                patches[i] = len(entry[3])
        skipped.sort()
        self._send(P.make(P.PREPARED, worker_id=self.worker_id, task_id=msg["task_id"], skipped=skipped,
                          busy_s=time.perf_counter() - started), lengths, patches)

    def _on_deliver(self, msg: dict[str, Any], items: np.ndarray, release: list[int]) -> None:
        addresses = dict((r, a) for r, a in msg["addresses"])
        for rank in np.unique(items[:, 0]).tolist():
            address = addresses.get(rank)
            if address is None:
                log.warning("step %d: no address for rank %d; its pieces were not sent", msg["step"], rank)
                continue
            rows = items[items[:, 0] == rank]  # in recipe order: the rank copies runs of them at once
            rows, tokens, patch_counts, patches = self._gather(msg["step"], rows)
            if not len(rows):
                continue
            header = P.make(P.PIECES, step=msg["step"], rank=rank, dtype=tokens.dtype.str,
                            patch_bytes=patches.shape[1] if patches.size else 0)
            frames = wire.encode(header, np.ascontiguousarray(rows[:, 1:]), tokens, patch_counts,
                                 np.ascontiguousarray(patches).reshape(-1))
            try:
                self._data_socket(address).send_multipart(frames, copy=tokens.nbytes < ZERO_COPY_BYTES)
            except zmq.Again:
                log.error("step %d: rank %d at %s did not take its pieces within %ds", msg["step"], rank, address,
                          SEND_TIMEOUT_MS // 1000)
        for key in release if self.cache else ():  # only JSONL records are cached; mapped ones never are
            entry = self.cache.get(key)
            if entry is not None:
                entry[1] -= 1
                if entry[1] <= 0:
                    del self.cache[key]
        self._send(P.make(P.DELIVERED, worker_id=self.worker_id, delivery_id=msg["delivery_id"]))

    def _gather(self, step: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The rows of deliver rows [rank, piece, doc_key, offset, length] (grouped by source)
        that can be served, their tokens concatenated in row order, and for image-text records the
        patches of the image placeholders each piece holds (placeholders are a record's first
        tokens, one per patch): (rows, tokens, patches per row, patches). A piece must lie within
        its document, and a record that is not memory-mapped must be in this worker's cache."""
        sources = rows[:, 2] >> 48
        kept, parts, patch_parts, patch_counts = [], [], [], []
        for s in np.unique(sources).tolist():
            mine = rows[sources == s]
            reader = self._reader(s)
            records, offsets, lengths = mine[:, 2] & _RECORD_MASK, mine[:, 3], mine[:, 4]
            if reader.format == "megatron":  # checked against the index, one gather from the memory map
                ok = offsets + lengths <= reader.lengths(records).astype(np.uint64)
            else:
                ok = np.array([(e := self.cache.get(key)) is not None and off + n <= e[2]
                               for key, off, n in mine[:, 2:].tolist()], dtype=bool)
            for key, off, n in mine[~ok][:, 2:].tolist():
                entry = self.cache.get(key) if reader.format != "megatron" else None
                why = ("beyond its document" if reader.format == "megatron" else
                       "not prepared here" if entry is None else f"beyond its document of {entry[2]} tokens")
                log.error("step %d: piece %x[%d:+%d] cannot be served (%s); not sent", step, key, off, n, why)
            mine = mine[ok]
            if not len(mine):
                continue
            kept.append(mine)
            if reader.format == "megatron":
                parts.extend(reader.pieces(mine[:, 2] & _RECORD_MASK, mine[:, 3], mine[:, 4]))  # views: one copy below
                patch_counts.append(np.zeros(len(mine), dtype="<u4"))
                continue
            counts = np.zeros(len(mine), dtype="<u4")
            for i, (key, off, n) in enumerate(mine[:, 2:].tolist()):
                entry = self.cache[key]
                parts.append(entry[0][off: off + n])
                if entry[3] is not None and off < len(entry[3]):
                    images = entry[3][off: min(off + n, len(entry[3]))]
                    counts[i] = len(images)
                    patch_parts.append(images)
            patch_counts.append(counts)
        if not parts:
            return rows[:0], np.zeros(0, np.uint16), np.zeros(0, "<u4"), np.zeros((0, 0), np.uint8)
        dtype = np.result_type(*{a.dtype for a in parts})
        patch_counts = np.concatenate(patch_counts)
        patches = np.concatenate(patch_parts) if patch_parts else np.zeros((0, 0), np.uint8)
        if not patches.size:
            patch_counts = patch_counts[:0]
        return (np.concatenate(kept), np.concatenate(parts).astype(dtype.newbyteorder("<"), copy=False), patch_counts,
                patches)

    def _data_socket(self, address: str) -> zmq.Socket:
        sock = self.data.get(address)
        if sock is None:
            sock = make_socket(self.ctx, zmq.PUSH)
            if self.keys:
                security.as_client(sock, self.keys, self.trainer_key)
            # Blocking send is our flow control (the coordinator bounds how far ahead anyone is);
            # the timeout keeps a vanished trainer from wedging the worker forever.
            sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
            sock.connect(address)
            self.data[address] = sock
        return sock


def _alive(pid: int) -> bool:
    """Whether the host agent still runs (it is not our parent: a fork server is)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_worker(coordinator: str, parent_pid: int | None = None, log_level: str = "INFO",
               log_path: str | None = None, keys_dir: str | None = None, agent_id: int = 0) -> None:
    """Entry point of one worker process (spawned by the host agent)."""
    setup_logging(log_level, "worker", log_path)
    memory.keep_freed_memory()
    worker = Worker(coordinator, parent_pid, keys_dir, agent_id)
    try:
        worker.run()
    except KeyboardInterrupt:
        pass
    finally:
        worker.close()
