"""The draft's optimizer: AdamW over every trainable weight, or Muon over the hidden matrices and AdamW over the rest.

`train.optimizer=muon` is what vLLM's speculators trainer does by default (0.9): `torch.optim.Muon` (Nesterov momentum
0.95, 5 Newton-Schulz steps, its learning rate scaled to match AdamW's update RMS, `match_rms_adamw`) on every 2-D
weight of the draft's layers (`fc`, attention and MLP projections), and AdamW (train.betas, train.weight_decay) on
the norms and the LM head when it is trained. Both use train.lr, so one schedule drives them.
"""

import torch
from torch import nn

ADAMW_ONLY = ("embed_tokens", "lm_head")  # vocabulary matrices stay on AdamW (standard Muon practice)


def build_optimizer(model: nn.Module, *, name: str, lr: float, betas: tuple[float, float], weight_decay: float,
                    muon_weight_decay: float) -> torch.optim.Optimizer:
    """AdamW (`name="adamw"`) or `MuonAdamW` (`name="muon"`) over the model's trainable parameters."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if name == "adamw":
        return torch.optim.AdamW([p for _, p in named], lr=lr, betas=betas, weight_decay=weight_decay)
    matrices = [p for n, p in named if p.ndim == 2 and min(p.shape) > 1 and not n.startswith(ADAMW_ONLY)]
    chosen = {id(p) for p in matrices}
    rest = [p for _, p in named if id(p) not in chosen]
    muon = torch.optim.Muon(matrices, lr=lr, weight_decay=muon_weight_decay, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(rest, lr=lr, betas=betas, weight_decay=weight_decay) if rest else None
    return MuonAdamW(muon, adamw)


class MuonAdamW(torch.optim.Optimizer):
    """Muon and AdamW stepped together as one optimizer: its param_groups are theirs (the same dicts), so an LR
    scheduler, zero_grad and gradient clipping over it reach both; state_dict holds both states."""

    def __init__(self, muon: torch.optim.Muon, adamw: torch.optim.AdamW | None):
        self.parts = {"muon": muon, **({"adamw": adamw} if adamw is not None else {})}
        groups = [group for part in self.parts.values() for group in part.param_groups]
        super().__init__(groups, defaults={})  # adopts the parts' group dicts as they are

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for part in self.parts.values():
            part.step()
        return loss

    def state_dict(self) -> dict:
        return {name: part.state_dict() for name, part in self.parts.items()}

    def load_state_dict(self, state_dict: dict) -> None:
        if set(state_dict) != set(self.parts):
            raise ValueError(f"optimizer state holds {sorted(state_dict)}, this optimizer {sorted(self.parts)}")
        for name, part in self.parts.items():
            part.load_state_dict(state_dict[name])
        # torch's load_state_dict replaces a part's group dicts: adopt the new ones, or a scheduler would set the
        # learning rate in dicts nobody reads
        self.param_groups = [group for part in self.parts.values() for group in part.param_groups]
