"""Paper-ready figures: one colour and line per rule in every figure, shared scales, error bands over
seeds, PNG + PDF + SVG at sizes that fit a one- or two-column paper."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from fedtrust import available
from fedtrust.report import load_runs, write_report
from fedtrust.report.figures import relative_trust
from fedtrust.report.style import COLUMN, PAGE, STYLES, rule_style, rule_styles
from fedtrust.sweeps.config import validate
from fedtrust.sweeps.runner import run_experiment

TRUST = ["ivar_mle", "ivar_vb", "icov_mle", "icov_vb", "arfl", "focus", "fedag"]
CLASSICAL = ["mean", "fedavg", "median", "trimmed_mean", "geometric_median", "krum", "multi_krum"]


def test_every_registered_rule_has_a_colour_and_line_no_other_rule_has():
    styles = [rule_style(name) for name in available()]
    assert set(available()) == set(STYLES)
    assert len({(s["color"], s["ls"]) for s in styles}) == len(styles)
    # the trust methods and the classical rules they are compared with never share a colour
    colours = [rule_style(name)["color"] for name in TRUST + CLASSICAL]
    assert len(set(colours)) == len(colours)


def test_a_rule_looks_the_same_in_every_figure_whatever_else_is_drawn():
    alone = rule_styles(["median"])["median"]
    crowded = rule_styles(["mean", "krum(f=0.3)", "median", "ivar_vb"])["median"]
    assert alone == crowded == rule_style("median")
    assert rule_style("trimmed_mean(f=0.3)") == rule_style("trimmed_mean")
    behind = rule_style("nnm+median")  # pre-aggregators: the colour of the rule behind them, another line
    assert behind["color"] == rule_style("median")["color"] and behind["ls"] == "-." and behind["marker"]


def test_a_rule_from_outside_fedtrust_keeps_its_style_from_one_process_to_the_next():
    """An unregistered rule's style comes from its name, not from Python's per-process string hash: the
    same in processes with different hash seeds, so its line matches across reports."""
    code = "from fedtrust.report.style import rule_style; print(rule_style('my_own_rule'))"
    seen = {
        subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
                       capture_output=True, text=True, check=True).stdout.strip()
        for seed in ("1", "2", "3")
    }  # fmt: skip
    assert seen == {str(rule_style("my_own_rule"))}


def test_variants_of_one_rule_are_shades_of_its_colour_each_with_a_marker():
    labels = [f"arfl(lam={lam})" for lam in (0.1, 1.0, 10.0)]
    styles = rule_styles(labels)
    assert styles[labels[0]]["color"] == rule_style("arfl")["color"]  # the first in the rule's own colour
    assert (
        len({s["color"] for s in styles.values()}) == 3 and len({s["marker"] for s in styles.values()}) == 3
    )


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """Two rules, clean and with a third of the clients flipping labels, two seeds, 4 rounds."""
    out = tmp_path_factory.mktemp("figures")
    cfg = validate({
        "name": "f",
        "data": {"name": "digits", "clients": 6},
        "train": {"rounds": 4, "lr": 0.5},
        "sweep": {
            "rule": [{"name": "mean"}, {"name": "krum", "f": 1}],
            "corruption": [{"name": "none"}, {"name": "label_flip", "fraction": 0.34}],
            "seed": [0, 1],
        },
    })  # fmt: skip
    run_experiment(cfg, out, progress=False)
    write_report(out / "f")
    return out / "f"


def _width_inches(path):
    if path.suffix == ".pdf":
        box = re.search(rb"/MediaBox \[\s*([\d.]+) ([\d.]+) ([\d.]+) ([\d.]+)", path.read_bytes())
        return (float(box[3]) - float(box[1])) / 72
    return float(re.search(r'<svg[^>]* width="([\d.]+)pt"', path.read_text())[1]) / 72


def test_every_figure_comes_as_png_pdf_and_svg_at_most_a_page_wide(sweep):
    pngs = sorted(sweep.glob("*.png"))
    assert {p.stem for p in pngs} == {"curves", "trust_corruption_none", "trust_corruption_label_flip"}
    for png in pngs:
        assert png.stat().st_size > 0
        for vector in (png.with_suffix(".pdf"), png.with_suffix(".svg")):
            assert COLUMN - 0.01 <= _width_inches(vector) <= PAGE + 0.01, vector.name


def test_the_curves_start_at_round_one_and_the_report_links_its_figures(sweep):
    runs = load_runs(sweep)
    assert all(r.curve()[0] == [1, 2, 3, 4] for r in runs)
    text = (sweep / "report.md").read_text()
    assert "![accuracy](curves.png)" in text and "(trust_corruption_label_flip.png)" in text


def test_trust_is_drawn_against_an_equal_share_on_one_scale_for_every_rule(sweep):
    runs = {(r.rule, r.setting): r for r in load_runs(sweep) if r.seed == 0}
    mean, krum = runs[("mean", "corruption=label_flip")], runs[("krum(f=1)", "corruption=label_flip")]
    index = {c: i for i, c in enumerate(mean.rounds[0]["clients"])}
    # the mean gives everyone an equal share: 1 everywhere (not the top of its own colour scale)
    assert np.allclose(relative_trust(mean, index), 1.0)
    picked = relative_trust(krum, index)  # Krum keeps one client: 6 equal shares on it, 0 elsewhere
    assert np.allclose(np.sort(picked, axis=0), [[0.0]] * 5 + [[6.0]])


def test_long_titles_break_between_words_and_before_options_never_inside_a_name():
    from fedtrust.report.style import wrap

    assert wrap("geometric_median(weighted=True)", 22) == "geometric_median\n(weighted=True)"
    assert wrap("corruption=label_shuffle, corruption.fraction=0.5", 40).split("\n") == [
        "corruption=label_shuffle,",
        "corruption.fraction=0.5",
    ]
    assert wrap("median", 22) == "median"
