"""megascale-data trainer client: import this in each trainer rank that needs data.

    from trainer_client import DataClient
    client = DataClient("tcp://127.0.0.1:5555", rank=r)
    for batch in client: ...

This package imports nothing from the coordinator or the worker; they import its protocol.
"""

from .client import DataClient
from .errors import MsdError, PeerLostError, ProtocolError, RejectedError
from .protocol import PROTOCOL_VERSION

__all__ = ["DataClient", "MsdError", "PeerLostError", "ProtocolError", "RejectedError", "PROTOCOL_VERSION"]
