"""A deterministic simulation of a whole msd job: `python -m msd.sim --seeds N` (see run.py)."""
