"""Wall-clock timing for the benchmarks, the device's queued work drained around each reading."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

CPU = torch.device("cpu")


def synchronized_clock(device: torch.device) -> float:
    """``perf_counter`` once the device's queued work is done (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def median_ms(
    call: Callable[[], object],
    repeats: int = 20,
    *,
    device: torch.device = CPU,
    warmups: int = 1,
) -> float:
    """Median wall time of ``call`` in ms over ``repeats`` calls, after ``warmups`` untimed."""
    for _ in range(warmups):
        call()
    times = []
    for _ in range(repeats):
        start = synchronized_clock(device)
        call()
        times.append(synchronized_clock(device) - start)
    return statistics.median(times) * 1000
