"""Error classes of the readers: a fatal one for a source that cannot be used at all, and a
skippable one for a single bad record (the job goes on; the record is counted and logged)."""

from msd_common.errors import MsdError

# Why a record was skipped (the coordinator counts skips per source and kind).
SKIP_KINDS = ("corrupt", "over_limit", "error", "quarantined")


class SourceFormatError(MsdError):
    """A shard is missing, truncated or not in the declared format; refused at start-up."""


class RecordError(MsdError):
    """One record cannot be used (corrupt JSON, invalid UTF-8, missing text, over a limit); it is
    skipped. `kind` is one of SKIP_KINDS."""

    def __init__(self, message: str, kind: str = "corrupt") -> None:
        super().__init__(message)
        self.kind = kind
