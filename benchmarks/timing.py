"""Timing helper shared by the benchmark scripts (run them as `python benchmarks/<name>.py`)."""
import statistics
import time


def median_time(fn, repeats: int) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
