"""engine=vllm on real vLLM (CPU build) against engine=hf, on tiny Llama and Qwen3 targets with the real tokenizers
and chat templates: shard rows, prefix-cache gap fill, engine log-probs, pooled states, resume after kill -9, bad rows,
config-time refusals, and regeneration (vLLM greedy = HF greedy in float32).

vLLM runs in a subprocess (`python -m specgen.<stage>`: vLLM spawns workers and wants a `__main__` guard); the HF
references run in this process. Tiny models use head size 32 (vLLM's CPU attention wants 32/64/128).
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, TOKENIZERS, build_tiny_model, require_shared
from specgen import open_shards
from specgen.config import compose
from specgen.errors import SpecgenError

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

COMMON = ["runtime.progress=false", "output.shard_size=3"]
# One process (no engine-core or worker processes): a kill -9 leaves nothing running, and the engine starts faster.
IN_PROCESS = ["engine.distributed_executor_backend=uni"]
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


def write_data(path: Path) -> Path:
    """Conversations, most sharing a ~300-token system prompt (several 128-token cache blocks), some multi-turn,
    plus two bad rows (reported in rejected.jsonl)."""
    rng = random.Random(0)
    system = "You are a careful assistant. " + " ".join(rng.choice(WORDS) for _ in range(300))
    lines = []
    for i in range(12):
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 25)))
        answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 25)))
        messages = ([{"role": "system", "content": system}] if i % 4 != 3 else []) + [
            {"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        if i % 3 == 1:
            messages += [{"role": "user", "content": "more " + question}, {"role": "assistant", "content": answer}]
        lines.append(json.dumps({"id": f"r{i}", "messages": messages}))
    lines.insert(4, "{not json")
    lines.insert(9, json.dumps({"id": "noassistant", "messages": [{"role": "user", "content": "only me"}]}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_data(tmp_path_factory.mktemp("data") / "chat.jsonl")


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """Tiny Llama (float32, 8 layers, head size 32) with the Llama 3.1 tokenizer and template."""
    return build_tiny_model("llama", tmp_path_factory.mktemp("llama"), vocab_size=128256, hidden_size=128,
                            tokenizer_dir=require_shared(TOKENIZERS["llama-3.1"]))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Path:
    """Tiny Qwen3 (bfloat16, 8 layers, head size 32) with the Qwen3 tokenizer and template."""
    return build_tiny_model("qwen3", tmp_path_factory.mktemp("qwen3"), vocab_size=151936, hidden_size=128,
                            head_dim=32, dtype=torch.bfloat16, tokenizer_dir=require_shared(TOKENIZERS["qwen3"]))


def vllm_cmd(stage: str, *overrides: str) -> list[str]:
    return [sys.executable, "-m", f"specgen.{stage}", "engine=vllm", *overrides]


def vllm_env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def run_vllm(stage: str, *overrides: str, in_process: bool = True) -> None:
    env = vllm_env() if in_process else {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(vllm_cmd(stage, *overrides, *(IN_PROCESS if in_process else [])), cwd=REPO, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


def run_hf(stage: str, *overrides: str) -> dict:
    from specgen.generate import run as generate
    from specgen.regenerate import run as regenerate

    return {"generate": generate, "regenerate": regenerate}[stage](compose(stage, list(overrides)))


def rows_by_id(out_dir: Path) -> dict[str, dict]:
    dataset = open_shards(out_dir)
    return {row["sample_id"]: row for row in (dataset[i] for i in range(len(dataset)))}


def shard_members(out_dir: Path) -> list[list[str]]:
    return [sorted(open_shards(path)[i]["sample_id"] for i in range(len(open_shards(path))))
            for path in sorted(out_dir.glob("shard-*.arrow"))]


def assert_rows_close(got: dict, want: dict, *, tol: float) -> None:
    assert got.keys() == want.keys()
    for sample_id, row in got.items():
        ref = want[sample_id]
        assert torch.equal(row["input_ids"], ref["input_ids"]) and torch.equal(row["loss_mask"], ref["loss_mask"])
        for name in ("aux_hidden_states", "last_hidden_state", "pooled_hidden_state", "token_logprobs"):
            if name in ref:
                torch.testing.assert_close(row[name].float(), ref[name].float(), rtol=tol, atol=tol, equal_nan=True,
                                           msg=lambda m: f"{sample_id} {name}: {m}")


GENERATE_LLAMA = ["capture.aux_layers=[0,3,7]", "output.store_prefix_once=true", "capture.pooled=mean_trainable"]


@pytest.fixture(scope="module")
def llama_vllm(llama, data, tmp_path_factory) -> Path:
    """engine=vllm generate on the tiny Llama with prefix caching on (the uninterrupted dataset)."""
    out = tmp_path_factory.mktemp("vllm") / "out"
    run_vllm("generate", f"model.path={llama}", f"data.path={data}", f"output.dir={out}", *COMMON, *GENERATE_LLAMA)
    return out


def test_llama_float32_rows_equal_hf_with_prefix_cache_gap_fill(llama, data, llama_vllm, tmp_path):
    hf = tmp_path / "hf"
    manifest = run_hf("generate", f"model.path={llama}", f"data.path={data}", f"output.dir={hf}", *COMMON,
                      *GENERATE_LLAMA)
    got = json.loads((llama_vllm / "manifest.json").read_text())
    # Cached prefixes were not recomputed, yet every row equals the HF forward of the whole row (tight in float32).
    assert got["prefix_reuse"]["tokens_computed"] < got["prefix_reuse"]["tokens_emitted"]
    assert_rows_close(rows_by_id(llama_vllm), rows_by_id(hf), tol=1e-4)
    assert shard_members(llama_vllm) == shard_members(hf)
    assert got["capture"]["backend"] == "vllm" and got["last_run"]["engine"] == "vllm"
    assert got["model"] == manifest["model"] and got["capture"]["aux_layers"] == [0, 3, 7]
    assert got["stats"]["tokens"] == manifest["stats"]["tokens"] and got["layout"] == "prefix_refs"
    assert (llama_vllm / "rejected.jsonl").read_text() == (hf / "rejected.jsonl").read_text() != ""
    # Nothing per request is left on disk: the output holds the dataset's files only (and the CLI's Hydra log). The
    # target's top-token counts need its LM head in this process, which engine=vllm does not load (a warning says so).
    assert {p.name for p in llama_vllm.iterdir()} - {"generate.log"} == {p.name for p in hf.iterdir()} - {
        "target_token_counts.json"}


def test_llama_resume_after_kill_gives_the_uninterrupted_dataset(llama, data, llama_vllm, tmp_path):
    out = tmp_path / "interrupted"
    cmd = vllm_cmd("generate", f"model.path={llama}", f"data.path={data}", f"output.dir={out}", *COMMON,
                   *GENERATE_LLAMA, *IN_PROCESS)
    proc = subprocess.Popen(cmd, cwd=REPO, env=vllm_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 900
    while not list(out.glob("shard-*.arrow")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "manifest.json").exists()
    killed_with = len(list(out.glob("shard-*.arrow")))
    assert 0 < killed_with < 5
    run_vllm("generate", f"model.path={llama}", f"data.path={data}", f"output.dir={out}", *COMMON, *GENERATE_LLAMA)
    assert_rows_close(rows_by_id(out), rows_by_id(llama_vllm), tol=1e-5)
    assert shard_members(out) == shard_members(llama_vllm)
    assert (out / "rejected.jsonl").read_text() == (llama_vllm / "rejected.jsonl").read_text()


def test_kill_9_of_a_multiprocess_vllm_job_leaves_no_process(tmp_path):
    """kill -9 of `specgen generate engine=vllm` with vLLM's own processes (engine core, workers: the default
    multiprocessing, executor mp) mid-run: within seconds none of the job's processes is left (specgen's watchdog
    ends them; before it, EngineCore and Worker were reparented to init and kept running)."""
    from specgen.runtime.reaper import descendants, start_time

    out = tmp_path / "out"  # the bundled tiny target on the bundled chat sample: the embedded default
    cmd = vllm_cmd("generate", f"output.dir={out}", "runtime.progress=false", "output.shard_size=2",
                   "data.max_rows=1000", "data.max_length=1024", "engine.distributed_executor_backend=mp")
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    recorded: dict[int, str] = {}
    try:
        deadline = time.time() + 600
        while not list(out.glob("shard-*.arrow")):  # the engine is up and capturing
            assert proc.poll() is None and time.time() < deadline, "the job ended before its first shard"
            time.sleep(0.05)
        recorded = descendants([proc.pid])
        names = {Path(f"/proc/{pid}/comm").read_text().strip() for pid in recorded if Path(f"/proc/{pid}").exists()}
        assert len(recorded) >= 3, names  # engine core, worker, specgen's watchdog (and vLLM's helpers)
        assert proc.poll() is None, "the job finished before it could be killed mid-run"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert not (out / "manifest.json").exists()
        deadline = time.time() + 30
        while alive := [pid for pid, start in recorded.items() if start_time(pid) == start]:
            assert time.time() < deadline, f"left running after kill -9 of the job: {alive} of {names}"
            time.sleep(0.1)
    finally:
        proc.kill()
        for pid, start in recorded.items():
            if start_time(pid) == start:
                os.kill(pid, signal.SIGKILL)


def test_qwen3_bfloat16_rows_and_logprobs_equal_hf(qwen3, data, tmp_path):
    """bf16 within a few bf16 steps; token_logprobs from vLLM's prompt log-probs; the engine in its own processes."""
    overrides = [f"model.path={qwen3}", f"data.path={data}", *COMMON, "capture.token_logprobs=true",
                 "capture.pooled=mean", "data.chat_template_kwargs={enable_thinking:false}"]
    run_vllm("generate", *overrides, f"output.dir={tmp_path / 'vllm'}", in_process=False)
    run_hf("generate", *overrides, f"output.dir={tmp_path / 'hf'}")
    got, want = rows_by_id(tmp_path / "vllm"), rows_by_id(tmp_path / "hf")
    assert_rows_close(got, want, tol=5e-2)
    for sample_id, row in got.items():  # bf16 steps are relative: also compare the mean error
        ref = want[sample_id]
        assert (row["aux_hidden_states"].float() - ref["aux_hidden_states"].float()).abs().mean() < 5e-3
        assert abs(float(row["mean_logprob"]) - float(ref["mean_logprob"])) < 2e-2


