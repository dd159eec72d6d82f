"""Not production code: a whole job on one machine (`local.LocalJob`), the demo (`msd demo`) and
the data it and the tests generate. Like Dask's `utils_test`: shipped, so that `msd demo`, the
tests and the benchmarks share it. It composes every role, so it sits above them, in `msd`."""
