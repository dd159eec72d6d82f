"""Moved to `worker.samples` in 0.4.0 (records by format: `msd_common.formats.records`); this old
path stays for one release (CHANGELOG.md)."""

import sys

from worker import samples as _moved

sys.modules[__name__] = _moved
