"""The open-file limit: raised towards what a large job needs, and a limit that cannot be raised
is named in a warning."""

import logging
import resource

from msd_common.sockets import raise_fd_limit


def test_the_soft_limit_is_raised_to_the_hard_one(monkeypatch):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        got = raise_fd_limit("test", want=2048)
        assert got == min(2048, hard) == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_limit_that_cannot_be_raised_is_named(monkeypatch, caplog):
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 1024))
    monkeypatch.setattr(resource, "setrlimit", lambda *_: None)
    with caplog.at_level(logging.WARNING, logger="msd"):
        assert raise_fd_limit("worker") == 1024
    assert "RLIMIT_NOFILE" in caplog.text and "1024" in caplog.text and "ulimit -n" in caplog.text
