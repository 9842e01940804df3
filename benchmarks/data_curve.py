"""Served acceptance length against training data size (issue #42's curve), from served_acceptance.py's results.

    python benchmarks/data_curve.py --point SIZE[:TRAINER]=DIR [--point ...] [--k 3] [--svg FILE] [--title TEXT]
        [--reference LABEL=VALUE ...]

Each DIR is a `benchmarks/served_acceptance.py --out` folder (results.jsonl: one line per draft and K, the draft's
method read from its config); SIZE is the number of training conversations behind its drafts and TRAINER names who
trained them (specgen unless given). Prints a markdown table (one row per point and method, the K asked for) and,
with --svg, plots acceptance length against conversations, one line per method and trainer (log-scaled sizes),
each --reference a dashed horizontal line (a goal, another recipe's figure).
A point without a result at that K, or whose draft was not lossless, is an error: the curve is of served, lossless
drafts only.
"""

import argparse
import json
import sys
from pathlib import Path


def parse_point(text: str) -> tuple[int, str, Path]:
    """`SIZE[:TRAINER]=DIR` -> (size, trainer, DIR)."""
    label, sep, folder = text.partition("=")
    size, _, trainer = label.partition(":")
    if not sep or not size.isdigit() or not folder:
        raise SystemExit(f"--point {text!r}: expected SIZE[:TRAINER]=DIR, e.g. 465=outputs/served-r465")
    return int(size), trainer or "specgen", Path(folder)


def read_point(size: int, trainer: str, folder: Path, k: int) -> list[dict]:
    """The rows of `folder`/results.jsonl at K=`k`, one per draft, labelled with the size and trainer."""
    path = folder / "results.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path} not found: pass a benchmarks/served_acceptance.py --out folder")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [row for row in rows if row["k"] == k]
    if not rows:
        raise SystemExit(f"{path} has no result at K={k}: serve its drafts with --ks {k}")
    lossy = [row["draft"] for row in rows if not row["lossless"]]
    if lossy:
        raise SystemExit(f"{path}: {', '.join(lossy)} not lossless at K={k}; its acceptance is not a served figure")
    return [{**row, "size": size, "trainer": trainer} for row in rows]


def table(rows: list[dict]) -> str:
    lines = ["| conversations | method | trainer | K | acceptance length | share of rounds accepting position 1..K |",
             "|---|---|---|---|---|---|"]
    for row in sorted(rows, key=lambda r: (r["method"], r["trainer"], r["size"])):
        shares = " / ".join(f"{share:.3f}" for share in row["per_position"])
        lines.append(f"| {row['size']:,} | {row['method']} | {row['trainer']} | {row['k']} | "
                     f"{row['acceptance_length']:.3f} | {shares} |")
    return "\n".join(lines)


def lines_of(rows: list[dict]) -> dict[tuple[str, str], list[tuple[int, float]]]:
    """(method, trainer) -> [(size, mean acceptance length of its drafts at that size)], sizes ascending."""
    grouped: dict[tuple[str, str], dict[int, list[float]]] = {}
    for row in rows:
        grouped.setdefault((row["method"], row["trainer"]), {}).setdefault(row["size"], []).append(
            row["acceptance_length"])
    return {key: sorted((size, sum(values) / len(values)) for size, values in sizes.items())
            for key, sizes in grouped.items()}


def plot(rows: list[dict], k: int, svg: Path, title: str, references: dict[str, float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matplotlib.rcParams.update({"svg.hashsalt": "specgen", "svg.fonttype": "none"})  # reproducible; text as text
    figure, axes = plt.subplots(figsize=(6, 4))
    for (method, trainer), points in sorted(lines_of(rows).items()):
        sizes, values = zip(*points)
        axes.plot(sizes, values, marker="o", label=f"{method} ({trainer})")
    for label, value in references.items():
        axes.axhline(value, linestyle="--", linewidth=1, color="grey")
        axes.annotate(label, (0.01, value), xycoords=("axes fraction", "data"), fontsize=8, va="bottom")
    sizes = sorted({row["size"] for row in rows})
    axes.set_xscale("log")
    axes.set_xticks(sizes, [f"{size:,}" for size in sizes])
    axes.minorticks_off()
    axes.set_xlim(sizes[0] / 1.3, sizes[-1] * 1.3)
    axes.set_xlabel("training conversations")
    axes.set_ylabel(f"served acceptance length, K={k}")
    axes.set_title(title, fontsize=10)
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    svg.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(svg, format="svg", metadata={"Date": None})
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--point", action="append", required=True, help="SIZE[:TRAINER]=DIR")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--svg", type=Path)
    parser.add_argument("--title", default="vLLM, MT-Bench first turns")
    parser.add_argument("--reference", action="append", default=[], help="LABEL=VALUE: a dashed horizontal line")
    args = parser.parse_args(argv)
    rows = [row for text in args.point for row in read_point(*parse_point(text), args.k)]
    print(table(rows))
    if args.svg:
        references = {label: float(value) for label, _, value in (text.rpartition("=") for text in args.reference)}
        plot(rows, args.k, args.svg, args.title, references)
        print(f"plot: {args.svg}", file=sys.stderr)


if __name__ == "__main__":
    main()
