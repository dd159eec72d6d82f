"""mixture.adapt through a real job: ranks report their training loss per sample
(`DataClient.report_loss`), the coordinator's policy moves weight toward the source learnt least,
each change is journaled at the step its decision fixes, and the state dir's manifest of every step
is exactly what the ranks received, the changes included; a restart of the coordinator on its state
dir carries the same trajectory on."""

from __future__ import annotations

import orjson
import pytest
from click.testing import CliRunner

from coordinator.journal import read_mixture_journal
from msd.cli import main
from msd.testing.local import LocalJob
from tests.conftest import job_dict, write_job
from tests.integration.harness import manifest, manifest_pieces, received_pieces, run_ranks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

LOOKAHEAD, EVERY = 2, 3
LOSSES = {0: 3.0, 1: 1.0, 2: 1.0}  # web is learnt least


def test_losses_steer_the_mixture_journaled_and_exact(dataset_dir, tmp_path):
    mixture = {"weights": {"web": 0.2, "code": 0.4, "long": 0.4},
               "adapt": {"policy": "loss_share", "every_steps": EVERY, "max_step_change": 0.05}}
    path = write_job(dataset_dir, job_dict(mixture=mixture, runtime={"heartbeat_s": 0.5, "prepare_batch": 16,
                                                                     "lookahead_steps": LOOKAHEAD}), "adapt.yaml")
    state = str(tmp_path / "state")
    steps, events = 24, []

    def during(cluster, batches):  # 2 ranks x 2 micro-batches a step
        if batches >= 4 * 13 and not events:
            cluster.restart_coordinator()
            events.append("restart")

    with LocalJob(path, workers=2, log_level="INFO", state_dir=state, log_path=str(tmp_path / "log")) as cluster:
        received, _ = run_ranks(cluster, ranks=2, steps=steps, during=during, timeout_s=200, losses=LOSSES)
    assert events == ["restart"]
    changes = read_mixture_journal(state)
    first = EVERY - 1 + LOOKAHEAD + 2  # the first decision's step: fixed by the step, not the timing
    at = [a for a, _ in changes]
    assert at[:3] == [first, first + EVERY, first + 2 * EVERY], changes
    assert all((a - first) % EVERY == 0 for a in at) and max(at) > 15  # decisions after the restart too
    web = [w[0] for _, w in changes]
    assert web[0] == pytest.approx(0.25)  # toward web (loss 3 against 1), 0.05 a decision at most
    assert all(0 < b - a <= 0.05 + 1e-9 for a, b in zip(web, web[1:]))

    shares = []
    for step in range(steps):
        m = manifest(state, step)
        assert manifest_pieces(m) == received_pieces(received, step), step
        shares.append(m["source_tokens"]["web"] / sum(m["source_tokens"].values()))
    assert sum(shares[:first]) / first < 0.3 < sum(shares[-6:]) / 6  # web's realised share grew

    # what the run shows: status (the policy and the losses behind its last decision), and the report
    status = orjson.loads((tmp_path / "state" / "status.json").read_bytes())
    assert status["adapt"]["policy"] == "loss_share"
    assert status["adapt"]["last_loss"]["web"] == pytest.approx(3.0)
    assert status["adapt"]["last_loss"]["code"] == pytest.approx(1.0) and status["adapt"]["failed"] is None
    out = tmp_path / "report.html"
    r = CliRunner().invoke(main, ["report", "--state-dir", state, "--out", str(out), "--max-steps", "10"])
    assert r.exit_code == 0, r.output
    page = out.read_text()
    assert '<img id="mixture-weights"' in page and "mixture.adapt: loss_share" in page
    assert page.count("<tr><td>") >= len(changes)  # a row per change


def test_behind_relays_the_same_losses_give_the_same_trajectory(dataset_dir, tmp_path):
    """dp=2 x tp=2, every rank receiving, two relays (a host each): the ranks' losses reach the
    coordinator in the relays' gathered tables, one report per data-parallel rank counts, and the
    trajectory and the stream are those of the ranks speaking to it directly."""
    from msd.testing.processes import stop
    from tests.integration.harness import signature
    from tests.integration.test_relay import start_relay

    mixture = {"weights": {"web": 0.2, "code": 0.4, "long": 0.4},
               "adapt": {"policy": "loss_share", "every_steps": EVERY, "max_step_change": 0.05}}
    job = job_dict(mixture=mixture, topology={"dp": 2, "tp": 2, "delivery": "all"},
                   runtime={"heartbeat_s": 0.5, "prepare_batch": 16, "lookahead_steps": LOOKAHEAD})
    steps, runs = 14, {}
    for how in ("direct", "relays"):
        path = write_job(dataset_dir, job, f"adapt-{how}.yaml")
        state = str(tmp_path / how)
        with LocalJob(path, workers=1, state_dir=state) as cluster:
            local = [f"ipc://{tmp_path}/{how}-relay-{i}.sock" for i in range(2)]
            relays = [start_relay(cluster.address, e, str(tmp_path / f"{how}-{i}.log")) for i, e in enumerate(local)] \
                if how == "relays" else []
            try:
                received, _ = run_ranks(cluster, ranks=4, steps=steps, timeout_s=150, losses=LOSSES,
                                        relays={0: local[0], 1: local[0], 2: local[1], 3: local[1]} if relays else None)
            finally:
                stop(relays)
        # (a decision for a step past the run's last may or may not be taken before the ranks leave)
        runs[how] = ([c for c in read_mixture_journal(state) if c[0] < steps], signature(received))
    assert runs["relays"] == runs["direct"]
    changes = runs["direct"][0]
    assert [at for at, _ in changes][:2] == [EVERY - 1 + LOOKAHEAD + 2, 2 * EVERY - 1 + LOOKAHEAD + 2]
    assert changes[0][1][0] == pytest.approx(0.25)  # as one report per DP rank (tp peers not counted twice)
