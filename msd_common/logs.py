"""Log set-up shared by every msd process (coordinator, worker host, worker processes).

Two formats: `text` (one line per record: time, process role and pid, level, message) and `json`
(one JSON object per line, for log pipelines: time, level, role, pid, logger, message, and the
step, source, rank or peer where the record carries them). `msd --log-format json` (on any command)
sets MSD_LOG_FORMAT, which the processes it starts inherit.
"""

from __future__ import annotations

import logging
import os
import time

import orjson

FORMAT_ENV = "MSD_LOG_FORMAT"
# attributes a log call may attach with extra={...}, copied into the JSON object
CONTEXT_FIELDS = ("step", "source", "rank", "peer", "worker_id", "record")


class JsonFormatter(logging.Formatter):
    def __init__(self, who: str) -> None:
        super().__init__()
        self.who = who

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                       + f".{int(record.msecs):03d}Z",
               "level": record.levelname, "role": self.who, "pid": record.process, "logger": record.name,
               "message": record.getMessage()}
        for name in CONTEXT_FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                out[name] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


def setup_logging(level: str, who: str, filename: str | None = None, fmt: str | None = None,
                  replace: bool = False) -> None:
    """Log records of `level` and above to stderr (or `filename`), as text or JSON (fmt, else
    $MSD_LOG_FORMAT, else text). replace: drop the handlers the process has (a forked worker
    inherits its agent's)."""
    fmt = fmt or os.environ.get(FORMAT_ENV) or "text"
    if fmt not in ("text", "json"):
        raise ValueError(f"log format {fmt!r}: expected text or json")
    handler = logging.FileHandler(filename) if filename else logging.StreamHandler()
    handler.setFormatter(JsonFormatter(who) if fmt == "json" else
                         logging.Formatter(f"%(asctime)s {who}[%(process)d] %(levelname)s %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=replace)
