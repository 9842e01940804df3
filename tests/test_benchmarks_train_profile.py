"""benchmarks/train_profile.py (issue 40: where a training step's time goes): the product's own step, timed by phase
and by op, on the CPU here (the same command runs on a GPU from benchmarks/gpu_limit.sh)."""

import json
import subprocess
import sys

from conftest import REPO, load_script

SCRIPT = REPO / "benchmarks" / "train_profile.py"


def test_ops_are_sorted_into_kinds_by_name():
    bench = load_script(SCRIPT)
    assert bench.kind_of("aten::mm") == bench.kind_of("aten::addmm") == "matmul"
    assert bench.kind_of("aten::_log_softmax_backward_data") == "softmax and loss"
    assert bench.kind_of("aten::index_select") == bench.kind_of("aten::nonzero") == "indexing"
    assert bench.kind_of("aten::fill_") == bench.kind_of("aten::cat") == "copies"
    assert bench.kind_of("aten::mul") == bench.kind_of("aten::_foreach_lerp_") == "elementwise and reductions"
    assert bench.kind_of("aten::as_strided") == "other"


def test_the_profile_times_every_phase_of_the_trainers_own_step(tmp_path):
    from specgen.config import compose
    from specgen.generate import run as generate

    shards = tmp_path / "shards"
    generate(compose("generate", ["recipe=demo", "data.max_rows=30", f"output.dir={shards}",
                                  "runtime.progress=false"]))
    done = subprocess.run([sys.executable, str(SCRIPT), "--shards", str(shards), "--device", "cpu", "--warmup", "1",
                           "--steps", "2", "--profile-steps", "1", "--out", str(tmp_path / "out"),
                           "train.batch_tokens=512", "train.ttt_length=2"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    profile = json.loads((tmp_path / "out" / "profile.json").read_text())
    phases = profile["phases_s"]
    assert set(phases) == {"data", "target head", "forward", "backward", "optimizer", "rest"}
    assert all(phases[name] > 0 for name in ("data", "target head", "forward", "backward", "optimizer"))
    assert abs(sum(phases.values()) - profile["step_s"]) < 1e-6 * max(1.0, profile["step_s"])  # rest: the remainder
    assert 0 < profile["tokens_per_step"] <= 512
    assert profile["kinds_s"]["matmul"] > 0 and profile["ops_per_step"] > 0
    assert profile["overrides"] == ["train.batch_tokens=512", "train.ttt_length=2"]
    table = (tmp_path / "out" / "table.md").read_text()
    assert "| target head |" in table and "| matmul |" in table and "aten::mm" in table
