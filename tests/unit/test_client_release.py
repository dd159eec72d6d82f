"""A micro-batch handed to the trainer lets go of the arrays it was made of (a step's image frames
used to stay until its last micro-batch was taken), and after enough of them the client gives the
heap's free pages back in its builder thread, not in the trainer's next()."""

import logging
import threading

import numpy as np

from msd.testing.ports import free_port
from trainer_client import DataClient, client as client_module
from trainer_client.assemble import StepAssembler
from trainer_client.receiving import ReadyStep

INFO = {"topology": {"dp": 1, "pp": 1, "cp": 1, "tp": 1}, "pad_id": 0, "micro_batch_size": 1, "micro_batches": 3}
FRAME_BYTES = 9 << 20  # a piece's array: two micro-batches' worth pass the client's 16 MiB


def step_with_arrays(step: int) -> ReadyStep:
    refs = np.array([[(step << 20) + i, 0, 5] for i in range(3)], np.uint64)  # a piece a micro-batch
    assembler = StepAssembler(refs, np.array([1, 1, 1]), 8, 0, 1)
    items = np.column_stack([np.arange(3, dtype=np.uint64), refs])
    frames = [np.full(FRAME_BYTES, step * 3 + i, np.uint8) for i in range(3)]
    assembler.add(items, np.arange(15, dtype=np.uint16), extras=[("frames_of_test", "|u1", [], False)],
                  extra_rows=np.ones((3, 1), np.int64), extra_frames=frames)
    return ReadyStep(step, 0, assembler, {}, 0, INFO, False)


def test_handed_micro_batches_let_go_of_their_arrays_and_the_builder_trims(monkeypatch):
    logging.getLogger("msd.session").setLevel(logging.ERROR)  # nobody is at the coordinator's port
    client = DataClient(f"tcp://127.0.0.1:{free_port()}", rank=0, timeout_s=10, as_torch=False)
    client.start()  # (which gives the pages its setting up left free back once, in this thread)
    trims: list[str] = []
    monkeypatch.setattr(client_module.memory, "return_freed_memory",
                        lambda: trims.append(threading.current_thread().name) or True)
    steps = [step_with_arrays(s) for s in range(2)]
    for ready in steps:
        client._queue.put(ready)
    try:
        for s, ready in enumerate(steps):
            for m in range(3):
                batch = next(client)
                assert (batch["step"], batch["micro_batch"]) == (s, m)
                assert batch["frames_of_test"].shape == (FRAME_BYTES,) and (batch["frames_of_test"] == s * 3 + m).all()
                assert sorted(ready.assembler.extras) == list(range(m + 1, 3))  # its own gone, the rest kept
    finally:
        client.close()
    # 54 MiB let go, 18 at a time past the 16 MiB: three trims, none in the trainer's thread
    assert trims == ["msd-build-0"] * 3
