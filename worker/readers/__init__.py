"""Source readers: map a record index to its tokens. Used by workers to read and by the
coordinator (counts and Megatron lengths only; it never reads payloads)."""

from .errors import RecordError, SourceFormatError
from .source import SourceReader, is_memory_mapped, open_source

__all__ = ["RecordError", "SourceFormatError", "SourceReader", "is_memory_mapped", "open_source"]
