"""One fixed line style per implementation, shared by every panel of a figure, and one legend
for the whole figure (matplotlib)."""
from __future__ import annotations

from collections.abc import Iterable, Sequence

# 10 colours x 7 markers (coprime: 70 distinct pairs before one repeats), then linestyles.
COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown",
          "tab:pink", "tab:gray", "tab:olive", "tab:cyan")
MARKERS = ("o", "s", "^", "D", "v", "P", "X")
LINESTYLES = ("-", "--", ":", "-.")


def styles(names: Iterable[str]) -> dict[str, dict]:
    """``name -> plot keywords`` (colour, marker, linestyle), distinct for each of ``names``,
    in order of first appearance."""
    out: dict[str, dict] = {}
    for i, name in enumerate(dict.fromkeys(names)):
        out[name] = {"color": COLORS[i % len(COLORS)], "marker": MARKERS[i % len(MARKERS)],
                     "linestyle": LINESTYLES[i // (len(COLORS) * len(MARKERS)) % len(LINESTYLES)]}
    return out


def figure_legend(fig, entries: Sequence[tuple[str, dict]]) -> None:
    """One legend for ``fig``, right of the panels: an entry per ``(label, plot keywords)``."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], markersize=4, linewidth=1, **kw) for _, kw in entries]
    fig.legend(handles, [label for label, _ in entries], loc="center left",
               bbox_to_anchor=(1.0, 0.5), fontsize=7, frameon=False)
