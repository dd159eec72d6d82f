"""Only the compiled part of the build; everything else is in pyproject.toml.

coordinator._greedy is the planner's inner loop (see coordinator/_greedy.c), coordinator._whole its
layout of whole samples (coordinator/_whole.c), coordinator._feistel
the keyed permutation of the record streams (coordinator/_feistel.c), msd_common.formats._lines the newline scan
of JSONL shards at a cold start (msd_common/formats/_lines.c). All are optional: where they cannot be built,
the same code runs in Python and numpy, slower.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(name, [name.replace(".", "/") + ".c"], optional=True, extra_compile_args=["-O2"])
                   for name in ("coordinator._greedy", "coordinator._whole", "coordinator._feistel",
                                "msd_common.formats._lines")])
