"""The memory accounting of tools/bench_e2e.py: what a loader adds to the machine is the signed
change of the summed PSS of every process. A loader that adds nothing (a rank that forks idle
workers) must read near zero; the old accounting (the rank's fall clipped at zero, its workers
counted whole) read the shared pages twice."""

import gc
import os
import signal
import sys
import time

import numpy as np

sys.path.insert(0, "tools")

import e2e_ranks  # noqa: E402


def test_a_loader_that_adds_nothing_reads_near_zero_where_clipping_read_the_shared_pages_twice():
    heap = np.ones(200 * 2**20 // 8)  # a trainer's 200 MB, touched
    gc.collect()
    gc.freeze()  # as the baselines do before their workers fork
    before = e2e_ranks.pss_kb(os.getpid())
    children = []
    for _ in range(4):
        pid = os.fork()
        if pid == 0:  # an idle worker: touches nothing
            signal.pause()
            os._exit(0)
        children.append(pid)
    try:
        time.sleep(0.5)
        now, kids = e2e_ranks.pss_now(os.getpid())
        added = e2e_ranks.added_kb([(before, now, kids)])
        clipped = max(0, now - before) + kids
        assert abs(added) < 24 * 1024, (before, now, kids)  # a few MB of copied pages per worker at most
        assert clipped > 120 * 1024  # the 4 workers' share of the 200 MB, counted again
        assert now < before - 120 * 1024  # the rank's own PSS fell: its pages are shared now
    finally:
        for pid in children:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        gc.unfreeze()
        del heap
