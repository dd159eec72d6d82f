"""Moved to `msd_common.formats.parquet` in 0.4.0; this old path stays for one release (CHANGELOG.md)."""

import sys

from msd_common.formats import parquet as _moved

sys.modules[__name__] = _moved
