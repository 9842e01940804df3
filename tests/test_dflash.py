"""DFlash draft (specgen.methods.dflash.model): layer ids, anchors, the block attention mask, the loss's slots and targets,
training forward == serving decode, checkpoints, and one-line errors for a checkpoint of the other method."""

import json

import pytest
import torch
import transformers

from specgen import methods
from specgen.assets import ASSETS_DIR
from specgen.draft.checkpoint import save_draft
from specgen.draft.target_head import TargetDistribution
from specgen.errors import SpecgenError
from specgen.methods.dflash.model import DFlashDraft, dflash_config, vllm_eagle_aux_ids
from specgen.methods.dflash.objective import block_visibility, dflash_loss, sample_anchors, slot_weights, valid_anchors
from specgen.methods.dflash.serving import load_dflash

TARGET = ASSETS_DIR / "tiny-target"
AUX = [1, 3, 4]


@pytest.fixture(scope="module")
def target_config():
    return transformers.AutoConfig.from_pretrained(TARGET)


def tiny_draft(target_config, *, block_size=4, vocab=2048, causal=False, layers=2, seed=0) -> DFlashDraft:
    torch.manual_seed(seed)
    draft = DFlashDraft(dflash_config(target_config, aux_layers=AUX, draft_vocab_size=vocab, num_layers=layers,
                                      block_size=block_size, mask_token_id=1, causal=causal))
    if vocab < 2048:
        draft.d2t.copy_(torch.arange(vocab))  # draft id d -> target id 2d
        draft.t2d[torch.arange(vocab) * 2] = True
    else:
        draft.t2d[:] = True
    for parameter in draft.parameters():
        parameter.data.add_(0.1 * torch.randn_like(parameter))  # norms away from 1
    return draft.eval()


def test_target_layer_ids_are_specgen_aux_layers(target_config):
    """specgen aux layer i (output of decoder layer i) is DFlash's target_layer_id i; vLLM reads it as its EAGLE-3
    aux id i + 1 (the stream entering layer i + 1); tests/test_vllm_dflash.py holds this against vLLM's function."""
    config = dflash_config(target_config, aux_layers=AUX, draft_vocab_size=2048, num_layers=1, block_size=4,
                           mask_token_id=0)
    assert config.dflash_config["target_layer_ids"] == [1, 3, 4]
    assert vllm_eagle_aux_ids(config.dflash_config["target_layer_ids"]) == [2, 4, 5]
    assert config.architectures == ["DFlashDraftModel"] and config.model_type == "qwen3"
    assert DFlashDraft(config).fc.in_features == 3 * 128


def test_anchors_need_two_trained_tokens_of_one_sample():
    loss_mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 1, 1]])
    documents = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1]])
    assert valid_anchors(loss_mask, documents).long().tolist() == [[0, 1, 1, 0, 0, 1, 1, 1, 0]]
    documents = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]])  # x_2 and x_3 in different samples
    assert valid_anchors(loss_mask, documents).long().tolist() == [[0, 1, 0, 0, 0, 1, 1, 1, 0]]


def test_anchor_sampling_is_seeded_and_padded():
    valid = torch.tensor([[0, 1, 1, 1, 0, 1], [0, 0, 1, 0, 0, 0]], dtype=torch.bool)
    anchors, kept = sample_anchors(valid, 3, torch.Generator().manual_seed(0))
    again, _ = sample_anchors(valid, 3, torch.Generator().manual_seed(0))
    assert torch.equal(anchors, again) and anchors.shape == (2, 3)
    assert kept.tolist() == [[True, True, True], [True, False, False]]
    assert anchors[1].tolist() == [2, 0, 0]
    assert all(valid[0, a] for a in anchors[0]) and anchors[0].tolist() == sorted(anchors[0].tolist())


def test_block_visibility():
    """Slot (a, k) sees context 0..a-1 of a's sample and its own block; a padding block only itself."""
    documents = torch.tensor([[0, 0, 0, 1, 1, 1]])
    anchors, kept = torch.tensor([[1, 4, 0]]), torch.tensor([[True, True, False]])
    visible = block_visibility(anchors, kept, documents, 2)[0].long()
    assert visible.shape == (6, 6 + 6)
    assert visible[:, :6].tolist() == [[1, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0],  # anchor 1: context x_0
                                       [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 0, 0],  # anchor 4: x_3 only (own sample)
                                       [0] * 6, [0] * 6]                        # padding
    assert visible[:, 6:].tolist() == [[1, 1, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0],
                                       [0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 1, 1]]
    causal = block_visibility(anchors, kept, documents, 2, causal=True)[0].long()
    assert causal[:2, 6:8].tolist() == [[1, 0], [1, 1]]


