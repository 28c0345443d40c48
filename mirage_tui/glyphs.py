"""Figures as plain strings: byte sizes, and bars and sparklines drawn with block characters (no Textual)."""

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
