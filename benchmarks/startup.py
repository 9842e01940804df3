"""What a stage costs before it does any work: CPU seconds of a config error, of `--cfg job`, and of a stage's imports.

    python benchmarks/startup.py [--repeats 3] [--old CHECKOUT]

Each row is a fresh `python` process run as a user types it (`python -m specgen.STAGE ...`), measured by the CPU
seconds of the child (user + system, `resource.getrusage`) and its wall seconds; the median of --repeats runs.
--old CHECKOUT (e.g. a `git worktree` of an earlier commit) runs the same commands from that checkout too, one after
the other in this process, so the two columns are measured side by side. The config error and `--cfg job` rows are
what `specgen.config.check_command_line` answers before torch is imported; the imports row is what every job pays
before its first step (torch, transformers and the stage's code).
"""

import argparse
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COMMANDS = {
    "generate, a config error": ["-m", "specgen.generate", "data.max_lenght=5"],
    "train, a config error": ["-m", "specgen.train", "train.epoch=2"],
    "train --cfg job": ["-m", "specgen.train", "--cfg", "job", "recipe=demo", "data.shards=S"],
    "generate's imports": ["-c", "import specgen.generate"],
}


def measure(args: list[str], cwd: Path) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one `python ARGS` run from `cwd` (its own checkout on sys.path first)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--old", type=Path, help="an earlier checkout to measure beside this one")
    opts = parser.parse_args()
    trees = {"this checkout": REPO, **({"old": opts.old.resolve()} if opts.old else {})}
    print(f"| command | {' | '.join(f'{name}: CPU s (wall s)' for name in trees)} |")
    print(f"|---|{'---|' * len(trees)}")
    for label, args in COMMANDS.items():
        cells = []
        for tree in trees.values():
            runs = [measure(args, tree) for _ in range(opts.repeats)]
            cells.append(f"{statistics.median(r[0] for r in runs):.2f} ({statistics.median(r[1] for r in runs):.2f})")
        print(f"| {label} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
