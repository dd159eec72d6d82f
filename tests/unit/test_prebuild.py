"""The client's reused buffers and its builder thread: a micro-batch built ahead is the one that
would have been built inside next(), a buffer the trainer still holds is never written again,
and the trainer never gets a micro-batch twice or out of order."""

import threading
import time

import numpy as np
import pytest

from trainer_client.assemble import StepAssembler
from trainer_client.buffers import BufferPool
from trainer_client.prebuild import Prebuilder
from trainer_client.receiving import ReadyStep

INFO = {"topology": {"dp": 1, "pp": 1, "cp": 1, "tp": 1}, "pad_id": 0, "micro_batch_size": 2, "micro_batches": 3}


def ready_step(step: int, row_len: int = 64, seed: int = 0) -> ReadyStep:
    rng = np.random.default_rng(seed + step)
    refs, counts = [], []
    for _ in range(6):  # 3 micro-batches of 2 rows, some padded
        left, n = row_len - int(rng.integers(0, 9)), 0
        while left > 0:
            length = min(left, int(rng.integers(1, 20)))
            refs.append((len(refs) + (step << 20), int(rng.integers(0, 9)), length))
            left, n = left - length, n + 1
        counts.append(n)
    refs_a = np.array(refs, dtype=np.uint64)
    assembler = StepAssembler(refs_a, np.array(counts), row_len, 0, 2)
    items = np.column_stack([np.arange(len(refs_a), dtype=np.uint64), refs_a])
    assembler.add(items, rng.integers(1, 60_000, int(refs_a[:, 2].sum())).astype(np.uint16))
    return ReadyStep(step, 0, assembler, {"step": step}, 0, INFO, False)


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        np.array_equal(a[k], b[k]) if isinstance(a[k], np.ndarray) else a[k] == b[k] for k in a)


def test_pooled_micro_batches_equal_freshly_allocated_ones():
    pool = BufferPool()
    for step in range(4):
        ready = ready_step(step)
        for m in range(3):
            assert same(ready.micro_batch(m, pool), ready.micro_batch(m))


def test_a_buffer_is_reused_only_once_nothing_refers_to_it():
    pool = BufferPool()
    ready = ready_step(0)
    first = ready.micro_batch(0, pool)
    kept = first["tokens"].copy()
    for m in (1, 2, 1, 2):  # the trainer holds `first` while later micro-batches are built
        ready.micro_batch(m, pool)
    assert np.array_equal(first["tokens"], kept)
    assert pool.allocated == 2  # the held one, and one reused for every later micro-batch
    labels, kept_labels = first["labels"], first["labels"].copy()  # a view keeps the buffer taken...
    del first
    second = ready.micro_batch(1, pool)  # (the other buffer: free)
    ready.micro_batch(2, pool)  # both taken: a third
    assert pool.allocated == 3 and np.array_equal(labels, kept_labels)
    del labels, second  # ...and once dropped, the buffers serve again
    for m in range(3):
        ready.micro_batch(m, pool)
    assert pool.allocated == 3


def test_a_torch_view_keeps_its_buffer_taken():
    torch = pytest.importorskip("torch")
    pool = BufferPool()
    ready = ready_step(1)
    tensor = torch.from_numpy(ready.micro_batch(0, pool)["position_ids"])[1:]  # a derived tensor only
    kept = tensor.clone()
    for m in (1, 2, 1, 2):
        ready.micro_batch(m, pool)
    assert torch.equal(tensor, kept)


def test_a_micro_batch_built_ahead_waits_for_a_spare_buffer_instead_of_allocating_a_third():
    from trainer_client.buffers import NoSpareBuffer

    pool = BufferPool()
    ready = ready_step(2)
    older, current = ready.micro_batch(0, pool), ready.micro_batch(1, pool)  # the trainer holds both
    with pytest.raises(NoSpareBuffer):
        ready.micro_batch(2, pool, ahead=True)
    del older  # the trainer drops its previous micro-batch
    assert same(ready.micro_batch(2, pool, ahead=True), ready.micro_batch(2))
    assert pool.allocated == 2 and current["tokens"].base is not None


def test_the_pool_keeps_a_bounded_number_of_buffers():
    pool = BufferPool(size=2)
    held = [pool.take(100) for _ in range(5)]  # the trainer holds them all
    assert pool.allocated == 5 and len(pool._bufs) == 2
    del held
    buf = pool.take(100)
    address = buf.ctypes.data
    del buf
    assert all(pool.take(100).ctypes.data == address for _ in range(3))  # freed: the same buffer again
    assert pool.allocated == 5
    pool.take(200)  # another size (a new row length) takes the place of a free one
    assert len(pool._bufs) == 2


