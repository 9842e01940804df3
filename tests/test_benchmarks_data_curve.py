"""benchmarks/data_curve.py, issue 42's curve: served_acceptance.py's results -> a table and a plot, one line per
method and trainer; only served, lossless drafts at the K asked for make a point."""

import json

import pytest

from conftest import REPO, load_script

SCRIPT = REPO / "benchmarks" / "data_curve.py"


@pytest.fixture(scope="module")
def curve():
    return load_script(SCRIPT)


def served(folder, *rows):
    """A served_acceptance.py --out folder holding `rows` (draft, method, k, acceptance_length, lossless)."""
    folder.mkdir()
    with open(folder / "results.jsonl", "w") as handle:
        for draft, method, k, length, lossless in rows:
            handle.write(json.dumps({"draft": draft, "method": method, "k": k, "acceptance_length": length,
                                     "per_position": [length - 1.0] + [0.0] * (k - 1), "lossless": lossless}) + "\n")
    return folder


def test_points_become_one_line_per_method_and_trainer(curve, tmp_path, capsys):
    small = served(tmp_path / "small", ("a", "eagle3", 3, 1.3, True), ("b", "dflash", 3, 1.2, True),
                   ("a", "eagle3", 5, 1.9, True))
    large = served(tmp_path / "large", ("c", "eagle3", 3, 1.5, True), ("d", "eagle3", 3, 1.7, True))
    peer = served(tmp_path / "peer", ("e", "eagle3", 3, 1.25, True))
    svg = tmp_path / "curve.svg"
    curve.main(["--point", f"200={small}", "--point", f"1000={large}", "--point", f"200:speculators={peer}",
                "--svg", str(svg), "--reference", "goal=1.8"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 5  # K=5's row is not on a K=3 curve; both drafts of the large point are rows
    assert rows[0].startswith("| 200 | dflash | specgen | 3 | 1.200 |")
    assert "| 1,000 | eagle3 | specgen | 3 | 1.500 | 0.500 / 0.000 / 0.000 |" in rows
    assert "| 200 | eagle3 | speculators | 3 | 1.250 | 0.250 / 0.000 / 0.000 |" in rows
    points = curve.lines_of([row for text in (f"200={small}", f"1000={large}", f"200:speculators={peer}")
                             for row in curve.read_point(*curve.parse_point(text), 3)])
    assert points == {("eagle3", "specgen"): [(200, 1.3), (1000, pytest.approx(1.6))],
                      ("dflash", "specgen"): [(200, 1.2)], ("eagle3", "speculators"): [(200, 1.25)]}
    text = svg.read_text()
    assert "<svg" in text and "eagle3 (speculators)" in text and "dflash (specgen)" in text and ">goal<" in text


def test_a_lossy_draft_or_a_missing_k_is_refused(curve, tmp_path):
    lossy = served(tmp_path / "lossy", ("a", "eagle3", 3, 1.4, False))
    with pytest.raises(SystemExit, match="not lossless at K=3"):
        curve.main(["--point", f"200={lossy}"])
    with pytest.raises(SystemExit, match="no result at K=7: serve its drafts with --ks 7"):
        curve.main(["--point", f"200={lossy}", "--k", "7"])
    with pytest.raises(SystemExit, match="expected SIZE"):
        curve.main(["--point", f"many={lossy}"])
