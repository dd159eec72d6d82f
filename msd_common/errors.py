"""Exception types shared by all parts of megascale-data (imported by coordinator and worker too)."""


class MsdError(Exception):
    """Base class of every error megascale-data raises on purpose."""


class ProtocolError(MsdError):
    """A wire message was malformed, oversized, of the wrong type or of the wrong version."""


class RejectedError(MsdError):
    """The coordinator refused this peer (version mismatch, rank already taken, bad request)."""


class JobFailedError(MsdError):
    """The coordinator stopped the job on a fatal error (a transform failing on every record, an
    internal error, a state dir it cannot write); the message carries its reason."""


class PeerLostError(MsdError):
    """The coordinator stopped answering for longer than the configured timeout."""


class CoordinatorStoppedError(PeerLostError):
    """The coordinator was stopped (SIGTERM: a drain, `kubectl delete pod`, `systemctl stop`) and no
    coordinator (a standby, or one restarted at the same address) took over within the grace
    period: the stream did not end, it was interrupted. The message names the stop."""
