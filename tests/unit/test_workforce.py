"""Worker allocation and host scaling decisions (coordinator/workforce.py), on plain records of
workers and ranks; the processes themselves are exercised in tests/integration/test_autoscale.py."""

from dataclasses import dataclass

import pytest

from coordinator.registry import HostInfo
from coordinator.workforce import Workforce


@dataclass
class W:
    worker_id: int
    busy_s: float = 0.0
    agent: int = 1


@dataclass
class T:
    waited_s: float = 0.0
    consumed: int = 0


def test_cost_estimates_follow_measurements():
    wf = Workforce(2, "adaptive")
    assert wf.estimate(0, 10) == pytest.approx(1e-3)  # nothing measured yet: a small default
    wf.record(1, seconds=0.5, records=10, tokens=5000)
    assert wf.costs[1].s_per_record == pytest.approx(0.05) and wf.costs[1].s_per_token == pytest.approx(1e-4)
    wf.record(1, seconds=1.5, records=10, tokens=5000)  # the source got costlier: the estimate moves
    assert 0.05 < wf.costs[1].s_per_record < 0.15
    assert wf.estimate(1, 4) == pytest.approx(4 * wf.costs[1].s_per_record)


def test_adaptive_picks_least_queued_work_fixed_keeps_one_source_per_worker():
    backlog = {0: 2.0, 1: 0.1, 2: 0.5, 3: 0.0}
    workers, weights = list(backlog), [0.5, 0.5]
    assert Workforce(2, "adaptive").choose(0, workers, weights, backlog.get) == 3
    fixed = Workforce(2, "fixed")
    assert fixed.fixed_split([3, 0, 2, 1], weights) == {0: 0, 1: 1, 2: 0, 3: 1}
    assert fixed.choose(0, workers, weights, backlog.get) == 2  # source 0's workers are 0 and 2
    assert fixed.choose(1, workers, weights, backlog.get) == 3
    # a source without weight gets no workers of its own
    assert set(fixed.fixed_split([0, 1, 2], [0.0, 1.0]).values()) == {1}


def test_hosts_grow_while_ranks_wait_then_report_what_is_missing():
    wf = Workforce(1, "adaptive")
    h = HostInfo(1, b"h", "cpu-1", procs=1, min_procs=1, max_procs=2, auto=True, last_seen=0.0)
    hosts = {1: h}
    workers = {0: W(0)}
    ranks = {0: T()}
    assert wf.decide(0.0, hosts, workers, ranks) == []  # the first call opens the window
    workers[0].busy_s, ranks[0].waited_s, ranks[0].consumed = 1.8, 1.0, 10
    grow = wf.decide(2.0, hosts, workers, ranks)
    assert grow == [(h, 2)] and wf.steps_per_s == pytest.approx(5.0)
    h.procs = 2
    workers[1] = W(1, busy_s=0.0)
    workers[0].busy_s, workers[1].busy_s, ranks[0].waited_s = 3.7, 1.9, 2.0
    assert wf.decide(4.0, hosts, workers, ranks) == [] and wf.needed == 2  # at the limit: 2 x 0.5 / 0.5
    # a rank that only reads waits all the time (a late report can even cover more than the
    # window): the shortfall is capped at 9x, not a runaway figure
    workers[0].busy_s, workers[1].busy_s, ranks[0].waited_s = 5.6, 3.8, 4.5
    assert wf.decide(6.0, hosts, workers, ranks) == [] and wf.last_wait == 1.0 and wf.needed == 18


def test_idle_auto_host_retires_its_newest_worker_after_the_delay():
    wf = Workforce(1, "adaptive", shrink_after_s=4.0)
    h = HostInfo(1, b"h", "cpu-1", procs=2, min_procs=1, max_procs=2, auto=True, last_seen=0.0)
    hosts = {1: h}
    workers, ranks = {0: W(0), 5: W(5)}, {0: T()}
    for t in (0.0, 2.0, 4.0):
        wf.decide(t, hosts, workers, ranks)
    assert wf.retiring(hosts) == set()  # idle for 2 s only
    wf.decide(6.0, hosts, workers, ranks)
    assert wf.retiring(hosts) == {5}
    wf.decide(8.0, hosts, workers, ranks)
    wf.decide(12.0, hosts, workers, ranks)
    assert wf.retiring(hosts) == {5}  # never below min_procs: one retiring of two is the most
    fixed_host = HostInfo(2, b"g", "cpu-2", procs=3, min_procs=3, max_procs=3, auto=False, last_seen=0.0)
    hosts[2] = fixed_host
    wf.decide(20.0, hosts, workers, ranks)
    assert fixed_host.retiring == set()  # a --procs N host is never resized
