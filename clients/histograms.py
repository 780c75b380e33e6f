"""Percentiles from Prometheus histogram buckets, the way ``histogram_quantile`` computes them.

``chatpipe top`` has no Prometheus server to ask: it scrapes each service's ``/metrics`` itself and
takes the difference of the cumulative bucket counts between two scrapes (the observations made in
between), then the quantile of that difference. Pure functions, no I/O.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

Buckets = Sequence[tuple[float, float]]  # (upper bound "le", cumulative count), ascending, last +Inf


def delta(new: Mapping[float, float], old: Mapping[float, float] | None) -> list[tuple[float, float]]:
    """The buckets of the observations made between two scrapes ({le: cumulative count} each).

    A count that went down means the service restarted (its counters began again): the new
    scrape alone is what was observed since then."""
    if old is None or any(new.get(le, 0.0) < old.get(le, 0.0) for le in old):
        old = {}
    return sorted((le, new[le] - old.get(le, 0.0)) for le in new)


def quantile(q: float, buckets: Buckets) -> float | None:
    """The ``q`` quantile (0..1) of a histogram's cumulative buckets; None when it is empty.

    Linear interpolation inside the bucket the rank falls in, from 0 for the first bucket (when its
    bound is above 0); a rank in the +Inf bucket gives the highest finite bound, as Prometheus does."""
    if not 0 <= q <= 1:
        raise ValueError(f"quantile {q} outside 0..1")
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for i, (upper, count) in enumerate(buckets):
        if count >= rank and count > 0:
            if math.isinf(upper):
                return lower if i > 0 else None  # only a +Inf bucket: nothing to say
            if i == 0 and upper <= 0:
                return upper
            if count == below:
                return lower
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower
