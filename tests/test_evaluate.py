"""Speculative decoding is lossless against the target's own greedy decoding, and acceptance is counted right."""

import json

import pytest
import torch
import transformers

from specgen.assets import ASSETS_DIR
from specgen.config import compose
from specgen.data.prompts import read_prompts
from specgen.draft.checkpoint import save_draft
from specgen.draft.speculative import TargetRunner, greedy_generate, speculative_generate
from specgen.methods.eagle3.model import Eagle3Draft, draft_config
from tests.conftest import DATASETS, build_tiny_model, require_shared
from tests.test_draft_model import one_thread  # noqa: F401 (fixture)

AUX = [1, 3, 4]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("target"), vocab_size=2048, hidden_size=64,
                            tokenizer_dir=ASSETS_DIR / "tokenizer")


def load(target_dir) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


def random_draft(model: transformers.PreTrainedModel, draft_to_target: list[int], seed: int = 0) -> Eagle3Draft:
    torch.manual_seed(seed)
    draft = Eagle3Draft(draft_config(model.config, aux_layers=AUX, draft_vocab_size=len(draft_to_target),
                                     norm_before_residual=False))
    draft.d2t.copy_(torch.tensor(draft_to_target) - torch.arange(len(draft_to_target)))
    draft.t2d[draft_to_target] = True
    draft.embed_tokens.weight.data.copy_(model.get_input_embeddings().weight)
    return draft.eval()


@pytest.mark.parametrize("num_draft_tokens", [1, 3])
def test_speculative_output_equals_greedy_output(target_dir, num_draft_tokens):
    model = load(target_dir)
    runner = TargetRunner(model, AUX)
    draft = random_draft(model, list(range(0, 2048, 2)))
    torch.manual_seed(1)
    for length in (3, 11):
        prompt = torch.randint(3, 2048, (length,)).tolist()
        reference = greedy_generate(runner, prompt, max_new_tokens=20, eos_ids={2})
        result = speculative_generate(runner, draft, prompt, num_draft_tokens=num_draft_tokens, max_new_tokens=20,
                                      eos_ids={2})
        assert result.tokens == reference.tokens
        assert sum(result.rounds_emitted) == len(result.tokens) - 1  # the first token comes from the prefill
        assert all(0 <= a <= num_draft_tokens for a in result.accepted)


