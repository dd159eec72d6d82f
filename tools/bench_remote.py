"""Reading from object storage, against Mosaic Streaming: the same text served by an S3-compatible
server on loopback (npm's s3rver, or moto's server mode, in its own process, behind a
byte-counting proxy).

    python tools/bench_remote.py --json OUT [--mb 200] [--ranks 2] [--workers 2] [--steps 150]
        [--repeats 3] [--shuffle-block 1] [--mosaic-python .venv-mosaic/bin/python]

Data: real text (this Python's standard library, documents of lognormal length), byte-tokenized
(one token per byte, end-of-document 256), written three ways from the same documents: 8 Megatron
pairs, 8 JSONL shards, and MDS shards written by Mosaic's own MDSWriter (samples of seq_len
tokens, the documents concatenated: how LLM teams feed Mosaic). All are uploaded to one bucket.

Designs, run alternately --repeats times, each with a cold cache:
- ours-remote-megatron, ours-remote-jsonl: `msd` over s3:// URLs (coordinator, --workers worker
  processes, --ranks trainer processes), records read by byte range;
- ours-whole-megatron, ours-whole-jsonl: the same with `storage: {whole_objects: true}` (each
  object copied whole into the local cache when first needed, as Mosaic does with its shards);
- ours-local-megatron, ours-local-jsonl: the same jobs over the local files (the ceiling);
  every job of ours shuffles in blocks of --shuffle-block records (a run is one request);
- mosaic-remote: per rank a StreamingDataset(remote=s3://...) in a torch DataLoader with
  workers/ranks worker processes (Mosaic's venv: make bench-remote-env).
The same tokens per step: ranks x micro-batch x seq_len. Per design: tokens per second at the
ranks (from start, and from the first batch on), time to first batch, bytes fetched from the
server per byte of the tokens delivered (read amplification), local disk of its caches, peak
memory (summed PSS) of all its processes. Medians and spreads in the JSON.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import orjson
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_output import emit  # noqa: E402
from e2e_ranks import descendants, pss_kb  # noqa: E402

from msd.testing.demo_data import _stdlib_sources  # noqa: E402
from msd.testing.local import LocalJob  # noqa: E402
from msd.testing.ports import free_port  # noqa: E402
from msd.testing.s3 import LoopbackS3  # noqa: E402
from msd_common.formats.megatron import write_megatron  # noqa: E402

BUCKET = "bench"
SHARDS = 8
EOD = 256


def make_corpus(root: str, mb: int, seq_len: int, mosaic_python: str | None) -> dict:
    """The documents as Megatron pairs, JSONL shards and (with Mosaic's python) MDS shards."""
    stamp = os.path.join(root, f".complete-{mb}-{seq_len}-{bool(mosaic_python)}")
    if os.path.exists(stamp):
        return orjson.loads(open(stamp, "rb").read())
    shutil.rmtree(root, ignore_errors=True)
    for d in ("megatron", "jsonl", "mds"):
        os.makedirs(os.path.join(root, d))
    text = "\n\n".join(src for _, src in _stdlib_sources())
    rng = np.random.default_rng(21)
    per_shard = (mb << 20) // SHARDS
    tokens_total = text_bytes = 0
    stream_path = os.path.join(root, "tokens.u16")
    with open(stream_path, "wb") as stream:
        for shard in range(SHARDS):
            docs, size = [], 0
            while size < per_shard:
                n = int(np.clip(rng.lognormal(7.5, 1.0), 50, 60_000))
                start = int(rng.integers(0, len(text) - n - 1))
                body = text[start:start + n].encode("utf-8", "ignore")
                docs.append(body)
                size += len(body)
            with open(os.path.join(root, "jsonl", f"part-{shard:02d}.jsonl"), "wb") as f:
                for body in docs:
                    f.write(orjson.dumps({"text": body.decode("utf-8", "ignore")}) + b"\n")
            arrays = [np.append(np.frombuffer(b, np.uint8).astype(np.uint16), np.uint16(EOD)) for b in docs]
            write_megatron(os.path.join(root, "megatron", f"part-{shard:02d}"), arrays, np.uint16)
            for a in arrays:
                stream.write(a.tobytes())
            tokens_total += sum(len(a) for a in arrays)
            text_bytes += os.path.getsize(os.path.join(root, "jsonl", f"part-{shard:02d}.jsonl"))
    if mosaic_python:
        subprocess.run([mosaic_python, "-c", MDS_WRITER, stream_path, os.path.join(root, "mds"), str(seq_len)],
                       check=True)
    os.unlink(stream_path)
    info = {"tokens": tokens_total, "jsonl_bytes": text_bytes, "megatron_bin_bytes": 2 * tokens_total,
            "mds_bytes": _du(os.path.join(root, "mds"))}
    with open(stamp, "wb") as f:
        f.write(orjson.dumps(info))
    return info


# Mosaic's own writer, in Mosaic's venv: samples of seq_len tokens (uint16), default shard size.
MDS_WRITER = """
import sys, numpy as np
from streaming import MDSWriter
tokens = np.fromfile(sys.argv[1], dtype=np.uint16)
seq = int(sys.argv[3])
with MDSWriter(out=sys.argv[2], columns={"tokens": "ndarray:uint16"}) as w:
    for i in range(len(tokens) // seq):
        w.write({"tokens": tokens[i * seq:(i + 1) * seq]})
"""


def _du(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


def write_job(path: str, fmt: str, where: str, a: argparse.Namespace, cache_dir: str, whole: bool = False) -> str:
    pattern = {"megatron": "megatron/part-*", "jsonl": "jsonl/part-*.jsonl"}[fmt]
    source = {"format": fmt, "paths": [f"{where}/{pattern}"], **({"eod_id": EOD} if fmt == "jsonl" else {})}
    if a.shuffle_block > 1:
        source["shuffle_block"] = a.shuffle_block
    if whole:
        source["storage"] = {"whole_objects": True}
    job = {
        "seed": 5,
        "sources": {"text": source},
        "batch": {"seq_len": a.seq_len, "micro_batch_size": a.micro_batch,
                  "global_batch_size": a.micro_batch * a.ranks},
        "topology": {"dp": a.ranks},
        "mixture": {"weights": {"text": 1.0}},
        "runtime": {"cache_dir": cache_dir, "lookahead_steps": 4, "prepare_batch": a.prepare_batch},
    }
    with open(path, "w") as f:
        yaml.safe_dump(job, f)
    return path


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far; 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


class PssSampler(threading.Thread):
    """Every half second, the summed PSS of a set of processes and their descendants (the peak),
    and the CPU seconds of each process of each role (the last figure seen: a process that ends
    between two samples loses at most half a second of its CPU)."""

    def __init__(self, roles) -> None:
        super().__init__(daemon=True)
        self.roles, self.peak_kb, self.stop = roles, 0, threading.Event()
        self._cpu: dict[tuple[str, int], float] = {}

    def run(self) -> None:
        while not self.stop.wait(0.5):
            pids = set()
            for role, roots in self.roles().items():
                for r in roots:
                    for pid in (r, *descendants(r)):
                        self._cpu[(role, pid)] = max(self._cpu.get((role, pid), 0.0), cpu_s(pid))
                        if role != "server":
                            pids.add(pid)
            self.peak_kb = max(self.peak_kb, sum(pss_kb(p) for p in pids))

    def cpu_by_role(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for (role, _), seconds in self._cpu.items():
            out[role] = out.get(role, 0.0) + seconds
        return out


def run_design(design: str, a: argparse.Namespace, s3: LoopbackS3, data: str, info: dict, work: str) -> dict:
    kind, where, fmt = design.split("-")  # ours|mosaic, remote|whole|local, megatron|jsonl|mds
    counted = where != "local" and not a.direct  # bytes are counted by the proxy only
    cache = os.path.join(work, f"cache-{design}")
    shutil.rmtree(cache, ignore_errors=True)
    os.makedirs(cache)
    env = {**os.environ, **s3.env(), "S3_ENDPOINT_URL": s3.endpoint, "MSD_CACHE_DIR": cache}
    if a.direct:  # past the counting proxy (bytes are then not counted)
        env.update(AWS_ENDPOINT_URL=s3.server_url, S3_ENDPOINT_URL=s3.server_url)
    saved_env = dict(os.environ)
    os.environ.update(env)  # the coordinator and worker processes are spawned from here
    s3.reset_stats()
    started = time.time()
    cluster = None
    try:
        if kind == "ours":
            base = data if where == "local" else f"s3://{BUCKET}"
            job = write_job(os.path.join(work, f"{design}.yaml"), fmt, base, a, cache, whole=where == "whole")
            cluster = LocalJob(job, workers=a.workers).__enter__()
            cmds = [[sys.executable, os.path.join(HERE, "remote_ranks.py"), "ours", "--address", cluster.address,
                     "--rank", str(r), "--steps", str(a.steps)] for r in range(a.ranks)]
            roots = lambda: {"coordinator": [cluster.coordinator.pid], "workers": [cluster.host.pid],  # noqa: E731
                             "ranks": [p.pid for p in procs], "server": [p.pid for p in s3._procs]}
        else:
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))  # its ranks meet in torch.distributed
            cmds = [[a.mosaic_python, os.path.join(HERE, "remote_ranks.py"), "mosaic", "--remote",
                     f"s3://{BUCKET}/mds", "--local", os.path.join(cache, "mds"), "--rank", str(r),
                     "--ranks", str(a.ranks), "--workers", str(max(1, a.workers // a.ranks)),
                     "--micro-batch", str(a.micro_batch), "--steps", str(a.steps), "--seed", "5"]
                    for r in range(a.ranks)]
            roots = lambda: {"ranks": [p.pid for p in procs], "server": [p.pid for p in s3._procs]}  # noqa: E731
        # what start-up fetched (our coordinator's indexes: line offsets streamed from whole JSONL
        # objects, Megatron .idx copies), apart from what feeding the ranks fetched
        startup_bytes = s3.stats()["bytes_out"] if counted else None
        procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env) for c in cmds]
        server_cpu = sum(cpu_s(p.pid) for p in s3._procs)  # the server's CPU before: uploads, other runs
        sampler = PssSampler(roots)
        sampler.start()
        results = []
        for p in procs:
            out, err = p.communicate(timeout=a.timeout_s)
            if p.returncode != 0:
                raise RuntimeError(f"{design}: a rank failed ({p.returncode}): {err.decode()[-2000:]}")
            results.append(orjson.loads(out.decode().strip().splitlines()[-1]))
        sampler.stop.set()
    finally:
        if cluster is not None:
            cluster.__exit__(None, None, None)
        os.environ.clear()
        os.environ.update(saved_env)
    stats = s3.stats() if counted else {"bytes_out": None, "requests": None}
    tokens = sum(r["tokens"] for r in results)
    first = min(r["first_batch_at"] for r in results)
    last = max(r["last_batch_at"] for r in results)
    stored_per_token = info["jsonl_bytes"] / info["tokens"] if fmt == "jsonl" else 2.0
    return {
        "design": design,
        "tokens": tokens,
        "tokens_per_s": tokens / (last - started),
        "tokens_per_s_after_first_batch": tokens / max(last - first, 1e-9),
        "first_batch_s": first - started,
        "bytes_fetched": stats["bytes_out"],
        "requests": stats["requests"],
        "read_amplification": stats["bytes_out"] / (tokens * stored_per_token) if counted else None,
        "startup_bytes": startup_bytes,
        "read_amplification_after_startup": ((stats["bytes_out"] - startup_bytes) / (tokens * stored_per_token)
                                             if counted else None),
        "cache_disk_mb": _du(cache) / 1e6,
        "peak_pss_mb": sampler.peak_kb / 1024,
        # CPU seconds of each role during the run (server: s3rver and the proxy)
        "cpu_s": {role: round(v - (server_cpu if role == "server" else 0.0), 2)
                  for role, v in sampler.cpu_by_role().items()},
    }


def summarize(runs: list[dict]) -> dict:
    out: dict = {"repeats": len(runs)}
    for key in ("tokens_per_s", "tokens_per_s_after_first_batch", "first_batch_s", "read_amplification",
                "read_amplification_after_startup", "startup_bytes",
                "cache_disk_mb", "peak_pss_mb", "bytes_fetched", "requests"):
        values = [r[key] for r in runs if r[key] is not None]
        if values:
            out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    roles = sorted({role for r in runs for role in r["cpu_s"]})
    out["cpu_s"] = {role: statistics.median(r["cpu_s"].get(role, 0.0) for r in runs) for role in roles}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None)
    p.add_argument("--mb", type=int, default=200, help="text per format, MB")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--workers", type=int, default=2, help="worker processes in all (Mosaic: split over ranks)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prepare-batch", type=int, default=64, help="our runtime.prepare_batch")
    p.add_argument("--shuffle-block", type=int, default=1,
                   help="our sources' shuffle_block (1: every record shuffled alone, one request each)")
    p.add_argument("--direct", action="store_true", help="clients talk to the server, not through the proxy")
    p.add_argument("--timeout-s", type=float, default=900)
    p.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "msd-bench-remote"))
    p.add_argument("--mosaic-python", default=os.path.join(os.path.dirname(HERE), ".venv-mosaic", "bin", "python"))
    p.add_argument("--s3rver", default=os.path.join(os.path.dirname(HERE), ".bench", "node_modules", ".bin", "s3rver"),
                   help="npm's s3rver (make bench-remote-env); 'moto' to use moto's server (it reads a whole object "
                        "to answer a range of it: a few dozen ranged reads per second on large objects)")
    p.add_argument("--designs", default="ours-remote-megatron,ours-local-megatron,ours-remote-jsonl,"
                                        "ours-local-jsonl,mosaic-remote-mds")
    a = p.parse_args()
    designs = a.designs.split(",")
    mosaic = a.mosaic_python if any(d.startswith("mosaic") for d in designs) else None
    if mosaic and not os.path.exists(mosaic):
        sys.exit(f"{mosaic}: no Mosaic Streaming venv (make bench-remote-env), or leave mosaic out of --designs")
    data = os.path.join(a.data_dir, "data")
    info = make_corpus(data, a.mb, a.seq_len, mosaic)
    work = os.path.join(a.data_dir, "work")
    os.makedirs(work, exist_ok=True)
    runs: dict[str, list[dict]] = {d: [] for d in designs}
    s3rver = None if a.s3rver == "moto" else a.s3rver
    if s3rver and not os.path.exists(s3rver):
        sys.exit(f"{s3rver}: not found (make bench-remote-env, or --s3rver moto)")
    with LoopbackS3(proxy=True, log_path=os.path.join(work, "s3.log"), s3rver=s3rver) as s3:
        s3.upload_dir(data, BUCKET)
        for repeat in range(a.repeats):
            for design in designs:
                r = run_design(design, a, s3, data, info, work)
                print(f"repeat {repeat}: {design}: {r['tokens_per_s']:.0f} tokens/s, first batch "
                      f"{r['first_batch_s']:.2f} s, amplification {r['read_amplification']}", file=sys.stderr)
                runs[design].append(r)
    summary = {d: summarize(rs) for d, rs in runs.items()}
    ratios = {}
    for fmt in ("megatron", "jsonl"):
        local = summary.get(f"ours-local-{fmt}")
        for where in ("remote", "whole"):
            remote = summary.get(f"ours-{where}-{fmt}")
            if remote and local:
                ratios[f"{fmt}_{where}_over_local"] = remote["tokens_per_s"]["median"] / local["tokens_per_s"]["median"]
            if remote and "mosaic-remote-mds" in summary:
                ratios[f"{fmt}_{where}_over_mosaic"] = (remote["tokens_per_s"]["median"]
                                                        / summary["mosaic-remote-mds"]["tokens_per_s"]["median"])
    emit({"bench": "remote", "command": " ".join(sys.argv), "corpus": info,
          "params": {k: v for k, v in vars(a).items() if k not in ("json",)},
          "tokens_per_step": a.ranks * a.micro_batch * a.seq_len, "ratios": ratios, "summary": summary,
          "runs": runs}, a.json)


if __name__ == "__main__":
    main()
