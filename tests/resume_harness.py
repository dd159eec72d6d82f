"""One save/load check for every component that checkpoints (after torchdata's test/nodes/utils.py):
the state is what the consumer has taken, and resuming from it gives exactly what an
uninterrupted run gives from there on, however often one resumes.

A component is described by `run(state, n) -> (items, states)`: n items from `state` (None: from
the start), and the state after each item. Items are compared with ==."""

from __future__ import annotations

from typing import Any, Callable

Run = Callable[[Any, int], tuple[list, list]]


def check_save_load(run: Run, total: int, resume_at: list[int], twice: tuple[int, int]) -> list:
    """Asserts, against one uninterrupted run of `total` items:
    - resuming from the state after item k gives items k+1.. (for each k of resume_at; a k that
      falls inside a unit of work, a step's micro-batch say, checks resuming mid-unit);
    - resuming at twice[0], running to twice[1], then resuming again from there gives the same;
    - loading a state and saving it at once gives it back unchanged is the component's own test.
    Returns the uninterrupted items."""
    reference, states = run(None, total)
    assert len(reference) == total and len(states) == total
    for k in resume_at:
        resumed, _ = run(states[k], total - k - 1)
        assert resumed == reference[k + 1:], f"resumed after item {k}: differs from the uninterrupted run"
    k1, k2 = twice
    first, first_states = run(states[k1], k2 - k1)
    second, _ = run(first_states[-1], total - k2 - 1)
    assert first + second == reference[k1 + 1:], f"resumed after item {k1}, then after item {k2}: differs"
    return reference
