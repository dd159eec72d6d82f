"""Only the compiled part of the build; everything else is in pyproject.toml.

coordinator._greedy is the planner's inner loop (see coordinator/_greedy.c), coordinator._feistel
the keyed permutation of the record streams (coordinator/_feistel.c). Both are optional: where they
cannot be built, the coordinator runs the same code in Python and numpy, slower.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(f"coordinator.{name}", [f"coordinator/{name}.c"], optional=True,
                             extra_compile_args=["-O2"]) for name in ("_greedy", "_feistel")])
