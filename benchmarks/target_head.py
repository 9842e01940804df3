"""The target head with and without `train.cache_target_argmax` (issue 40: where a training step's time goes).

    python benchmarks/target_head.py --shards S [--batches 24] [--rounds 3] [--device cpu] [key=value ...]

Builds the training `specgen train data.shards=S key=value ...` builds (`build_training`: its draft vocabulary,
batch plan and LM-head chunks), takes the first --batches batches of its first epoch, and times the target
distribution of each (`batch_target`, what every training step runs first) three ways, between device
synchronisations: the full LM head at every batch (no cache), a sample's first batch with the cache (the full
vocabulary's argmax, per sample, and the draft vocabulary's rows) and a later batch of the same samples (the draft
vocabulary's rows only). Checks that the three give the same argmax and, within float rounding, the same
probabilities. Prints one table (ms a batch, the median of --rounds, and the ratio to no cache).
"""

import statistics
import tempfile
import time
from itertools import islice
from pathlib import Path

import torch

from specgen.draft.batch import batch_target
from specgen.draft.target_head import ArgmaxCache, TargetHead
from specgen.draft.vocab import VocabMapping
from train_profile import build, parse, training_parser  # benchmarks/, the script's folder


def timed(device: torch.device, fn) -> tuple[float, list]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, out


def main() -> None:
    parser = training_parser(__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=24, help="batches of the first epoch timed")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (each with a fresh cache); the median is kept")
    args = parse(parser)
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        training = build(args, Path(tmp) / "train", args.overrides)  # as train_profile.py builds it
    trainer = training.trainer
    shift, head = trainer.settings.mask_shift, trainer.head
    batches = [batch.to(device) for batch in islice(trainer.source.epoch(0), args.batches)]
    mapping = VocabMapping(head.draft_to_target.cpu(), head.weight.shape[0])
    lengths = trainer.source.dataset.lengths()
    results: dict[str, list[float]] = {"no cache": [], "first sight": [], "cached": []}
    for _ in range(args.rounds):
        uncached = TargetHead(head.weight, mapping, head.chunk_tokens)
        cached = TargetHead(head.weight, mapping, head.chunk_tokens, argmax_cache=ArgmaxCache(lengths))
        for name, target_head in (("no cache", uncached), ("first sight", cached), ("cached", cached)):
            seconds, outs = timed(device, lambda h=target_head: [batch_target(h, b, shift) for b in batches])
            results[name].append(seconds / len(batches))
            if name == "no cache":
                reference = outs
            else:
                for out, ref in zip(outs, reference, strict=True):
                    assert torch.equal(out.argmax, ref.argmax), f"{name}: the argmax differs from the full head's"
                    torch.testing.assert_close(out.probs, ref.probs, rtol=1e-4, atol=1e-6)
    tokens = statistics.mean(b.num_tokens for b in batches)
    base = statistics.median(results["no cache"])
    print(f"{args.device} ({torch.get_num_threads()} threads) · shards {args.shards} · "
          f"{' '.join(args.overrides) or 'default settings'} · {len(batches)} batches of {tokens:,.0f} tokens · "
          f"LM head {tuple(head.weight.shape)} {head.weight.dtype}, draft vocabulary {len(head.draft_to_target):,} · "
          f"median of {args.rounds} rounds")
    print("\n| target distribution | ms a batch | vs no cache |\n|---|---|---|")
    for name, values in results.items():
        value = statistics.median(values)
        print(f"| {name} | {1e3 * value:.1f} | {base / value:.2f}x |")


if __name__ == "__main__":
    main()
