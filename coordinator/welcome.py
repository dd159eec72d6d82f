"""How the coordinator answers a worker's or a host agent's hello: the one place that says what a
welcome holds and when a peer is refused. CoordinatorState answers with these while it serves the
job, and the counting at start-up (counting.py, `runtime.index_on: workers`) with the same, so a
worker welcomed by either gets the same job in the same typed form.
"""

from __future__ import annotations

import logging
from typing import Sequence

from msd_common import protocol as P
from msd_common.spec import JobConfig

log = logging.getLogger("msd.coordinator")


def version_refusal(version: int, who: str) -> P.Reject | None:
    """A REJECT for a peer that speaks another protocol (logged, naming `who`), else None."""
    if version == P.PROTOCOL_VERSION:
        return None
    log.warning("%s speaks protocol %d, we speak %d: rejected", who, version, P.PROTOCOL_VERSION)
    return P.Reject(reason=f"protocol version {version} != {P.PROTOCOL_VERSION}")


def worker_welcome(job: JobConfig, worker_id: int, count: Sequence[int] = ()) -> P.Welcome:
    """A worker's welcome: its id, the job as workers read it (msd_common.spec.WorkerJob), the
    heartbeat, and the sources whose records it should count before anything else."""
    return P.Welcome(worker_id=worker_id, job=job.worker_job().to_wire(), heartbeat_s=job.runtime.heartbeat_s,
                     count=sorted(count))


def trainer_batch_info(job: JobConfig, rope: str, earlier_digests: list[str]) -> dict:
    """What a rank's welcome says of the job (the same for every rank: built once)."""
    return {
        "seq_len": job.batch.seq_len,
        "micro_batch_size": job.batch.micro_batch_size,
        "micro_batches": job.micro_batches_per_rank,
        "pad_id": job.batch.pad_id,
        "dp": job.dp,
        "topology": job.topology._asdict(),
        "sources": [s.name for s in job.sources],
        "patch_bytes": job.patch_bytes,  # 0: no image-text source
        "rope": rope,  # "mrope": position_ids [3, B, L] (a Qwen-VL processor's sources)
        "calibrate": job.calibrate,  # clients time each micro-batch's compute and report it
        "earlier_plan_digests": earlier_digests,  # a checkpoint that carries one of these is this job's
    }


def host_scale(job: JobConfig, procs: int, retire: list[int], reason: str) -> P.Scale:
    """How many worker processes a host agent runs (and which to retire first)."""
    return P.Scale(procs=procs, retire=retire, reason=reason, heartbeat_s=job.runtime.heartbeat_s)
