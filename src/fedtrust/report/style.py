"""How every figure looks: one colour and line per rule, the same in every figure; sizes that fit a
paper's column; every figure written as PNG, PDF and SVG.

Colours come from Paul Tol's *muted* scheme and Okabe and Ito's (both chosen to stay distinct under the
common colour-vision deficiencies; Tol, "Colour schemes", SRON/EPS/TN/09-002; Okabe and Ito, "Color
Universal Design", 2002), with black and grey. The line says the rule's family: solid for fedtrust's
trust-inference methods, dashed for the classical robust rules, dotted for the newer defences, dash-dot
with a marker for a rule behind pre-aggregators (``nnm+median``, in the colour of the rule behind them)
or one registered outside fedtrust. No two rules share both colour and line, so a rule is told apart in
print and on screen alike.
"""

from __future__ import annotations

import hashlib
import re
import textwrap
from contextlib import contextmanager
from pathlib import Path

import matplotlib
import matplotlib.colors

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

#: Paul Tol's muted scheme, black and grey, and three of Okabe and Ito's (orange, blue, vermillion):
#: fourteen colours, so the rules most often drawn together never share one.
INDIGO, CYAN, TEAL, GREEN, OLIVE = "#332288", "#88CCEE", "#44AA99", "#117733", "#999933"
SAND, ROSE, WINE, PURPLE = "#DDCC77", "#CC6677", "#882255", "#AA4499"
BLACK, GREY, ORANGE, BLUE, VERMILLION = "#000000", "#777777", "#E69F00", "#0072B2", "#D55E00"
COLOURS = [INDIGO, CYAN, TEAL, GREEN, OLIVE, SAND, ROSE, WINE, PURPLE, BLACK, GREY, ORANGE, BLUE, VERMILLION]

#: Every registered rule's colour and line: solid for fedtrust's trust inference, dashed for the
#: classical robust rules, dotted for the newer defences. No two rules share both; the trust methods and
#: the classical rules they are compared with (mean to Multi-Krum) share no colour at all.
STYLES = {
    "ivar_mle": (INDIGO, "-"), "ivar_vb": (CYAN, "-"), "icov_mle": (GREEN, "-"), "icov_vb": (TEAL, "-"),
    "arfl": (WINE, "-"), "focus": (PURPLE, "-"), "fedag": (OLIVE, "-"),
    "mean": (BLACK, "--"), "fedavg": (GREY, "--"), "median": (ROSE, "--"), "trimmed_mean": (SAND, "--"),
    "geometric_median": (ORANGE, "--"), "krum": (BLUE, "--"), "multi_krum": (VERMILLION, "--"),
    "bulyan": (INDIGO, "--"), "centered_clipping": (CYAN, "--"), "cfl": (GREEN, "--"),
    "norm_bounding": (BLACK, ":"), "dnc": (ROSE, ":"), "flame": (BLUE, ":"), "foolsgold": (ORANGE, ":"),
    "fltrust": (VERMILLION, ":"),
}  # fmt: skip
MARKERS = ["o", "s", "^", "v", "D", "P", "X", "*"]

#: Widths in inches of one column and of a whole page (two columns) of a two-column paper (IEEE, ACM:
#: 3.3-3.5 and 7.0-7.2).
COLUMN = 3.4
PAGE = 7.0
#: What figures save as: raster for reports and slides, vector for papers.
FORMATS = ("png", "pdf", "svg")

#: The grey of reference lines.
PALE = "#BBBBBB"

_RC = {
    "font.size": 8,
    "axes.titlesize": 8,
    "axes.labelsize": 8,
    "xtick.labelsize": 7,
    "ytick.labelsize": 7,
    "legend.fontsize": 7,
    "figure.titlesize": 9,
    "lines.linewidth": 1.3,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "savefig.dpi": 200,
    "pdf.fonttype": 42,  # TrueType in PDFs: editable text, accepted by the publishers' checkers
    "svg.fonttype": "none",
}


@contextmanager
def paper():
    """Matplotlib settings of every figure fedtrust draws (8-point text at print size)."""
    with plt.rc_context(_RC):
        yield


def family_of(label: str) -> str:
    """A rule's registered name from a label with options and pre-aggregators: ``nnm+trimmed_mean(f=0.3)``
    -> ``trimmed_mean``."""
    return label.split("(", 1)[0].split("+")[-1].strip()


def rule_style(label: str) -> dict:
    """Colour, line style and marker (or None) of a rule's line, from its label; the same label gets
    the same style in every figure."""
    name = label.split("(", 1)[0].strip()
    if name in STYLES:
        color, ls = STYLES[name]
        return {"color": color, "ls": ls, "marker": None}
    digest = int(hashlib.sha256(name.encode()).hexdigest(), 16)
    marker = MARKERS[digest % len(MARKERS)]
    base = family_of(label)
    if base in STYLES:  # pre-aggregators in front of a registered rule: that rule's colour
        return {"color": STYLES[base][0], "ls": "-.", "marker": marker}
    return {"color": COLOURS[digest // len(MARKERS) % len(COLOURS)], "ls": "-.", "marker": marker}


def rule_styles(labels) -> dict[str, dict]:
    """Styles of the labels drawn in one figure. The same rule with other options (``arfl(lam=0.1)``,
    ``arfl(lam=1)``) keeps its line, in shades of its colour from dark to light in the order drawn, each
    with a marker of its own."""
    styles = {label: rule_style(label) for label in labels}
    groups: dict[tuple, list[str]] = {}
    for label, s in styles.items():
        groups.setdefault((s["color"], s["ls"], s["marker"]), []).append(label)
    for members in groups.values():
        if len(members) > 1:
            for k, label in enumerate(members):
                base = styles[label]
                lighter = 0.65 * k / (len(members) - 1)  # blended toward white
                rgb = [c + (1 - c) * lighter for c in matplotlib.colors.to_rgb(base["color"])]
                styles[label] = {
                    **base,
                    "color": matplotlib.colors.to_hex(rgb),
                    "marker": MARKERS[k % len(MARKERS)],
                }
    return styles


def wrap(text: str, width: int) -> str:
    """A title broken into lines of at most ``width`` characters, so it never runs past its panel: at
    spaces, and before a rule's options (``geometric_median`` / ``(weighted=True)``), not inside a name."""
    spaced = re.sub(r"(?<=\w)\(", " (", text) if len(text) > width else text
    return "\n".join(textwrap.wrap(spaced, width, break_long_words=False)) or text


def slug(text: str) -> str:
    """A file name from free text: letters, digits and underscores."""
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_")[:80] or "figure"


def save(fig, path: str | Path, formats=FORMATS) -> Path:
    """Write ``fig`` next to ``path`` in each format (same stem) and close it; returns the PNG's path
    (the first format's, when PNG is not among them)."""
    path = Path(path)
    written = [path.with_suffix(f".{fmt}") for fmt in formats]
    for target in written:
        fig.savefig(target)
        # the first save placed the panels (constrained layout: most of a many-panel figure's time); the
        # other formats keep that placement rather than compute it again
        fig.set_layout_engine("none")
    plt.close(fig)
    return written[0]
