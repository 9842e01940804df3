"""The trainer's memory on long samples: peak memory of one EAGLE-3 training step on ONE sample of T tokens.

    python benchmarks/train_memory.py [--config DIR] [--lengths 4096,16384,32768] [--ttt-length 7]
        [--draft-vocab 8192] [--device cpu|cuda] [--dtype float32|bfloat16]

Each length runs in a process of its own (peak RSS only grows): the step is what `specgen train` runs per batch
(the target distribution from the LM head, the TTT unroll forward and backward, an AdamW step) on random hidden
states of the target whose `config.json` is in --config (default: the packaged tiny target; SmolLM2-135M's folder
from `python -m specgen.assets.smollm2` for the real model's shapes). Its weights are not read: the embedding and
LM head are random, which changes no tensor's size. Printed per length: peak RSS (CPU) or peak allocated GPU
memory (cuda), its growth per token from the previous length, and the step's wall time. Memory that grows linearly
shows as a flat bytes-per-token column; a dense [T, T] attention score tensor per step would make it grow with T.
"""

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers

from specgen import methods
from specgen.assets import ASSETS_DIR
from specgen.config import settings_of
from specgen.draft.batch import DraftBatch, batch_target, collate
from specgen.draft.loss import MASK_SHIFTS
from specgen.draft.target_head import TargetHead
from specgen.draft.vocab import VocabMapping, build_vocab_mapping
from specgen.methods.eagle3 import model as draft_model


def one_step(config_dir: Path, length: int, ttt_length: int, draft_vocab: int, device: str, dtype: str,
             sample_length: int | None = None) -> dict:
    """One training step on one packed row of `length` tokens (one sample, or samples of `sample_length`);
    peak memory and time."""
    torch.manual_seed(0)
    target_config = transformers.AutoConfig.from_pretrained(config_dir).get_text_config()
    hidden, vocab = target_config.hidden_size, target_config.vocab_size
    aux_layers = [1, target_config.num_hidden_layers // 2, target_config.num_hidden_layers - 2]
    mapping: VocabMapping = build_vocab_mapping({t: vocab - t for t in range(vocab)}, vocab, min(draft_vocab, vocab))
    embedding, lm_head = torch.randn(vocab, hidden) * 0.02, torch.randn(vocab, hidden) * 0.02
    method = methods.get("eagle3")
    shipped = settings_of("train", [f"train.ttt_length={ttt_length}"])  # the shipped draft and train settings
    draft = method.new_draft(target_config, aux_layers=aux_layers, mapping=mapping, embedding=embedding,
                             lm_head=lm_head, draft=shipped.draft)
    torch_dtype = getattr(torch, dtype)
    draft.to(device=device, dtype=torch_dtype)
    objective = method.objective(draft, train=shipped.train, draft=shipped.draft, seed=0,
                                 mask_shift=MASK_SHIFTS[shipped.train.loss_mask])
    optimizer = torch.optim.AdamW(draft.trainable_parameters(), lr=1e-4)
    head = TargetHead(lm_head.to(device=device, dtype=torch_dtype), mapping)
    sizes = [length] if sample_length is None else \
        [min(sample_length, length - start) for start in range(0, length, sample_length)]
    rows = [{"input_ids": torch.randint(vocab, (n,)), "loss_mask": torch.ones(n, dtype=torch.long),
             "aux_hidden_states": torch.randn(n, 3 * hidden, dtype=torch_dtype),
             "last_hidden_state": torch.randn(n, hidden, dtype=torch_dtype)} for n in sizes]
    batch: DraftBatch = collate(rows, packed=True).to(device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    target = batch_target(head, batch)
    loss, _ = objective(batch.input_ids, batch.loss_mask, batch.aux_hidden_states, target.probs, target.argmax,
                        batch.position_ids, batch.document_ids)
    loss.backward()
    optimizer.step()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"length": length, "peak_bytes": peak, "seconds": time.perf_counter() - start, "loss": float(loss)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=ASSETS_DIR / "tiny-target")
    parser.add_argument("--lengths", default="4096,16384,32768")
    parser.add_argument("--ttt-length", type=int, default=7)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--sample-length", type=int, help="pack samples of this many tokens into each row "
                        "(default: the row is one sample)")
    parser.add_argument("--attention-chunk", type=int, help="override specgen.methods.eagle3.model.ATTENTION_CHUNK "
                        "(score elements per chunk; 10**12: one dense pass)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.attention_chunk:
        draft_model.ATTENTION_CHUNK.update(cpu=args.attention_chunk, cuda=args.attention_chunk)
    if args.child:
        print(json.dumps(one_step(args.config, args.child, args.ttt_length, args.draft_vocab, args.device,
                                  args.dtype, args.sample_length)))
        return
    memory = "peak GPU MB" if args.device == "cuda" else "peak RSS MB"
    print(f"target config {args.config} · ttt_length {args.ttt_length} · draft vocab {args.draft_vocab} · "
          f"{args.device} {args.dtype} · samples of {args.sample_length or 'the whole row'} · attention chunk "
          f"{args.attention_chunk or draft_model.ATTENTION_CHUNK[args.device.split(':')[0]]}")
    print(f"| tokens | {memory} | KB per token (from the previous row) | step s | loss |")
    print("|---|---|---|---|---|")
    previous = None
    for length in (int(x) for x in args.lengths.split(",")):
        child = subprocess.run([sys.executable, __file__, "--child", str(length), "--config", str(args.config),
                                "--ttt-length", str(args.ttt_length), "--draft-vocab", str(args.draft_vocab),
                                "--device", args.device, "--dtype", args.dtype, "--threads", str(args.threads),
                                *(["--sample-length", str(args.sample_length)] if args.sample_length else []),
                                *(["--attention-chunk", str(args.attention_chunk)] if args.attention_chunk else [])],
                               capture_output=True, text=True)
        if child.returncode != 0:
            tail = (child.stderr.strip().splitlines() or ["?"])[-1]
            print(f"| {length:,} | failed: {tail} | | | |")
            continue
        result = json.loads(child.stdout.strip().splitlines()[-1])
        growth = "" if previous is None else \
            f"{(result['peak_bytes'] - previous['peak_bytes']) / (length - previous['length']) / 1024:.1f}"
        print(f"| {length:,} | {result['peak_bytes'] / 2**20:,.0f} | {growth} | {result['seconds']:.1f} | "
              f"{result['loss']:.3f} |")
        previous = result


if __name__ == "__main__":
    main()