def test_a_dataset_started_with_hf_does_not_resume_with_vllm(llama, data, tmp_path):
    """Shards of two engines never mix: the resume refuses in one line naming the key."""
    out = tmp_path / "out"
    run_hf("generate", f"model.path={llama}", f"data.path={data}", f"output.dir={out}", "data.max_rows=3", *COMMON)
    done = subprocess.run(vllm_cmd("generate", f"model.path={llama}", f"data.path={data}", f"output.dir={out}",
                                   "data.max_rows=3", *COMMON, *IN_PROCESS), cwd=REPO, env=vllm_env(),
                          capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith(f"error: output.dir={out} holds a dataset made with a different configuration "
                            "(changed: capture.backend, engine.name)"), error
    assert json.loads((out / "manifest.json").read_text())["capture"]["backend"] == "llama"


@pytest.mark.parametrize("override, message", [
    ("capture.logits=topk", "capture.logits=topk is not available with engine=vllm"),
    ("capture.logprob_temperature=0.5", "capture.logprob_temperature=0.5"),
    ("capture.prefill_chunk_tokens=64", "engine.max_num_batched_tokens"),
])
def test_options_vllm_cannot_produce_exactly_are_refused_at_config_time(llama, data, tmp_path, override, message):
    from specgen.generate import run

    cfg = compose("generate", [f"model.path={llama}", f"data.path={data}", f"output.dir={tmp_path / 'out'}",
                               "engine=vllm", "capture.token_logprobs=true", override, *COMMON])
    started = time.time()
    with pytest.raises(SpecgenError, match=message):
        run(cfg)
    assert time.time() - started < 60  # refused before an engine starts


def regenerate_on_both(tmp_path: Path, overrides: list[str]) -> None:
    """Regenerate with engine=vllm into tmp_path/vllm and engine=hf into tmp_path/hf; both write the same parts."""
    run_vllm("regenerate", *overrides, f"output.dir={tmp_path / 'vllm'}")
    run_hf("regenerate", *overrides, f"output.dir={tmp_path / 'hf'}")
    parts = sorted(p.name for p in (tmp_path / "hf").glob("part-*.jsonl"))
    assert parts and parts == sorted(p.name for p in (tmp_path / "vllm").glob("part-*.jsonl"))
    for name in parts:
        assert (tmp_path / "vllm" / name).read_text() == (tmp_path / "hf" / name).read_text()


def test_regenerate_vllm_greedy_equals_hf_greedy_float32(llama, data, tmp_path):
    overrides = [f"model.path={llama}", f"data.path={data}", "runtime.progress=false", "output.shard_size=4",
                 "regenerate.temperature=0", "regenerate.max_new_tokens=8"]
    regenerate_on_both(tmp_path, overrides)
    got, want = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("vllm", "hf"))
    assert got["stats"] == want["stats"] and got["stats"]["new_tokens"] > 0
    assert got["generation"]["backend"].startswith("vllm")


