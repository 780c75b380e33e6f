"""Progress per job step (rich), with each step's wall time kept for the run summary.

Spark evaluates lazily, so a step's time is the time of the action that materialises it
(``StepTimer.run`` wraps that action). Steps are shown as they finish; with ``enabled=False``
nothing is printed but timings are still recorded (tests, bench).
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

from rich.console import Console


@dataclass
class StepTimer:
    enabled: bool = True
    console: Console = field(default_factory=lambda: Console(stderr=True))
    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def step(self, name: str, detail: str = ""):
        start = time.perf_counter()
        with self.console.status(f"[bold]{name}[/] {detail}", spinner="dots") if self.enabled else nullcontext():
            yield
        elapsed = time.perf_counter() - start
        self.seconds[name] = self.seconds.get(name, 0.0) + elapsed
        if self.enabled:
            self.console.print(f"[green]✓[/] {name:<18} {elapsed:7.2f} s  {detail}")
