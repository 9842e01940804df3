"""Disaggregated training with a vLLM engine as one capture server and the HF capture as the other (CPU build).

vLLM's states match the HF forward to float32 rounding (tests/test_vllm.py), not bit for bit, so the run is checked
against online training of the same samples with a tolerance.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO
from specgen.assets import ASSETS_DIR
from specgen.config import compose

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TARGET = ASSETS_DIR / "tiny-target"  # the bundled target (head size 32, as vLLM's CPU attention wants) and its sample
QUICK = ["runtime.progress=false", "runtime.threads=1", "train.tensorboard=false", "train.num_workers=0",
         "train.batch_tokens=1024", "train.ttt_length=3", "draft.vocab_size=500", "train.log_every=1",
         "train.lr=1e-3", "train.max_steps=12", "data.max_length=512", "data.max_rows=24"]
SERVER = ["runtime.threads=1", "stream.poll_s=0.01", "stream.stale_s=2"]  # heartbeats every 0.33 s


def server(stream: Path, model: Path, name: str, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "specgen.capture_server", f"stream.dir={stream}",
                             f"model.path={model}", f"stream.server_id={name}", *SERVER, *extra], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def captured(stream: Path, name: str) -> int:
    try:
        return json.loads((stream / "servers" / f"{name}.json").read_text()).get("captured", 0)
    except (OSError, ValueError):
        return 0


def test_a_vllm_server_killed_mid_run_and_an_hf_server_that_joins_feed_one_trainer(tmp_path):
    """The vLLM server delivers the first batches and is killed with -9; an HF server joins and finishes the run
    (taking over the claim the vLLM server held, if any): every batch trained once, as online training does."""
    from specgen.train import run as train

    stream = tmp_path / "stream"
    common = [*QUICK, f"model.path={TARGET}", f"data.path={ASSETS_DIR / 'chat' / 'train.jsonl'}"]
    started = [server(stream, TARGET, "vllm", "engine=vllm", "engine.distributed_executor_backend=uni")]
    try:
        trainer = subprocess.Popen([sys.executable, "-m", "specgen.train", *common, "mode=disaggregated",
                                    f"stream.dir={stream}", "stream.window=1", f"output.dir={tmp_path / 'ckpt'}"],
                                   cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        started.append(trainer)
        deadline = time.monotonic() + 300
        while captured(stream, "vllm") < 2:  # the engine is up and has delivered
            assert time.monotonic() < deadline and trainer.poll() is None, "the vLLM server delivered nothing"
            time.sleep(0.05)
        started[0].kill()  # one process (engine.distributed_executor_backend=uni): nothing of it is left
        started[0].wait()
        started.append(server(stream, TARGET, "hf"))
        out, _ = trainer.communicate(timeout=600)
        assert trainer.returncode == 0, out[-3000:]
        hf_summary = started[2].communicate(timeout=120)[0]
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
    stream_line = next(line for line in out.splitlines() if line.strip().startswith("stream"))
    by_server = dict(re.findall(r"(vllm|hf): (\d+)", stream_line))
    assert int(by_server["vllm"]) >= 2 and int(by_server["hf"]) >= 1, stream_line
    assert int(by_server["vllm"]) + int(by_server["hf"]) == 12  # one batch per step, each once
    assert "captured" in hf_summary

    train(compose("train", [*common, "mode=online", f"output.dir={tmp_path / 'online'}"]))
    got, want = load_file(tmp_path / "ckpt" / "model.safetensors"), load_file(tmp_path / "online" / "model.safetensors")
    # Muon turns float32-rounding differences of the states into updates that differ by ~2e-4 after 6 steps of
    # lr 1e-3 (measured); the losses agree to ~5e-6 relative.
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-3, msg=name)
    losses = [[json.loads(line)["loss"] for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
              for run in ("ckpt", "online")]
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)