def test_regenerate_vllm_sampled_row_does_not_depend_on_the_rows_beside_it(llama, data, tmp_path):
    """engine=vllm submits a conversation's next turn as soon as its previous one is back (continuous batching) and
    seeds each request from the part's seed and the request's source row, message and draw: a re-run writes the same
    parts, and a row's sampled turns are the same when the other rows of its part change and one fewer follows (so
    its second turn is no longer the same request of its depth, nor the same step of the engine)."""
    changed = tmp_path / "changed.jsonl"
    lines = data.read_text().splitlines()
    assert json.loads(lines[1])["id"] == "r1" and len(json.loads(lines[1])["messages"]) == 5  # two turns
    changed.write_text("\n".join([*lines[:2], *(line.replace(" beta", " beta beta") for line in lines[2:-1])]) + "\n")
    overrides = [f"model.path={llama}", "runtime.progress=false", "output.shard_size=16",
                 "regenerate.temperature=1.0", "regenerate.max_new_tokens=8"]
    for source, name in ((data, "a"), (data, "b"), (changed, "c")):
        run_vllm("regenerate", *overrides, f"data.path={source}", f"output.dir={tmp_path / name}")
    parts = {name: [json.loads(line) for line in (tmp_path / name / "part-00000.jsonl").read_text().splitlines()]
             for name in "abc"}
    assert parts["a"] == parts["b"]
    assert [row["id"] for row in parts["a"][:2]] == ["r0", "r1"] and parts["a"][:2] == parts["c"][:2]
    assert len(parts["c"]) == len(parts["a"]) - 1
    assert [row["messages"] for row in parts["a"][2:-1]] != [row["messages"] for row in parts["c"][2:]]
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["generation"]["seeding"].startswith("each request seeded with derived_seed(")


