"""A real S3-compatible server on loopback for tests and benchmarks: moto's server mode in a child
process, optionally behind a proxy (`python -m msd.testing.s3proxy`) that fails or stalls
a share of requests and counts the bytes it passes.

    with LoopbackS3(error_rate=0.1) as s3:
        s3.upload_dir(local_dir, "bucket", "prefix")
        os.environ.update(s3.env())  # AWS_ENDPOINT_URL etc., what any S3 client reads
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

import orjson

from .ports import free_port
from .processes import stop


def _wait_for(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except Exception as e:  # noqa: BLE001 - not up yet
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not come up in {timeout_s} s ({e})") from None
            time.sleep(0.1)


def _wait_for_port(port: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing listens on port {port} after {timeout_s} s") from None
            time.sleep(0.1)


class LoopbackS3:
    def __init__(self, error_rate: float = 0.0, drop_rate: float = 0.0, stall_rate: float = 0.0, stall_s: float = 2.0,
                 seed: int = 0, proxy: bool | None = None, log_path: str | None = None,
                 s3rver: str | None = None) -> None:
        """s3rver: the path of an `s3rver` executable (npm's file-backed S3 server) to serve
        instead of moto: moto reads a whole object to answer a range of it, which caps ranged
        reads of large objects at a few dozen per second (benchmarks use s3rver)."""
        self.s3rver = s3rver
        self._data_dir: str | None = None
        self.faults = {"error_rate": error_rate, "drop_rate": drop_rate, "stall_rate": stall_rate, "stall_s": stall_s,
                       "seed": seed}
        self.proxy = proxy if proxy is not None else bool(error_rate or drop_rate or stall_rate)
        self.log_path = log_path
        self._procs: list[subprocess.Popen] = []

    def __enter__(self) -> "LoopbackS3":
        log = open(self.log_path or os.devnull, "ab")
        port = free_port()
        self.server_url = f"http://127.0.0.1:{port}"
        if self.s3rver:
            self._data_dir = tempfile.mkdtemp(prefix="msd-s3rver-")
            self._procs.append(subprocess.Popen([self.s3rver, "-d", self._data_dir, "-a", "127.0.0.1", "-p", str(port),
                                                 "--silent", "--allow-mismatched-signatures", "--no-vhost-buckets"],
                                                stdout=log, stderr=log))
            _wait_for_port(port)
        else:
            self._procs.append(subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                                                 str(port)], stdout=log, stderr=log))
            _wait_for(self.server_url + "/moto-api/")
        self.endpoint = self.server_url
        if self.proxy:
            proxy_port = free_port()
            args = [sys.executable, "-m", "msd.testing.s3proxy", "--upstream", self.server_url,
                    "--port", str(proxy_port)]
            for k, v in self.faults.items():
                args += [f"--{k.replace('_', '-')}", str(v)]
            self._procs.append(subprocess.Popen(args, stdout=log, stderr=log))
            self.endpoint = f"http://127.0.0.1:{proxy_port}"
            _wait_for(self.endpoint + "/__msd_proxy/stats")
        return self

    def __exit__(self, *exc: Any) -> None:
        stop(reversed(self._procs), timeout_s=10)
        if self._data_dir:
            shutil.rmtree(self._data_dir, ignore_errors=True)

    def env(self) -> dict[str, str]:
        """What an S3 client needs to reach this server (the standard AWS variables)."""
        key = "S3RVER" if self.s3rver else "testing"  # s3rver knows one account
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": key,
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}

    def client(self, direct: bool = True):
        """A boto3 client (direct to the server, past the fault proxy, unless asked otherwise)."""
        import boto3

        key = "S3RVER" if self.s3rver else "testing"
        return boto3.client("s3", endpoint_url=self.server_url if direct else self.endpoint,
                            aws_access_key_id=key, aws_secret_access_key=key, region_name="us-east-1")

    def upload_dir(self, local_dir: str, bucket: str, prefix: str = "") -> int:
        """Create the bucket and upload every file under local_dir to prefix/<relative path>;
        returns the number of files."""
        client = self.client()
        try:
            client.create_bucket(Bucket=bucket)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        n = 0
        for root, _, files in os.walk(local_dir):
            for name in sorted(files):
                path = os.path.join(root, name)
                key = os.path.relpath(path, local_dir).replace(os.sep, "/")
                client.upload_file(path, bucket, f"{prefix.rstrip('/')}/{key}" if prefix else key)
                n += 1
        return n

    def stats(self) -> dict[str, Any]:
        """The proxy's counts: requests, bytes_out (to clients), errors, drops, stalls."""
        with urllib.request.urlopen(self.endpoint + "/__msd_proxy/stats", timeout=5) as r:
            return orjson.loads(r.read())

    def reset_stats(self) -> None:
        urllib.request.urlopen(self.endpoint + "/__msd_proxy/reset", timeout=5).read()
