"""Moved to `msd_common.job_keys` in 0.4.0; this old path stays for one release (CHANGELOG.md)."""

import sys

from msd_common import job_keys as _moved

sys.modules[__name__] = _moved
