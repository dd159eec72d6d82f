"""Moved to `msd_common.topology` in 0.4.0; this old path stays for one release (CHANGELOG.md)."""

import sys

from msd_common import topology as _moved

sys.modules[__name__] = _moved
