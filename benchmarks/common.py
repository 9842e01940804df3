"""What several benchmarks share: where ../shared is, and the Llama-shaped model they measure on.

Scripts in benchmarks/ import it as `from common import ...` (they run as `python benchmarks/NAME.py`)."""

import os
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("SPECGEN_SHARED", REPO.parent / "shared"))
LLAMA_TOKENIZER = SHARED / "tokenizers" / "llama-3.1"


SMALL = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
         "num_key_value_heads": 4, "tie_word_embeddings": False}
SMOLLM2_135M = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "tie_word_embeddings": True}  # SmolLM2-135M-Instruct's decoder


def build_llama(out_dir: Path, dtype: str = "float32", max_positions: int = 4096, shape: dict = SMALL) -> Path:
    """A randomly initialised Llama of `shape` (default: a small real LLM's, hidden 512, 8 layers, GQA 8/4) with the
    real Llama-3.1 vocabulary and tokenizer, saved to `out_dir` (seed 0: the same weights every time)."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=128256, max_position_embeddings=max_positions, **shape)
    tf.AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype)).save_pretrained(out_dir)
    tf.AutoTokenizer.from_pretrained(LLAMA_TOKENIZER).save_pretrained(out_dir)
    return out_dir
