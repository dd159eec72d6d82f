"""`msd report --state-dir DIR --out report.html`: one file a person opens in a browser (or a PNG):
the realised mix against its target over the steps, the balance of every sampled step against
arrival-order dealing, the data wait of each rank, and the skipped records.

Everything comes from the state dir: the step journal holds each step's cumulative target and
delivered tokens per source; the balance of a step is planned again from its journaled state
(msd/replay.py), for at most `max_steps` steps spread over the run; data wait and skips
are the coordinator's last status (status.json) and the quarantine journal.
"""

from __future__ import annotations

import base64
import html
import io
import os
from typing import Any

import numpy as np
import orjson

from coordinator.balance import imbalance
from coordinator.journal import (read_cost_changes, read_eval_journal, read_mixture_journal,
                                 read_quarantine_journal)
from .replay import Replay
from coordinator.statedir import STATUS_FILE


def gather(replay: Replay, state_dir: str, max_steps: int = 200) -> dict[str, Any]:
    """The report's data."""
    names = [s.name for s in replay.job.sources]
    try:  # the coordinator's last status: written at every runtime.status_every_s, and when it stops
        with open(os.path.join(state_dir, STATUS_FILE), "rb") as f:
            status = orjson.loads(f.read())
    except (OSError, orjson.JSONDecodeError):
        status = {}
    steps = sorted(replay.journaled)
    changes = read_mixture_journal(state_dir)  # run-time changes (msd mix, mixture.adapt): the weights plot
    last = max([status.get("last_consumed_step", -1), *(status.get("consumed") or {}).values()])
    if last >= 0:  # the steps some rank trained on, not the ones planned ahead of them
        steps = [s for s in steps if s <= last + 1]
    states = [replay.journaled[s] for s in steps]
    target = np.array([st["target"] for st in states], dtype=np.float64)
    delivered = np.array([st["delivered"] for st in states], dtype=np.float64)
    # per step: tokens each source got in it, and its target's growth (the mix the plan aimed at)
    got, aimed = np.diff(delivered, axis=0), np.diff(target, axis=0)
    mix_steps = steps[:-1]
    with np.errstate(invalid="ignore", divide="ignore"):
        realised_share = np.nan_to_num(got / got.sum(axis=1, keepdims=True))
        target_share = np.nan_to_num(aimed / aimed.sum(axis=1, keepdims=True))
    with np.errstate(invalid="ignore", divide="ignore"):
        so_far = np.nan_to_num(delivered[1:] / delivered[1:].sum(axis=1, keepdims=True))
        aimed_so_far = np.nan_to_num(target[1:] / target[1:].sum(axis=1, keepdims=True))
    cumulative_distance = np.abs(so_far - aimed_so_far).sum(axis=1) / 2 if len(mix_steps) else np.zeros(0)
    sampled = (sorted({mix_steps[int(i)] for i in np.linspace(0, len(mix_steps) - 1, max_steps)})
               if mix_steps else [])
    balance = []
    for step in sampled:
        plan = next(replay.plan_from(step))
        balance.append((step, imbalance(plan.rank_costs), imbalance(plan.naive_rank_costs)))
    return {"job": replay.job.path, "digest": replay.job.digest(), "dp": replay.job.dp, "names": names,
            "steps": mix_steps, "cumulative_distance": cumulative_distance, "realised_share": realised_share,
            "target_share": target_share,
            "total_realised": (delivered[-1] / max(delivered[-1].sum(), 1)) if len(delivered) else np.zeros(len(names)),
            "balance": balance, "status": status, "quarantined": read_quarantine_journal(state_dir),
            "evals": read_eval_journal(state_dir), "cost_changes": read_cost_changes(state_dir),
            "mixture_changes": changes,
            "job_weights": [replay.job.weights_at(s) for s in range(max(steps, default=0) + 1)] if changes else []}


