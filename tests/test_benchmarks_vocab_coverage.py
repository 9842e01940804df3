"""benchmarks/vocab_coverage.py: the share of the tokens the target wrote that a draft vocabulary contains, read from a
draft's d2t and from what specgen.train would choose on the same token counts."""

import json

import pytest
import torch
from safetensors.torch import save_file

from conftest import REPO, load_script
from specgen.draft.vocab import build_vocab_mapping, write_token_counts

SCRIPT = REPO / "benchmarks" / "vocab_coverage.py"
COUNTS = {3: 50, 7: 40, 9: 30, 11: 20, 12: 10}  # trained tokens of a 16-token target vocabulary


@pytest.fixture(scope="module")
def coverage():
    return load_script(SCRIPT)


def test_shares_of_the_targets_tokens_in_a_drafts_vocabulary_and_at_each_size(coverage, tmp_path, capsys):
    served = tmp_path / "served"
    served.mkdir()
    # 10 tokens written: 3 x4, 7 x2, 11 x1, 5 x3 (5 never trained)
    (served / "target.json").write_text(json.dumps({"output_token_ids": [[3, 3, 7, 5, 11], [3, 5, 5, 7, 3]]}))
    shards = tmp_path / "shards"
    shards.mkdir()
    write_token_counts(shards / "token_counts.json", COUNTS, 16)
    draft = tmp_path / "draft"
    draft.mkdir()
    mapping = build_vocab_mapping(COUNTS, 16, 2)  # {3, 7}, as train writes it: d2t beside the weights
    save_file({"d2t": mapping.d2t, "fc.weight": torch.zeros(2, 2)}, str(draft / "model.safetensors"))

    coverage.main(["--served", str(served), "--draft", str(draft), "--counts", str(shards / "token_counts.json"),
                   "--sizes", "1", "3", "99"])
    out = capsys.readouterr().out
    assert "target's tokens: 10 (4 distinct)" in out
    assert "| draft draft | 2 | 0.6000 |" in out  # 3 and 7
    assert "| shards: draft.vocab_size=1 | 1 | 0.4000 |" in out  # 3
    assert "| shards: draft.vocab_size=3 | 3 | 0.6000 |" in out  # 3, 7, 9
    assert "| shards: draft.vocab_size=99 | 5 | 0.7000 |" in out  # clipped to the 5 trained tokens: + 11
    assert "| shards: every trained token | 5 | 0.7000 |" in out


def test_a_folder_without_the_targets_tokens_is_refused(coverage, tmp_path):
    with pytest.raises(SystemExit, match="served_acceptance.py --out"):
        coverage.main(["--served", str(tmp_path), "--counts", str(tmp_path / "token_counts.json")])
