"""benchmarks/target_head.py (issue 40): the target head with and without train.cache_target_argmax, on the
product's own batches, checked against the full head."""

import re
import subprocess
import sys

from conftest import REPO

SCRIPT = REPO / "benchmarks" / "target_head.py"


def test_the_cached_head_is_timed_against_the_full_head_on_the_trainers_batches(tmp_path):
    from specgen.config import compose
    from specgen.generate import run as generate

    shards = tmp_path / "shards"
    generate(compose("generate", ["recipe=demo", "data.max_rows=20", f"output.dir={shards}",
                                  "runtime.progress=false"]))
    done = subprocess.run([sys.executable, str(SCRIPT), "--shards", str(shards), "--device", "cpu", "--batches", "3",
                           "--rounds", "1", "train.batch_tokens=256"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]  # the argmax and probabilities agree
    assert "3 batches of" in done.stdout
    rows = dict(re.findall(r"^\| (no cache|first sight|cached) \| [\d.]+ \| ([\d.]+)x \|$", done.stdout, re.M))
    assert set(rows) == {"no cache", "first sight", "cached"} and rows["no cache"] == "1.00"