def weights_figure(names: list[str], job_weights: list[list[float]], changes: list[tuple[int, list[float]]]):
    """Each source's weight over the steps: the job file's mixture, with its run-time changes (msd
    mix, mixture.adapt) from their steps on; None without changes."""
    import matplotlib.pyplot as plt

    if not changes or not job_weights:
        return None
    weights = np.array(job_weights, dtype=np.float64)
    for at, w in sorted(changes, key=lambda c: c[0]):
        if at < len(weights):
            weights[at:] = np.asarray(w, dtype=np.float64) / max(sum(w), 1e-12)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for i, name in enumerate(names):
        ax.step(np.arange(len(weights)), weights[:, i], where="post", label=name)
    for at, _ in changes:
        ax.axvline(at, color="grey", linewidth=0.5)
    ax.set_xlabel("step")
    ax.set_ylabel("weight")
    ax.set_title("mixture weights (vertical lines: run-time changes)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def figure(data: dict[str, Any]):
    """The report's plots in one matplotlib figure (mix, its error, balance, data wait)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    (mix, error), (bal, wait) = axes
    names, steps = data["names"], data["steps"]
    window = max(1, len(steps) // 50)  # a rolling mean over ~2% of the run: one step's share is lumpy
    kernel = np.ones(window) / window
    shown = np.argsort(-data["target_share"].mean(axis=0))[:8] if len(steps) else []
    for i in shown:
        line = mix.plot(steps[window - 1:], np.convolve(data["realised_share"][:, i], kernel, "valid"),
                        label=f"{names[i]} realised")[0]
        mix.plot(steps, data["target_share"][:, i], "--", color=line.get_color(), label=f"{names[i]} target")
    mix.set_title("share of each step's tokens by source (solid" + (f", mean of {window} steps" if window > 1 else "")
                  + ") and its target (dashed)")
    mix.set_xlabel("step")
    mix.set_ylabel("share of the step's tokens")
    mix.legend(fontsize=9, ncol=2)
    if len(steps):
        # the mix of every token so far against the target so far: what the run has trained on
        # (one step's own share is lumpy, a few documents, and says little)
        error.plot(steps, data["cumulative_distance"] * 100)
        final = data["cumulative_distance"][-1] * 100
        error.set_title(f"all tokens so far: distance from the target mix, % (now {final:.3f} %)")
    else:
        error.set_title("all tokens so far: distance from the target mix, %")
    error.set_xlabel("step")
    error.set_ylabel("total variation distance, %")
    error.set_ylim(bottom=0)
    if data["balance"]:
        b = np.array(data["balance"])
        bal.plot(b[:, 0], b[:, 2], ".-", label=f"arrival order (per-rank loaders), mean {b[:, 2].mean():.3f}")
        bal.plot(b[:, 0], b[:, 1], ".-", label=f"msd layout, mean {b[:, 1].mean():.3f}")
        bal.legend()
    bal.set_title("slowest rank's cost over the mean, per step (1.0 = even)")
    bal.set_xlabel("step")
    waits = data["status"].get("data_wait_s") or {}
    if waits:
        ranks = sorted(waits, key=int)
        wait.bar(ranks, [waits[r] for r in ranks])
        wait.set_title(f"data wait per rank, seconds in all (longest {max(waits.values()):.2f} s)")
        wait.set_xlabel("rank")
    else:
        wait.axis("off")
        wait.text(0.5, 0.5, "No data wait recorded: no rank had reported a step by the coordinator's\n"
                  "last status (STATE/status.json, written every runtime.status_every_s\n"
                  "seconds and when it stops; msd status shows it live).",
                  ha="center", va="center", fontsize=10, wrap=True, transform=wait.transAxes)
    from matplotlib.ticker import MaxNLocator

    for ax in (mix, error, bal):  # steps are whole numbers, also on a short run's axis
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(f"{data['job']} (digest {data['digest']}, dp={data['dp']})")
    fig.tight_layout()
    return fig


def eval_curves(evals: list[dict]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """set -> source -> [(step, mean loss over the ranks that reported it)], by step."""
    sums: dict[tuple[str, str, int], list[float]] = {}
    for e in evals:
        for source, loss in e["losses"].items():
            sums.setdefault((e["set"], source, e["step"]), []).append(loss)
    out: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for (name, source, step), values in sorted(sums.items()):
        out.setdefault(name, {}).setdefault(source, []).append((step, float(np.mean(values))))
    return out


def eval_figure(evals: list[dict]):
    """One plot per eval set: a loss curve per source over the training steps; None without evals."""
    import matplotlib.pyplot as plt

    curves = eval_curves(evals)
    if not curves:
        return None
    fig, axes = plt.subplots(1, len(curves), figsize=(7 * len(curves), 4), squeeze=False)
    for ax, (name, by_source) in zip(axes[0], sorted(curves.items())):
        for source, points in sorted(by_source.items()):
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=source)
        ax.set_title(f"eval set {name}: loss per source")
        ax.set_xlabel("training step")
        ax.set_ylabel("mean loss")
        ax.legend()
    fig.tight_layout()
    return fig


def cost_figure(changes: list[dict]):
    """Per calibrated change: measured against predicted seconds per micro-batch, with the model
    before (at its best scale) and the one adopted; None without changes."""
    import matplotlib.pyplot as plt

    changes = [c for c in changes if c.get("evidence")]
    if not changes:
        return None
    fig, axes = plt.subplots(1, len(changes), figsize=(5 * len(changes), 4.5), squeeze=False)
    for ax, c in zip(axes[0], changes):
        ev = np.asarray(c["evidence"], dtype=np.float64)
        top = float(ev.max()) * 1.05
        ax.plot([0, top], [0, top], color="grey", linewidth=1)
        before, after = (c["errors"] + [float("nan")] * 2)[:2]
        ax.scatter(ev[:, 0], ev[:, 1], s=8, label=f"model before (error {before:.3f})")
        ax.scatter(ev[:, 0], ev[:, 2], s=8, label=f"adopted from step {c['at_step']} (error {after:.3f})")
        ax.set_xlabel("measured seconds per micro-batch")
        ax.set_ylabel("predicted seconds")
        ax.set_title(f"cost model change at step {c['at_step']}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def write_report(data: dict[str, Any], out: str) -> None:
    """An HTML file (the plots embedded, tables of mix and skips) or, for a .png path, the plots."""
    import matplotlib.pyplot as plt

    fig = figure(data)
    if out.lower().endswith(".png"):
        fig.savefig(out, dpi=100)
        plt.close(fig)
        return
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    image = base64.b64encode(buf.getvalue()).decode("ascii")
    status = data["status"]
    skipped = status.get("skipped_by_kind") or {}
    e = html.escape
    rows = "".join(
        f"<tr><td>{e(n)}</td><td>{data['target_share'][:, i].mean() if len(data['steps']) else 0:.4f}</td>"
        f"<td>{data['total_realised'][i]:.4f}</td>"
        f"<td>{e(', '.join(f'{k} {v}' for k, v in (skipped.get(n) or {}).items()) or '0')}</td></tr>"
        for i, n in enumerate(data["names"]))
    quarantined = "".join(f"<li>{e(s)} record {r}</li>" for s, r in data["quarantined"]) or "<li>none</li>"
    evals_fig = eval_figure(data.get("evals") or [])
    if evals_fig is not None:
        buf = io.BytesIO()
        evals_fig.savefig(buf, format="png", dpi=100)
        plt.close(evals_fig)
        evals_html = (f'<img id="eval-curves" alt="eval loss per source" '
                      f'src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode("ascii")}">')
    else:
        evals_html = '<p id="eval-curves">No evaluation reported (client.report_eval).</p>'
    changes = data.get("cost_changes") or []
    cost_fig = cost_figure(changes)
    if cost_fig is not None:
        buf = io.BytesIO()
        cost_fig.savefig(buf, format="png", dpi=100)
        plt.close(cost_fig)
        rows_c = "".join(f"<tr><td>{c['at_step']}</td><td>{e(', '.join(f'{v:.4g}' for v in c['coefficients']))}</td>"
                         f"<td>{e(', '.join(f'{v:.4f}' for v in c['errors']))}</td></tr>" for c in changes)
        cost_html = (f'<table id="cost-changes"><tr><th>from step</th><th>quadratic, linear, constant, patch terms</th>'
                     f'<th>error before, after</th></tr>{rows_c}</table>'
                     f'<img id="cost-fit" alt="predicted against measured time per micro-batch" '
                     f'src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode("ascii")}">')
    else:
        cost_html = '<p id="cost-fit">The job file\'s cost model throughout (no balance.calibrate change).</p>'

    weights_fig = weights_figure(data["names"], data.get("job_weights") or [], data.get("mixture_changes") or [])
    adapt = status.get("adapt")
    if weights_fig is not None:
        buf = io.BytesIO()
        weights_fig.savefig(buf, format="png", dpi=100)
        plt.close(weights_fig)
        losses = (adapt or {}).get("last_loss") or {}
        rows_w = "".join(f"<tr><td>{at}</td>{''.join(f'<td>{v / max(sum(w), 1e-12):.4f}</td>' for v in w)}</tr>"
                         for at, w in data["mixture_changes"])
        loss_row = ("<tr><td>last training loss</td>" + "".join(
            f"<td>{losses[n]:.4f}</td>" if losses.get(n) is not None else "<td>-</td>" for n in data["names"])
            + "</tr>") if adapt else ""
        weights_html = (f'<p>{e("mixture.adapt: " + adapt["policy"]) if adapt else "Changed with msd mix."}</p>'
                        f'<table id="mixture-changes"><tr><th>from step</th>'
                        f'{"".join(f"<th>{e(n)}</th>" for n in data["names"])}</tr>{rows_w}{loss_row}</table>'
                        f'<img id="mixture-weights" alt="mixture weights over the steps" '
                        f'src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode("ascii")}">')
    else:
        weights_html = '<p id="mixture-weights">The job file\'s mixture throughout (no run-time change).</p>'

    relays = status.get("relays") or []
    if relays:  # as the coordinator last saw them (status.json)
        rows_r = "".join(f"<tr><td>{e(r['host'])} ({e(r['address'])})</td><td>{len(r['ranks'])}</td>"
                         f"<td>{r['bytes_in'] / 1e6:.1f}</td><td>{r['bytes_out'] / 1e6:.1f}</td>"
                         f"<td>{r['queued']}</td><td>{r['late_steps']}</td></tr>" for r in relays)
        relays_html = (f'<table id="relays"><tr><th>host</th><th>ranks</th><th>MB in</th><th>MB out</th><th>queued</th>'
                       f'<th>late steps</th></tr>{rows_r}</table>')
    else:
        relays_html = '<p id="relays">No relay (every rank spoke to the coordinator and the workers directly).</p>'

    balance = data["balance"]
    ours = np.mean([b[1] for b in balance]) if balance else float("nan")
    naive = np.mean([b[2] for b in balance]) if balance else float("nan")
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>msd report: {e(data['job'])}</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}} img{{max-width:100%;height:auto}}
td:first-child{{text-align:left}}</style></head>
<body>
<h1>msd report</h1>
<p>Job <code>{e(data['job'])}</code>, digest <code>{e(data['digest'])}</code>, dp={data['dp']};
steps {data['steps'][0] if data['steps'] else '-'} to {data['steps'][-1] if data['steps'] else '-'} journaled.</p>
<h2>Balance</h2>
<p id="balance">Mean max/mean rank cost over {len(balance)} sampled steps: {ours:.3f} (msd layout),
{naive:.3f} (the same documents dealt in arrival order).</p>
<img alt="mix, balance and data wait" src="data:image/png;base64,{image}">
<h2>Mix and skipped records</h2>
<table id="sources"><tr><th>source</th><th>target share (mean)</th><th>realised share</th><th>skipped</th></tr>
{rows}</table>
<h2>Mixture weights</h2>{weights_html}
<h2>Quarantined records</h2><ul id="quarantined">{quarantined}</ul>
<h2>Evaluation</h2>{evals_html}
<h2>Cost model</h2>{cost_html}
<h2>Relays</h2>{relays_html}
</body></html>
"""
    with open(out, "w", encoding="utf-8") as f:
        f.write(page)
