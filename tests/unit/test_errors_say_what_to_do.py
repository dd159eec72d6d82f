"""Errors that say what to do. An address msd cannot use is refused at once, saying what form it takes (issue 61, tried
as a new
user would: `DataClient("127.0.0.1:5999")` put a ZMQError traceback in the I/O thread and then
waited 300 s blaming a missing coordinator; `msd worker` and `msd coordinator --bind` printed about
30 lines of traceback)."""

import time

import pytest
from click.testing import CliRunner

from msd.cli import main
from msd_common.session import check_address, split_addresses
from trainer_client import DataClient


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:5555", "tcp://head-0.msd:5555", "tcp://[::1]:5555",
                                     "ipc:///tmp/msd.sock", "inproc://x"])
def test_addresses_zeromq_takes_pass(address):
    assert check_address(address) == address


@pytest.mark.parametrize("address", ["127.0.0.1:5999", "tcp://127.0.0.1", "tcp://127.0.0.1:99999", "http://a:1",
                                     "tcp://*:5555", "tcp://a:5555 ", "localhost"])
def test_other_addresses_are_refused_naming_the_form(address):
    with pytest.raises(ValueError, match="is not an address msd can use.*tcp://HOST:PORT"):
        check_address(address)


def test_a_bind_address_may_name_every_interface():
    assert check_address("tcp://*:5555", bind=True) == "tcp://*:5555"
    assert split_addresses("tcp://a:1, tcp://b:2") == ["tcp://a:1", "tcp://b:2"]
    with pytest.raises(ValueError, match="'b:2'"):
        split_addresses("tcp://a:1,b:2")


def test_a_client_given_a_bare_host_and_port_raises_at_once_with_the_form():
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"'127.0.0.1:5999' is not an address msd can use \(tcp://127.0.0.1:5999\)"):
        DataClient("127.0.0.1:5999", rank=0)
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize("args, option", [
    (["worker", "--coordinator", "127.0.0.1:5999"], "--coordinator"),
    (["relay", "--coordinator", "127.0.0.1:5999"], "--coordinator"),
    (["status", "--coordinator", "127.0.0.1:5999"], "--coordinator"),
    (["mix", "--coordinator", "127.0.0.1:5999", "--at-step", "5", "web=1"], "--coordinator"),
    (["coordinator", "--config", "configs/example.yaml", "--bind", "127.0.0.1:5999"], "--bind"),
])
def test_every_command_refuses_it_naming_the_option_without_a_traceback(args, option):
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2, r.output
    assert f"Invalid value for '{option}': '127.0.0.1:5999' is not an address msd can use" in r.output
    assert "Traceback" not in r.output


def test_msd_report_refuses_an_out_file_it_would_not_write_in_its_format(tmp_path):
    """`msd report --out x.pdf` wrote HTML into the .pdf file, silently."""
    r = CliRunner().invoke(main, ["report", "--state-dir", str(tmp_path), "--out", str(tmp_path / "x.pdf")])
    assert r.exit_code == 2 and "writes HTML (name it .html) or a PNG of the plots (.png)" in r.output, r.output
    assert not (tmp_path / "x.pdf").exists()


@pytest.mark.parametrize("command", [["worker", "--coordinator", "tcp://127.0.0.1:1"], ["relay", "--coordinator",
                                     "tcp://127.0.0.1:1"], ["coordinator", "--config", "configs/example.yaml"]])
def test_every_command_takes_the_same_log_levels(command):
    """`--log-level` took a fixed list on `msd relay` but free text on `msd worker`."""
    r = CliRunner().invoke(main, [*command, "--log-level", "LOUD"])
    assert r.exit_code == 2 and "Invalid value for '--log-level': 'LOUD' is not one of" in r.output, r.output


def test_the_status_line_says_no_rank_is_connected_rather_than_step_minus_one():
    """"slowest rank at step -1 of 0 rank(s)" once the ranks were done."""
    from coordinator.status_view import status_line

    assert "no rank connected" in status_line({"next_step": 5, "consumed": {}})
    assert "-1" not in status_line({"next_step": 5, "consumed": {}})
    assert "slowest rank at step 3 of 1 rank(s)" in status_line({"next_step": 5, "consumed": {"0": 3}})


def test_msd_status_of_a_stopped_job_answers_at_once_from_its_state_dir(tmp_path):
    """Issue 61: `msd status --state-dir` of a job that had stopped waited 5 s for a coordinator
    that was not there before it showed the last status."""
    import json
    import os

    from msd.testing.ports import free_address

    state = tmp_path / "state"
    state.mkdir()
    (state / "coordinator.json").write_text(json.dumps({"address": free_address(), "digest": "d", "pid": 1}))
    started = os.path.getmtime(state / "coordinator.json")
    (state / "status.json").write_text(json.dumps({"time": started + 10, "stopped": "the job ended", "next_step": 7,
                                                   "consumed": {"0": 6}}))
    begin = time.monotonic()
    r = CliRunner().invoke(main, ["status", "--state-dir", str(state)])
    assert time.monotonic() - begin < 1.0, r.output
    assert r.exit_code == 0 and "the last status it wrote" in r.output, r.output


def test_a_vision_worker_without_torch_says_nothing_of_pytorch(tmp_path):
    """Issue 61: "[transformers] PyTorch was not found" twice on a vision worker: advice for users
    of transformers' models, which a worker host (the `vision` extra, no torch) never loads."""
    import subprocess
    import sys

    script = tmp_path / "no_torch.py"
    script.write_text(
        "import importlib.abc, importlib.util, sys\n"
        "class NoTorch(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'torchvision'):\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, NoTorch())\n"
        "find = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, *a, **k: None if name.split('.')[0] in ('torch', 'torchvision') "
        "else find(name, *a, **k)\n"
        "import worker.processor\n"
        "import transformers\n"
        "print('torch hidden:', not transformers.is_torch_available())\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "torch hidden: True" in out.stdout, out.stderr
    assert "PyTorch was not found" not in out.stderr, out.stderr
