"""Moved to `msd_common.files` in 0.4.0; this old path stays for one release (CHANGELOG.md)."""

import sys

from msd_common import files as _moved

sys.modules[__name__] = _moved
