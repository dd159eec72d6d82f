"""tools/bench_sim.py's CPU by role: each role's entry points are timed exclusive of the other
entry points they call (a rank's handling leaves out the wire's decoding inside it), so the roles
never count one CPU second twice, and the clocks come off after the pass."""

import os
import sys
import time

TOOLS = os.path.join(os.path.dirname(__file__), "..", "..", "tools")
sys.path.insert(0, TOOLS)

import bench_sim  # noqa: E402
from msd_common import wire  # noqa: E402


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_roles_are_timed_exclusive_of_the_roles_they_call(monkeypatch):
    # stand-ins: "wire encode" calls "wire decode", as a role calls the wire
    def decode(*args, **kwargs):
        _spin(0.05)

    def encode(*args, **kwargs):
        _spin(0.03)
        wire.decode()  # the module's attribute, as the roles call it: the clock is on it

    monkeypatch.setattr(wire, "decode", decode)
    monkeypatch.setattr(wire, "encode", encode)
    with bench_sim.RoleClock() as clock:
        wire.encode()
    assert wire.encode is encode and wire.decode is decode  # the clocks are off again
    assert 0.045 <= clock.seconds["wire decode"] <= 0.07
    assert 0.025 <= clock.seconds["wire encode"] <= 0.045  # its own 30 ms, not the 80 ms with decode's