def test_training_forward_equals_the_serving_decode(target_config):
    """The hidden states of a block at anchor a in the batched training forward (several anchors, two samples
    packed) equal a decode-time forward: context = target features of positions 0..a-1 only, block [x_a, M, M, M]
    at positions a..a+3 (what vLLM's proposer runs)."""
    for causal in (False, True):
        draft = tiny_draft(target_config, causal=causal)
        generator = torch.Generator().manual_seed(1)
        ids = torch.randint(3, 2048, (1, 14), generator=generator)
        aux = torch.randn(1, 14, 3 * 128, generator=generator)
        documents = torch.tensor([[0] * 8 + [1] * 6])
        positions = torch.tensor([list(range(8)) + list(range(6))])
        anchors, kept = torch.tensor([[2, 5, 10]]), torch.ones(1, 3, dtype=torch.bool)
        block_ids = torch.full((1, 3, 4), draft.mask_token_id)
        block_ids[..., 0] = ids[0, anchors[0]]
        block_positions = (positions.gather(1, anchors)[..., None] + torch.arange(4)).reshape(1, -1)
        with torch.no_grad():
            batched = draft(block_ids.reshape(1, -1), block_positions, draft.context_kv(aux, positions),
                            block_visibility(anchors, kept, documents, 4, causal=causal)).view(3, 4, -1)
            for index, (start, anchor) in enumerate(((0, 2), (0, 5), (8, 10))):
                context = draft.context_kv(aux[:, start:anchor], torch.arange(anchor - start)[None])
                position = anchor - start
                single = draft(block_ids[:, index], torch.arange(position, position + 4)[None], context,
                               torch.ones(4, anchor - start + 4, dtype=torch.bool).tril(anchor - start)[None]
                               if causal else None)
                assert torch.allclose(batched[index], single[0], atol=1e-5), (causal, anchor)


def test_the_proposer_drafts_what_one_forward_over_the_whole_context_drafts(target_config):
    """DFlashProposer (what specgen.evaluate and the probe decode through) grows the context call by call; its K
    drafts equal the argmax of slots 1..K of one forward over the full context, block [x, M x K] after it."""
    for causal in (False, True):
        draft = tiny_draft(target_config, vocab=1024, causal=causal)
        generator = torch.Generator().manual_seed(2)
        aux = torch.randn(9, 3 * 128, generator=generator)
        proposer = methods.of_model(draft).proposer(draft)
        proposer.propose(aux[:5], [7, 8, 9, 10, 11], 3)
        drafted = proposer.propose(aux[5:], [12, 13, 14, 15], 3)
        with torch.no_grad():
            visible = torch.ones(4, 13, dtype=torch.bool).tril(9)[None] if causal else None
            hidden = draft(torch.tensor([[15] + [draft.mask_token_id] * 3]), torch.arange(9, 13)[None],
                           draft.context_kv(aux[None], torch.arange(9)[None]), visible)
        assert drafted == draft.to_target_ids(draft.logits(hidden[0, 1:]).argmax(-1)).tolist(), causal


