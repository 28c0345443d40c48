"""Figures as plain strings: byte sizes, durations, bars and sparklines of block characters (no Textual)."""

from __future__ import annotations

_LEVELS = " ▁▂▃▄▅▆▇█"


def human_bytes(n: int) -> str:
    """``1536`` -> ``1.5 KiB``: sizes the way nvidia-smi/rocm-smi readers expect them."""
    if n < 1024:
        return f"{n} B"
    size, unit = float(n), "B"
    for unit in ("KiB", "MiB", "GiB"):
        size /= 1024
        if size < 1024:
            break
    return f"{size:.1f} {unit}"


def human_seconds(seconds: float) -> str:
    """``0.0124`` -> ``12.4 ms``: an emulated duration in the unit that suits it."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(seconds) >= scale:
            value = seconds / scale
            return f"{value:.0f} {unit}" if value >= 100 else f"{value:.3g} {unit}"
    return "0 s" if seconds == 0 else f"{seconds * 1e9:.3g} ns"


def bar(fraction: float, width: int) -> str:
    """A bar ``width`` cells wide, filled to ``fraction`` (clamped to 0..1)."""
    filled = round(max(0.0, min(1.0, fraction)) * width)
    return "█" * filled + "░" * (width - filled)


def sparkline(samples) -> str:
    """One character per sample, its height relative to the largest sample (the shape over time)."""
    top = max(samples, default=0)
    if top <= 0:
        return _LEVELS[0] * len(samples)
    return "".join(_LEVELS[round(v / top * (len(_LEVELS) - 1))] for v in samples)


def histogram(counts) -> str:
    """One character per bin, its height relative to the fullest bin; unlike :func:`sparkline`, a bin with
    anything in it never draws as blank (a lone outlier is what a reader looks for)."""
    top = max(counts, default=0)
    if top <= 0:
        return _LEVELS[0] * len(counts)
    return "".join(_LEVELS[max(1, round(n / top * (len(_LEVELS) - 1)))] if n else _LEVELS[0] for n in counts)
