"""An HTTP proxy between S3 clients and a server that injects the faults object stores show:
503 SlowDown answers, dropped connections, stalls. It counts requests and response bytes
(read amplification is measured here, on the wire).

    python -m msd.testing.s3proxy --upstream http://127.0.0.1:5000 --port 5001 \
        --error-rate 0.1 --stall-rate 0.02 --stall-s 2

Which requests fail is drawn from a seeded generator in arrival order; GET /__msd_proxy/stats
answers the counts as JSON, GET /__msd_proxy/reset zeroes them.
"""

from __future__ import annotations

import argparse
import http.client
import random
import socket
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import orjson

HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"}
SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
             b'<Message>Please reduce your request rate.</Message></Error>')


class Faults:
    def __init__(self, error_rate: float, drop_rate: float, stall_rate: float, stall_s: float, seed: int) -> None:
        self.error_rate, self.drop_rate, self.stall_rate, self.stall_s = error_rate, drop_rate, stall_rate, stall_s
        self.random = random.Random(seed)
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.counts = {"requests": 0, "bytes_out": 0, "errors": 0, "drops": 0, "stalls": 0}

    def draw(self) -> str:
        with self.lock:
            self.counts["requests"] += 1
            x = self.random.random()
        if x < self.error_rate:
            return "error"
        if x < self.error_rate + self.drop_rate:
            return "drop"
        if x < self.error_rate + self.drop_rate + self.stall_rate:
            return "stall"
        return "pass"

    def count(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] += n


def handler(upstream: str, faults: Faults) -> type[BaseHTTPRequestHandler]:
    target = urllib.parse.urlsplit(upstream)

    class Proxy(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet: thousands of requests
            pass

        def _control(self) -> bool:
            if not self.path.startswith("/__msd_proxy/"):
                return False
            if self.path.endswith("/reset"):
                faults.reset()
            body = orjson.dumps(faults.counts)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return True

        def _forward(self) -> None:
            if self._control():
                return
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            fate = faults.draw()
            if fate == "error":
                faults.count("errors")
                self.send_response(503)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(SLOW_DOWN)))
                self.end_headers()
                self.wfile.write(SLOW_DOWN)
                return
            if fate == "drop":
                faults.count("drops")
                self.close_connection = True
                return  # nothing answered: the client sees the connection closed
            if fate == "stall":
                faults.count("stalls")
                time.sleep(faults.stall_s)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
            for attempt in range(2):  # a kept-alive upstream connection may have been closed meanwhile
                conn = self._upstream()
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    break
                except (http.client.HTTPException, OSError):
                    conn.close()
                    self._conn = None
                    if attempt:
                        raise
            self.send_response(resp.status, resp.reason)
            for k, v in resp.getheaders():
                if k.lower() not in HOP_BY_HOP and (k.lower() != "content-length" or self.command == "HEAD"):
                    self.send_header(k, v)
            if self.command != "HEAD":
                self.send_header("Content-Length", str(len(data)))
            # headers and body in one write: written apart, Nagle's algorithm and the client's
            # delayed ACK hold each response back by tens of milliseconds
            self._headers_buffer.append(b"\r\n")
            head = b"".join(self._headers_buffer)
            self._headers_buffer = []
            self.wfile.write(head + (data if self.command != "HEAD" else b""))
            if self.command != "HEAD":
                faults.count("bytes_out", len(data))

        def _upstream(self) -> http.client.HTTPConnection:
            if getattr(self, "_conn", None) is None:
                self._conn = http.client.HTTPConnection(target.hostname, target.port, timeout=120)
                self._conn.connect()
                self._conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return self._conn

        def setup(self) -> None:
            super().setup()
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

    return Proxy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--error-rate", type=float, default=0.0)
    parser.add_argument("--drop-rate", type=float, default=0.0)
    parser.add_argument("--stall-rate", type=float, default=0.0)
    parser.add_argument("--stall-s", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args()
    faults = Faults(a.error_rate, a.drop_rate, a.stall_rate, a.stall_s, a.seed)
    # a client opens dozens of connections at once: with the default backlog of 5, the rest wait
    # out SYN retransmits (seconds)
    ThreadingHTTPServer.request_queue_size = 1024
    server = ThreadingHTTPServer(("127.0.0.1", a.port), handler(a.upstream, faults))
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
