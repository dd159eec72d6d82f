"""megascale-data trainer client: import this in each trainer rank that needs data.

    from trainer_client import DataClient
    client = DataClient("tcp://127.0.0.1:5555", rank=r)
    for batch in client: ...

This package imports nothing from the coordinator or the worker; they import its protocol.
"""

from typing import TYPE_CHECKING

from msd_common.errors import (CoordinatorStoppedError, JobFailedError, MsdError, PeerLostError, ProtocolError,
                               RejectedError)
from msd_common.protocol import PROTOCOL_VERSION

if TYPE_CHECKING:
    from .client import DataClient

__all__ = ["CoordinatorStoppedError", "DataClient", "JobFailedError", "MsdError", "PeerLostError", "ProtocolError",
           "RejectedError",
           "PROTOCOL_VERSION"]


def __getattr__(name: str):
    # DataClient (numpy, threads) is imported on first use: worker host agents import this
    # package for its protocol only and stay small (they run on every CPU host).
    if name == "DataClient":
        from .client import DataClient

        return DataClient
    raise AttributeError(f"module 'trainer_client' has no attribute {name!r}")
