"""`msd mix`: ask a running coordinator to use new mixture weights from a later step on."""

from __future__ import annotations

from msd_common import protocol as P


def parse_weights(items: tuple[str, ...]) -> dict[str, float]:
    """["web=0.5", "code=0.5"] -> {"web": 0.5, "code": 0.5}; ValueError naming the bad item."""
    weights: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"{item!r}: expected SOURCE=WEIGHT")
        try:
            weights[name] = float(value)
        except ValueError:
            raise ValueError(f"{item!r}: {value!r} is not a number") from None
    return weights


def request_mix(address: str, at_step: int, weights: dict[str, float], timeout_s: float = 10.0,
                keys_dir: str | None = None) -> tuple[bool, str]:
    """Send the change and wait for the coordinator's answer: (accepted, reason if not).
    address: one, or a primary and its standbys (comma-separated); keys_dir: the job's key
    directory (a job with security.curve takes changes only from its operator key)."""
    from .control import NoAnswer, ask

    try:
        reply = ask(address, P.make(P.MIX_REQUEST, at_step=at_step, weights=weights), timeout_s, keys_dir)
    except NoAnswer as e:
        return False, str(e)
    return bool(reply["ok"]), reply["reason"]
