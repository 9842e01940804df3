"""What every draft method shares; the methods themselves are packages of `specgen.methods`.

    vocab.py        draft vocabulary from trained-token counts; d2t / t2d; the reduced LM head every draft has
    aux.py          the aux layers a draft reads: specgen's ids (layer outputs) and the serving engines' (+1)
    batch.py        the training batch (right-padded or packed samples with the target's hidden states)
    loss.py         the loss-mask shift (train.loss_mask), per-step statistics and the metrics read from them
    target_head.py  the target's LM head and embedding read alone; chunked target distribution
    checkpoint.py   save / load a draft through its method; step-numbered training checkpoints (resume)
    exports.py      the vllm, sglang, specforge and speculators layouts (aux-id conventions), read and written
    speculative.py  greedy speculative decoding and the reference greedy decoding, for evaluation
    lossless.py     where speculative output departs from greedy: rounding (a near-tie) or a bug
"""

from specgen.draft.checkpoint import load_draft, save_draft
from specgen.draft.vocab import VocabMapping, build_vocab_mapping

__all__ = ["VocabMapping", "build_vocab_mapping", "load_draft", "save_draft"]
