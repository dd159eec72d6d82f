"""Source readers: map a record index to its tokens. Used by workers to read and by the
coordinator (counts and Megatron lengths only; it never reads payloads)."""

from .errors import RecordError, SourceFormatError
from .source import SourceReader, open_source

__all__ = ["RecordError", "SourceFormatError", "SourceReader", "open_source"]
