"""`specgen.train`: offline from real shards, online with the target in the loop, checkpoints, resume."""

import json
import os
import re
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from specgen.assets import ASSETS_DIR
from specgen.config import compose
from specgen.draft.checkpoint import load_draft, read_raw_config, specgen_info
from specgen.errors import SpecgenError
from specgen.training.optim import newton_schulz_dtype
from tests.conftest import build_tiny_model
from tests.test_draft_model import PUBLISHED_NAMES, one_thread  # noqa: F401 (fixture)

ROWS = 12  # conversations of the bundled corpus used by these tests
QUICK = ["train.num_workers=0", "runtime.progress=false", "runtime.threads=1", "train.tensorboard=false",
         "train.batch_tokens=256", "train.ttt_length=3", "draft.vocab_size=300", "train.log_every=1", "train.lr=1e-3"]


def data_overrides() -> list[str]:
    return [f"data.path={ASSETS_DIR / 'chat' / 'train.jsonl'}", f"data.max_rows={ROWS}", "data.max_length=96"]


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """A tiny float32 Llama target with the bundled tokenizer (so model.path alone is enough)."""
    return build_tiny_model("llama", tmp_path_factory.mktemp("target"), vocab_size=2048, hidden_size=64,
                            tokenizer_dir=ASSETS_DIR / "tokenizer")


@pytest.fixture(scope="module")
def shards(target, tmp_path_factory) -> Path:
    from specgen.generate import run as generate

    out = tmp_path_factory.mktemp("shards")
    generate(compose("generate", [f"model.path={target}", f"output.dir={out}", "output.shard_size=5",
                                  "runtime.progress=false", "capture.count_target_tokens=true", *data_overrides()]))
    return out


def train(overrides: list[str]) -> dict:
    from specgen.train import run

    return run(compose("train", [*QUICK, *overrides]))


def metrics(ckpt: Path) -> list[dict]:
    return [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()]