def test_loss_scores_slot_k_against_the_target_at_a_plus_k_minus_1(target_config):
    """A target distribution that is one-hot on the token id 2*t at position t: slot k of the block at anchor a is
    scored against position a+k-1 exactly where loss_mask[a+k] holds in a's sample."""
    draft = tiny_draft(target_config, vocab=1024)
    seq = 10
    probs = torch.zeros(1, seq, 1024)
    probs[0, torch.arange(seq), torch.arange(seq)] = 1.0  # draft id t = target id 2t at position t
    argmax = (2 * torch.arange(seq))[None]
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1, 1, 1]])
    documents = torch.tensor([[0] * 8 + [1] * 2])
    anchors, kept = torch.tensor([[2, 6]]), torch.ones(1, 2, dtype=torch.bool)
    out = dflash_loss(draft, torch.randint(3, 2048, (1, seq)), loss_mask, torch.randn(1, seq, 3 * 128),
                      TargetDistribution(probs, argmax), anchors=anchors, kept=kept, gamma=None,
                      document_ids=documents, drop_out_of_vocab=False)
    # anchor 2: slots 1,2 (x_3, x_4 trained), slot 3 (x_5) not; anchor 6: slot 1 (x_7), slots 2,3 are sample 1
    assert out.stats[:, 3].tolist() == [2.0, 1.0, 0.0]
    # the loss by hand: KL(one-hot || q) = -log q(draft id a+k-1) at the three scored slots, unweighted (gamma None)
    generator = torch.Generator().manual_seed(0)
    ids, aux = torch.randint(3, 2048, (1, seq), generator=generator), torch.randn(1, seq, 3 * 128, generator=generator)
    out = dflash_loss(draft, ids, loss_mask, aux, TargetDistribution(probs, argmax), anchors=anchors, kept=kept,
                      gamma=None, document_ids=documents, drop_out_of_vocab=False)
    blocks = torch.full((1, 2, 4), draft.mask_token_id)
    blocks[..., 0] = ids[0, [2, 6]]
    with torch.no_grad():
        hidden = draft(blocks.reshape(1, -1), torch.tensor([[2, 3, 4, 5, 6, 7, 8, 9]]), draft.context_kv(aux, torch.arange(seq)[None]), block_visibility(anchors, kept, documents, 4))
        log_q = torch.log_softmax(draft.logits(hidden[0]), -1)
    by_hand = -(log_q[1, 2] + log_q[2, 3] + log_q[5, 6]) / 3  # (slot, draft id = position a+k-1)
    assert out.loss.item() == pytest.approx(by_hand.item(), rel=1e-5)
    assert slot_weights(4, 4.0).tolist() == pytest.approx([0.0, 1.0, float(torch.exp(torch.tensor(-0.25))),
                                                            float(torch.exp(torch.tensor(-0.5)))])


def test_checkpoint_round_trip_and_vllm_layout(target_config, tmp_path):
    for vocab in (1024, 2048):
        draft = tiny_draft(target_config, vocab=vocab)
        folder = tmp_path / f"v{vocab}"
        save_draft(draft, folder, {"step": 3})
        config = json.loads((folder / "config.json").read_text())
        assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
        assert config["dflash_config"] == {"mask_token_id": 1, "target_layer_ids": AUX, "causal": False}
        assert config["draft_vocab_size"] == vocab and config["specgen"]["method"] == "dflash"
        from safetensors import safe_open

        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            names = set(f.keys())
        assert "embed_tokens.weight" not in names and "lm_head.weight" in names and "fc.weight" in names
        assert ("d2t" in names) == (vocab < 2048)  # vLLM has draft_id_to_target_id only for a reduced vocab
        assert "layers.1.self_attn.k_norm.weight" in names and "hidden_norm.weight" in names
        loaded = load_dflash(folder)
        for name, tensor in draft.state_dict().items():
            if name != "embed_tokens.weight":
                assert torch.equal(loaded.state_dict()[name], tensor), name
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(SpecgenError, match="checksum mismatch"):
        load_dflash(folder)


def test_a_checkpoint_of_the_other_method_is_a_one_line_error():
    """One way to tell a checkpoint's method (specgen.methods), for vLLM's layout and specgen's record alike."""
    assert methods.method_of_config({"architectures": ["DFlashDraftModel"]}) == "dflash"
    assert methods.method_of_config({"dflash_config": {}, "architectures": ["X"]}) == "dflash"
    assert methods.method_of_config({"architectures": ["LlamaForCausalLMEagle3"]}) == "eagle3"
    with pytest.raises(SpecgenError, match=r"^draft.path CKPT holds a dflash draft but draft.method=eagle3: drop "
                                           r"draft.method or pass draft.method=dflash$"):
        methods.resolve("eagle3", {"architectures": ["DFlashDraftModel"]}, "CKPT")
    with pytest.raises(SpecgenError, match=r"^draft.path CKPT holds a eagle3 draft .* draft.method=eagle3$"):
        methods.resolve("dflash", {"architectures": ["LlamaForCausalLMEagle3"]}, "CKPT")


def test_bad_dflash_settings_are_one_line_errors(target_config):
    with pytest.raises(SpecgenError, match="mask_token_id=5000 is outside"):
        dflash_config(target_config, aux_layers=AUX, draft_vocab_size=8, num_layers=1, block_size=4,
                      mask_token_id=5000)
    with pytest.raises(SpecgenError, match="block_size=1"):
        dflash_config(target_config, aux_layers=AUX, draft_vocab_size=8, num_layers=1, block_size=1,
                      mask_token_id=0)


