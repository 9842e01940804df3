"""Draft vocabulary mapping (d2t / t2d) and the LM-head-only target distribution, against a real HF forward."""

import logging

import pytest
import torch
import transformers

from specgen.draft.target_head import TargetHead, load_target_weights
from specgen.draft.vocab import (
    VocabMapping,
    build_vocab_mapping,
    count_trained_tokens,
    read_token_counts,
    write_token_counts,
)
from specgen.errors import SpecgenError
from tests.test_draft_model import one_thread  # noqa: F401 (fixture)


def test_keeps_the_most_frequent_trained_tokens_in_target_id_order():
    counts = {7: 50, 3: 10, 9: 10, 1: 99, 4: 2}
    mapping = build_vocab_mapping(counts, target_vocab_size=12, draft_vocab_size=3)
    assert mapping.draft_to_target.tolist() == [1, 3, 7]  # 1, 7, then the tie 3 vs 9 goes to the lower id
    assert mapping.d2t.tolist() == [1, 2, 5]  # target = draft + d2t[draft]
    assert (torch.arange(3) + mapping.d2t).tolist() == [1, 3, 7]
    assert mapping.t2d.nonzero().flatten().tolist() == [1, 3, 7]
    assert mapping.t2d.shape == (12,) and mapping.t2d.dtype == torch.bool


def test_clips_to_the_tokens_seen_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="specgen.draft"):
        mapping = build_vocab_mapping({5: 1, 2: 3, 8: 0}, target_vocab_size=10, draft_vocab_size=32000)
    assert mapping.draft_to_target.tolist() == [2, 5]
    assert "hold only 2 distinct tokens" in caplog.text


def test_rejects_counts_from_another_tokenizer():
    with pytest.raises(SpecgenError, match="outside the target vocabulary"):
        build_vocab_mapping({3: 1, 100: 1}, target_vocab_size=10, draft_vocab_size=2)


def test_d2t_round_trip_and_damage_detection():
    mapping = build_vocab_mapping({i: 100 - i for i in range(0, 40, 3)}, 64, 8)
    again = VocabMapping.from_d2t(mapping.d2t, 64)
    assert torch.equal(again.draft_to_target, mapping.draft_to_target)
    with pytest.raises(SpecgenError, match="increasing"):
        VocabMapping.from_d2t(torch.tensor([5, 0, 0]), 64)
    with pytest.raises(SpecgenError, match="another target"):
        VocabMapping.from_d2t(mapping.d2t, 20)


def test_counts_only_loss_masked_tokens_and_round_trips_the_file(tmp_path):
    counts = count_trained_tokens([([4, 5, 5, 6], [0, 1, 1, 0]), ([5, 6, 7], [1, 1, 1])])
    assert dict(counts) == {5: 3, 6: 1, 7: 1}
    write_token_counts(tmp_path / "token_counts.json", counts, vocab_size=10)
    assert read_token_counts(tmp_path / "token_counts.json") == ({5: 3, 6: 1, 7: 1}, 10)


@pytest.mark.parametrize("tied", [False, True])
def test_lm_head_alone_rebuilds_the_target_distribution(tmp_path, tied):
    """Embedding and LM head read from the safetensors files equal the model's; the chunked, vocabulary-restricted
    distribution equals the Hugging Face forward's logits."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    weights = load_target_weights(tmp_path)
    assert torch.equal(weights.embedding, model.get_input_embeddings().weight)
    assert torch.equal(weights.lm_head, model.get_output_embeddings().weight)

    input_ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        out = model(input_ids=input_ids, output_hidden_states=True)
    last_hidden_state = out.hidden_states[-1]  # HF's last entry is the post-norm state the head reads
    mapping = build_vocab_mapping({i: 1 + i % 5 for i in range(64)}, 64, 20)
    needed = torch.rand(2, 9) < 0.7
    target = TargetHead(weights.lm_head, mapping, chunk_tokens=4).distribution(last_hidden_state, needed)
    expected = torch.softmax(out.logits[..., mapping.draft_to_target], dim=-1)
    torch.testing.assert_close(target.probs[needed], expected[needed], rtol=1e-5, atol=1e-6)
    assert torch.equal(target.argmax[needed], out.logits.argmax(-1)[needed])
    assert (target.argmax[~needed] == -1).all() and (target.probs[~needed] == 0).all()


def test_missing_weights_are_a_clear_error(tmp_path):
    with pytest.raises(SpecgenError, match="config.json"):
        load_target_weights(tmp_path)
