"""Moved to `msd_common.spec` in 0.4.0 (the typed job spec every role reads); this old path stays
for one release (CHANGELOG.md)."""

import sys

from msd_common import spec as _moved

sys.modules[__name__] = _moved
