"""vLLM (its CPU build) serves specgen's EAGLE-3.1 and P-EAGLE drafts as specgen.evaluate decodes them.

Each method is trained by specgen.train on the same demo shards, evaluated by specgen.evaluate, and the same prompts
are replayed in vLLM (greedy, K=4) by tests/vllm_replay.py: outputs identical to the target alone and to specgen's,
and vLLM's own spec-decode counters (drafts, accepted tokens, per position) equal to specgen.evaluate's.
P-EAGLE is served with `parallel_drafting=True` (vllm format) and from its speculators export with no flag.
"""

import json

import pytest

from conftest import vllm_replay
from specgen.config import compose
from specgen.draft.exports import vllm_speculative_config
from tests.test_vllm_serving import MAX_NEW_TOKENS, PROMPTS, QUIET, TARGET, K

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from specgen.generate import run as generate

    root = tmp_path_factory.mktemp("methods")
    generate(compose("generate", ["recipe=demo", "data.max_rows=80", f"output.dir={root / 'shards'}", *QUIET]))
    return root


def trained(root, method: str) -> dict:
    from specgen.evaluate import run as evaluate
    from specgen.train import run as train

    draft, out = root / f"draft-{method}", root / f"eval-{method}"
    train(compose("train", ["recipe=demo", f"data.shards={root / 'shards'}", f"output.dir={draft}",
                            f"draft.method={method}", "train.epochs=4", "train.num_workers=0",
                            "train.tensorboard=false", *QUIET]))
    report = evaluate(compose("evaluate", ["recipe=demo", f"draft.path={draft}", f"evaluate.num_draft_tokens={K}",
                                           f"evaluate.max_prompts={PROMPTS}", f"evaluate.max_new_tokens={MAX_NEW_TOKENS}",
                                           f"output.dir={out}", "model.dtype=float32", *QUIET]))  # exact: as vLLM's
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    return {"draft": draft, "report": report, "samples": samples, "samples_path": out / "samples.jsonl"}


def replay(root, name: str, samples_path, *args: str) -> dict:
    return vllm_replay(samples_path, root / f"vllm-{name}.json", "--k", str(K), "--max-new-tokens", str(MAX_NEW_TOKENS),
                       *args)


ALONE: dict[str, dict] = {}  # vLLM's target-alone replay, by the prompts it decoded


def target_alone(root, samples_path) -> dict:
    """vLLM's target alone on these prompts, replayed once per distinct prompt set: its greedy outputs depend on the
    prompts only, and every method here is evaluated on the same held-out prompts."""
    prompts = json.dumps([json.loads(line)["prompt_token_ids"] for line in samples_path.read_text().splitlines()])
    if prompts not in ALONE:
        ALONE[prompts] = replay(root, f"target-{len(ALONE)}", samples_path, "--target", str(TARGET))
    return ALONE[prompts]



def assert_served_as_evaluated(served: dict, alone: dict, run: dict) -> None:
    report = run["report"]
    assert report["lossless"] and report["matches_target_greedy"], report["lossless_line"]  # float32: exact
    assert served["output_token_ids"] == alone["output_token_ids"]  # lossless in vLLM
    assert served["output_token_ids"] == [sample["output_token_ids"] for sample in run["samples"]]
    assert served["num_drafts"] == report["verification_rounds"]
    assert served["num_accepted_tokens"] == report["accepted_draft_tokens"]
    assert served["acceptance_rate_per_position"] == pytest.approx(report["acceptance_rate_per_position"], abs=1e-9)


def test_vllm_serves_eagle31_as_evaluated(shards):
    run = trained(shards, "eagle3.1")
    config = json.loads((run["draft"] / "config.json").read_text())
    assert (config["fc_norm"], config["norm_output"]) == (True, True)
    served = replay(shards, "eagle3.1", run["samples_path"], "--target", str(TARGET), "--draft", str(run["draft"]))
    alone = target_alone(shards, run["samples_path"])
    assert_served_as_evaluated(served, alone, run)


def test_vllm_serves_peagle_with_parallel_drafting_as_evaluated(shards):
    from specgen.export import run as export

    run = trained(shards, "p-eagle")
    spec = vllm_speculative_config("p-eagle", run["draft"], K)  # what specgen.train's summary prints, at K
    assert spec["parallel_drafting"] is True
    served = replay(shards, "p-eagle", run["samples_path"], "--target", str(TARGET),
                    "--speculative-config", json.dumps(spec))
    alone = target_alone(shards, run["samples_path"])
    assert_served_as_evaluated(served, alone, run)
    folder = shards / "peagle-speculators"
    export(compose("export", [f"draft.path={run['draft']}", f"output.dir={folder}", "export.format=speculators",
                              f"export.speculative_tokens={K}", f"model.path={TARGET}"]))
    bare = replay(shards, "p-eagle-speculators", run["samples_path"], "--speculators", str(folder))
    assert_served_as_evaluated(bare, alone, run)
