"""EAGLE-3 and EAGLE-3.1 as draft methods (`specgen.methods`): the reference implementation of the interface.

Both train the same model (`specgen.methods.eagle3.model.Eagle3Draft`) with the TTT unroll (`specgen.methods.eagle3.ttt`) and draft a
chain at decoding (`ChainProposer`, what vLLM's EAGLE proposer does). eagle3.1 differs only in its default flags:
fc_norm and norm_output on (the EAGLE-3.1 paper's per-aux-layer norm and the post-norm state fed forward); the
`draft.fc_norm`, `draft.norm_before_fc` and `draft.norm_output` keys override the method's default when set.
"""

from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from torch import nn

from specgen.draft import exports
from specgen.draft.loss import step_metrics
from specgen.methods.eagle3.checkpoint import load_eagle_family
from specgen.methods.eagle3.model import DraftKV, Eagle3Draft, draft_config
from specgen.methods.eagle3.ttt import TTTObjective

FLAGS = ("fc_norm", "norm_before_fc", "norm_output")


@dataclass(frozen=True)
class EagleMethod:
    name: str
    flag_defaults: dict = field(default_factory=dict)  # EAGLE-3.1 flags this method turns on when left null
    model_class: type = Eagle3Draft

    def flags(self, draft) -> dict:
        """EAGLE-3.1 flags: draft.<flag> when set, else the method's default (False for eagle3)."""
        return {flag: bool(getattr(draft, flag) if getattr(draft, flag) is not None
                           else self.flag_defaults.get(flag, False)) for flag in FLAGS}

    def build_config(self, target_config, *, aux_layers: list[int], draft_vocab_size: int,
                     draft) -> transformers.LlamaConfig:
        return draft_config(target_config, aux_layers=aux_layers, draft_vocab_size=draft_vocab_size,
                            overrides=draft.overrides, norm_before_residual=draft.norm_before_residual,
                            **self.flags(draft))

    def new_draft(self, target_config, *, aux_layers: list[int], mapping, embedding: torch.Tensor,
                  lm_head: torch.Tensor, draft) -> Eagle3Draft:
        """Llama initialisation, the vocabulary mapping, the target's embedding; LM head per draft.init_lm_head."""
        config = self.build_config(target_config, aux_layers=aux_layers, draft_vocab_size=mapping.draft_vocab_size,
                                   draft=draft)
        model = self.model_class(config)
        model.start_from_target(mapping, embedding, lm_head, init_lm_head=draft.init_lm_head)
        return model

    def load(self, folder: Path, *, embedding: torch.Tensor | None, target_config, foreign_ids: str) -> Eagle3Draft:
        return load_eagle_family(folder, self.model_class, embedding=embedding, target_config=target_config,
                                 foreign_ids=foreign_ids)

    def objective(self, model: Eagle3Draft, *, train, draft, seed: int, mask_shift: int) -> nn.Module:
        return TTTObjective(model, ttt_length=train.ttt_length, decay=train.ttt_decay, mask_shift=mask_shift,
                            drop_out_of_vocab=train.out_of_vocab == "drop")

    def metrics(self, stats: torch.Tensor, *, train, draft) -> dict[str, float]:
        return step_metrics(stats, train.ttt_decay)

    def export(self, config, tensors: dict[str, torch.Tensor], fmt: str, *, info: dict | None = None,
               speculative_tokens: int = 3, verifier: str | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
        return exports.export_files(config, tensors, fmt, info={**(info or {}), "method": self.name},
                                    speculative_tokens=speculative_tokens, verifier=verifier)

    def proposer(self, draft: Eagle3Draft) -> "ChainProposer":
        return ChainProposer(draft)


class ChainProposer:
    """vLLM's EAGLE drafting: base entries for the verified positions, then a chain of K steps from the last one,
    step j reading the draft's own step j-1 output and token (`specgen.methods.eagle3.model`); the chain is dropped after."""

    def __init__(self, draft: Eagle3Draft):
        self.draft = draft
        self.kv = DraftKV()
        self.device = next(draft.parameters()).device

    def base_step(self, aux: torch.Tensor, tokens: list[int]) -> torch.Tensor:
        """Base entries for the verified positions; returns the last one's output [1, 1, H]."""
        draft, device = self.draft, self.device
        first = self.kv.base_length
        positions = torch.arange(first, first + len(tokens), device=device)[None]
        return draft(torch.tensor([tokens], device=device), draft.project(aux.to(device))[None], positions, self.kv,
                     extend_base=True)[:, -1:]

    def next_input(self, step: int, drafted: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(token [1, 1], hidden [1, 1, H]) that chain step `step` >= 1 reads: the previous draft token and output."""
        return torch.tensor([[drafted[-1]]], device=self.device), hidden

    def propose(self, aux: torch.Tensor, tokens: list[int], num_draft_tokens: int) -> list[int]:
        draft = self.draft
        hidden = self.base_step(aux, tokens)
        last_position = self.kv.base_length - 1
        drafted = []
        for step in range(num_draft_tokens):
            if step > 0:
                token, hidden = self.next_input(step, drafted, hidden)
                hidden = draft(token, hidden, torch.tensor([[last_position + step]], device=self.device), self.kv,
                               extend_base=False)
            drafted.append(int(draft.to_target_ids(draft.logits(hidden)[0, -1].argmax())))
        self.kv.drop_chain()
        return drafted


METHODS = {"eagle3": EagleMethod("eagle3"),
           "eagle3.1": EagleMethod("eagle3.1", flag_defaults={"fc_norm": True, "norm_output": True})}
