"""Moved to `msd_common.doc_keys` in 0.4.0; this old path stays for one release (CHANGELOG.md)."""

import sys

from msd_common import doc_keys as _moved

sys.modules[__name__] = _moved
