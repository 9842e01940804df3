"""Two processes on CPU (gloo) under `accelerate launch`: DDP and DeepSpeed ZeRO-2, offline and online.

A data-parallel step over 2 processes must equal one process accumulating the same 2 batches: the batch plan gives
process r the batches r, r+2, ..., which are exactly the pairs a single process with train.grad_accum=2 sums.
"""

import os

import pytest
import torch
from safetensors.torch import load_file

from conftest import accelerate_launch, run_launched
from specgen.assets import ASSETS_DIR
from tests.test_train import QUICK, data_overrides, metrics, shards, target, train  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow


def launch_two(overrides: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = run_launched(accelerate_launch("specgen.train", *QUICK, *overrides), env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def optimizer_for(distributed: str) -> list[str]:
    """ZeRO partitions matrices, which Muon (the default optimizer) needs whole: DeepSpeed runs train with AdamW."""
    return ["train.optimizer=adamw"] if distributed == "zero2" else []


@pytest.mark.parametrize("distributed", ["ddp", "zero2"])
def test_two_processes_equal_one_process_accumulating(distributed, shards, tmp_path):  # noqa: F811
    """... with the acceptance probe on the main process at step 1, which log_every=2 alone would not log: every
    process must log (all-reduce) there too, and the probe must not change the weights."""
    steps = ["train.max_steps=2", "train.schedule_steps=2", *optimizer_for(distributed)]
    probe = ["train.log_every=2", "train.eval_every=1", f"train.eval_prompts={ASSETS_DIR / 'chat' / 'heldout.jsonl'}",
             "train.eval_max_prompts=2", "evaluate.max_new_tokens=8"]
    launch_two([f"data.shards={shards}", f"output.dir={tmp_path / 'two'}", f"distributed={distributed}", *steps,
                *probe])
    train([f"data.shards={shards}", f"output.dir={tmp_path / 'one'}", "train.grad_accum=2", *steps])

    two, one = load_file(tmp_path / "two" / "model.safetensors"), load_file(tmp_path / "one" / "model.safetensors")
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-4, atol=1e-6, msg=name)
    lines_two, lines_one = metrics(tmp_path / "two"), metrics(tmp_path / "one")
    assert [line["step"] for line in lines_two] == [1, 2]
    assert all(line["accept_rounds"] > 0 for line in lines_two)
    assert [line["tokens_seen"] for line in lines_two] == [line["tokens_seen"] for line in lines_one]
    assert lines_two[-1]["loss"] == pytest.approx(lines_one[-1]["loss"], rel=1e-4)


@pytest.mark.parametrize("distributed", ["ddp", "zero2"])
def test_two_processes_online(distributed, target, tmp_path):  # noqa: F811
    launch_two(["mode=online", f"model.path={target}", *data_overrides(), f"output.dir={tmp_path / 'ckpt'}",
                f"distributed={distributed}", "train.max_steps=2", *optimizer_for(distributed)])
    assert [line["step"] for line in metrics(tmp_path / "ckpt")] == [1, 2]
    assert (tmp_path / "ckpt" / "checkpoints" / "step-000002" / "training_state").is_dir()


def test_zero2_resume(shards, tmp_path):  # noqa: F811
    """ZeRO-2 partitions the optimizer state; resuming restores every partition. Both processes write their
    partitions into the step's staging folder, which the main process renames once all are written."""
    schedule = ["distributed=zero2", "train.schedule_steps=4", "train.epochs=3", *optimizer_for("zero2")]
    launch_two([f"data.shards={shards}", f"output.dir={tmp_path / 'straight'}", "train.max_steps=4", *schedule])
    launch_two([f"data.shards={shards}", f"output.dir={tmp_path / 'pieces'}", "train.max_steps=2", *schedule])
    launch_two([f"data.shards={shards}", f"output.dir={tmp_path / 'pieces'}", "train.max_steps=4",
                "train.resume=true", "train.save_every=1", *schedule])
    checkpoints = tmp_path / "pieces" / "checkpoints"
    assert sorted(path.name for path in checkpoints.iterdir()) == ["latest", "step-000003", "step-000004"]
    partitions = {path.name for path in (checkpoints / "step-000004" / "training_state" / "deepspeed").iterdir()}
    assert {name for name in partitions if "optim_states" in name} == {
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"}
    straight = load_file(tmp_path / "straight" / "model.safetensors")
    pieces = load_file(tmp_path / "pieces" / "model.safetensors")
    for name in straight:
        torch.testing.assert_close(pieces[name], straight[name], rtol=1e-5, atol=1e-7, msg=name)
