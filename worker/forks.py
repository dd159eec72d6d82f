"""The host's fork server: it forks every worker process, and runs only while workers are being
started.

The first server is forked from the host process (`msd worker`'s agent, or the coordinator with
`--worker-procs`) before that process opens any zmq socket, once the worker's modules are
imported and frozen (`worker/preload.py`): the host process, the server and the workers share
those pages. A server that was asked for nothing for LINGER_S exits. Python 3.11 writes reference
counts and specialised bytecode into the objects it runs, so a page that both the host process
and a worker wrote to has a copy in each, and the server alone held the original: 9.6 MB of
126 at tools/bench_e2e.py's headline point. A start asked for once the server has gone gets a
new one: a fresh interpreter (forking the host process is unsafe by then: it has threads and
sockets), which imports the worker's modules, forks, and lingers the same way. It shares those
modules with its own workers only, so a worker started late costs more than one of the first.

Every worker is forked through an intermediate process that exits at once, so the host process
adopts it (it is a child subreaper, Linux `prctl`): the agent waits for its workers itself, with
or without a server, and gets their exit status. A worker marks the prepare task it works on in
its own cell of a table that the agent shares with the servers and workers (a memfd, `WorkCell`),
with the sample it is making and since when; the agent reads the cell while the worker lives (a
sample past its source's max_sample_s gets the worker stopped) and when it has died, so the task
and record that killed it can be blamed. A worker busy on one sample is alive while its process
is: the agent vouches for it. Workers stop on their own once the agent is gone (`worker/loop.py`).

Agent and server speak over a pair of pipes, one JSON object per line:

    agent -> server   {"start": [worker args...], "cell": n}
    server -> agent   {"started": pid}, or {"failed": "why"}

A server exits when its inbox closes (the agent stops it, or is gone) or after LINGER_S without
a request. Python's multiprocessing fork server did this job before: it needed a resource tracker
process beside it (7 MB of the 167 tools/bench_e2e.py measured at 8 ranks), and it imported the
modules in an interpreter of its own, shared with nobody but the workers.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import logging
import mmap
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from typing import Any, Callable

from msd_common.memory import return_freed_memory

log = logging.getLogger("msd.worker.forks")

REAP_EVERY_S = 0.1
STOP_WAIT_S = 5.0
START_WAIT_S = 60.0  # a fresh server imports numpy and the readers before it forks
LINGER_S = 5.0  # a server asked for nothing this long exits
CELLS = 4096  # task cells: worker processes a host can have started and not yet waited for
SERVER_NAME, WORKER_NAME = "msd-forks", "msd-worker"  # as /proc/PID/comm, ps -o comm and top show them
_PR_SET_NAME, _PR_SET_CHILD_SUBREAPER = 15, 36


def name_process(name: str) -> None:
    """The process's name in `ps -o comm`, top and /proc/PID/comm (Linux; nothing elsewhere):
    forked processes keep their parent's command line, so the name tells them apart."""
    try:
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def become_subreaper() -> None:
    """Orphaned descendants of this process (the workers, once their intermediate exits) become
    its children, so it can wait for them and read their exit status."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed: a worker host needs Linux 3.4 "
                      "or later")


def host_worker_pids(agent_pid: int) -> list[int]:
    """The worker processes of the host agent `agent_pid` now running (its children named
    msd-worker; Linux /proc), for tests, benchmarks and operators' scripts."""
    return [pid for pid in _children(agent_pid) if process_comm(pid) == WORKER_NAME]


def fork_server_pids(parent_pid: int) -> list[int]:
    """The host fork servers now running among a process's children: a host agent's, or a
    coordinator's with --worker-procs (Linux /proc)."""
    return [pid for pid in _children(parent_pid) if process_comm(pid) == SERVER_NAME]


def _children(pid: int) -> list[int]:
    """Children of every thread of a process (a fresh server is the child of the thread that
    started it)."""
    out: list[int] = []
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(p) for p in f.read().split()]
        except OSError:
            pass
    return out


