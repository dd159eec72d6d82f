"""Moved to `msd_common.formats.jsonl` in 0.4.0; this old path stays for one release (CHANGELOG.md)."""

import sys

from msd_common.formats import jsonl as _moved

sys.modules[__name__] = _moved
