"""Text sparklines for the terminal reports (learning curves, acceptance profiles)."""


def sparkline(values: list[float], lo: float | None = None, hi: float | None = None) -> str:
    """One block character per value, scaled between `lo` and `hi` (default: the values' min and max)."""
    bars = "▁▂▃▄▅▆▇█"
    lo = min(values, default=0) if lo is None else lo
    hi = max(values, default=0) if hi is None else hi

    def level(v):
        return 0 if hi == lo else min(len(bars) - 1, max(0, round((v - lo) / (hi - lo) * (len(bars) - 1))))

    return "".join(bars[level(v)] for v in values)
