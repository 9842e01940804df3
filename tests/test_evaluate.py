"""Speculative decoding is lossless against the target's own greedy decoding, and acceptance is counted right."""

import json

import pytest
import torch
import transformers

from specgen.assets import ASSETS_DIR
from specgen.config import compose
from specgen.draft.checkpoint import save_draft
from specgen.draft.model import Eagle3Draft, draft_config
from specgen.draft.speculative import TargetRunner, greedy_generate, speculative_generate
from specgen.evaluate import read_prompts
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
    draft = Eagle3Draft(draft_config(model.config, aux_layers=AUX, draft_vocab_size=len(draft_to_target)))
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
    assert written["matches_target_greedy"] is True and written["num_prompts"] == 3
    assert written["num_turns"] == 6  # MT-Bench questions have two turns
    assert 1.0 <= written["acceptance_length"] <= 5.0
    assert set(written["per_category"]) == {json.loads(line)["category"]
                                            for line in mt_bench.read_text().splitlines()[:3]}
    samples = [json.loads(line) for line in (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()]
    assert sum(s["rounds"] for s in samples) == written["verification_rounds"]


def test_prompts_from_conversations_use_their_user_turns(tmp_path):
    rows = [{"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"},
                                          {"from": "human", "value": "bye"}, {"from": "gpt", "value": "ok"}]},
            {"question_id": 7, "category": "math", "turns": ["1+1?"]}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    prompts = list(read_prompts(str(path)))
    assert [(p.id, p.category, p.user_turns) for p in prompts] == [("a", "all", ["hi", "bye"]),
                                                                    ("7", "math", ["1+1?"])]
