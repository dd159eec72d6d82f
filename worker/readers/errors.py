"""Error classes of the readers: a fatal one for a source that cannot be used at all, and a
skippable one for a single bad record (the job goes on; the record is counted and logged)."""

from trainer_client.errors import MsdError


class SourceFormatError(MsdError):
    """A shard is missing, truncated or not in the declared format; refused at start-up."""


class RecordError(MsdError):
    """One record cannot be used (corrupt JSON, invalid UTF-8, missing text); it is skipped."""
