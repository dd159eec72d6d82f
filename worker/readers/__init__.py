"""Moved in 0.4.0: records by format are `msd_common.formats` (the floor the coordinator reads
counts from), samples are `worker.samples`. These old names stay for one release (CHANGELOG.md)."""

from msd_common.formats.errors import RecordError, SourceFormatError
from worker.samples import SourceReader, is_memory_mapped, open_source

__all__ = ["RecordError", "SourceFormatError", "SourceReader", "is_memory_mapped", "open_source"]
