"""benchmarks/gpu_limit.py, the one GPU benchmark command (issue 40): its FLOP counts, how it reads the stages'
own figures, and its tiny CPU mode end to end (slow: five stage processes)."""

import json
import subprocess
import sys

import pytest
import transformers

from conftest import DATASETS, REPO, TOKENIZERS, load_script, require_shared

SCRIPT = REPO / "benchmarks" / "gpu_limit.py"


@pytest.fixture(scope="module")
def bench():
    return load_script(SCRIPT)


def test_the_8b_forward_costs_about_14_gflop_per_token(bench):
    config = transformers.LlamaConfig(vocab_size=bench.VOCAB, **bench.SHAPES["8b"])
    weights, attention = bench.target_flops_per_token(config, [200, 200])
    assert 13.9e9 < weights < 14.0e9  # 2 x 6.98B decoder-layer weights (issue 40: about 14 GFLOP per token)
    assert attention == 2 * 32 * 32 * 128 * 200  # 2 x layers x heads x head_dim x sum(L^2) / sum(L)


def test_training_speed_leaves_out_the_first_window(bench, tmp_path):
    windows = [{"step": 2, "tokens_per_s": 100.0, "tokens_seen": 1000, "loss": 9.0},
               {"step": 4, "tokens_per_s": 500.0, "tokens_seen": 2000, "loss": 8.0},
               {"step": 6, "tokens_per_s": 250.0, "tokens_seen": 3000, "loss": 7.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(w) + "\n" for w in windows))
    got = bench.train_figures(tmp_path)
    assert got["tokens"] == 2000 and got["seconds"] == pytest.approx(6.0)
    assert got["tokens_per_s"] == pytest.approx(2000 / 6) and got["steps"] == 6 and got["loss"] == 7.5


@pytest.mark.slow  # 1.5-2.5 minutes on 2 cores: a target, three generate runs, two training runs (five processes)
def test_tiny_cpu_mode_runs_every_stage_and_prints_one_table(tmp_path):
    require_shared(TOKENIZERS["llama-3.1"])
    require_shared(DATASETS["alpaca"])
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--shape", "tiny", "--rows", "16",
                           "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = (tmp_path / "table.md").read_text()
    for label in ("bare HF decoder stack", "generate, default settings", "generate, capture.prefix_reuse=false",
                  "generate, no reuse, output.codec=fp8", "train offline", "train online"):
        assert f"| {label}" in table
    assert "capture.prefix_reuse=auto on cpu" in table  # the default run says how auto decided
    assert "target forward = 2 x decoder-layer matmul weights" in table and "draft training = 6 x" in table
    results = json.loads((tmp_path / "results.json").read_text())
    assert all(run["tokens_per_s"] > 0 and run["flops_per_token"] > 0 for run in results["runs"])
    assert results["draft_matmul_params"] > 0
