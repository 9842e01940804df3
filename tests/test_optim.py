"""`train.optimizer`: AdamW, or Muon on the draft's hidden matrices with AdamW on the rest, as one optimizer; and
`train.schedule`: the learning-rate multiplier."""

import copy
import math

import pytest
import torch

from specgen.training.optim import Muon, MuonAdamW, build_optimizer, newton_schulz_dtype, orthogonalize
from specgen.training.trainer import lr_schedule
from tests.test_draft_model import one_thread, tiny_draft  # noqa: F401 (fixture)

SETTINGS = dict(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0, muon_weight_decay=0.1)


def names_in(draft, optimizer) -> set[str]:
    ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return {name for name, p in draft.named_parameters() if id(p) in ids}


def step_on_random_loss(draft, optimizer, seed: int = 0) -> None:
    torch.manual_seed(seed)
    loss = sum((p * torch.randn_like(p)).sum() for p in draft.parameters() if p.requires_grad)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    draft = tiny_draft()
    optimizer = build_optimizer(draft, name="muon", **SETTINGS)
    assert isinstance(optimizer, MuonAdamW)
    muon, adamw = (names_in(draft, optimizer.parts[name]) for name in ("muon", "adamw"))
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.mlp.down_proj.weight"} <= muon
    assert all(name.endswith("norm.weight") for name in adamw - {"lm_head.weight"}) and "lm_head.weight" in adamw
    assert not muon & adamw and "embed_tokens.weight" not in muon | adamw  # the frozen embedding is left out
    assert muon | adamw == {name for name, p in draft.named_parameters() if p.requires_grad}

    draft.lm_head.weight.requires_grad_(False)  # draft.freeze_lm_head
    assert "lm_head.weight" not in names_in(draft, build_optimizer(draft, name="muon", **SETTINGS))


def test_a_scheduler_drives_both_parts_and_every_trainable_weight_moves():
    draft = tiny_draft()
    optimizer = build_optimizer(draft, name="muon", **SETTINGS)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    before = {name: p.detach().clone() for name, p in draft.named_parameters()}
    step_on_random_loss(draft, optimizer)
    scheduler.step()
    assert [g["lr"] for part in optimizer.parts.values() for g in part.param_groups] == [5e-3, 5e-3]
    for name, p in draft.named_parameters():
        assert torch.equal(p, before[name]) != p.requires_grad, name


def test_the_state_round_trips_so_a_resumed_run_takes_the_same_steps():
    straight, resumed = tiny_draft(), tiny_draft()
    first = build_optimizer(straight, name="muon", **SETTINGS)
    for seed in range(2):
        step_on_random_loss(straight, first, seed)
    resumed.load_state_dict(straight.state_dict())
    second = build_optimizer(resumed, name="muon", **SETTINGS)
    second.load_state_dict(copy.deepcopy(first.state_dict()))  # as torch.save + torch.load give it
    torch.optim.lr_scheduler.LambdaLR(second, lambda step: 0.5)  # the scheduler of a resumed run reaches both parts
    assert [g["lr"] for part in second.parts.values() for g in part.param_groups] == [5e-3, 5e-3]
    for group in first.param_groups:
        group["lr"] *= 0.5
    step_on_random_loss(straight, first, 2)
    step_on_random_loss(resumed, second, 2)
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters()))
    with pytest.raises(ValueError, match="optimizer state holds"):
        second.load_state_dict({"muon": first.state_dict()["muon"]})


