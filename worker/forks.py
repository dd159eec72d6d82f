"""The host's fork server: a child of the host agent, forked once before the agent opens any
zmq socket, that forks every worker process.

The agent imports the worker's modules and freezes them out of the garbage collector
(`worker/preload.py`) before it forks this server, so the agent, the server and every worker
share those pages. The server itself never creates a zmq context: forking a process that holds
one leaves the child with the parent's sockets and a context whose I/O threads are gone. It
answers the agent over a pair of pipes, one JSON object per line:

    agent -> server   {"start": [worker args...]}
    server -> agent   {"started": pid}
                      {"exited": pid, "exitcode": code, "task": task}

`exitcode` is as multiprocessing gives it (negative: killed by that signal); `task` is the
prepare task the worker marked as the one it worked on when it died (-1: none), from a shared
8-byte cell the server maps before each fork. When the agent is gone (its pipe closes), the
server stops its workers and exits. Python's multiprocessing fork server did this job before:
it needed a resource tracker process beside it (7 MB of the 167 tools/bench_e2e.py measured at
8 ranks), and it imported the modules in an interpreter of its own, shared with nobody but the
workers (here the agent shares them too: 163 -> 144 MB in all at that point).
"""

from __future__ import annotations

import ctypes
import json
import logging
import mmap
import os
import select
import signal
import sys
import time
import traceback
from typing import Any, Callable

from trainer_client.memory import return_freed_memory

log = logging.getLogger("msd.worker.forks")

REAP_EVERY_S = 0.1
STOP_WAIT_S = 5.0
SERVER_NAME, WORKER_NAME = "msd-forks", "msd-worker"  # as /proc/PID/comm, ps -o comm and top show them


def name_process(name: str) -> None:
    """The process's name in `ps -o comm`, top and /proc/PID/comm (Linux; nothing elsewhere):
    forked processes keep their parent's command line, so the name tells them apart."""
    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def host_worker_pids(agent_pid: int) -> list[int]:
    """The worker processes of the host agent `agent_pid` now running (its fork server's
    children; Linux /proc), for tests, benchmarks and operators' scripts."""
    return [pid for server in fork_server_pids(agent_pid) for pid in _children(server)]


