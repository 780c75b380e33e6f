"""The intake batch bounds: count and time come from the take (``faust_runtime/take.py``), tokens from here.

The take closes a batch at ``n`` events, when no more arrive, or ``within`` seconds after its
first; it has no notion of size. Intake therefore takes up to ``n`` prompts and splits them, in arrival order, into
runs whose prompt tokens stay within the token bound: a run closes *before* the prompt that
would pass the bound, so every run is within it, except a single prompt larger than the bound,
which forms a run of its own (it is still served; the context budget decides if it fits the
model). Each run is then embedded, recalled and produced as one batch. Pure logic, no I/O.
"""

from __future__ import annotations

from typing import Sequence, TypeVar

T = TypeVar("T")


def split_by_tokens(items: Sequence[T], tokens: Sequence[int], max_tokens: int) -> list[list[T]]:
    """``items`` (with their token counts) cut into consecutive runs of at most ``max_tokens``."""
    runs: list[list[T]] = []
    run: list[T] = []
    used = 0
    for item, n in zip(items, tokens, strict=True):  # a count for every item
        if run and used + n > max_tokens:
            runs.append(run)
            run, used = [], 0
        run.append(item)
        used += n
    if run:
        runs.append(run)
    return runs
