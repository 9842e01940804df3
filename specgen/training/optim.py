"""The draft's optimizer: AdamW over every trainable weight, or Muon over the hidden matrices and AdamW over the rest.

`train.optimizer=muon` is what vLLM's speculators trainer does by default (0.9): `torch.optim.Muon` (Nesterov momentum
0.95, 5 Newton-Schulz steps, its learning rate scaled to match AdamW's update RMS, `match_rms_adamw`) on every 2-D
weight of the draft's layers (`fc`, attention and MLP projections), and AdamW (train.betas, train.weight_decay) on
the norms and the LM head when it is trained. Both use train.lr, so one schedule drives them.

Muon's Newton-Schulz orthogonalization runs in bfloat16 (as torch's and the reference's) where the device multiplies
bfloat16 natively, and in float32 elsewhere: on a CPU without native bfloat16 the emulated matmuls took 83% of a
SmolLM2 draft's step (5.7x slower training), for no gain in accuracy.
"""

import torch
from torch import nn

from specgen.runtime.dtype import DtypeChoice, native_on

ADAMW_ONLY = ("embed_tokens", "lm_head")  # vocabulary matrices stay on AdamW (standard Muon practice)


def build_optimizer(model: nn.Module, *, name: str, lr: float, betas: tuple[float, float], weight_decay: float,
                    muon_weight_decay: float, device: str | torch.device = "cpu") -> torch.optim.Optimizer:
    """AdamW (`name="adamw"`) or `MuonAdamW` (`name="muon"`) over the model's trainable parameters, which live on
    `device` (it picks the dtype of Muon's orthogonalization, `newton_schulz_dtype`)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if name == "adamw":
        return torch.optim.AdamW([p for _, p in named], lr=lr, betas=betas, weight_decay=weight_decay)
    matrices = [p for n, p in named if p.ndim == 2 and min(p.shape) > 1 and not n.startswith(ADAMW_ONLY)]
    chosen = {id(p) for p in matrices}
    rest = [p for _, p in named if id(p) not in chosen]
    muon = Muon(matrices, lr=lr, weight_decay=muon_weight_decay, adjust_lr_fn="match_rms_adamw",
                ns_dtype=newton_schulz_dtype(device))
    adamw = torch.optim.AdamW(rest, lr=lr, betas=betas, weight_decay=weight_decay) if rest else None
    return MuonAdamW(muon, adamw)


def newton_schulz_dtype(device: str | torch.device, cpu_flags: frozenset[str] | None = None) -> DtypeChoice:
    """bfloat16 (torch's) where `device` multiplies it natively (an accelerator, a CPU with avx512_bf16 or
    amx_bf16), else float32. cpu_flags: as specgen.runtime.dtype.choose_dtype's."""
    native = native_on("bfloat16", device, cpu_flags)
    if native:
        return DtypeChoice("bfloat16", f"as torch.optim.Muon, {native}")
    return DtypeChoice("float32", "this CPU has no native bfloat16 matmul, no avx512_bf16 or amx_bf16; float32 is "
                                  "several times faster")


class Muon(torch.optim.Muon):
    """torch.optim.Muon whose Newton-Schulz orthogonalization runs in `ns_dtype` (torch's: always bfloat16).

    The same hyperparameters, state (`momentum_buffer`) and update; with `ns_dtype` bfloat16 the steps are torch's
    exactly (tested). `ns_dtype` is a DtypeChoice so the train summary can say which dtype and why."""

    def __init__(self, params, *, ns_dtype: DtypeChoice, **kwargs):
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            lr, momentum = float(group["lr"]), group["momentum"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad, state = param.grad, self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad)
                buf = state["momentum_buffer"]
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = orthogonalize(update, group["ns_coefficients"], group["ns_steps"], group["eps"],
                                       self.ns_dtype.torch_dtype)
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], param.shape))
        return loss


def orthogonalize(grad: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """Muon's quintic Newton-Schulz iteration (Keller Jordan's, as torch.optim.Muon's) in `dtype`: about U V^T for
    grad = U S V^T, with singular values pushed into roughly [0.7, 1.2]."""
    a, b, c = coefficients
    x = grad.to(dtype)
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, rule: str | None, shape: torch.Size) -> float:
    """Muon's per-matrix learning rate (torch's `adjust_lr_fn`): match_rms_adamw scales by 0.2 sqrt(max(A, B))."""
    rows, cols = shape[:2]
    if rule is None or rule == "original":
        return lr * max(1.0, rows / cols) ** 0.5
    if rule == "match_rms_adamw":
        return lr * 0.2 * max(rows, cols) ** 0.5
    return lr


def describe(optimizer: torch.optim.Optimizer) -> str:
    """One line for a stage summary: which optimizer over how many tensors, and the dtype of Muon's iteration."""
    if not isinstance(optimizer, MuonAdamW):
        return f"{type(optimizer).__name__.lower()} on {sum(len(g['params']) for g in optimizer.param_groups)} tensors"
    muon = optimizer.parts["muon"]
    rest = sum(len(g["params"]) for g in optimizer.parts["adamw"].param_groups) if "adamw" in optimizer.parts else 0
    return (f"muon on {sum(len(g['params']) for g in muon.param_groups)} hidden matrices, Newton-Schulz in "
            f"{muon.ns_dtype.name} ({muon.ns_dtype.reason}); adamw on {rest} tensors")


class MuonAdamW(torch.optim.Optimizer):
    """Muon and AdamW stepped together as one optimizer: its param_groups are theirs (the same dicts), so an LR
    scheduler, zero_grad and gradient clipping over it reach both; state_dict holds both states."""

    def __init__(self, muon: Muon, adamw: torch.optim.AdamW | None):
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
