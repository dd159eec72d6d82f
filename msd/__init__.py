"""The top floor: the `msd` command, which puts the roles together.

    cli, commands        `msd` and its subcommands (each role's own command is in its package:
                         coordinator, worker; this package dispatches to them)
    replay, dryrun,      `msd plan`, `msd manifest`, `msd where`, `msd report`: the planner run
    inspection, report   over the job's data in one process, with the workers' sample stage
    testing              a whole job on one machine (tests, the demo, the benchmarks)

Only this package imports more than one role; no role imports it (tests/unit/test_floors.py).
"""