def test_adamw_is_plain_adamw():
    draft = tiny_draft()
    optimizer = build_optimizer(draft, name="adamw", **SETTINGS)
    assert type(optimizer) is torch.optim.AdamW
    assert names_in(draft, optimizer) == {name for name, p in draft.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("shape", ["cosine", "linear"])
def test_lr_schedule_warms_up_then_decays_to_the_floor(shape):
    multiplier = lr_schedule(total_steps=12, warmup_steps=2, min_lr_ratio=0.1, shape=shape)
    values = [multiplier(step) for step in range(14)]
    assert values[:3] == [0.5, 1.0, 1.0]  # warmup steps 0, 1; the peak at step 2
    assert all(a >= b for a, b in zip(values[2:], values[3:]))  # never rises after the peak
    assert values[12] == pytest.approx(0.1) and values[13] == pytest.approx(0.1)  # the floor, held after the end
    middle = values[7]  # halfway through the decay (5 of 10 steps)
    # A straight line is at the midpoint there; a cosine too: both reach 0.55 at half time.
    assert middle == pytest.approx(0.55)
    quarter = multiplier(4)  # 2 of 10 decay steps
    assert quarter == pytest.approx(0.1 + 0.9 * (0.8 if shape == "linear" else 0.5 * (1 + math.cos(math.pi * 0.2))))


def test_muon_with_a_bfloat16_iteration_steps_exactly_as_torchs():
    """specgen's Muon only picks the dtype of the Newton-Schulz iteration: in bfloat16 it is torch.optim.Muon."""
    ours, theirs = tiny_draft(), tiny_draft()
    theirs.load_state_dict(ours.state_dict())
    matrices = lambda draft: [p for n, p in draft.named_parameters() if p.requires_grad and p.ndim == 2  # noqa: E731
                              and not n.startswith("lm_head")]
    settings = dict(lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    mine = Muon(matrices(ours), ns_dtype=newton_schulz_dtype("cpu", frozenset({"amx_bf16"})), **settings)
    torchs = torch.optim.Muon(matrices(theirs), **settings)
    for seed in range(3):
        step_on_random_loss(ours, mine, seed)
        step_on_random_loss(theirs, torchs, seed)
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters()))
    assert mine.state_dict()["state"].keys() == torchs.state_dict()["state"].keys()
    assert all(torch.equal(mine.state_dict()["state"][k]["momentum_buffer"], v["momentum_buffer"])
               for k, v in torchs.state_dict()["state"].items())


@pytest.mark.parametrize("shape", [(48, 160), (160, 48)])
def test_the_float32_iteration_orthogonalizes_as_the_bfloat16_one(shape):
    """In float32 the iteration lands where bfloat16's does (its singular values in Muon's band), up to bfloat16's
    rounding: the CPU path changes the speed, not the update."""
    torch.manual_seed(0)
    grad = torch.randn(shape) @ torch.diag(torch.logspace(-3, 0, shape[1]))  # ill-conditioned, as gradients are
    coefficients = torch.optim._muon.DEFAULT_A, torch.optim._muon.DEFAULT_B, torch.optim._muon.DEFAULT_C
    exact = orthogonalize(grad, coefficients, 5, 1e-7, torch.float32)
    rounded = orthogonalize(grad, coefficients, 5, 1e-7, torch.bfloat16).float()
    assert exact.dtype == torch.float32 and exact.shape == grad.shape
    singular = torch.linalg.svdvals(exact)
    top = singular[: min(shape) // 2]  # the well-conditioned half: pushed into Muon's band around 1
    assert top.min() > 0.6 and singular.max() < 1.25
    assert (exact - rounded).norm() / exact.norm() < 0.03
    assert torch.allclose(exact, rounded, atol=0.02)


def test_the_iteration_runs_in_bfloat16_only_where_it_is_native():
    assert newton_schulz_dtype("cpu", frozenset({"avx2", "fma"})).name == "float32"
    for flag in ("avx512_bf16", "amx_bf16"):
        choice = newton_schulz_dtype("cpu", frozenset({"avx2", flag}))
        assert choice.name == "bfloat16" and flag in choice.reason
    assert newton_schulz_dtype("cuda").name == "bfloat16"
    draft = tiny_draft()
    optimizer = build_optimizer(draft, name="muon", **SETTINGS, device="cpu")
    assert optimizer.parts["muon"].ns_dtype == newton_schulz_dtype("cpu")
