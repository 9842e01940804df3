"""speculators 0.9 reads specgen's EAGLE-3.1 and P-EAGLE exports and agrees; one P-EAGLE training step of specgen
equals speculators' own (`speculators.models.peagle`, the only P-EAGLE trainer among the installed peers:
SpecForge 0.2.0 has none). Runs in vLLM's venv, where the packages are installed --no-deps."""

import pytest
import torch
import transformers

from specgen.draft.checkpoint import load_draft
from specgen.methods.eagle3.model import Eagle3Draft, draft_config
from specgen.methods.peagle.method import PEagleDraft, cod_selection, peagle_forward
from tests.test_foreign_packages import (
    TARGET,
    assert_same,
    export,
    inputs,  # noqa: F401 (fixture)
    load_speculators,
    packed_training_batch,
    specgen_logits,
    speculators_logits,
    target,  # noqa: F401 (fixture)
)

pytestmark = pytest.mark.vllm


def moved(draft, embedding):
    draft.d2t.copy_(torch.arange(1024))  # draft id d -> target id 2d
    draft.t2d[torch.arange(1024) * 2] = True
    for parameter in draft.parameters():
        parameter.data.add_(0.1 * torch.randn_like(parameter))  # norms away from 1: a misplaced norm shows
    draft.embed_tokens.weight.data.copy_(embedding)
    return draft.eval()


@pytest.mark.parametrize("norm_before_fc", [False, True])  # speculators takes one of fc_norm / norm_before_fc
def test_speculators_runs_our_eagle31_export_as_specgen_does(target, inputs, tmp_path, norm_before_fc):
    config, embedding = target
    torch.manual_seed(0)
    draft = moved(Eagle3Draft(draft_config(config, aux_layers=[1, 3, 4], draft_vocab_size=1024,
                                           fc_norm=not norm_before_fc, norm_output=True,
                                           norm_before_fc=norm_before_fc, norm_before_residual=False)), embedding)
    model = load_speculators(export(draft, "speculators", tmp_path / "speculators"))
    assert (model.fc_norm is None) == norm_before_fc and (model.input_norm is None) != norm_before_fc
    assert model.config.norm_output
    model.embed_tokens.weight.data.copy_(embedding)  # the target's, as vLLM shares it (not stored in the draft)
    assert_same(specgen_logits(draft, *inputs), speculators_logits(model, *inputs))
    again = load_draft(tmp_path / "speculators", embedding=embedding, target_config=config).eval()
    assert again.method_name == "eagle3.1"
    assert_same(specgen_logits(again, *inputs), speculators_logits(model, *inputs))


def peagle_pair(target, tmp_path):
    """A specgen P-EAGLE draft and speculators' PEagleDraftModel loaded from its speculators export."""
    from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig

    config, embedding = target
    torch.manual_seed(0)
    dconfig = draft_config(config, aux_layers=[1, 3, 4], draft_vocab_size=1024, norm_before_residual=True)
    dconfig.mask_token_id, dconfig.parallel_drafting = 7, True
    draft = moved(PEagleDraft(dconfig), embedding)
    folder = export(draft, "speculators", tmp_path / "peagle")
    spec_config = PEagleSpeculatorConfig.from_pretrained(folder)
    spec_config.transformer_layer_config._attn_implementation = "eager"
    model = PEagleDraftModel.from_pretrained(folder, config=spec_config).float()
    assert model.mask_token_id == 7 and torch.equal(model.mask_hidden.data, draft.mask_hidden.data)
    model.embed_tokens.weight.data.copy_(embedding)
    model.embed_tokens.weight.requires_grad_(False)  # specgen keeps the target's embedding (vLLM shares it)
    return draft, model


def test_cod_selection_draws_what_speculators_draws():
    from speculators.models.peagle.data import generate_cod_sample_indices

    loss_mask = (torch.arange(40) % 7 >= 2).long()
    torch.manual_seed(5)
    anchor, depth = generate_cod_sample_indices(40, loss_mask[None], num_depths=4)
    torch.manual_seed(5)
    loss_mask[0] = 0  # speculators would anchor index 0's depth-1 element at -1; specgen drops it (not drawn here)
    keep = cod_selection(loss_mask.bool(), torch.zeros(40, dtype=torch.long), depths=4, ratio=0.7, ratio_min=0.2)
    for d in range(1, 4):
        assert torch.where(keep[d])[0].tolist() == anchor[depth == d].tolist(), d


