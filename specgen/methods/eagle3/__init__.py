"""EAGLE-3 and EAGLE-3.1: one Llama decoder layer over [token embedding ; fc(aux hidden states)], trained by the
training-time-test unroll, drafting a chain of K tokens as vLLM's EAGLE proposer does.

    model.py       the draft (fc + one decoder layer + norm + reduced LM head) and its KV cache for chain drafting
    ttt.py         the training-time test: the unrolled loss with the shifted loss mask
    checkpoint.py  the LlamaForCausalLMEagle3 layout, read from any supported format (`specgen.draft.exports`)
    method.py      the `DraftMethod` (eagle3, eagle3.1) and the chain proposer
"""

from specgen.methods.eagle3.method import METHODS

__all__ = ["METHODS"]
