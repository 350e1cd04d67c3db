"""Byte counts for people: the one formatter that plans, the demo and the benchmarks use."""
from __future__ import annotations

__all__ = ["format_bytes"]


def format_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'``: binary units up to TiB, one decimal (whole bytes below 1 KiB)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
