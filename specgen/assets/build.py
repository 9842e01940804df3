"""Rebuild the bundled chat corpus and tokenizer from the public datasets in ../shared.

The embedded default must run on a fresh clone without ../shared, so the outputs of this script are committed:
  chat/train.jsonl, chat/heldout.jsonl  ShareGPT rows (FastChat dummy conversations + Alpaca converted to chat)
  tokenizer/                            a byte-level BPE tokenizer trained on that corpus, with a ChatML template
Run: python -m specgen.assets.build [--shared ../shared]
"""

import argparse
import json
import random
from pathlib import Path

from specgen.assets import ASSETS_DIR

VOCAB_SIZE = 2048
HELDOUT = 64
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def load_corpus(shared: Path) -> list[dict]:
    rows = json.loads((shared / "datasets" / "sharegpt_fastchat_dummy.json").read_text())
    for i, item in enumerate(json.loads((shared / "datasets" / "alpaca_en_demo.json").read_text())):
        prompt = item["instruction"] + (("\n\n" + item["input"]) if item.get("input") else "")
        rows.append({"id": f"alpaca_{i}", "conversations": [
            {"from": "human", "value": prompt}, {"from": "gpt", "value": item["output"]}]})
    random.Random(0).shuffle(rows)
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def train_tokenizer(rows: list[dict], out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = (turn["value"] for row in rows for turn in row["conversations"])
    tokenizer.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shared", type=Path, default=Path(__file__).resolve().parents[3] / "shared")
    args = parser.parse_args()
    rows = load_corpus(args.shared)
    write_jsonl(ASSETS_DIR / "chat" / "train.jsonl", rows[HELDOUT:])
    write_jsonl(ASSETS_DIR / "chat" / "heldout.jsonl", rows[:HELDOUT])
    train_tokenizer(rows[HELDOUT:], ASSETS_DIR / "tokenizer")
    print(f"wrote {len(rows) - HELDOUT} train + {HELDOUT} held-out rows and a {VOCAB_SIZE}-token tokenizer to {ASSETS_DIR}")


if __name__ == "__main__":
    main()