def process_comm(pid: int) -> str:
    """A process's name (/proc/PID/comm; "" if it is gone)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


class WorkCell(ctypes.Structure):
    """What one worker process is working on, in memory its host agent reads: the prepare task (-1:
    none), the sample (source, record) and since when (CLOCK_MONOTONIC, ns: one clock for every
    process of the host; 0: no sample), and how long that sample may take (its source's
    max_sample_s, ns). The agent reads it while the worker lives (a sample past its limit is
    poison: the worker is stopped) and once it has died (which task and record killed it)."""

    _fields_ = [("task", ctypes.c_int64), ("source", ctypes.c_int64), ("record", ctypes.c_int64),
                ("started_ns", ctypes.c_int64), ("limit_ns", ctypes.c_int64)]

    def clear(self) -> None:
        self.task, self.source, self.record, self.started_ns, self.limit_ns = -1, -1, -1, 0, 0

    def overrun_s(self, now_ns: int) -> float:
        """Seconds the current sample has run past its limit (0: none running, or within it)."""
        started, limit = self.started_ns, self.limit_ns
        if started <= 0 or limit <= 0:
            return 0.0
        return max(0.0, (now_ns - started - limit) / 1e9)


CELL_BYTES = ctypes.sizeof(WorkCell)


class TaskCells:
    """The table of work cells (WorkCell), in a memfd so that a fresh server maps the same pages."""

    def __init__(self, fd: int | None = None) -> None:
        self.fd = os.memfd_create("msd-task-cells", 0) if fd is None else fd  # inheritable: servers get it
        if fd is None:
            os.ftruncate(self.fd, CELLS * CELL_BYTES)
        self.map = mmap.mmap(self.fd, CELLS * CELL_BYTES)
        self._free: list[int] = []  # given back; cells from _next on were never used
        self._next = 0

    def take(self) -> int:
        if self._free:
            n = self._free.pop()
        elif self._next < CELLS:
            n, self._next = self._next, self._next + 1
        else:
            raise RuntimeError(f"more than {CELLS} worker processes started and not waited for")
        self.cell(n).clear()
        return n

    def give_back(self, n: int) -> WorkCell:
        """A copy of the cell's last values, and it is free again."""
        value = WorkCell.from_buffer_copy(self.cell(n))
        self._free.append(n)
        return value

    def cell(self, n: int) -> WorkCell:
        return WorkCell.from_buffer(self.map, CELL_BYTES * n)


