"""The target-written conversations kept in the repository (`benchmarks/data/smollm2-135m`, issue #42's data-size
curve) are what their README says: every part intact against its sidecar's checksum, read whole as a source, each
row the target's answers to the recipe prompt mix's row with its id (its user turns, or the first of them where
regeneration cut a long conversation, kept as they are)."""

import json

import pytest

from conftest import REPO, SHARED, require_shared
from specgen.assets.smollm2 import write_prompt_mix
from specgen.data import Conversation, iter_records, normalize
from specgen.data.sources import capped_source
from specgen.regen.parts import finished_parts, read_sidecar

KEPT = REPO / "benchmarks" / "data" / "smollm2-135m"
# A folder whose first part is still being written (a regeneration running in this checkout) is not kept yet
FOLDERS = sorted({path.parent for path in KEPT.glob("*/part-*.json")})


def user_turns(conversation: Conversation) -> list[str]:
    return [message["content"] for message in conversation.messages if message["role"] == "user"]


def answers(conversation: Conversation) -> list[str]:
    """The assistant turns that regeneration rewrites: a tool call's turn is kept as the source has it."""
    return [message["content"] for message in conversation.messages
            if message["role"] == "assistant" and not message.get("tool_calls")]


@pytest.mark.parametrize("folder", FOLDERS, ids=[folder.name for folder in FOLDERS])
def test_a_kept_dataset_is_intact_and_answers_the_recipe_prompts(folder, tmp_path):
    prompts_file = tmp_path / "prompts.jsonl"
    write_prompt_mix(prompts_file, require_shared(SHARED / "datasets"))
    prompts = [record.record for record in iter_records(prompts_file)]
    by_id = {(row.get("id") or f"row-{index}"): index for index, row in enumerate(prompts)}
    parts = finished_parts(folder)
    assert parts and sorted(parts) == list(range(len(parts))), "parts are kept in order, from the first"
    sidecars = [read_sidecar(folder, unit) for unit in sorted(parts)]
    rows = [record.record for record in capped_source(folder, None).records]  # checks every part's checksum
    assert len(rows) == sum(sidecar["stats"]["rows"] for sidecar in sidecars)
    assert len({row["id"] for row in rows}) == len(rows)  # one reply per prompt in a folder
    held = sum(sidecar["stats"]["source_rows"] for sidecar in sidecars)
    written, same = 0, []
    for row in rows:
        index = by_id[row["id"]]
        assert index < held
        mine, source = normalize(row), normalize(prompts[index])
        asked = user_turns(mine)  # a row cut where a prompt grew past data.max_length keeps its first turns
        assert asked and asked == user_turns(source)[:len(asked)], row["id"]
        wrote = answers(mine)
        assert wrote, row["id"]  # every row has an answer the target wrote
        written += len(wrote)
        same += [answer for answer, theirs in zip(wrote, answers(source)) if answer == theirs]
    # The target's own answers, not the source's: one may equal the source's only where the answer is short and
    # determined by the question ("She is not doing the task."; "The average of the numbers you provided is 15.").
    assert all(len(answer) <= 120 for answer in same), same
    assert len(same) <= written // 100, f"{len(same)} of {written} answers are the source's"
    run = json.loads((folder / "run.json").read_text())["identity"]
    assert run["output.shard_size"] == 128 and run["data"]["path"] == "outputs/grow/prompts.jsonl"