def test_a_peagle_training_step_equals_speculators(target, tmp_path, monkeypatch):
    """Same weights, same packed batch and the same COD draw (speculators' own, recorded): specgen's P-EAGLE loss
    (train.loss_mask=input, out_of_vocab=keep) and speculators' PEagleDraftModel.forward (KL, 4 depths) give the
    same loss up to the target's entropy, and the same gradient on every weight both train (mask_hidden included)."""
    import speculators.models.peagle.core as core
    from speculators.losses import eager

    from specgen.draft.batch import batch_target, collate
    from specgen.draft.target_head import TargetHead
    from specgen.draft.vocab import VocabMapping

    target_model = transformers.AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32)
    draft, model = peagle_pair(target, tmp_path)
    lm_head = target_model.lm_head.weight.detach()
    draft.init_lm_head_from_target(lm_head)
    model.lm_head.weight.data.copy_(draft.lm_head.weight)
    model.verifier_lm_head.weight.data.copy_(lm_head[draft.t2d])
    model.verifier_norm.weight.data.copy_(target_model.model.norm.weight.detach())
    model.train()
    samples = packed_training_batch(target_model)

    parts = {"hidden_states": [], "input_ids": [], "document_ids": [], "loss_mask": [], "position_ids": [],
             "verifier_last_hidden_states": []}
    for document, sample in enumerate(samples):  # speculators' shift_batch: token t+1 with hidden state t
        n = len(sample["input_ids"])
        parts["hidden_states"].append(sample["aux_hidden_states"][:-1])
        parts["input_ids"].append(sample["input_ids"][1:])
        parts["verifier_last_hidden_states"].append(sample["pre_norm"][1:])
        parts["loss_mask"].append(sample["loss_mask"][1:].bool())
        parts["position_ids"].append(torch.arange(1, n))
        parts["document_ids"].append(torch.full((n - 1,), document))
    drawn = {}
    original = core.generate_cod_sample_indices

    def record(**kwargs):
        drawn["anchor"], drawn["depth"] = original(**kwargs)
        return drawn["anchor"], drawn["depth"]

    monkeypatch.setattr(core, "generate_cod_sample_indices", record)
    torch.manual_seed(3)
    _, their_loss, _ = model(**{name: torch.cat(values)[None] for name, values in parts.items()}, num_depths=4,
                             loss_config={"kl_div": (eager.kl_div_loss, 1.0)})
    their_loss.backward()
    theirs = {name.replace("layers.0.", "midlayer."): p.grad for name, p in model.named_parameters()
              if p.requires_grad}
    assert (drawn["depth"] > 0).sum() > 10  # COD kept elements at every depth
    assert {"mask_hidden", "fc.weight", "norm.weight"} <= set(theirs)

    # speculators' packed index (sample k, local t) is specgen's (sample k, local t): anchor a reads h[a], x[a+1]
    lengths = [len(s["input_ids"]) for s in samples]
    ours_of = torch.cat([torch.arange(n - 1) + sum(lengths[:k]) for k, n in enumerate(lengths)])
    batch = collate(samples, pad_id=0, packed=True)
    selection = [torch.zeros_like(batch.loss_mask, dtype=torch.bool) for _ in range(4)]
    for anchor, depth in zip(drawn["anchor"].tolist(), drawn["depth"].tolist()):
        selection[depth][0, ours_of[anchor]] = True
    head = TargetHead(lm_head, VocabMapping(torch.arange(1024) * 2, 2048))
    draft.train().zero_grad()
    out = peagle_forward(draft, batch.input_ids, batch.loss_mask, batch.aux_hidden_states,
                         batch_target(head, batch, 1), depths=4, mask_shift=1, drop_out_of_vocab=False,
                         position_ids=batch.position_ids, document_ids=batch.document_ids, selection=selection)
    out.loss.backward()  # cross-entropy: KL plus the target's entropy, which has no gradient
    ours = {name: p.grad for name, p in draft.named_parameters() if name in theirs}
    assert set(ours) == set(theirs)
    worst = max(float((ours[name] - theirs[name]).norm() / theirs[name].norm()) for name in theirs)
    assert worst < 1e-4, worst