class ForkedWorker:
    """The agent's handle of one worker process (like multiprocessing's Process: pid, is_alive,
    exitcode, terminate, kill, join). It is the agent's process's child: its status is waited for
    here."""

    def __init__(self, cells: TaskCells, pid: int, cell: int) -> None:
        self.pid, self._cells, self._cell = pid, cells, cell
        self.task = -1  # the prepare task it worked on when it died (-1: none)
        self.source = self.record = -1  # and the sample (-1: none)
        self.overran_s = 0.0  # > 0: stopped by its agent, its sample that far past its limit
        self._exitcode: int | None = None

    def working_on(self) -> WorkCell:
        """While it lives: what it works on now (its cell, as it writes it)."""
        return self._cells.cell(self._cell)

    def overrun_s(self) -> float:
        """While it lives: seconds its current sample has run past the source's max_sample_s."""
        if self._exitcode is not None:
            return 0.0
        return self.working_on().overrun_s(time.monotonic_ns())

    def stop_overrun(self, overran_s: float) -> None:
        """Its sample ran past the limit: SIGKILL (a sample stuck in native code ignores anything
        milder), remembered, so its exit is reported as the sample's poison, not as a crash."""
        self.overran_s = overran_s
        self.kill()

    @property
    def exitcode(self) -> int | None:
        if self._exitcode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # waited for elsewhere: its status is lost
                pid, status = self.pid, -1
            if pid:
                self._exitcode = os.waitstatus_to_exitcode(status) if status >= 0 else 1
                last = self._cells.give_back(self._cell)
                self.task, self.source, self.record = last.task, last.source, last.record
        return self._exitcode

    def is_alive(self) -> bool:
        return self.exitcode is None

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        if self.exitcode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def join(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.exitcode is None:
            if deadline is not None and time.monotonic() >= deadline:
                return
            time.sleep(0.02)


class ForkServer:
    """The agent's side: start() forks the first server (call it before the process has a zmq
    context or a second thread); start_worker() has a server fork a worker running
    `target(*args, task_cell)`, starting a fresh server if none runs. `target_name` ("module:
    function") is how a fresh server finds the target."""

    def __init__(self, target: Callable[..., None], target_name: str) -> None:
        self.target, self.target_name = target, target_name
        self.pid: int | None = None  # the server now running
        self.servers_started = 0
        self.cells: TaskCells | None = None
        self._fresh: subprocess.Popen | None = None
        self._to: int | None = None
        self._from: int | None = None
        self._buffer = b""
        self._replies: list[dict[str, Any]] = []

    @property
    def running(self) -> bool:
        return self._from is not None

    def start(self) -> None:
        become_subreaper()
        self.cells = TaskCells()
        from_agent, to_server = os.pipe()  # (read end, write end)
        from_server, to_agent = os.pipe()
        pid = os.fork()
        if pid == 0:  # the server
            os.close(to_server)
            os.close(from_server)
            _serve_and_exit(from_agent, to_agent, self.target, self.cells)
        os.close(from_agent)
        os.close(to_agent)
        self._connected(pid, to_server, from_server)

    def _start_fresh(self) -> None:
        from_agent, to_server = os.pipe()
        from_server, to_agent = os.pipe()
        fds = (from_agent, to_agent, self.cells.fd)
        try:
            self._fresh = subprocess.Popen([sys.executable, "-m", "worker.forks", *map(str, fds), self.target_name],
                                           pass_fds=fds)
        finally:
            os.close(from_agent)
            os.close(to_agent)
        log.info("started a fork server (pid %d) in a fresh interpreter", self._fresh.pid)
        self._connected(self._fresh.pid, to_server, from_server)

    def _connected(self, pid: int, to_server: int, from_server: int) -> None:
        self.pid, self._to, self._from, self._buffer = pid, to_server, from_server, b""
        self.servers_started += 1
        os.set_blocking(from_server, False)

    def start_worker(self, args: tuple) -> ForkedWorker:
        """A new worker process (RuntimeError if no server could start it)."""
        if self.cells is None:
            raise RuntimeError("the fork server was never started")
        cell = self.cells.take()
        try:
            for _ in range(2):  # a server that lingered out just as we asked: once more, with a new one
                self.poll()
                if not self.running:
                    self._start_fresh()
                try:
                    os.write(self._to, json.dumps({"start": list(args), "cell": cell}).encode() + b"\n")
                except BrokenPipeError:
                    self._gone()
                    continue
                reply = self._reply()
                if reply is None:
                    continue
                if "failed" in reply:
                    raise RuntimeError(f"the fork server could not start a worker process: {reply['failed']}")
                return ForkedWorker(self.cells, int(reply["started"]), cell)
            raise RuntimeError("no fork server could start a worker process")
        except BaseException:
            self.cells.give_back(cell)
            raise

    def _reply(self) -> dict[str, Any] | None:
        """The server's answer to the request just sent (None: the server went away first)."""
        deadline = time.monotonic() + START_WAIT_S
        while not self._replies:
            if not self.running or time.monotonic() > deadline:
                if self.running:
                    log.error("the fork server (pid %s) did not answer in %.0fs; stopping it", self.pid,
                              START_WAIT_S)
                    self.stop()
                return None
            self.poll(REAP_EVERY_S)
        return self._replies.pop(0)

    def poll(self, timeout: float = 0.0) -> None:
        """Read what the server said (waiting up to `timeout` seconds for a first line); a server
        that has exited is waited for."""
        if self._from is None:
            return
        if timeout > 0:
            select.select([self._from], [], [], timeout)
        closed = False
        try:
            while not closed:
                chunk = os.read(self._from, 65536)
                closed = not chunk
                self._buffer += chunk
        except BlockingIOError:
            pass
        *lines, self._buffer = self._buffer.split(b"\n")
        self._replies += [json.loads(line) for line in lines]  # a reply read with the end still counts
        if closed:
            self._gone()

    def _gone(self) -> None:
        """The server exited (it lingered out, or died): wait for it."""
        for fd in (self._from, self._to):
            if fd is not None:
                os.close(fd)
        self._from = self._to = None
        if self._fresh is not None:
            self._fresh.wait()
            self._fresh = None
        elif self.pid is not None:
            try:
                os.waitpid(self.pid, 0)
            except ChildProcessError:
                pass
        self.pid = None

    def stop(self) -> None:
        """Close the pipe: the server exits (the workers are the agent's to stop)."""
        if self._to is not None:
            os.close(self._to)
            self._to = None
        deadline = time.monotonic() + STOP_WAIT_S
        while self.running and time.monotonic() < deadline:
            self.poll(REAP_EVERY_S)
        if self.running:
            os.kill(self.pid, signal.SIGKILL)
            while self.running:
                self.poll(REAP_EVERY_S)


class _Server:
    """The server's side: forks on request, through an intermediate process, and lingers."""

    def __init__(self, inbox: int, outbox: int, target: Callable[..., None], cells: TaskCells) -> None:
        self.inbox, self.outbox, self.target, self.cells = inbox, outbox, target, cells

    def run(self) -> None:
        name_process(SERVER_NAME)
        # The free pages of the heap it was forked with (the imports' temporaries) go back now:
        # otherwise, once its parent reuses them, the server alone holds the old copies.
        return_freed_memory()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the agent, which stops us
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        buffer, asked = b"", time.monotonic()
        while time.monotonic() - asked < LINGER_S:
            ready, _, _ = select.select([self.inbox], [], [], REAP_EVERY_S)
            if not ready:
                continue
            chunk = os.read(self.inbox, 65536)
            if not chunk:  # the agent is gone or stops us
                return
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                request = json.loads(line)
                self._say(self._fork(request["start"], int(request["cell"])))
            asked = time.monotonic()

    def _fork(self, args: list, cell: int) -> dict[str, Any]:
        pid_from, pid_to = os.pipe()
        middle = os.fork()
        if middle == 0:  # the intermediate: forks the worker, says its pid, exits (the agent adopts it)
            code = 1
            try:
                os.close(pid_from)
                name_process(WORKER_NAME)  # inherited: the worker has its name before its pid is reported
                worker = os.fork()
                if worker == 0:
                    os.close(pid_to)
                    _run_worker(self.target, args, self.cells.cell(cell), (self.inbox, self.outbox))
                os.write(pid_to, str(worker).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(pid_to)
        try:
            _, status = os.waitpid(middle, 0)
            pid = os.read(pid_from, 32)
        finally:
            os.close(pid_from)
        if status != 0 or not pid:
            return {"failed": f"the intermediate process ended with status {status}"}
        return {"started": int(pid)}

    def _say(self, msg: dict[str, Any]) -> None:
        try:
            os.write(self.outbox, json.dumps(msg).encode() + b"\n")
        except BrokenPipeError:  # the agent is gone; the inbox says so next
            pass


def _serve_and_exit(inbox: int, outbox: int, target: Callable[..., None], cells: TaskCells) -> None:
    code = 1
    try:
        _Server(inbox, outbox, target, cells).run()
        code = 0
    except BaseException:  # noqa: BLE001 - whatever it was, the server ends here, said on stderr
        traceback.print_exc()
    finally:
        os._exit(code)


def _run_worker(target: Callable[..., None], args: list, cell: WorkCell, pipes: tuple[int, int]) -> None:
    """In the forked worker (named by its intermediate): never returns."""
    code = 1
    try:
        for fd in pipes:
            os.close(fd)
        # Ctrl-C reaches the whole process group: the agent stops its workers (as the server). A
        # worker that stopped itself on it exited 0 first, and the agent, still running, logged
        # "exited with 0; restarting" for each (issue 61)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        target(*args, cell)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - a worker's crash ends it with status 1, its traceback on stderr
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _main(argv: list[str]) -> None:
    """A fresh server: `python -m worker.forks INBOX OUTBOX CELLS_FD module:function`."""
    inbox, outbox, cells_fd = (int(a) for a in argv[:3])
    module, _, function = argv[3].partition(":")
    from . import preload  # noqa: F401  (the worker's modules, imported and frozen before any fork)

    target = getattr(importlib.import_module(module), function)
    _serve_and_exit(inbox, outbox, target, TaskCells(cells_fd))


if __name__ == "__main__":
    _main(sys.argv[1:])
