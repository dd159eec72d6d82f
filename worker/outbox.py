"""Moved to `msd_common.outbox` in 0.4.0 (the relay sends with it too); this old path stays for one release."""

import sys

from msd_common import outbox as _moved

sys.modules[__name__] = _moved
