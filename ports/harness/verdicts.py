"""How a measured number is judged against a published claim (``compare.py --claims``).

Claims are made on other GPUs, so a verdict allows slack: a speed-up ratio is compared as a gain
(ratio - 1) and *holds* when the measured gain lies in the claimed range widened by ``SLACK`` of
each end (at least ``SLACK_MIN``); a level (e.g. GB/s) holds when it lies in the claimed range
widened by ``SLACK`` of itself. Otherwise it *does not hold* (smaller or larger here).
"""
from __future__ import annotations

SLACK, SLACK_MIN = 0.25, 0.05  # how far a measured value may sit outside the claimed range


def ratio_verdict(measured: float, low: float, high: float | None = None) -> str:
    """A measured speed-up ratio against a claimed one (or range), as gains (ratio - 1)."""
    high = low if high is None else high
    g_lo, g_hi, gain = low - 1, high - 1, measured - 1
    if gain < g_lo - max(SLACK_MIN, SLACK * abs(g_lo)):
        return "does not hold: smaller here"
    if gain > g_hi + max(SLACK_MIN, SLACK * abs(g_hi)):
        return "does not hold: larger here"
    return "holds"


def level_verdict(measured: float, low: float, high: float | None = None) -> str:
    """A measured level (e.g. GB/s) against a claimed one or range, each end widened by
    ``SLACK`` of itself."""
    high = low if high is None else high
    if measured < low * (1 - SLACK):
        return "does not hold: smaller here"
    if measured > high * (1 + SLACK):
        return "does not hold: larger here"
    return "holds"