def test_target_runner_hooks_the_layers_only_during_its_own_forwards(target_dir):
    """A target shared with online training's capture must run there without the runner's hooks."""
    from transformers import DynamicCache

    model = load(target_dir)
    runner = TargetRunner(model, AUX)
    layers = model.get_decoder().layers
    logits, aux = runner.forward([5, 6, 7], DynamicCache())
    assert aux.shape == (3, len(AUX) * model.config.hidden_size) and logits.shape[0] == 3
    assert not any(layer._forward_hooks for layer in layers)
    with torch.inference_mode():
        states = model(input_ids=torch.tensor([[5, 6, 7]]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(aux, torch.cat([states[layer + 1][0] for layer in AUX], dim=-1))


def test_acceptance_is_counted_per_verification_round(target_dir):
    """A target whose LM head is zero always picks token 0 (argmax of ties); a draft whose head is zero always
    proposes its draft id 0. Mapped to target 0, every draft token is accepted (K+1 per round); mapped to
    target 1, none is (1 per round)."""
    model = load(target_dir)
    torch.nn.init.zeros_(model.lm_head.weight)
    runner = TargetRunner(model, AUX)
    k, rounds = 3, 4
    for first_target_id, expected in ((0, k + 1), (1, 1)):
        draft = random_draft(model, [first_target_id, 5, 9])
        torch.nn.init.zeros_(draft.lm_head.weight)
        max_new = 1 + rounds * expected  # the prefill's token, then `rounds` full rounds
        result = speculative_generate(runner, draft, [5, 6, 7], num_draft_tokens=k, max_new_tokens=max_new,
                                      eos_ids={2})
        assert result.tokens == [0] * max_new
        assert result.accepted == [expected - 1] * rounds
        assert result.rounds_emitted == [expected] * rounds


def sample(accepted: list[int], emitted: list[int], category: str = "all") -> dict:
    return {"id": category, "category": category, "turn": 0, "new_tokens": 1 + sum(emitted), "rounds": len(accepted),
            "accepted": accepted, "emitted_per_round": emitted, "matches_target_greedy": True,
            "seconds_speculative": 1.0, "seconds_greedy": 1.0, "greedy_tokens": 1 + sum(emitted)}


def test_acceptance_length_is_one_plus_accepted_per_round():
    """vLLM's definition: 1 + accepted / rounds; the last round of a turn may emit fewer tokens than it accepted
    (cut at the end of the turn), which only the separately named emitted_tokens_per_round sees."""
    from specgen.evaluate import summarize

    k = 4
    samples = [sample([4, 0, 2], [5, 1, 1], "a"),  # last round accepted 2 but the turn ended after 1 token
               sample([1, 3], [2, 4], "b")]
    report = summarize(samples, num_draft_tokens=k, near_tie_tolerance=8.0)
    assert report["acceptance_length"] == pytest.approx(1 + 10 / 5)
    assert report["emitted_tokens_per_round"] == pytest.approx(13 / 5)
    # vLLM's num_accepted_tokens_per_pos / num_drafts: rounds that accepted at least j + 1 drafts
    assert report["acceptance_rate_per_position"] == pytest.approx([4 / 5, 3 / 5, 2 / 5, 1 / 5])
    assert report["accepted_histogram"] == [1, 1, 1, 1, 1] and report["accepted_draft_tokens"] == 10
    assert report["per_category"]["a"]["acceptance_length"] == pytest.approx(1 + 6 / 3)
    assert report["per_category"]["b"]["acceptance_rate_per_position"] == pytest.approx([1, 0.5, 0.5, 0])


def test_evaluate_stage_on_mt_bench_prompts(target_dir, tmp_path):
    from specgen.evaluate import run

    model = load(target_dir)
    draft = random_draft(model, list(range(1024)))
    ckpt = tmp_path / "draft"
    save_draft(draft, ckpt, {"target": {"path": str(target_dir)}, "aux_layers": AUX})
    mt_bench = require_shared(DATASETS["mt_bench"])
    report = run(compose("evaluate", [f"draft.path={ckpt}", f"data.path={mt_bench}", "evaluate.max_prompts=3",
                                           "evaluate.max_new_tokens=12", f"output.dir={tmp_path / 'eval'}",
                                           "runtime.progress=false", "runtime.threads=1"]))
    written = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert written == json.loads(json.dumps(report))
    assert written["matches_target_greedy"] is True and written["num_prompts"] == 3  # float32: exact
    assert written["lossless"] and written["near_tie_turns"] == [] and written["failed_turns"] == []
    assert written["num_turns"] == 6  # MT-Bench questions have two turns
    assert 1.0 <= written["acceptance_length"] <= 5.0
    assert set(written["per_category"]) == {json.loads(line)["category"]
                                            for line in mt_bench.read_text().splitlines()[:3]}
    samples = [json.loads(line) for line in (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()]
    assert sum(s["rounds"] for s in samples) == written["verification_rounds"]
    accepted = sum(sum(s["accepted"]) for s in samples)
    assert written["acceptance_length"] == pytest.approx(1 + accepted / written["verification_rounds"])
    assert len(written["acceptance_rate_per_position"]) == 4
    assert all(s["output_token_ids"][:1] and len(s["prompt_token_ids"]) == s["prompt_tokens"] for s in samples)


def test_prompts_from_conversations_use_their_user_turns(tmp_path):
    rows = [{"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"},
                                          {"from": "human", "value": "bye"}, {"from": "gpt", "value": "ok"}]},
            {"question_id": 7, "category": "math", "turns": ["1+1?"]}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    prompts = list(read_prompts(str(path)))
    assert [(p.id, p.category, p.user_turns) for p in prompts] == [("a", "all", ["hi", "bye"]),
                                                                    ("7", "math", ["1+1?"])]


def without_timings(report: dict) -> dict:
    return {key: value for key, value in report.items() if key != "tokens_per_s"}


def test_evaluate_resumes_after_a_kill_with_the_same_result(target_dir, tmp_path):
    """Each prompt is journaled as it finishes; a re-run skips the finished ones (a line cut by the kill is dropped)
    and writes the eval.json of an uninterrupted run; other settings in that output.dir are refused."""
    from specgen.errors import SpecgenError
    from specgen.evaluate import PROGRESS, run

    model = load(target_dir)
    ckpt = tmp_path / "draft"
    save_draft(random_draft(model, list(range(1024))), ckpt, {"target": {"path": str(target_dir)}, "aux_layers": AUX})
    mt_bench = require_shared(DATASETS["mt_bench"])

    def evaluate(out, *extra):
        return run(compose("evaluate", [f"draft.path={ckpt}", f"data.path={mt_bench}", "evaluate.max_prompts=3",
                                        "evaluate.max_new_tokens=8", f"output.dir={out}", "runtime.progress=false",
                                        "runtime.threads=1", *extra]))

    whole = evaluate(tmp_path / "whole")
    journal = (tmp_path / "whole" / PROGRESS).read_text().splitlines(keepends=True)
    assert len(journal) == 1 + 3 and "settings" in json.loads(journal[0])
    killed = tmp_path / "killed"
    killed.mkdir()
    (killed / PROGRESS).write_text("".join(journal[:2]) + journal[2][:40])  # prompt 0 done, prompt 1 half-written

    resumed = evaluate(killed)

    assert without_timings(resumed) | {"draft": None} == without_timings(whole) | {"draft": None}
    lines = [json.loads(line) for line in (killed / PROGRESS).read_text().splitlines()]
    assert [line.get("index") for line in lines] == [None, 0, 1, 2]
    assert lines[1] == json.loads(journal[1])  # prompt 0 was not decoded again
    with pytest.raises(SpecgenError, match="other settings"):
        evaluate(killed, "evaluate.num_draft_tokens=2")


def test_evaluate_killed_mid_run_resumes_to_the_same_result(target_dir, tmp_path):
    """A real SIGKILL once some prompts are journaled: the re-run keeps them (not decoded again) and its eval.json
    equals an uninterrupted run's (wall-clock tokens/s aside)."""
    import signal
    import subprocess
    import sys
    import time

    from specgen.evaluate import PROGRESS, run
    from tests.conftest import REPO

    model = load(target_dir)
    ckpt = tmp_path / "draft"
    save_draft(random_draft(model, list(range(1024))), ckpt, {"target": {"path": str(target_dir)}, "aux_layers": AUX})
    args = [f"draft.path={ckpt}", f"data.path={require_shared(DATASETS['mt_bench'])}", "evaluate.max_prompts=12",
            "evaluate.max_new_tokens=48", "runtime.progress=false", "runtime.threads=1"]
    whole = run(compose("evaluate", [*args, f"output.dir={tmp_path / 'whole'}"]))

    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "specgen.evaluate", *args, f"output.dir={out}"], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while (not (out / PROGRESS).exists() or len((out / PROGRESS).read_text().splitlines()) < 3) \
            and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    journaled = (out / PROGRESS).read_text().splitlines()
    assert 3 <= len(journaled) < 1 + 12 and not (out / "eval.json").exists(), "the kill must land mid-run"

    resumed = run(compose("evaluate", [*args, f"output.dir={out}"]))

    assert without_timings(resumed) | {"draft": None} == without_timings(whole) | {"draft": None}
    assert (out / PROGRESS).read_text().splitlines()[:len(journaled) - 1] == journaled[:-1]  # kept, not redone
