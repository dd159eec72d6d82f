"""Moved to `msd_common.tokenizer` in 0.4.0; this old path stays for one release (CHANGELOG.md)."""

import sys

from msd_common import tokenizer as _moved

sys.modules[__name__] = _moved