def fork_server_pids(parent_pid: int) -> list[int]:
    """The host fork servers among a process's children: a host agent's, or a coordinator's
    with --worker-procs (Linux /proc)."""
    return [pid for pid in _children(parent_pid) if process_comm(pid) == SERVER_NAME]


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def process_comm(pid: int) -> str:
    """A process's name (/proc/PID/comm; "" if it is gone)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


class ForkedWorker:
    """The agent's handle of one worker process, forked by the server (like multiprocessing's
    Process: pid, is_alive, exitcode, terminate, kill, join)."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.server, self.pid = server, pid
        self.task = -1  # the prepare task it worked on when it died (-1: none)
        self._exitcode: int | None = None

    @property
    def exitcode(self) -> int | None:
        self.server.poll()
        return self._exitcode

    def is_alive(self) -> bool:
        return self.exitcode is None

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        if self._exitcode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def join(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._exitcode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            self.server.poll(REAP_EVERY_S if left is None else min(REAP_EVERY_S, left))


class ForkServer:
    """The agent's side: start() forks the server (call it before the process has a zmq context
    or a second thread); start_worker() has it fork a worker running `target(*args, task_cell)`."""

    def __init__(self, target: Callable[..., None]) -> None:
        self.target = target
        self.pid: int | None = None
        self.gone = False  # the server died (not stopped by us): no worker can start
        self._to: int | None = None
        self._from: int | None = None
        self._buffer = b""
        self._workers: dict[int, ForkedWorker] = {}
        self._started: list[int] = []

    def start(self) -> None:
        from_agent, to_server = os.pipe()  # (read end, write end)
        from_server, to_agent = os.pipe()
        pid = os.fork()
        if pid == 0:  # the server
            os.close(to_server)
            os.close(from_server)
            code = 1
            try:
                _Server(from_agent, to_agent, self.target).run()
                code = 0
            except BaseException:  # noqa: BLE001 - whatever it was, the server ends here, said on stderr
                traceback.print_exc()
            finally:
                os._exit(code)
        os.close(from_agent)
        os.close(to_agent)
        self.pid, self._to, self._from = pid, to_server, from_server
        os.set_blocking(from_server, False)

    def start_worker(self, args: tuple) -> ForkedWorker:
        if self.gone or self._to is None:
            raise RuntimeError("the host's fork server is gone")
        try:
            os.write(self._to, json.dumps({"start": list(args)}).encode() + b"\n")
        except BrokenPipeError:  # it died since the last poll
            self.poll()
            raise RuntimeError("the host's fork server is gone") from None
        deadline = time.monotonic() + 30
        while not self._started:
            if self.gone or time.monotonic() > deadline:
                raise RuntimeError("the host's fork server did not start a worker process")
            self.poll(REAP_EVERY_S)
        pid = self._started.pop(0)
        worker = self._workers[pid] = ForkedWorker(self, pid)
        return worker

    def poll(self, timeout: float = 0.0) -> None:
        """Read what the server said (waiting up to `timeout` seconds for a first line)."""
        if self._from is None or self.gone:
            return
        if timeout > 0:
            select.select([self._from], [], [], timeout)
        try:
            while True:
                chunk = os.read(self._from, 65536)
                if not chunk:
                    self._lost()
                    return
                self._buffer += chunk
        except BlockingIOError:
            pass
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            self._on(json.loads(line))

    def _on(self, msg: dict[str, Any]) -> None:
        if "started" in msg:
            self._started.append(int(msg["started"]))
        elif "exited" in msg:
            worker = self._workers.pop(int(msg["exited"]), None)
            if worker is not None:
                worker._exitcode, worker.task = int(msg["exitcode"]), int(msg["task"])

    def _lost(self) -> None:
        """The server is gone: no worker can start, and none can be waited for (they are not our
        children). Those still running are told to stop (they would on their own once the agent
        is gone) and count as exited."""
        self.gone = True
        os.close(self._from)
        self._from = None
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass
        for worker in self._workers.values():
            worker.terminate()
            worker._exitcode = -signal.SIGKILL
        self._workers.clear()

    def stop(self) -> None:
        """Close the pipe: the server stops the workers still running and exits."""
        if self._to is not None:
            os.close(self._to)
            self._to = None
        if self.pid is not None and not self.gone:
            deadline = time.monotonic() + STOP_WAIT_S + 1
            while not self.gone and time.monotonic() < deadline:
                self.poll(REAP_EVERY_S)
            if not self.gone:
                os.kill(self.pid, signal.SIGKILL)
                self.poll(1.0)


class _Server:
    """The server's side: forks on request, reaps its children and says how they ended."""

    def __init__(self, inbox: int, outbox: int, target: Callable[..., None]) -> None:
        self.inbox, self.outbox, self.target = inbox, outbox, target
        self.cells: dict[int, tuple[mmap.mmap, ctypes.c_int64]] = {}

    def run(self) -> None:
        name_process(SERVER_NAME)
        # The free pages of the heap it was forked with (the imports' temporaries) go back now:
        # otherwise, once its parent reuses them, the server alone holds the old copies for ever
        # (1.5 MB of 126 at tools/bench_e2e.py's headline point with msd coordinator --worker-procs).
        return_freed_memory()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the agent, which stops us
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        buffer = b""
        while True:
            ready, _, _ = select.select([self.inbox], [], [], REAP_EVERY_S)
            if ready:
                chunk = os.read(self.inbox, 65536)
                if not chunk:  # the agent is gone or stops us
                    self._stop_all()
                    return
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    self._fork(json.loads(line)["start"])
            self._reap()

    def _fork(self, args: list) -> None:
        shared = mmap.mmap(-1, 8)
        cell = ctypes.c_int64.from_buffer(shared)
        cell.value = -1
        pid = os.fork()
        if pid == 0:
            _run_worker(self.target, args, cell, (self.inbox, self.outbox))
        self.cells[pid] = (shared, cell)
        self._say({"started": pid})

    def _reap(self) -> None:
        while self.cells:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            shared, cell = self.cells.pop(pid, (None, None))
            task = cell.value if cell is not None else -1
            del cell
            if shared is not None:
                shared.close()
            self._say({"exited": pid, "exitcode": os.waitstatus_to_exitcode(status), "task": task})

    def _say(self, msg: dict[str, Any]) -> None:
        try:
            os.write(self.outbox, json.dumps(msg).encode() + b"\n")
        except BrokenPipeError:  # the agent is gone; the inbox says so next
            pass

    def _stop_all(self) -> None:
        for pid in self.cells:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + STOP_WAIT_S
        while self.cells and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.05)
        for pid in list(self.cells):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        while self.cells:
            self._reap()
            time.sleep(0.01)


def _run_worker(target: Callable[..., None], args: list, cell: ctypes.c_int64, pipes: tuple[int, int]) -> None:
    """In the forked worker: never returns."""
    code = 1
    try:
        for fd in pipes:
            os.close(fd)
        name_process(WORKER_NAME)
        signal.signal(signal.SIGINT, signal.default_int_handler)
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
