"""Moved to `msd_common.formats.arrow` in 0.4.0; this old path stays for one release (CHANGELOG.md)."""

import sys

from msd_common.formats import arrow as _moved

sys.modules[__name__] = _moved