def test_offline_training_writes_a_servable_checkpoint(shards, target, tmp_path):
    ckpt = tmp_path / "ckpt"
    train([f"data.shards={shards}", f"output.dir={ckpt}", "train.max_steps=3"])

    config = json.loads((ckpt / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["num_hidden_layers"] == 1 and config["vocab_size"] == 2048 and config["hidden_size"] == 64
    # default for 8 layers: outputs of layers 1, 3, 4, which vLLM numbers hidden_states[2, 4, 5]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert config["specgen"]["aux_layers"] == [1, 3, 4]
    assert config["specgen"]["aux_layer_convention"] == "layer_outputs_0based"
    assert config["specgen"]["format"] == "vllm"
    assert config["dtype"] == "float32"  # the stored weights' dtype
    assert 0 < config["draft_vocab_size"] <= 300 and config["target_hidden_size"] == 64
    assert config["specgen"]["target"]["path"] == str(target) and config["specgen"]["step"] == 3
    assert transformers.AutoConfig.from_pretrained(ckpt).draft_vocab_size == config["draft_vocab_size"]

    weights = load_file(ckpt / "model.safetensors")
    assert set(weights) == PUBLISHED_NAMES
    assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
    assert int(weights["t2d"].sum()) == config["draft_vocab_size"]
    target_ids = torch.arange(config["draft_vocab_size"]) + weights["d2t"]
    assert torch.equal(weights["t2d"].nonzero().flatten(), target_ids)  # both maps describe one vocabulary

    lines = metrics(ckpt)
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert all({"loss", "acc_0", "acc_2", "loss_2", "lr", "tokens_per_s"} <= set(line) for line in lines)
    assert all(0 <= line["acc_0"] <= 1 and line["loss"] > 0 for line in lines)

    embedding = transformers.AutoModelForCausalLM.from_pretrained(target).get_input_embeddings().weight
    draft = load_draft(ckpt, embedding=embedding.detach())
    assert all(torch.equal(draft.state_dict()[name], tensor) for name, tensor in weights.items())

    assert set(config["specgen"]["checksums"]) == {"model.safetensors"}
    data = bytearray((ckpt / "model.safetensors").read_bytes())
    data[-5] ^= 1  # one bit in the stored tensors
    (ckpt / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(SpecgenError, match="model.safetensors: checksum mismatch"):
        load_draft(ckpt, embedding=embedding.detach())


def test_training_lowers_the_loss(shards, tmp_path):
    ckpt = tmp_path / "ckpt"
    train([f"data.shards={shards}", f"output.dir={ckpt}", "train.max_steps=12", "train.lr=3e-3"])
    lines = metrics(ckpt)
    first, last = sum(line["loss"] for line in lines[:3]), sum(line["loss"] for line in lines[-3:])
    assert last < first


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_continues_exactly(shards, tmp_path, optimizer):
    """4 steps in one go == 2 steps, stop, resume to 4: same weights, same optimizer, same batches."""
    schedule = ["train.schedule_steps=4", "train.epochs=3", f"train.optimizer={optimizer}"]
    straight, pieces = tmp_path / "straight", tmp_path / "pieces"
    train([f"data.shards={shards}", f"output.dir={straight}", "train.max_steps=4", *schedule])
    train([f"data.shards={shards}", f"output.dir={pieces}", "train.max_steps=2", *schedule])
    with pytest.raises(SpecgenError, match="train.resume=true"):
        train([f"data.shards={shards}", f"output.dir={pieces}", "train.max_steps=4", *schedule])
    train([f"data.shards={shards}", f"output.dir={pieces}", "train.max_steps=4", "train.resume=true", *schedule])

    expected, got = load_file(straight / "model.safetensors"), load_file(pieces / "model.safetensors")
    assert all(torch.equal(expected[name], got[name]) for name in expected)
    assert [line["step"] for line in metrics(pieces)] == [1, 2, 3, 4]
    assert [line["loss"] for line in metrics(pieces)] == [line["loss"] for line in metrics(straight)]


KILL_AT = """import importlib, os, sys
from specgen.config import compose
module, _, path = sys.argv[1].partition(":")
*owners, name = path.split(".")
owner = importlib.import_module(module)
for part in owners:
    owner = getattr(owner, part)
original, calls = getattr(owner, name), [0]
def killed(*args, **kwargs):  # the process ends right before the nth call, as kill -9 ends it
    calls[0] += 1
    if calls[0] == int(sys.argv[2]):
        os._exit(137)
    return original(*args, **kwargs)
setattr(owner, name, killed)
from specgen.train import run
run(compose("train", sys.argv[3:]))
"""
SAVED = ["train.max_steps=4", "train.save_every=1", "train.keep_checkpoints=2", "train.schedule_steps=4",
         "train.epochs=3"]


@pytest.fixture(scope="module")
def uninterrupted(shards, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted") / "ckpt"
    train([f"data.shards={shards}", f"output.dir={out}", *SAVED])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kill_before, resumes_from", [
    ("specgen.training.strategy:DDPStrategy.save", 2),  # step 3's weights written, its optimizer not
    ("specgen.training.trainer:TrainerState.save", 2),  # weights and optimizer written, the loop state not
    ("specgen.draft.checkpoint:Checkpoints._write_latest", 3),  # renamed into place, the pointer still says step 2
    ("specgen.draft.checkpoint:Checkpoints._publish", 3),  # output.dir's draft still step 2's
    ("specgen.draft.checkpoint:Checkpoints._prune", 3),  # three checkpoints left, one too many
])
def test_a_kill_inside_a_checkpoint_save_resumes_from_the_last_complete_one(shards, uninterrupted, tmp_path,
                                                                           kill_before, resumes_from):
    """A real training process killed inside the save of step 3 (4 steps, a checkpoint every step, 2 kept); the
    resumed run ends equal to the uninterrupted one, and nothing half-written is left."""
    import subprocess
    import sys

    from tests.conftest import REPO

    out = tmp_path / "ckpt"
    overrides = [*QUICK, f"data.shards={shards}", f"output.dir={out}", *SAVED]
    killed = subprocess.run([sys.executable, "-c", KILL_AT, kill_before, "3", *overrides], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True)
    assert killed.returncode == 137, killed.stderr[-3000:]
    complete = sorted(path.name for path in (out / "checkpoints").glob("step-*") if not path.name.endswith(".tmp"))
    assert complete[-1] == f"step-{resumes_from:06d}"
    assert load_file(out / "checkpoints" / complete[-1] / "model.safetensors")  # complete: it reads
    train([f"data.shards={shards}", f"output.dir={out}", *SAVED, "train.resume=true"])

    expected, got = load_file(uninterrupted / "model.safetensors"), load_file(out / "model.safetensors")
    assert all(torch.equal(expected[name], got[name]) for name in expected)
    assert [line["loss"] for line in metrics(out)] == [line["loss"] for line in metrics(uninterrupted)]
    assert sorted(path.name for path in (out / "checkpoints").iterdir()) == ["latest", "step-000003", "step-000004"]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-000004"
    assert json.loads((out / "config.json").read_text())["specgen"]["step"] == 4


def test_a_pointer_file_left_half_committed_does_not_stop_a_resume(shards, uninterrupted, tmp_path):
    """A kill between writing `latest`'s temporary file and renaming it leaves the file `latest.tmp` (found by
    killing a disaggregated trainer at random: the cleanup treated every `*.tmp` as a folder)."""
    out = tmp_path / "ckpt"
    train([f"data.shards={shards}", f"output.dir={out}", *SAVED, "train.max_steps=2"])
    (out / "checkpoints" / "latest.tmp").write_text("step-000002")
    train([f"data.shards={shards}", f"output.dir={out}", *SAVED, "train.resume=true"])
    expected, got = load_file(uninterrupted / "model.safetensors"), load_file(out / "model.safetensors")
    assert all(torch.equal(expected[name], got[name]) for name in expected)
    assert not (out / "checkpoints" / "latest.tmp").exists()


def test_a_kill_inside_the_first_save_leaves_nothing_to_resume(shards, tmp_path):
    import subprocess
    import sys

    from tests.conftest import REPO

    out = tmp_path / "ckpt"
    overrides = [*QUICK, f"data.shards={shards}", f"output.dir={out}", *SAVED]
    killed = subprocess.run([sys.executable, "-c", KILL_AT, "specgen.training.trainer:TrainerState.save", "1",
                             *overrides], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert killed.returncode == 137
    assert [path.name for path in (out / "checkpoints").iterdir()] == ["step-000001.tmp"]
    with pytest.raises(SpecgenError, match="no complete checkpoint in checkpoints/"):
        train([f"data.shards={shards}", f"output.dir={out}", *SAVED, "train.resume=true"])
    assert not list((out / "checkpoints").iterdir())  # the half-written checkpoint is gone


def test_a_checkpoint_of_the_layout_before_checkpoints_folders_still_resumes(shards, uninterrupted, tmp_path):
    """Earlier specgen kept training_state/ beside the draft in output.dir: train.resume=true continues from it."""
    import shutil

    out = tmp_path / "ckpt"
    train([f"data.shards={shards}", f"output.dir={out}", *SAVED, "train.max_steps=2"])
    shutil.move(out / "checkpoints" / "step-000002" / "training_state", out / "training_state")
    shutil.rmtree(out / "checkpoints")
    train([f"data.shards={shards}", f"output.dir={out}", *SAVED, "train.resume=true"])
    expected, got = load_file(uninterrupted / "model.safetensors"), load_file(out / "model.safetensors")
    assert all(torch.equal(expected[name], got[name]) for name in expected)


def test_online_step_equals_offline_step_padded_or_packed(shards, target, tmp_path):
    """The same samples through the target in the loop give the loss the shards give (one batch holds all), and
    packing them into one row (train.packing) gives the loss of padded rows: the same step four ways."""
    one_batch = ["train.max_steps=1", "train.batch_tokens=1000000"]
    runs = {}
    for packing in ("false", "true"):
        offline, online = tmp_path / f"offline-{packing}", tmp_path / f"online-{packing}"
        train([f"data.shards={shards}", f"output.dir={offline}", f"train.packing={packing}", *one_batch])
        train(["mode=online", f"model.path={target}", *data_overrides(), f"output.dir={online}",
               f"train.packing={packing}", *one_batch])
        runs[offline.name], runs[online.name] = metrics(offline)[0], metrics(online)[0]
    reference = runs.pop("offline-false")
    for name, got in runs.items():
        for key in ("loss", "loss_0", "loss_1", "loss_2"):
            assert got[key] == pytest.approx(reference[key], rel=1e-5), (name, key)
        for key in ("acc_0", "acc_1", "acc_2", "tokens_seen", "trainable_positions"):
            assert got[key] == reference[key], (name, key)
    assert json.loads((tmp_path / "online-false" / "token_counts.json").read_text()) == \
        json.loads((shards / "token_counts.json").read_text())


def test_fine_tuning_reuses_the_checkpoint_vocabulary(shards, tmp_path):
    base = tmp_path / "base"
    # 20 of the random target's top tokens (100 of the data's most frequent tokens would score nothing)
    train([f"data.shards={shards}", f"output.dir={base}", "train.max_steps=1", "draft.vocab_size=20",
           "draft.vocab_source=target"])
    tuned = tmp_path / "tuned"
    train([f"data.shards={shards}", f"output.dir={tuned}", "train.max_steps=1", f"draft.init={base}",
           "draft.vocab_size=300"])
    assert torch.equal(load_file(base / "model.safetensors")["d2t"], load_file(tuned / "model.safetensors")["d2t"])


def test_fine_tuning_refuses_shards_of_other_aux_layers(shards, tmp_path):
    base = tmp_path / "base"
    train([f"data.shards={shards}", f"output.dir={base}", "train.max_steps=1"])
    config = json.loads((base / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 3, 5]  # vLLM ids: layer outputs 0, 2, 4
    config["specgen"]["aux_layers"] = [0, 2, 4]
    (base / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecgenError, match=r"aux layers \[0, 2, 4\].*\[1, 3, 4\]"):
        train([f"data.shards={shards}", f"output.dir={tmp_path / 'tuned'}", "train.max_steps=1",
               f"draft.init={base}"])


def test_user_errors_are_one_line_messages(tmp_path):
    with pytest.raises(SpecgenError, match="data.shards"):
        train([f"output.dir={tmp_path / 'x'}"])
    with pytest.raises(SpecgenError, match="model.path is required"):  # data of one's own needs one's own target
        train(["mode=online", f"data.path={ASSETS_DIR / 'chat' / 'train.jsonl'}", f"output.dir={tmp_path / 'y'}"])
    with pytest.raises(SpecgenError, match="train.optimizer=muon needs whole matrices"):
        train(["train.optimizer=muon", "distributed=zero2", f"output.dir={tmp_path / 'z'}"])
    with pytest.raises(SpecgenError, match="zero_optimization.stage=3 partitions the draft's weights"):
        train(["train.optimizer=adamw", "distributed=zero2", "distributed.deepspeed.zero_optimization.stage=3",
               f"output.dir={tmp_path / 'w'}"])
    assert not (tmp_path / "w").exists()  # refused before the run touches output.dir


@pytest.mark.parametrize("out_of_vocab", ["drop", "keep"])
def test_training_that_scores_nothing_stops_with_an_error_about_the_draft_vocabulary(shards, tmp_path, out_of_vocab):
    """The random target's top tokens lie outside the data's 50 most frequent trained tokens: nothing is scored
    (whether such positions are left out of the loss or kept in it)."""
    top = json.loads((shards / "target_token_counts.json").read_text())
    # one trainable position (t with loss_mask[t+1] = 1) per trained token
    assert sum(top["counts"].values()) == json.loads((shards / "manifest.json").read_text())["stats"]["trainable_tokens"]
    with pytest.raises(SpecgenError) as error:
        train([f"data.shards={shards}", f"output.dir={tmp_path / 'data-vocab'}", "train.max_steps=4",
               "draft.vocab_size=50", "train.log_every=2", f"train.out_of_vocab={out_of_vocab}"])
    message = str(error.value)
    assert "\n" not in message and "no trainable position was scored in the first 2 steps" in message
    assert "draft vocabulary" in message and "regenerate" in message and "draft.vocab_source=target" in message
    assert not (tmp_path / "data-vocab" / "model.safetensors").exists()  # no checkpoint of nothing

    ckpt = tmp_path / "target-vocab"
    train([f"data.shards={shards}", f"output.dir={ckpt}", "train.max_steps=2", "draft.vocab_size=50",
           "draft.vocab_source=target"])
    lines = metrics(ckpt)
    assert all(line["scored"] == 1.0 and line["trainable_positions"] > 0 and line["loss"] > 0 for line in lines)


def test_a_second_job_on_a_checkpoint_directory_is_refused(shards, tmp_path):
    from specgen.store.lease import LeaseHeld, hold_lease

    ckpt = tmp_path / "ckpt"
    with hold_lease(ckpt, stage="train"):
        with pytest.raises(LeaseHeld, match=f"output.dir {ckpt} is in use by train"):
            train([f"data.shards={shards}", f"output.dir={ckpt}", "train.max_steps=1", "output.overwrite=true"])
    assert not (ckpt / "model.safetensors").exists()


@pytest.mark.parametrize("frozen", [True, False])
def test_lm_head_starts_as_the_targets_rows_and_stays_when_frozen(shards, target, tmp_path, frozen):
    ckpt = tmp_path / "ckpt"
    train([f"data.shards={shards}", f"output.dir={ckpt}", "train.max_steps=2", "draft.init_lm_head=target",
           f"draft.freeze_lm_head={str(frozen).lower()}"])
    weights = load_file(ckpt / "model.safetensors")
    target_head = transformers.AutoModelForCausalLM.from_pretrained(target).lm_head.weight.detach()
    rows = target_head[torch.arange(len(weights["d2t"])) + weights["d2t"]]
    assert torch.equal(weights["lm_head.weight"], rows) is frozen  # trained heads move off the target's rows
    assert torch.allclose(weights["lm_head.weight"], rows, atol=0.05)  # ... but start there


def test_norm_before_residual_and_loss_mask_options_reach_the_checkpoint_and_metrics(shards, tmp_path):
    ckpt = tmp_path / "ckpt"
    train([f"data.shards={shards}", f"output.dir={ckpt}", "train.max_steps=2", "draft.norm_before_residual=true",
           "train.loss_mask=input"])
    assert json.loads((ckpt / "config.json").read_text())["norm_before_residual"] is True
    line = metrics(ckpt)[-1]
    assert 1 <= line["accept_len_sim"] <= 4 and 0 <= line["cacc_2"] <= 1
    with pytest.raises(SpecgenError, match="train.loss_mask"):  # the schema names the key
        train([f"data.shards={shards}", f"output.dir={tmp_path / 'x'}", "train.loss_mask=output"])


@pytest.fixture(scope="module")
def demo_shards(tmp_path_factory) -> Path:
    """Shards of 60 demo conversations through the bundled (trained) tiny target: a draft learns to be accepted."""
    from specgen.generate import run as generate

    out = tmp_path_factory.mktemp("demo-shards")
    generate(compose("generate", ["recipe=demo", "data.max_rows=60", f"output.dir={out}", "runtime.progress=false"]))
    return out


def test_the_acceptance_probe_decodes_like_evaluate_and_leaves_training_unchanged(demo_shards, tmp_path):
    """train.eval_every=10 adds real speculative decoding of the live draft to the metrics lines of steps 10, 20
    and the last (24); its last figure is specgen.evaluate's on the saved checkpoint (first turns, the same prompts,
    K and length), and the weights are those of the same run without it."""
    from specgen.evaluate import run as evaluate
    from specgen.train import run as run_train

    prompts = ASSETS_DIR / "chat" / "heldout.jsonl"
    common = ["recipe=demo", f"data.shards={demo_shards}", "train.max_steps=24", "train.log_every=8",
              "evaluate.max_new_tokens=32", "evaluate.num_draft_tokens=3", "model.dtype=float32",
              "train.num_workers=0", "train.tensorboard=false", "runtime.progress=false"]
    probed, plain = tmp_path / "probed", tmp_path / "plain"
    run_train(compose("train", [*common, f"output.dir={probed}", "train.eval_every=10",
                                f"train.eval_prompts={prompts}", "train.eval_max_prompts=4"]))
    run_train(compose("train", [*common, f"output.dir={plain}", "train.eval_every=0"]))

    lines = metrics(probed)
    assert [line["step"] for line in lines] == [8, 10, 16, 20, 24]  # probe steps are logged besides log_every's
    assert [("accept_len" in line) for line in lines] == [False, True, False, True, True]
    assert [line["step"] for line in metrics(plain)] == [8, 16, 24]
    assert not any("accept_len" in line for line in metrics(plain))
    expected, got = load_file(plain / "model.safetensors"), load_file(probed / "model.safetensors")
    assert all(torch.equal(expected[name], got[name]) for name in expected)

    report = evaluate(compose("evaluate", ["recipe=demo", f"draft.path={probed}", "evaluate.turns=first",
                                           "evaluate.max_prompts=4", "evaluate.max_new_tokens=32",
                                           "evaluate.num_draft_tokens=3", f"output.dir={tmp_path / 'eval'}",
                                           "model.dtype=float32",
                                           "runtime.progress=false"]))
    assert lines[-1]["accept_rounds"] == report["verification_rounds"]
    assert lines[-1]["accept_len"] == pytest.approx(report["acceptance_length"], abs=1e-12)
    assert 1 < lines[-1]["accept_len"] <= 4  # the draft is accepted: the comparison is not one of zeros
    assert all(line["accept_lossless"] == 1.0 for line in lines if "accept_len" in line)


def test_the_acceptance_probe_online_shares_the_target_in_the_loop(tmp_path):
    """Online, the probe decodes with the target that captures the batches (its layer hooks only during its own
    forwards): the same weights as without it, and the figure logged."""
    from specgen.train import run as run_train

    common = ["recipe=demo", "mode=online", "data.max_rows=16", "train.max_steps=6", "train.log_every=3",
              "evaluate.max_new_tokens=16", "train.tensorboard=false", "runtime.progress=false"]
    probed, plain = tmp_path / "probed", tmp_path / "plain"
    run_train(compose("train", [*common, f"output.dir={probed}", "train.eval_every=3",
                                f"train.eval_prompts={ASSETS_DIR / 'chat' / 'heldout.jsonl'}",
                                "train.eval_max_prompts=2"]))
    run_train(compose("train", [*common, f"output.dir={plain}", "train.eval_every=0"]))
    assert [line["accept_rounds"] > 0 for line in metrics(probed)] == [True, True]
    assert not any("accept_len" in line for line in metrics(plain))
    expected, got = load_file(plain / "model.safetensors"), load_file(probed / "model.safetensors")
    assert all(torch.equal(expected[name], got[name]) for name in expected)


def test_the_acceptance_probe_needs_its_prompts_before_anything_loads(tmp_path):
    with pytest.raises(SpecgenError, match="pass train.eval_prompts=FILE .* and/or train.heldout_samples=N"):
        train([f"output.dir={tmp_path / 'x'}", "train.eval_every=5"])
    with pytest.raises(SpecgenError, match="train.eval_prompts=.*no such file"):
        train([f"output.dir={tmp_path / 'y'}", "train.eval_every=5", f"train.eval_prompts={tmp_path / 'none'}"])


def test_the_summary_says_when_the_draft_vocabulary_is_smaller_than_asked(shards, tmp_path, capsys):
    """draft.vocab_size larger than the distinct trained tokens is clipped, and the summary says so (not only a log)."""
    train([f"data.shards={shards}", f"output.dir={tmp_path / 'ckpt'}", "train.max_steps=1", "draft.vocab_size=8192"])

    used = json.loads((tmp_path / "ckpt" / "config.json").read_text())["draft_vocab_size"]
    assert used < 8192
    out = capsys.readouterr().out
    assert f"draft.vocab_size=8,192 asked, only {used:,} distinct tokens seen, so {used:,} used" in out
    dtype = newton_schulz_dtype("cpu").name  # the default optimizer says the dtype of its iteration and why
    assert re.search(rf"optimizer +muon on \d+ hidden matrices, Newton-Schulz in {dtype} \(.+\); adamw on \d+", out)


def test_heldout_split_is_fixed_disjoint_and_kept_out_of_every_training_batch(shards):
    from specgen.store.reader import open_shards
    from specgen.training.offline import OfflineBatches
    from specgen.training.plan import BatchPlan
    from specgen.training.probe import heldout_split

    dataset = open_shards(shards)
    ids = dataset.sample_ids()
    assert len(set(ids)) == ROWS == len(ids)
    trained, held = heldout_split(ids, 4)
    assert len(held) == 4 and sorted(trained + held) == list(range(ROWS)) and heldout_split(ids, 4) == (trained, held)
    assert heldout_split(ids, 0) == (list(range(ROWS)), [])
    with pytest.raises(SpecgenError, match="leaves nothing to train"):
        heldout_split(ids, ROWS)
    for rank in range(2):  # each process's batches, over epochs: the training samples only, each once an epoch
        source = OfflineBatches(dataset, BatchPlan(batch_tokens=256, max_batch_size=None, seed=3, rank=rank,
                                                   world_size=2), indices=trained)
        for epoch in range(2):
            seen = [i for batch in source.plan.epoch(source.lengths, epoch) for i in batch]
            assert all(source.indices[i] in trained for i in seen)
    batches = list(OfflineBatches(dataset, BatchPlan(batch_tokens=10_000, max_batch_size=None, seed=0),
                                  indices=held).epoch(0))
    assert sum(len(batch.lengths) for batch in batches) == 4
    assert sorted(int(n) for batch in batches for n in batch.lengths) == sorted(dataset.lengths()[i] for i in held)


def test_heldout_split_holds_out_whole_prompts_so_no_reply_or_turn_of_them_is_trained_on():
    """Pooled replies share their prompt's id and per-turn rows add `#k`: a held-out prompt takes all its samples;
    with one sample per prompt the draw is the plain draw of N samples."""
    from specgen.training.probe import heldout_split, prompt_key

    ids = [f"p{i}" for i in range(30)] + [f"p{i}" for i in range(0, 30, 2)] + [f"q#{k}" for k in range(3)]
    for wanted in (1, 4, 9, 20):
        trained, held = heldout_split(ids, wanted)
        assert len(held) >= wanted and sorted(trained + held) == list(range(len(ids)))
        held_prompts = {prompt_key(ids[i]) for i in held}
        assert held_prompts.isdisjoint(prompt_key(ids[i]) for i in trained)
        assert len(held) - wanted < 3  # stops at the first prompt that reaches N (a prompt here has at most 3)
    assert prompt_key("q#2") == "q" and prompt_key("alpaca_7") == "alpaca_7" and prompt_key("a#b") == "a#b"
    singles = [f"s{i}" for i in range(50)]
    held = heldout_split(singles, 7)[1]
    drawn = torch.randperm(50, generator=torch.Generator().manual_seed(0))[:7]
    assert held == sorted(drawn.tolist())
    with pytest.raises(SpecgenError, match="leaves nothing to train on 4 samples of 1 prompts"):
        heldout_split(["x", "x#0", "x#1", "x"], 1)


def test_heldout_samples_are_scored_like_a_training_step_at_eval_every_and_the_last_step(shards, tmp_path, capsys):
    """train.heldout_samples=4: the draft trains on the other samples, and its vocabulary counts only theirs;
    heldout_* metrics at steps 20 and 30 (the last) and in the summary; heldout_acc_0 at the last step equals step 0's
    accuracy worked out by hand from the saved draft on those 4 samples (draft argmax == target argmax where the
    predicted token is trained)."""
    from specgen.draft.target_head import load_target_weights
    from specgen.draft.vocab import VocabMapping, count_trained_tokens
    from specgen.methods.eagle3.model import DraftKV
    from specgen.store.reader import open_shards
    from specgen.training.probe import heldout_split

    ckpt = tmp_path / "ckpt"
    train([f"data.shards={shards}", f"output.dir={ckpt}", "train.max_steps=30", "train.log_every=15",
           "train.heldout_samples=4", "train.eval_every=20", "train.lr=5e-3"])
    lines = metrics(ckpt)
    assert [line["step"] for line in lines] == [15, 20, 30]
    assert [("heldout_acc_0" in line) for line in lines] == [False, True, True]
    assert "4 held out" in capsys.readouterr().out

    dataset = open_shards(shards)
    trained, held = heldout_split(dataset.sample_ids(), 4)
    weights = load_target_weights(json.loads((shards / "manifest.json").read_text())["model"]["path"])
    draft = load_draft(str(ckpt), embedding=weights.embedding.float()).eval()

    # the draft vocabulary (every distinct trained token: draft.vocab_size is larger) comes from the trained samples
    def counted(indices):
        return set(count_trained_tokens((dataset[i]["input_ids"].tolist(), dataset[i]["loss_mask"].tolist())
                                        for i in indices))
    vocabulary = set(VocabMapping.from_d2t(draft.d2t, draft.config.vocab_size).draft_to_target.tolist())
    assert vocabulary == counted(trained) != counted(range(ROWS))
    lm_head = weights.lm_head
    hits = scored = 0
    with torch.no_grad():
        for i in held:
            row = dataset[i]
            ids, mask = row["input_ids"][None], row["loss_mask"][None]
            target_top = (row["last_hidden_state"].float() @ lm_head.float().T).argmax(-1)
            shifted = torch.cat([ids[:, 1:], ids.new_zeros(1, 1)], dim=1)
            hidden = draft(shifted, draft.project(row["aux_hidden_states"].float()[None]),
                           torch.arange(ids.shape[1])[None], DraftKV(), extend_base=True)
            guess = draft.to_target_ids(draft.logits(hidden).argmax(-1))[0]
            for index in range(ids.shape[1] - 2):
                if mask[0, index + 2]:
                    scored += 1
                    hits += int(guess[index] == target_top[index + 1])
    assert hits > 0 and lines[-1]["heldout_trainable_positions"] == scored
    # (one near-tie may fall the other way between a padded batch and a sample alone)
    assert lines[-1]["heldout_acc_0"] == pytest.approx(hits / scored, abs=1 / scored + 1e-12)


def test_heldout_samples_need_offline_shards_and_eval_every_accepts_them_alone(shards, tmp_path):
    with pytest.raises(SpecgenError, match="train.heldout_samples=2 holds out samples of data.shards"):
        train([f"output.dir={tmp_path / 'x'}", "mode=online", "train.heldout_samples=2"])
    ckpt = tmp_path / "ckpt"
    train([f"data.shards={shards}", f"output.dir={ckpt}", "train.max_steps=2", "train.heldout_samples=2",
           "train.eval_every=1"])
    assert all("heldout_loss" in line and "accept_len" not in line for line in metrics(ckpt))


def test_keep_best_publishes_the_best_probed_draft(shards, tmp_path, capsys):
    """train.keep_best=heldout_accept_len_sim, a probe every 4 steps: output.dir holds checkpoints/best, the draft
    of the probe with the highest held-out figure in metrics.jsonl (its step in config.json), and the summary names
    the step it kept."""
    ckpt = tmp_path / "ckpt"
    train([f"data.shards={shards}", f"output.dir={ckpt}", "train.max_steps=12", "train.log_every=4",
           "train.heldout_samples=4", "train.eval_every=4", "train.lr=5e-3", "train.keep_best=heldout_accept_len_sim"])
    probes = [line for line in metrics(ckpt) if "heldout_accept_len_sim" in line]
    assert [line["step"] for line in probes] == [4, 8, 12]
    best = max(probes, key=lambda line: line["heldout_accept_len_sim"])  # the first of equal figures
    assert specgen_info(read_raw_config(ckpt))["step"] == best["step"]
    for name in ("model.safetensors", "config.json"):
        assert (ckpt / name).read_bytes() == (ckpt / "checkpoints" / "best" / name).read_bytes()
    assert not list(ckpt.glob("*.tmp")), "publishing a draft twice left its temporary names in output.dir"
    summary = capsys.readouterr().out
    assert "kept draft" in summary and f"step {best['step']} of 12: heldout_accept_len_sim" in summary
    # the serve line: the vLLM speculative_config of this checkpoint, K = the TTT steps it trained (train.ttt_length=3)
    spec = {"method": "eagle3", "model": str(ckpt.resolve()), "num_speculative_tokens": 3}
    target = json.loads((shards / "manifest.json").read_text())["model"]["path"]
    assert f"vLLM: LLM(model={json.dumps(target)}, speculative_config={json.dumps(spec)})" in summary


def test_keep_best_keeps_an_earlier_draft_when_later_probes_score_lower(shards, tmp_path):
    """Through the training seam, with the probe's figure scripted (1.1, 1.5, 1.2 at steps 4, 8, 12) on top of the
    real held-out score: the draft of step 8 is the published one, byte for byte step 8's checkpoint, not the last
    one's; the loop state records it (resumed runs compare against it)."""
    from specgen.config import settings_of
    from specgen.training.setup import Process, build_training

    out = tmp_path / "seam"
    settings = settings_of("train", [*QUICK, f"data.shards={shards}", f"output.dir={out}", "train.max_steps=12",
                                     "train.log_every=4", "train.heldout_samples=4", "train.eval_every=4",
                                     "train.save_every=4", "train.keep_checkpoints=3",
                                     "train.keep_best=heldout_accept_len_sim"])
    training = build_training(settings, Process(torch.device("cpu")), out)
    real, scripted = training.trainer.probe, iter([1.1, 1.5, 1.2])
    training.trainer.probe = lambda: {**real(), "heldout_accept_len_sim": next(scripted)}
    training.fit()

    state = training.trainer.state
    assert (state.step, state.best_step, state.best_value) == (12, 8, 1.5)
    step8, step12 = out / "checkpoints" / "step-000008", out / "checkpoints" / "step-000012"
    assert (out / "model.safetensors").read_bytes() == (step8 / "model.safetensors").read_bytes()
    assert (out / "model.safetensors").read_bytes() != (step12 / "model.safetensors").read_bytes()
    assert specgen_info(read_raw_config(out))["step"] == 8
    saved = json.loads((step12 / "training_state" / "trainer_state.json").read_text())
    assert (saved["best_step"], saved["best_value"]) == (8, 1.5)


def test_keep_best_needs_the_probes_it_picks_among(shards, tmp_path):
    common = [f"data.shards={shards}", f"output.dir={tmp_path / 'x'}"]
    with pytest.raises(SpecgenError, match="^train.keep_best=heldout_acc_0 picks among the drafts probed every"):
        train([*common, "train.keep_best=heldout_acc_0", "train.heldout_samples=2"])
    with pytest.raises(SpecgenError, match="^train.keep_best=heldout_acc_0 is a figure of the held-out samples"):
        train([*common, "train.keep_best=heldout_acc_0", "train.eval_every=2",
               f"train.eval_prompts={ASSETS_DIR / 'chat' / 'heldout.jsonl'}"])
    with pytest.raises(SpecgenError, match="^train.keep_best=accept_len is the decoded acceptance"):
        train([*common, "train.keep_best=accept_len", "train.eval_every=2", "train.heldout_samples=2"])
    with pytest.raises(SpecgenError, match="^train.keep_best=loss is not one of"):
        train([*common, "train.keep_best=loss"])


def test_the_training_seam_trains_what_the_stage_trains(shards, uninterrupted, tmp_path):
    """`build_training(settings)` (what benchmarks and notebooks call) ends with the weights `specgen train` ends
    with, on the same settings: the stage adds the job around it, nothing to the training."""
    from safetensors.torch import load_file

    from specgen.config import settings_of
    from specgen.training.setup import Process, build_training

    out = tmp_path / "seam"
    settings = settings_of("train", [*QUICK, f"data.shards={shards}", f"output.dir={out}", *SAVED])
    torch.set_num_threads(settings.runtime.threads)  # as the stage does
    training = build_training(settings, Process(torch.device("cpu")), out)
    training.fit()
    assert training.trainer.state.step == 4
    ours, stage = load_file(out / "model.safetensors"), load_file(uninterrupted / "model.safetensors")
    assert ours.keys() == stage.keys() and all(torch.equal(ours[name], stage[name]) for name in ours)


def test_ddp_close_frees_the_wrapper_while_the_process_group_lives(tmp_path):
    """DDP's reducer holds the process group and is freed holding the GIL: freed after `end_training` destroyed the
    group, it would run the group's destructor, which joins gloo's threads, one of which may wait for the GIL (a
    hang at the end of a finished run, seen in CI). `close()` must free it at once."""
    import gc
    import weakref

    import torch.distributed as dist
    from torch import nn

    from specgen.training.strategy import DDPStrategy

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        gc.disable()  # only close() may collect
        model = nn.Linear(4, 4)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        strategy = DDPStrategy(model, optimizer, scheduler, device=torch.device("cpu"), world_size=2, grad_accum=1,
                               grad_clip=0.0)
        strategy.backward(strategy.forward(torch.randn(3, 4), sync=True).sum())
        strategy.update(boundary=True)
        wrapper = weakref.ref(strategy.wrapped)
        assert isinstance(wrapper(), nn.parallel.DistributedDataParallel)
        strategy.close()
        assert wrapper() is None
        assert strategy.wrapped is model
    finally:
        gc.enable()
        dist.destroy_process_group()


def test_the_target_argmax_cache_trains_as_the_full_head_does_and_resumes_exactly(shards, tmp_path, capsys):
    """train.cache_target_argmax: over three epochs the draft trains as with the full LM head at every step (the same
    figures, weights within float rounding: the probabilities come from the draft vocabulary's rows alone), each
    sample's argmax is computed once and read back in the later epochs, and a run stopped inside the second epoch
    (its cache lost) resumes to the uninterrupted run's weights exactly."""
    common = [f"data.shards={shards}", "train.epochs=3", "train.batch_tokens=512"]
    full, cached, pieces = tmp_path / "full", tmp_path / "cached", tmp_path / "pieces"
    train([*common, f"output.dir={full}", "train.cache_target_argmax=false"])
    assert "target head" not in capsys.readouterr().out
    train([*common, f"output.dir={cached}", "train.cache_target_argmax=true"])
    out = capsys.readouterr().out
    lines = metrics(cached)
    assert lines[-1]["epoch"] == 2  # three epochs
    samples = int(re.search(r"\((\d+) samples\)", out).group(1))
    assert f"of {samples} samples (each sample once); argmax read back for {2 * samples} samples" in out
    for ours, plain in zip(lines, metrics(full), strict=True):
        assert ours["loss"] == pytest.approx(plain["loss"], rel=1e-4)
        assert ours["acc_0"] == pytest.approx(plain["acc_0"], abs=1e-6)
    expected, got = load_file(full / "model.safetensors"), load_file(cached / "model.safetensors")
    assert all(torch.allclose(expected[name], got[name], atol=1e-4) for name in expected)

    per_epoch = sum(line["epoch"] == 0 for line in lines)
    schedule = [*common, "train.cache_target_argmax=true", f"train.schedule_steps={len(lines)}"]
    train([*schedule, f"output.dir={pieces}", f"train.max_steps={per_epoch + 1}"])
    train([*schedule, f"output.dir={pieces}", f"train.max_steps={len(lines)}", "train.resume=true"])
    expected, got = load_file(cached / "model.safetensors"), load_file(pieces / "model.safetensors")
    assert all(torch.equal(expected[name], got[name]) for name in expected)


def test_tensorboard_auto_logs_when_installed_and_says_so(shards, tmp_path, capsys):
    """train.tensorboard=auto (the default) logs into output.dir/tensorboard where the package is installed (the dev
    extra has it) and the summary names the folder."""
    pytest.importorskip("tensorboard")
    ckpt = tmp_path / "ckpt"
    train([f"data.shards={shards}", f"output.dir={ckpt}", "train.max_steps=2", "train.tensorboard=auto"])
    assert list((ckpt / "tensorboard").rglob("events.out.tfevents.*"))
    assert re.search(r"tensorboard\s+" + re.escape(str(ckpt / "tensorboard")), capsys.readouterr().out)


def test_tensorboard_without_the_package(monkeypatch, shards, tmp_path, capsys):
    """Without a TensorBoard writer installed (a plain `pip install specgen`): auto trains without logging and says so
    in the summary; true fails before anything loads, naming the key; false is off."""
    import accelerate.utils

    from specgen.train import tensorboard_on

    monkeypatch.setattr(accelerate.utils, "is_tensorboard_available", lambda: False)
    assert tensorboard_on("auto") is False and tensorboard_on(False) is False
    with pytest.raises(SpecgenError, match=r"train\.tensorboard=true needs the tensorboard package"):
        train([f"data.shards={shards}", f"output.dir={tmp_path / 'refused'}", "train.tensorboard=true"])
    assert not (tmp_path / "refused").exists()
    ckpt = tmp_path / "ckpt"
    train([f"data.shards={shards}", f"output.dir={ckpt}", "train.max_steps=1", "train.tensorboard=auto"])
    assert not (ckpt / "tensorboard").exists()
    assert "off (train.tensorboard=auto: the tensorboard package is not installed" in capsys.readouterr().out


@pytest.mark.parametrize("shards, message", [(None, "offline training needs data.shards=DIR"),
                                             ("missing", "data.shards={path} does not exist: pass a specgen output "
                                                         "directory or one shard file")])
def test_offline_training_without_its_shards_fails_before_taking_output_dir(shards, message, tmp_path):
    """No data.shards, or one that is not there: a one-line error naming the key, and output.dir is left untouched
    (no lease, no TensorBoard folder)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    given = [] if shards is None else [f"data.shards={tmp_path / shards}"]
    with pytest.raises(SpecgenError, match=re.escape(message.format(path=tmp_path / str(shards)))):
        train([*given, f"output.dir={ckpt}", "train.tensorboard=auto"])
    assert not any(ckpt.iterdir())
