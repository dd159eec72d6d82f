"""Only the compiled part of the build; everything else is in pyproject.toml.

coordinator._greedy is the planner's inner loop (see coordinator/_greedy.c). It is optional: where
it cannot be built, the planner runs the same rule in Python (balance._greedy_loop), slower.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("coordinator._greedy", ["coordinator/_greedy.c"], optional=True,
                             extra_compile_args=["-O2"])])