def test_regenerate_vllm_stops_a_looping_turn_where_it_loops_and_writes_what_hf_writes(llama, data, tmp_path):
    """engine=vllm aborts a turn at the token that makes it loop (regenerate.on_loop=drop here; resample alike): the
    turn's row is dropped as when the turn runs to max_new_tokens, which engine=hf does. Greedy float32, so both must
    write the same parts and the same rejections; vLLM generates fewer tokens, the difference in the stopped turns."""
    overrides = [f"model.path={llama}", f"data.path={data}", "runtime.progress=false", "output.shard_size=4",
                 "regenerate.temperature=0", "regenerate.max_new_tokens=32", "regenerate.loop_ngram=1",
                 "regenerate.loop_repeats=9"]  # this random model repeats a token 16-26 times in most turns, 6-8 in 2
    regenerate_on_both(tmp_path, overrides)
    rejected = [(tmp_path / d / "rejected.jsonl").read_text() for d in ("vllm", "hf")]
    assert rejected[0] == rejected[1]
    got, want = (json.loads((tmp_path / d / "manifest.json").read_text())["stats"] for d in ("vllm", "hf"))
    assert want["dropped"].get("loop") and want["rows"], "the turns must mix loops and others"
    assert got["loop_stopped_turns"] == got["loop_turns"] == want["loop_turns"] and want["loop_stopped_turns"] == 0
    assert got["new_tokens"] < want["new_tokens"] and got["truncated_turns"] < want["truncated_turns"]
    assert got["rows"] == want["rows"] and got["dropped"] == want["dropped"]


def test_sampled_regeneration_on_a_cpu_prefills_every_prompt_whole():
    """vLLM's CPU worker rewinds a seeded request's generator after a split prefill step, which a CPU generator refuses
    ('CPU Generator does not use offset': SmolLM2, 200 rows, engine=vllm, sampled, died in its first part). Sampled
    regeneration there turns chunked prefill off; greedy (no seeds) and an explicit engine.extra setting keep theirs."""
    from specgen.regen.engine import Sampling
    from specgen.regen.vllm import cpu_seeded_kwargs

    sampled, greedy = (Sampling(temperature=t, top_p=1.0, top_k=0, max_new_tokens=8) for t in (0.7, 0.0))
    assert cpu_seeded_kwargs(sampled, {"max_num_seqs": 8}) == {"enable_chunked_prefill": False}
    assert cpu_seeded_kwargs(greedy, {}) == {}
    assert cpu_seeded_kwargs(sampled, {"enable_chunked_prefill": True}) == {}


def test_regenerate_vllm_within_the_model_positions(tmp_path):
    """The bundled 2048-position target with data.max_length=2048 and max_new_tokens=48: the engine gets
    max_model_len 2048 (not 2096, which vLLM refuses), and a prompt over 2000 tokens is rejected and counted,
    exactly as engine=hf does it."""
    from test_regenerate import TINY_TARGET, long_prompt_source

    source = long_prompt_source(tmp_path / "chat.jsonl", (2000, 2048))
    overrides = [f"model.path={TINY_TARGET}", f"data.path={source}", "runtime.progress=false",
                 "regenerate.temperature=0", "regenerate.max_new_tokens=48"]
    run_vllm("regenerate", *overrides, f"output.dir={tmp_path / 'vllm'}")
    run_hf("regenerate", *overrides, f"output.dir={tmp_path / 'hf'}")
    got, want = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("vllm", "hf"))
    assert got["stats"]["rejected"] == want["stats"]["rejected"] == {"prompt_too_long": 1}
    assert got["generation"]["max_prompt_tokens"] == want["generation"]["max_prompt_tokens"] == 2000
    assert got["stats"]["rows"] == want["stats"]["rows"] == 2
