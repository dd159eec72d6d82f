"""The memory accounting of tools/bench_e2e.py: what a loader adds to the machine is the signed
change of the summed PSS of every process. A loader that adds nothing (a rank that forks idle
workers) must read near zero; the old accounting (the rank's fall clipped at zero, its workers
counted whole) read the shared pages twice."""

import os
import subprocess
import sys

import orjson

# A fresh process, as a trainer rank is: the test runner's own heap (and its threads, writing to
# pages it shares with forked children) would be measured too.
RANK = r'''
import gc, os, signal, sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
import e2e_ranks, orjson
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
time.sleep(0.5)
now, kids = e2e_ranks.pss_now(os.getpid())
for pid in children:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
print(orjson.dumps({"before": before, "now": now, "kids": kids,
                    "added": e2e_ranks.added_kb([(before, now, kids)])}).decode())
'''


def test_a_loader_that_adds_nothing_reads_near_zero_where_clipping_read_the_shared_pages_twice():
    tools = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools")
    out = orjson.loads(subprocess.run([sys.executable, "-c", RANK, tools], check=True, capture_output=True,
                                      timeout=60).stdout)
    before, now, kids, added = out["before"], out["now"], out["kids"], out["added"]
    clipped = max(0, now - before) + kids
    assert abs(added) < 24 * 1024, out  # a few MB of copied pages per worker at most
    assert clipped > 120 * 1024, out  # the 4 workers' share of the 200 MB, counted again
    assert now < before - 120 * 1024, out  # the rank's own PSS fell: its pages are shared now


# A coordinator with many sources hard-linked to one index maps the same file once per source.
MAPPED = r'''
import mmap, os, sys
sys.path.insert(0, sys.argv[1])
import bench_scale, orjson
path = sys.argv[2]
with open(path, "wb") as f:
    f.write(os.urandom(4 << 20))
maps = []
for _ in range(40):  # 40 sources, one index
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    sum(m[i] for i in range(0, len(m), 4096))  # every page resident in this mapping
    maps.append(m)
print(orjson.dumps(bench_scale._status(os.getpid())).decode())
'''


def test_a_file_mapped_by_many_sources_counts_once_in_the_scale_benchmark(tmp_path):
    tools = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools")
    out = orjson.loads(subprocess.run([sys.executable, "-c", MAPPED, tools, str(tmp_path / "index.bin")], check=True,
                                      capture_output=True, timeout=60).stdout)
    mb = 1 << 20
    assert out["RssFile"] > 40 * 4 * mb  # each mapping's pages counted again
    assert 4 * mb <= out["Pss_File"] < 4 * mb + 16 * mb, out  # the index once (plus libraries' shares)


# A batch held for part of a run: the sampler sees it at its peak, and the mean lies between.
SAMPLED = r'''
import os, sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
import e2e_ranks, orjson
before = e2e_ranks.anon_shmem_kb(os.getpid())
with e2e_ranks.AnonShmemSampler(os.getpid(), every_s=0.01) as sampled:
    time.sleep(0.2)
    held = np.ones(64 * 2**20 // 8)  # 64 MB, touched, for a while
    time.sleep(0.3)
    del held
    time.sleep(0.3)
print(orjson.dumps({**sampled.growth_kb(before), "after": e2e_ranks.anon_shmem_kb(os.getpid()) - before}).decode())
'''


def test_memory_sampled_over_a_run_sees_a_peak_that_one_reading_at_its_end_misses():
    tools = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools")
    out = orjson.loads(subprocess.run([sys.executable, "-c", SAMPLED, tools], check=True, capture_output=True,
                                      timeout=60).stdout)
    assert out["peak"] > 60 * 1024, out  # the 64 MB while held
    assert out["after"] < 16 * 1024, out  # gone at the end (a large array is unmapped when freed)
    assert out["after"] < out["mean"] < out["peak"] - 16 * 1024, out


BETWEEN_SAMPLES = r'''
import os, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import e2e_ranks, orjson
with e2e_ranks.AnonShmemSampler(os.getpid(), every_s=60) as sampled:  # no sample falls in the run
    made = np.ones(64 * 2**20 // 8)  # 64 MB, touched, then freed at once
    del made
print(orjson.dumps(sampled.growth_kb(0)).decode())
'''


def test_the_kernel_s_high_water_mark_sees_a_batch_that_lives_between_two_samples():
    """A float micro-batch made inside next() beside the one the trainer holds lives about 50 ms:
    a 20 ms sampler may miss it; the resident set's high-water mark, reset as the run begins, does not."""
    tools = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools")
    out = orjson.loads(subprocess.run([sys.executable, "-c", BETWEEN_SAMPLES, tools], check=True,
                                      capture_output=True, timeout=60).stdout)
    assert out["peak_rise"] == 0, out  # not sampled
    assert out["rss_rise_exact"] is not None and out["rss_rise_exact"] > 60 * 1024, out
