"""Imported once by the host agent, before it forks its fork server (worker/forks.py): the modules
a worker needs are loaded and their objects frozen out of the garbage collector, so the agent, the
server and the forked workers share those pages instead of each holding a private copy (a spawned
worker re-imports everything: ~20 MB of its own per process)."""

import gc

from worker import loop  # noqa: F401  (numpy, pyzmq, msgpack, orjson, the readers)
from msd_common.formats import jsonl, megatron, parquet, webdataset  # noqa: F401

gc.collect()
gc.freeze()