@pytest.mark.slow
def test_a_resumed_dflash_run_ends_with_the_same_weights(tmp_path):
    """4 steps + train.resume to 8 equals 8 steps straight (the anchors are seeded by the batch, not by a counter)."""
    from specgen.config import compose
    from specgen.generate import run as generate
    from specgen.train import run as train

    quiet = ["runtime.progress=false", "runtime.threads=1"]
    generate(compose("generate", ["recipe=demo", "data.max_rows=24", f"output.dir={tmp_path / 's'}", *quiet]))
    common = ["recipe=demo", f"data.shards={tmp_path / 's'}", "draft.method=dflash", "train.num_workers=0",
              "train.tensorboard=false", "train.eval_every=0", "train.schedule_steps=8", "train.batch_tokens=256",
              *quiet]
    train(compose("train", [*common, f"output.dir={tmp_path / 'straight'}", "train.max_steps=8"]))
    train(compose("train", [*common, f"output.dir={tmp_path / 'resumed'}", "train.max_steps=4"]))
    train(compose("train", [*common, f"output.dir={tmp_path / 'resumed'}", "train.max_steps=8", "train.resume=true"]))
    straight, resumed = load_dflash(tmp_path / "straight"), load_dflash(tmp_path / "resumed")
    for name, tensor in straight.state_dict().items():
        if name != "embed_tokens.weight":  # the target's, not stored
            assert torch.equal(resumed.state_dict()[name], tensor), name


def test_export_writes_the_dflash_layout_and_refuses_eagle_formats(target_config, tmp_path):
    from safetensors.torch import load_file

    from specgen.config import compose
    from specgen.export import run as export

    save_draft(tiny_draft(target_config, vocab=1024), tmp_path / "ckpt", {"target": {"path": str(TARGET)}})
    summary = export(compose("export", [f"draft.path={tmp_path / 'ckpt'}", f"output.dir={tmp_path / 'out'}",
                                        "export.dtype=bfloat16"]))
    assert summary["method"] == "dflash" and summary["target_layer_ids"] == AUX
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["dtype"] == "bfloat16"
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    assert tensors["fc.weight"].dtype == torch.bfloat16 and "embed_tokens.weight" not in tensors
    with pytest.raises(SpecgenError, match="^a DFlash draft exports as export.format=vllm only .*; sglang holds "
                                           "EAGLE-3 drafts$"):
        export(compose("export", [f"draft.path={tmp_path / 'ckpt'}", f"output.dir={tmp_path / 'x'}",
                                  "export.format=sglang"]))
    with pytest.raises(SpecgenError, match="holds a dflash draft but draft.method=eagle3"):
        export(compose("export", [f"draft.path={tmp_path / 'ckpt'}", f"output.dir={tmp_path / 'y'}",
                                  "draft.method=eagle3"]))


def test_evaluate_warns_when_k_exceeds_the_positions_the_block_trained(target_config, tmp_path, capsys):
    """A block of 4 trains 3 draft positions: K=4 is evaluated (vLLM serves it too) with a warning naming the
    untrained position, in the summary and eval.json; K=3 has none."""
    from specgen.config import compose
    from specgen.evaluate import run as evaluate

    save_draft(tiny_draft(target_config, block_size=4), tmp_path / "ckpt", {"target": {"path": str(TARGET)}})
    reports = {k: evaluate(compose("evaluate", ["recipe=demo", f"draft.path={tmp_path / 'ckpt'}",
                                                f"evaluate.num_draft_tokens={k}", "evaluate.max_prompts=1",
                                                "evaluate.max_new_tokens=6", f"output.dir={tmp_path / f'k{k}'}",
                                                "runtime.progress=false", "runtime.threads=1"]))
               for k in (3, 4)}
    assert reports[3]["warnings"] == []
    [warning] = reports[4]["warnings"]
    assert warning.startswith("evaluate.num_draft_tokens=4 is more than the 3 draft positions this DFlash draft "
                              "trained (block_size 4): position 4 is untrained; serve it with "
                              "num_speculative_tokens <= 3")
    assert json.loads((tmp_path / "k4" / "eval.json").read_text())["warnings"] == [warning]
    assert warning in " ".join(capsys.readouterr().out.split())
    assert reports[4]["matches_target_greedy"]  # evaluated all the same: still lossless
