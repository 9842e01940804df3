"""Train the bundled tiny target (`tiny-target/`) on the bundled chat corpus, on CPU, in a few minutes.

A randomly initialised target makes every acceptance-length number meaningless: its greedy output is noise that no
draft can predict, or a constant that any draft predicts. This script gives the demo a target that has actually
learned the corpus: a Llama-architecture model (8 layers, so the default EAGLE-3 aux layers [1, 3, 4] are valid,
hidden 128, the bundled 2048-token BPE tokenizer) trained as a chat model on `chat/train.jsonl`: the whole
conversation is its context, the assistant replies (the data stage's loss mask) are its targets, so it learns to
answer and to end its turn rather than to imitate role headers. `chat/heldout.jsonl` is never seen here; the demo
evaluates the draft on it.

Run: python -m specgen.assets.train_target [--epochs 4] [--threads 1]   (about 15 minutes on one core)
Writes tiny-target/ (config.json, generation_config.json, bf16 model.safetensors of ~4 MB, tokenizer files).
"""

import argparse
import math
import random
import shutil
import time
from pathlib import Path

import torch
import transformers

from specgen.assets import ASSETS_DIR
from specgen.data.prepare import prepare_rows
from specgen.data.sample import TokenizedSample
from specgen.data.sources import iter_records
from specgen.data.template import ChatTemplateTokenizer

TOKENIZER_DIR = ASSETS_DIR / "tokenizer"
TRAIN_DATA = ASSETS_DIR / "chat" / "train.jsonl"
OUT_DIR = ASSETS_DIR / "tiny-target"
MAX_LENGTH = 512


def target_config(tokenizer) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )


def tokenized_corpus(tokenizer) -> list[TokenizedSample]:
    """The training conversations rendered with the chat template, with the assistant-token loss mask."""
    chat = ChatTemplateTokenizer(tokenizer, max_length=MAX_LENGTH)
    return [sample for row in prepare_rows(iter_records(TRAIN_DATA), chat) for sample in row.samples]


def batches(samples: list[TokenizedSample], batch_tokens: int,
            rng: random.Random) -> list[list[TokenizedSample]]:
    """Length-sorted batches of about `batch_tokens` padded tokens, in a shuffled order."""
    ordered = sorted(samples, key=len)
    out, current = [], []
    for sample in ordered:
        if current and (len(current) + 1) * len(sample) > batch_tokens:
            out.append(current)
            current = []
        current.append(sample)
    out.append(current)
    rng.shuffle(out)
    return out


def collate(batch: list[TokenizedSample], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids, and labels that are the ids on assistant tokens and -100 (no loss) elsewhere."""
    longest = max(len(sample) for sample in batch)
    input_ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), longest), -100, dtype=torch.long)
    for row, sample in enumerate(batch):
        ids = torch.tensor(sample.input_ids)
        input_ids[row, : len(ids)] = ids
        labels[row, : len(ids)] = torch.where(torch.tensor(sample.loss_mask).bool(), ids, -100)
    return input_ids, labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-tokens", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=6e-3)
    # One thread: matrices 128 wide gain little from a second one, and on a shared, oversubscribed CPU a second
    # OpenMP thread that waits for a descheduled partner made steps 15x slower here.
    parser.add_argument("--threads", type=int, default=1, help="CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    tokenizer = transformers.AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    corpus = tokenized_corpus(tokenizer)
    model = transformers.LlamaForCausalLM(target_config(tokenizer))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    steps_per_epoch = len(batches(corpus, args.batch_tokens, random.Random(0)))
    total_steps = args.epochs * steps_per_epoch
    warmup = max(1, total_steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(step, total_steps) / total_steps)))
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, {len(corpus)} conversations, "
          f"{sum(map(len, corpus)):,} tokens/epoch ({sum(s.num_trainable for s in corpus):,} trained), "
          f"{total_steps} steps")

    start, step = time.time(), 0
    model.train()
    for epoch in range(args.epochs):
        for batch in batches(corpus, args.batch_tokens, rng):
            input_ids, labels = collate(batch, tokenizer.pad_token_id)
            loss = model(input_ids=input_ids, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % 20 == 0 or step == total_steps:
                print(f"epoch {epoch} step {step}/{total_steps} loss {loss.item():.3f} "
                      f"lr {schedule.get_last_lr()[0]:.2e} {time.time() - start:.0f}s", flush=True)

    save(model, tokenizer, args.out)
    print(f"wrote {args.out} in {time.time() - start:.0f}s")


def save(model: transformers.LlamaForCausalLM, tokenizer, out_dir: Path) -> None:
    """Replace `out_dir` with the bf16 weights, config and generation config, plus a copy of the tokenizer files
    (so model.path alone is enough). The files are copied rather than re-saved: tokenizing with truncation leaves
    a truncation setting on the loaded tokenizer that save_pretrained would persist."""
    if out_dir.exists():
        shutil.rmtree(out_dir)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.to(torch.bfloat16).save_pretrained(out_dir)
    for file in TOKENIZER_DIR.iterdir():
        shutil.copy(file, out_dir / file.name)

if __name__ == "__main__":
    main()
