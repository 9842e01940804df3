"""One DFlash training step of specgen equals speculators 0.9's DFlashDraftModel.forward on a fixed batch: the same
loss and the same gradient on every weight both train (speculators is installed `--no-deps` in vLLM's venv).

Both get the same weights, the same packed batch (three samples) and the same anchors: speculators draws its anchors
with `select_anchors` (torch.randperm), specgen with its own seeded sampler, so the test hands speculators specgen's
anchors by replacing that one sampling function (the model, its mask, its loss are speculators' own code).
speculators' anchors need only a trained token and keep clear of the row's last block_size positions; the anchors
used here satisfy both trainers' rules. Its targets come from `verifier_norm` + `verifier_lm_head` over the target's
final-norm INPUT; specgen's shards hold the final-norm output, so the batch carries both (the same target logits).
"""

import pytest
import torch
import transformers

from specgen.assets import ASSETS_DIR
from specgen.draft.batch import batch_target, collate
from specgen.draft.target_head import TargetHead
from specgen.draft.vocab import VocabMapping
from specgen.methods.dflash.model import DFlashDraft, dflash_config
from specgen.methods.dflash.objective import dflash_loss, sample_anchors, valid_anchors

pytestmark = pytest.mark.vllm  # runs in vLLM's venv, where speculators is installed

TARGET = ASSETS_DIR / "tiny-target"
BLOCK, GAMMA, MASK = 4, 4.0, 1


def speculators_model(draft: DFlashDraft, lm_head_rows: torch.Tensor, target_model):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import DFlashSpeculatorConfig
    from speculators.models.dflash.core import DFlashDraftModel
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    layer = transformers.Qwen3Config(**{k: v for k, v in draft.config.to_dict().items()
                                        if k not in ("architectures", "dflash_config", "block_size")})
    layer._attn_implementation = "eager"  # flex attention wants a compiler on CPU
    config = DFlashSpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=draft.config.draft_vocab_size, block_size=BLOCK,
        aux_hidden_state_layer_ids=draft.config.dflash_config["target_layer_ids"], mask_token_id=MASK,
        speculators_config=SpeculatorsConfig(
            algorithm="dflash", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=BLOCK - 1)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=str(TARGET), architectures=["LlamaForCausalLM"])))
    model = DFlashDraftModel(config)
    missing, unexpected = model.load_state_dict({k: v for k, v in draft.state_dict().items()}, strict=False)
    assert not unexpected, unexpected
    assert set(missing) == {"verifier_lm_head.weight", "verifier_norm.weight"}, missing
    model.verifier_lm_head.weight.data.copy_(lm_head_rows)
    model.verifier_norm.weight.data.copy_(target_model.model.norm.weight.detach())
    return model.float().train()


def packed_samples(target_model, lengths=(13, 17, 15), seed: int = 1) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for n in lengths:
        pre_norm = 3 * torch.randn(n, 128, generator=generator)
        samples.append({"input_ids": torch.randint(3, 2048, (n,), generator=generator),
                        "aux_hidden_states": torch.randn(n, 3 * 128, generator=generator),
                        "pre_norm": pre_norm, "last_hidden_state": target_model.model.norm(pre_norm).detach(),
                        "loss_mask": (torch.arange(n) >= 4).long()})
    return samples


def test_a_dflash_training_step_equals_speculators(monkeypatch):
    import speculators.models.dflash.core as core
    from speculators.losses import eager

    target_model = transformers.AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32)
    embedding, lm_head = target_model.get_input_embeddings().weight.detach(), target_model.lm_head.weight.detach()
    torch.manual_seed(0)
    draft = DFlashDraft(dflash_config(target_model.config, aux_layers=[1, 3, 4], draft_vocab_size=1024, num_layers=2,
                                      block_size=BLOCK, mask_token_id=MASK))
    draft.d2t.copy_(torch.arange(1024))  # draft id d -> target id 2d
    draft.t2d[torch.arange(1024) * 2] = True
    for parameter in draft.parameters():
        parameter.data.add_(0.1 * torch.randn_like(parameter))  # norms away from 1: a misplaced norm shows
    draft.embed_tokens.weight.data.copy_(embedding)
    draft.init_lm_head_from_target(lm_head)
    draft.lm_head.weight.requires_grad_(False)  # speculators freezes it too
    model = speculators_model(draft, lm_head[draft.t2d], target_model)

    samples = packed_samples(target_model)
    batch = collate(samples, pad_id=0, packed=True)
    total = batch.input_ids.shape[1]
    valid = valid_anchors(batch.loss_mask, batch.document_ids)
    valid[:, total - BLOCK:] = False  # speculators keeps anchors out of the row's last block
    anchors, kept = sample_anchors(valid, max_anchors=10, generator=torch.Generator().manual_seed(3))
    assert kept.all() and anchors.shape[1] == 10

    monkeypatch.setattr(core, "select_anchors", lambda loss_mask, n, block_size: (anchors[0], kept[0]))
    _, their_loss, _ = model(hidden_states=batch.aux_hidden_states, input_ids=batch.input_ids,
                             loss_mask=batch.loss_mask.bool(), document_ids=batch.document_ids,
                             position_ids=batch.position_ids,
                             verifier_last_hidden_states=torch.cat([s["pre_norm"] for s in samples])[None],
                             max_anchors=10, gamma=GAMMA, loss_config={"kl_div": (eager.kl_div_loss, 1.0)})
    their_loss.backward()
    theirs = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}

    head = TargetHead(lm_head, VocabMapping(torch.arange(1024) * 2, 2048))
    out = dflash_loss(draft, batch.input_ids, batch.loss_mask, batch.aux_hidden_states, batch_target(head, batch),
                      anchors=anchors, kept=kept, gamma=GAMMA, position_ids=batch.position_ids,
                      document_ids=batch.document_ids, drop_out_of_vocab=False)
    out.loss.backward()
    ours = {name: p.grad for name, p in draft.named_parameters() if name in theirs}

    assert set(ours) == set(theirs) and len(theirs) == 2 * 11 + 3  # fc, hidden_norm, norm + 11 per layer
    assert torch.allclose(out.loss, their_loss, rtol=1e-5, atol=1e-6), (out.loss.item(), their_loss.item())
    worst = max(float((ours[name] - theirs[name]).norm() / theirs[name].norm()) for name in theirs)
    assert worst < 1e-4, worst
