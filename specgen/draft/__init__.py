"""Draft models: the methods, their vocabulary, training (offline and online) and speculative decoding.

    methods.py      the draft interface: eagle.py (EAGLE-3, EAGLE-3.1), peagle.py (P-EAGLE), dflash.py (DFlash)

    model.py        the draft (fc + one decoder layer over [embedding; hidden] + norm + reduced LM head)
    vocab.py        draft vocabulary from trained-token counts; d2t / t2d
    target_head.py  the target's LM head and embedding read alone; chunked target distribution
    ttt.py          training-time test: the unrolled loss with the shifted loss mask
    batches.py      deterministic length-bucketed batch plans, split over processes
    offline.py      batches from shards;  online.py: batches captured by the target in the loop
    strategy.py     how the draft is replicated: DDP or DeepSpeed ZeRO-2 under `accelerate launch`
    trainer.py      the loop: steps, metrics.jsonl, TensorBoard, checkpoints, resume
    checkpoint.py   the `LlamaForCausalLMEagle3` checkpoint layout, as vLLM reads it (aux ids = layer outputs + 1)
    exports.py      export to / import from the vllm, sglang, specforge and speculators layouts (aux-id conventions)
    speculative.py  greedy speculative decoding and the reference greedy decoding, for evaluation
    probe.py        acceptance length of the live draft during training (speculative decoding on held-out prompts)
"""

from specgen.draft.checkpoint import load_draft, save_draft
from specgen.draft.model import DraftKV, Eagle3Draft, draft_config
from specgen.draft.vocab import VocabMapping, build_vocab_mapping

__all__ = ["DraftKV", "Eagle3Draft", "VocabMapping", "build_vocab_mapping", "draft_config", "load_draft",
           "save_draft"]