class Builder:
    """A Prebuilder over ReadySteps, recording what it sends and which thread built what."""

    def __init__(self, slow_s: float = 0.0) -> None:
        self.built_in: list[str] = []
        self.slow_s = slow_s
        self.sent: list = []
        self.pre = Prebuilder(self.build, self.sent.append, name="test-build")

    def build(self, ready: ReadyStep, m: int, ahead: bool = False) -> dict:
        self.built_in.append(threading.current_thread().name)
        time.sleep(self.slow_s)
        return ready.micro_batch(m)


def test_a_trainer_that_computes_gets_every_micro_batch_built_ahead_in_order():
    b = Builder()
    steps = [ready_step(s) for s in range(3)]
    expected = [s.micro_batch(m) for s in steps for m in range(3)]
    got = []
    for s in steps:
        for m in range(3):
            got.append(b.pre.take(s, m))  # what next() does: take this one, ask for the next
            if m + 1 < 3:
                b.pre.ask(s, m + 1)
            elif s.step + 1 < 3:
                b.pre.ask(steps[s.step + 1], 0)
            time.sleep(0.01)  # compute
    b.pre.close()
    assert all(same(x, y) for x, y in zip(got, expected)) and len(got) == len(expected)
    assert b.pre.built_ahead == len(expected) - 4  # all but the first step and the next first (each index timed once)
    assert b.built_in.count("test-build") == b.pre.built_ahead  # nothing was built twice
    assert len(b.built_in) == len(expected)


def test_a_trainer_that_computes_only_after_a_step_gets_only_first_micro_batches_built_ahead():
    b = Builder()
    steps = [ready_step(s) for s in range(4)]
    for s in steps:
        for m in range(3):
            b.pre.take(s, m)
            if m + 1 < 3:
                b.pre.ask(s, m + 1)
            elif s.step + 1 < 4:
                b.pre.ask(steps[s.step + 1], 0)
                time.sleep(0.01)  # the optimizer step: the only compute
    b.pre.close()
    assert b.pre.built_ahead == 2  # steps 2 and 3's first micro-batches (step 1's timed the compute)
    assert b.built_in.count("test-build") == 2


def test_without_compute_between_calls_nothing_is_asked_of_the_builder():
    b = Builder()
    s = ready_step(0)
    for _ in range(4):
        for m in range(3):
            b.pre.take(s, m)
            b.pre.ask(s, (m + 1) % 3)
    b.pre.close()
    assert b.pre.built_ahead == 0 and set(b.built_in) == {threading.current_thread().name}


def test_the_trainer_waits_for_a_build_in_progress_instead_of_building_twice():
    b = Builder(slow_s=0.2)
    s = ready_step(0)
    b.pre._computed[0] = 1.0  # as after a long compute following micro-batch 0
    b.pre._taken_m = 0
    b.pre.ask(s, 1)
    time.sleep(0.05)  # the builder is inside its 0.2 s build
    started = time.perf_counter()
    batch = b.pre.take(s, 1)
    assert 0.1 < time.perf_counter() - started < 0.5
    b.pre.close()
    assert same(batch, s.micro_batch(1)) and b.built_in == ["test-build"]


def test_a_build_that_fails_ahead_fails_again_in_the_trainer():
    class Broken(Exception):
        pass

    calls = []

    def build(ready, m, ahead=False):
        calls.append(threading.current_thread().name)
        raise Broken("bad micro-batch")

    pre = Prebuilder(build, lambda cmd: None, name="test-build")
    pre._computed[-1] = 1.0
    pre.ask(None, 0)
    time.sleep(0.05)
    with pytest.raises(Broken):
        pre.take(None, 0)
    pre.close()
    assert calls == ["test-build", threading.current_thread().name]


def test_commands_reach_the_io_thread_in_order():
    b = Builder()
    b.pre.command(["consumed", 0, 0.0])
    b.pre.command(["state", 1])
    b.pre.close()
    assert b.sent == [["consumed", 0, 0.0], ["state", 1]]


def test_housekeeping_runs_in_the_builders_thread_after_what_was_asked_before_it():
    b = Builder()
    ran: list = []
    b.pre.command(["consumed", 0])
    b.pre.call(lambda: ran.append((threading.current_thread().name, list(b.sent))))
    b.pre.close()
    assert ran == [("test-build", [["consumed", 0]])]  # not in the trainer's thread, and in order


def test_failed_housekeeping_leaves_the_builder_forwarding_commands():
    b = Builder()

    def broken() -> None:
        raise OSError("no libc here")

    b.pre.call(broken)
    b.pre.command(["consumed", 1])
    b.pre.close()
    assert b.sent == [["consumed", 1]]
