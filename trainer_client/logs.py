"""Log set-up shared by every msd process (coordinator, worker host, worker processes)."""

from __future__ import annotations

import logging


def setup_logging(level: str, who: str, filename: str | None = None) -> None:
    """One line per record: time, process role and pid, level, message."""
    logging.basicConfig(level=level.upper(), filename=filename,
                        format=f"%(asctime)s {who}[%(process)d] %(levelname)s %(message)s")
