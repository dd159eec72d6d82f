"""worker.host.local_address: where a host on the coordinator's machine connects, for the
addresses `msd coordinator --bind` takes."""

import pytest

from worker.host import local_address


@pytest.mark.parametrize("bind, expected", [
    ("tcp://*:5555", "tcp://127.0.0.1:5555"),
    ("tcp://0.0.0.0:6000", "tcp://127.0.0.1:6000"),
    ("tcp://[::]:7000", "tcp://[::1]:7000"),
    ("tcp://10.1.2.3:5555", "tcp://10.1.2.3:5555"),  # a named interface is reachable as it is
    ("tcp://127.0.0.1:5555", "tcp://127.0.0.1:5555"),
    ("ipc:///run/msd/job.sock", "ipc:///run/msd/job.sock"),
])
def test_wildcards_become_loopback_and_the_rest_stays(bind, expected):
    assert local_address(bind) == expected
