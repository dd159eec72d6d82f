"""Moved to `msd_common.errors` in 0.4.0; this old path stays for one release (CHANGELOG.md)."""

import sys

from msd_common import errors as _moved

sys.modules[__name__] = _moved
