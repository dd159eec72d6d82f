"""Can one coordinator keep up with 1,024 ranks and 306 sources? A fleet on one machine.

    python tools/bench_scale.py --json OUT [--quick] [--points DP:S:R,...] [--step-s S]
    python tools/bench_scale.py --plot-from OUT PNG

Per grid point (DP ranks, S sources, R records per source): a real `msd coordinator` (with
--metrics-port), a real `msd worker` host with 2 worker processes, and DP light trainer ranks
(tools/scale_ranks.py: the real protocol and the real ReceivingState, no tensors), 256 to a
process. The ranks finish their steps together, one step per --step-s seconds (default 1: the
targets are stated at one step per second, and CPU per step at another rate is not comparable:
a coordinator that falls behind handles many messages per wake-up); --step-s 0: as fast as they
can. Sources are Megatron pairs: one index of R documents (lognormal lengths, mean ~1,000
tokens) with a sparse .bin, hard-linked S times (S sources of R records each, 3 x 10^9 records
at 306 x 10^7, at the disk cost of one). Each rank gets 8,192 tokens per step (one sequence).

Reported per point: the coordinator's CPU per step (utime+stime from /proc over the steps after
a warm-up, against the slowest rank's consumed step from its metrics), its peak RSS and, apart,
its anonymous (heap) and file-backed (mapped indexes) resident memory, the latter as PSS (a page
of the one hard-linked index counts once, not once per source), messages per second by type,
sockets per worker process, the step rate, and the time from the coordinator's start to the
first batch at any rank.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

import orjson
import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_output import emit  # noqa: E402

from msd.testing.fleet import sources  # noqa: E402
from msd.testing.ports import free_port  # noqa: E402
from msd.testing.processes import stop  # noqa: E402
from worker.forks import host_worker_pids  # noqa: E402

TOKENS_PER_RANK = 8192
RANKS_PER_PROCESS = 256
SCRAPE_EVERY_S = 3.0  # the coordinator pays for every scrape (hundreds of series at 306 sources)
WORKERS = 2
LOG_LEVEL = os.environ.get("BENCH_SCALE_LOG_LEVEL", "WARNING")  # INFO, with BENCH_SCALE_KEEP_LOGS=1, to see start-up
KEEP_LOGS = bool(os.environ.get("BENCH_SCALE_KEEP_LOGS"))
GRID = [(8, 1, 10**5), (64, 1, 10**5), (256, 1, 10**5), (512, 1, 10**5), (1024, 1, 10**5),
        (512, 64, 10**5), (512, 306, 10**5), (512, 306, 10**7)]
QUICK = [(8, 1, 10**5), (64, 1, 10**5), (256, 1, 10**5), (64, 64, 10**5), (64, 306, 10**5)]


def write_job(root: str, dp: int, prefixes: list[str], records: int, tokens: int = TOKENS_PER_RANK,
              adapt: str | None = None) -> str:
    job = {
        "seed": 3,
        "sources": {f"src{i:03d}": {"format": "megatron", "paths": [p]} for i, p in enumerate(prefixes)},
        "batch": {"seq_len": tokens, "micro_batch_size": 1, "global_batch_size": dp},
        "topology": {"dp": dp},
        "mixture": {"weights": {f"src{i:03d}": 1.0 for i in range(len(prefixes))}},
        "balance": {"cost": {"quadratic": 1.0, "linear": 0.0}},
        "runtime": {"heartbeat_s": 2.0, "lookahead_steps": 2},
    }
    if adapt:  # mixture.adapt on the ranks' reported losses (tools/scale_ranks.py --loss-sources)
        job["mixture"]["adapt"] = {"policy": adapt, "every_steps": 5}
    path = os.path.join(root, f"job-{dp}-{len(prefixes)}-{records}-{tokens}-{adapt or 'static'}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(job, f, sort_keys=False)
    return path


def _cpu_s(pid: int, thread: int | None = None) -> float:
    """utime+stime of a process (all its threads, those gone included), or of one of its threads."""
    with open(f"/proc/{pid}/task/{thread}/stat" if thread else f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _status(pid: int) -> dict[str, int]:
    """Bytes: peak and current RSS, and RSS and PSS by kind. A file's page mapped by many
    mappings counts once per mapping in RSS (306 sources hard-linked to one index: 306 times),
    once in all in PSS (split over its mappings, and with other processes that map it)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("Pss", "Pss_Anon", "Pss_File"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _sockets(pid: int) -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _slowest_step(samples: dict) -> float:
    steps = [v for (n, _), v in samples.items() if n == "msd_steps_consumed"]
    return min(steps) if steps else -1


PROFILED = """
import cProfile, sys
from msd.cli import main
profile = cProfile.Profile()
profile.enable()
try:
    main(sys.argv[2:])
except SystemExit:
    pass
finally:
    profile.disable()
    profile.dump_stats(sys.argv[1])
"""


def run_point(root: str, dp: int, count: int, records: int, steps: int, profile: str | None = None,
              step_s: float = 0.0, per_relay: int = 0, tokens: int = TOKENS_PER_RANK, adapt: str | None = None,
              scrape_s: float = SCRAPE_EVERY_S) -> dict:
    """per_relay: ranks behind each relay (tools/scale_ranks.py --per-relay), 0 for none; adapt: a
    mixture.adapt policy, the ranks then reporting a loss for every source with each consumed."""
    prefixes = sources(root, count, records)
    job = write_job(root, dp, prefixes, records, tokens, adapt)
    msd = os.path.join(os.path.dirname(sys.executable), "msd")
    port, metrics = free_port(), free_port()
    address = f"tcp://127.0.0.1:{port}"
    logs = tempfile.mkdtemp(prefix="msd-scale-")
    started = time.time()
    command = ["coordinator", "--config", job, "--bind", address, "--metrics-port", str(metrics), "--log-level",
               LOG_LEVEL]
    command = [sys.executable, "-c", PROFILED, profile, *command] if profile else [msd, *command]
    coord = subprocess.Popen(command, stderr=open(os.path.join(logs, "coordinator.log"), "wb"))
    # Peers start once the metrics port is up: their hundreds of outgoing connections take
    # ephemeral ports, and one of them could otherwise take the metrics port before it is bound.
    while True:
        try:
            _scrape(metrics)
            break
        except OSError:
            if coord.poll() is not None:
                raise RuntimeError(f"the coordinator exited at start; logs in {logs}")
            time.sleep(0.05)
    host = subprocess.Popen([msd, "worker", "--coordinator", address, "--procs", str(WORKERS), "--log-level",
                             LOG_LEVEL], stderr=open(os.path.join(logs, "worker.log"), "wb"))
    outs = [os.path.join(logs, f"ranks-{i}.json") for i in range(math.ceil(dp / RANKS_PER_PROCESS))]
    ranks = [subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "scale_ranks.py"),
                               "--coordinator", address, "--ranks",
                               f"{i * RANKS_PER_PROCESS}:{min(dp, (i + 1) * RANKS_PER_PROCESS)}",
                               "--steps", str(steps), "--out", out, *(["--step-s", str(step_s)] if step_s else []),
                               "--per-relay", str(per_relay), "--loss-sources", str(count if adapt else 0)])
             for i, out in enumerate(outs)]
    samples, peak_sockets = [], 0
    try:
        while any(p.poll() is None for p in ranks):
            time.sleep(scrape_s)
            if coord.poll() is not None or host.poll() is not None:
                raise RuntimeError(f"the coordinator or worker host exited early; logs in {logs}")
            try:
                scraped = _scrape(metrics)
            except OSError:
                continue
            # the main thread is the event loop: the state, the sockets, the metrics' copy; the
            # others serve the scrapes (and write the state dir)
            samples.append((time.monotonic(), _cpu_s(coord.pid), _slowest_step(scraped), scraped,
                            _cpu_s(coord.pid, coord.pid)))
            for w in host_worker_pids(host.pid):  # the agent's children (worker/forks.py)
                try:
                    peak_sockets = max(peak_sockets, _sockets(w))
                except OSError:
                    pass
        memory = _status(coord.pid)
    finally:
        stop([*ranks, host, coord])
    results = [orjson.loads(open(o, "rb").read()) for o in outs if os.path.exists(o)]
    done = min((r["steps_done"] for r in results), default=0)
    first = min((r["first_batch_at"] for r in results if r["first_batch_at"]), default=None)
    # the window: from the sample where the slowest rank passed a fifth of the steps to the last
    # before the ranks leave
    window = [s for s in samples if steps // 5 <= s[2] < steps - 2]
    row = {"dp": dp, "per_relay": per_relay, "relays": -(-dp // per_relay) if per_relay else 0,
           "tokens_per_rank": tokens, "sources": count, "records_per_source": records, "records": count * records,
           "steps": done, "time_to_first_batch_s": round(first - started, 2) if first else None,
           "coordinator_peak_rss_mb": round(memory.get("VmHWM", 0) / 2**20, 1),  # file pages once per mapping
           "coordinator_heap_mb": round(memory.get("RssAnon", 0) / 2**20, 1),
           # the mapped indexes' resident pages, each counted once (PSS: shared ones split with
           # the workers that map them too); RSS counts a page once per mapping of it
           "coordinator_mapped_files_mb": round(memory.get("Pss_File", 0) / 2**20, 1),
           "coordinator_mapped_files_rss_mb": round(memory.get("RssFile", 0) / 2**20, 1),
           "max_sockets_per_worker_process": peak_sockets}
    if len(window) >= 2 and window[-1][2] > window[0][2]:
        (t0, c0, s0, m0, loop0), (t1, c1, s1, m1, loop1) = window[0], window[-1]
        row["coordinator_cpu_ms_per_step"] = round(1000 * (c1 - c0) / (s1 - s0), 2)
        row["coordinator_loop_cpu_ms_per_step"] = round(1000 * (loop1 - loop0) / (s1 - s0), 2)
        # the rest: ZeroMQ's I/O thread (the sockets' own work) and the HTTP threads serving
        # /metrics (a scrape's text has a line per rank and per relay counter)
        row["coordinator_other_threads_cpu_ms_per_step"] = round(row["coordinator_cpu_ms_per_step"]
                                                                 - row["coordinator_loop_cpu_ms_per_step"], 2)
        row["scrape_every_s"] = scrape_s
        row["steps_per_s"] = round((s1 - s0) / (t1 - t0), 2)
        rates = {}
        for (name, labels), v in m1.items():
            if name in ("msd_messages_received_total", "msd_messages_sent_total"):
                kind = ("in " if "received" in name else "out ") + dict(labels)["type"]
                rates[kind] = round((v - m0.get((name, labels), 0.0)) / (t1 - t0), 1)
        row["messages_per_s"] = dict(sorted(rates.items(), key=lambda kv: -kv[1]))
    if KEEP_LOGS:
        print(f"logs of this point: {logs}", file=sys.stderr)
    else:
        shutil.rmtree(logs, ignore_errors=True)
    print(orjson.dumps(row).decode(), file=sys.stderr)
    return row


def plot(result: dict, png: str) -> None:
    """Coordinator CPU per step against DP (one source) and against sources (DP 512)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [p for p in result["points"] if p.get("coordinator_cpu_ms_per_step") is not None]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    by_dp = sorted((p["dp"], p["coordinator_cpu_ms_per_step"]) for p in pts if p["sources"] == 1)
    left.plot(*zip(*by_dp), marker="o", label="measured, 1 source")
    left.plot([512, 1024], [100, 200], "r^", label="target")
    left.set(xscale="log", xlabel="data-parallel ranks", ylabel="coordinator CPU ms per step")
    for records, style in ((10**5, "o-"), (10**7, "s")):
        by_s = sorted((p["sources"], p["coordinator_cpu_ms_per_step"]) for p in pts
                      if p["dp"] == 512 and p["records_per_source"] in (records, 10**5 if p["sources"] == 1 else -1))
        if by_s:
            right.plot(*zip(*by_s), style, label=f"DP 512, {records:.0e} records per source")
    single = next((p["coordinator_cpu_ms_per_step"] for p in pts if p["dp"] == 512 and p["sources"] == 1), None)
    if single:
        right.axhline(1.5 * single, color="r", linestyle=":", label="target: 1.5x one source")
    right.set(xlabel="sources", ylabel="coordinator CPU ms per step")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--plot-from":  # RESULT.json PNG
        with open(sys.argv[2], "rb") as f:
            plot(orjson.loads(f.read()), sys.argv[3])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--step-s", type=float, default=1.0, help="seconds per step of the ranks (0: as fast as they can)")
    ap.add_argument("--points", default=None, help="DP:S:R,... instead of the grid")
    ap.add_argument("--profile", default=None, help="cProfile the coordinator of each point into PROFILE-DP-S-R")
    ap.add_argument("--data-dir", default=os.path.expanduser("~/.cache/megascale-data/bench-scale"))
    args = ap.parse_args()
    grid = ([tuple(int(x) for x in p.split(":")) for p in args.points.split(",")] if args.points
            else QUICK if args.quick else GRID)
    rows = []
    for dp, s, r in grid:
        paced = 40 if args.quick else 60
        steps = args.steps or (paced if args.step_s else max(60, 24000 // dp))  # enough for a few scrapes
        profile = f"{args.profile}-{dp}-{s}-{r}" if args.profile else None
        rows.append(run_point(args.data_dir, dp, s, r, steps, profile, args.step_s))
    emit({"tokens_per_rank_per_step": TOKENS_PER_RANK, "worker_processes": WORKERS, "step_s": args.step_s,
          "points": rows}, args.json)


if __name__ == "__main__":
    main()
