"""Running a real job (coordinator + worker processes + trainer processes on loopback) and
collecting what every rank received."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from typing import Any, Callable

import numpy as np

from msd_common.spec import load_job
from msd.testing.local import LocalJob
from msd_common.doc_keys import split_doc_key
from worker.samples import open_source

SPAWN = mp.get_context("spawn")


Compute = float | list[tuple[int, float]]  # seconds per micro-batch, or [(from step, seconds), ...]
PerRank = Compute | dict[int, Compute]  # the same for every rank, or per rank


def _compute_at(compute_s: Compute, step: int) -> float:
    if isinstance(compute_s, (int, float)):
        return float(compute_s)
    return next((s for start, s in reversed(compute_s) if step >= start), 0.0)


def collect(address: str, rank: int, steps: int, out: Any, compute_s: Compute = 0.0,
            resume: dict | None = None, host: str = "127.0.0.1", relay: str | None = None,
            relay_timeout_s: float = 30.0, device: str | None = None,
            losses: dict[int, float] | None = None) -> None:
    """Trainer process: receive `steps` steps (from `resume`, a state_dict, if given) and send
    every micro-batch back to the test, spending `compute_s` per micro-batch (or per the
    schedule) as a trainer's compute would; through `relay` (an endpoint) if given; with
    `device`, as torch tensors whose pixel values are made there (sent back as numpy arrays);
    `losses`: source -> the loss of every sample of that source, reported after each micro-batch
    (DataClient.report_loss, one value per sample)."""
    from trainer_client import DataClient

    client = DataClient(address, rank=rank, as_torch=device is not None, timeout_s=60, host=host, relay=relay,
                        relay_timeout_s=relay_timeout_s, device=device)
    if resume is not None:
        client.load_state_dict(resume)
    try:
        for batch in client:
            if device is not None:
                if "pixel_values" in batch:
                    assert batch["pixel_values"].device.type == device, batch["pixel_values"].device
                batch = {k: v.cpu().numpy() if hasattr(v, "numpy") else v for k, v in batch.items()}
            out.put(("batch", rank, {**{k: v for k, v in batch.items() if k != "plan"}, "received_at": time.time()}))
            if losses is not None:
                sources = split_doc_key(np.asarray(batch["doc_keys"]))[0]
                client.report_loss(np.array([losses[int(s)] for s in sources]))
            pause = _compute_at(compute_s, batch["step"])
            if pause:
                time.sleep(pause)
            if batch["step"] + 1 >= steps and batch["micro_batch"] == client.batch_info["micro_batches"] - 1:
                break
        out.put(("done", rank, client.state_dict()))
    except Exception as e:
        out.put(("error", rank, f"{type(e).__name__}: {e}"))
    finally:
        client.close()


def run_job(job_path: str, *, workers: int | None, ranks: int, steps: int, log_path: str | None = None,
            during: Callable[[LocalJob, int], None] | None = None, timeout_s: float = 90,
            compute_s: PerRank = 0.0, max_procs: int | None = None,
            devices: dict[int, str] | None = None) -> dict[int, list[dict]]:
    """Run the job; `during(cluster, batches_so_far)` is called as batches arrive (fault injection).
    workers=None: the host runs `--procs auto --max-procs max_procs`."""
    with LocalJob(job_path, workers=workers, log_path=log_path, log_level="INFO", max_procs=max_procs) as cluster:
        return run_ranks(cluster, ranks=ranks, steps=steps, during=during, timeout_s=timeout_s, compute_s=compute_s,
                         devices=devices)[0]


def run_ranks(cluster: LocalJob, *, ranks: int, steps: int, during: Callable[[LocalJob, int], None] | None = None,
              timeout_s: float = 90, compute_s: PerRank = 0.0,
              resume: dict[int, dict] | None = None,
              client_host: str = "127.0.0.1", relays: dict[int, str] | None = None,
              relay_timeout_s: float = 30.0,
              devices: dict[int, str] | None = None,
              losses: dict[int, float] | None = None) -> tuple[dict[int, list[dict]], dict[int, dict]]:
    """Trainer processes for ranks 0..ranks-1 against a running job, until `steps`: what each
    received, and each one's final state_dict. relays: rank -> the endpoint of the relay it uses;
    devices: rank -> the torch device its client makes pixel values on (DataClient's device=)."""
    received: dict[int, list[dict]] = {r: [] for r in range(ranks)}
    states: dict[int, dict] = {}
    out = SPAWN.Queue()
    per_rank = compute_s if isinstance(compute_s, dict) else {r: compute_s for r in range(ranks)}
    procs = [SPAWN.Process(target=collect, args=(cluster.address, r, steps, out, per_rank.get(r, 0.0),
                                                 (resume or {}).get(r), client_host, (relays or {}).get(r),
                                                 relay_timeout_s, (devices or {}).get(r), losses))
             for r in range(ranks)]
    for p in procs:
        p.start()
    cluster.trainer_pids = [p.pid for p in procs]  # for fault injection in `during`
    done, deadline, finished = 0, time.monotonic() + timeout_s, False
    try:
        while done < ranks:
            if time.monotonic() > deadline:
                raise AssertionError(f"job did not finish in {timeout_s}s; got "
                                     f"{ {r: len(b) for r, b in received.items()} } micro-batches")
            try:
                kind, rank, payload = out.get(timeout=0.5)
            except queue.Empty:
                continue
            if kind == "error":
                raise AssertionError(f"rank {rank}: {payload}")
            if kind == "done":
                done += 1
                states[rank] = payload
            else:
                received[rank].append(payload)
                if during is not None:
                    during(cluster, sum(len(b) for b in received.values()))
        finished = True
    finally:  # ranks that finished get 10 s in all to exit; after a failure, those left are stuck: killed
        end = time.monotonic() + (10 if finished else 0)
        for p in procs:
            p.join(timeout=max(0.0, end - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)
    return received, states


def signature(received: dict[int, list[dict]]) -> list[tuple]:
    """The stream that determinism promises: (step, rank, micro_batch, doc_keys, offsets, lengths)."""
    out = []
    for rank, batches in sorted(received.items()):
        for b in batches:
            out.append((b["step"], rank, b["micro_batch"], tuple(b["doc_keys"].tolist()),
                        tuple(b["doc_offsets"].tolist()), tuple(b["piece_lengths"].tolist())))
    return sorted(out)


def manifest(state_dir: str, step: int, *extra: str) -> dict:
    """`msd manifest --json` of one step, from a job's state dir."""
    import orjson
    from click.testing import CliRunner

    from msd.cli import main

    r = CliRunner().invoke(main, ["manifest", "--state-dir", state_dir, "--step", str(step), "--json", *extra])
    assert r.exit_code == 0, r.output
    return orjson.loads(r.output)


def manifest_pieces(m: dict) -> dict[tuple[int, int], list[tuple[int, int, int]]]:
    """A manifest's pieces as (rank, micro_batch) -> [(doc_key, offset, length), ...], in order,
    as `received_pieces` gives a run's."""
    out: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for rank, pieces in m["ranks"].items():
        for p in pieces:
            out.setdefault((int(rank), p["micro_batch"]), []).append((p["doc_key"], p["offset"], p["length"]))
    return out


def received_pieces(received: dict[int, list[dict]], step: int) -> dict[tuple[int, int], list[tuple[int, int, int]]]:
    """What the ranks received of one step, as `manifest_pieces` lays a manifest out."""
    return {(rank, b["micro_batch"]): list(zip(b["doc_keys"].tolist(), b["doc_offsets"].tolist(),
                                               b["piece_lengths"].tolist()))
            for rank, batches in received.items() for b in batches if b["step"] == step}


def check_content(job_path: str, received: dict[int, list[dict]]) -> int:
    """Assert the tokens of every piece equal the source document's tokens at that offset; return
    the number of pieces checked."""
    job = load_job(job_path)
    pad_id = job.batch.pad_id
    readers = [open_source(spec) for spec in job.worker_job().sources]
    checked = 0
    for batches in received.values():
        for b in batches:
            flat = b["tokens"].reshape(-1)
            at = 0
            row_len = b["tokens"].shape[1]
            for key, off, n in zip(b["doc_keys"].tolist(), b["doc_offsets"].tolist(), b["piece_lengths"].tolist()):
                source, record = split_doc_key(key)
                expected = readers[source].read(record)[off: off + n].astype(np.int64)
                # a row holds its pieces, then padding: the piece is here, or the row ended
                fits = at % row_len + n <= row_len
                if at % row_len and (not fits or not np.array_equal(flat[at: at + n], expected)):
                    assert (flat[at: at + row_len - at % row_len] == pad_id).all(), f"row not padded before {key:x}"
                    at += row_len - at % row_len
                np.testing.assert_array_equal(flat[at: at + n], expected, err_msg=f"piece {key:x}@{off}+{n}")
                at += n
                checked += 1
    return checked
