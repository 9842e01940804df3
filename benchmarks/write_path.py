"""How fast captured batches reach the disk: the shard write path of `specgen generate` (issue #40), before and after.

    python benchmarks/write_path.py [--out /tmp] [--units 3] [--rows-per-unit 24] [--batch-tokens 4096]
        [--repeats 3] [--writers N] [--padded]

Synthetic captures of a Llama-3.1-8B target (hidden 4096, the 3 default aux layers of 32 decoder layers, bf16:
32,773 bytes per token stored with input_ids and loss_mask) go through the real writer as `generate` hands them over:
the ShardSpec `generate` builds for that target, `BackgroundWriter` with queue depth pipeline.write_queue, and per
unit `begin`, one `write` per packed batch (`packed_batches`; the rows are consecutive slices of one captured
tensor, as `capture_packed_batches` gives them; --padded: rows of a right-padded [B, T, H] batch, as with
capture.packing=false), then `commit` (sidecar, fsync, rename). Row lengths are drawn uniformly in 200..400 tokens
(seed 0). Each path writes the same units into a fresh folder under --out, round-robin for --repeats rounds; the
table gives the median over the rounds of shard bytes (and tokens) over the wall time from the first `begin` until
every shard is committed. The paths:

  before        ShardWriter(overlap_hash=False, fewer_copies=False), 1 writer thread: the path before issue #40 (rows
                concatenated with torch.cat, the sha256 computed in the writing thread between writes)
  writers=1     ShardWriter as generate uses it (hashing on a helper thread while the bytes are written, packed rows
                handed to Arrow without a copy), 1 writer thread
  writers=N     the same with N writer threads taking the units in turn (N: --writers, default pipeline.writers)

The last line says whether every path wrote byte-identical shards (the sha256 in each sidecar). Into a folder on a
disk the commit's fsync waits for the disk itself; /dev/shm (tmpfs) measures the CPU side alone.
"""

import argparse
import functools
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from specgen.capture.layers import default_aux_layers
from specgen.data.batching import packed_batches, token_budget_batches
from specgen.data.sample import TokenizedSample
from specgen.pipeline import BackgroundWriter
from specgen.store.columns import ShardSpec, columns
from specgen.store.writer import ShardWriter, finished_shards, read_sidecar

REPO = Path(__file__).resolve().parent.parent
PIPELINE_DEFAULTS = OmegaConf.load(REPO / "conf" / "pipeline" / "default.yaml")
HIDDEN, LAYERS, VOCAB, MAX_BATCH_SIZE = 4096, 32, 128256, 64  # Llama-3.1-8B; capture.max_batch_size


def llama8b_spec() -> ShardSpec:
    """The spec `generate.target_for` builds for a bf16 Llama-3.1-8B with the default outputs."""
    return ShardSpec(hidden_size=HIDDEN, num_aux=len(default_aux_layers(LAYERS)), dtype="bfloat16")


def draw_units(units: int, rows_per_unit: int) -> list[list[TokenizedSample]]:
    rng = random.Random(0)
    result = []
    for unit in range(units):
        samples = []
        for row in range(rows_per_unit):
            length = rng.randint(200, 400)
            prompt = rng.randint(20, length // 2)
            samples.append(TokenizedSample(f"u{unit}-r{row}", unit * rows_per_unit + row,
                                           [rng.randrange(VOCAB) for _ in range(length)],
                                           [0] * prompt + [1] * (length - prompt)))
        result.append(samples)
    return result


class CapturedBatches:
    """Host tensors standing in for the target's outputs: two batch-sized buffers of random bf16 bit patterns (what
    the bytes are does not change the cost), used in turn."""

    def __init__(self, spec: ShardSpec, batch_tokens: int):
        generator = torch.Generator().manual_seed(0)

        def states(width: int) -> torch.Tensor:
            bits = torch.randint(-(1 << 15), 1 << 15, (batch_tokens, width), dtype=torch.int16, generator=generator)
            return bits.view(torch.bfloat16)

        self.aux = [states(spec.num_aux * HIDDEN) for _ in range(2)]
        self.last = [states(HIDDEN) for _ in range(2)]
        self.turn = 0

    def rows(self, batch: list[TokenizedSample], padded: bool) -> list[dict]:
        aux, last = self.aux[self.turn % 2], self.last[self.turn % 2]
        self.turn += 1
        rows = [{"sample_id": s.sample_id, "source_index": s.source_index, "input_ids": s.input_ids,
                 "loss_mask": s.loss_mask} for s in batch]
        if padded:  # out[b, :len] of a right-padded [B, longest, H] batch (capture_batches)
            longest = max(len(s) for s in batch)
            aux = aux[: len(batch) * longest].view(len(batch), longest, -1)
            last = last[: len(batch) * longest].view(len(batch), longest, -1)
            for b, row in enumerate(rows):
                row["aux_hidden_states"] = aux[b, : len(row["input_ids"])]
                row["last_hidden_state"] = last[b, : len(row["input_ids"])]
        else:  # out[0, lo:hi] of one packed row (capture_packed_batches)
            lo = 0
            for row in rows:
                hi = lo + len(row["input_ids"])
                row["aux_hidden_states"], row["last_hidden_state"] = aux[lo:hi], last[lo:hi]
                lo = hi
        return rows


def write_units(out_dir: Path, spec: ShardSpec, units: list[list[TokenizedSample]], captured: CapturedBatches, *,
                batch_tokens: int, padded: bool, depth: int, writers: int, shard_writer) -> float:
    """Hand the units to a BackgroundWriter as specgen.capture.units.capture_units does; returns the seconds until all committed."""
    captured.turn = 0  # every path gets the same bytes
    started = time.perf_counter()
    with BackgroundWriter(out_dir, spec, depth=depth, on_batch=lambda tokens: None, on_commit=lambda rows: None,
                          shard_writer=shard_writer, writers=writers) as writer:
        for index, samples in enumerate(units):
            writer.begin(index)
            batches = (token_budget_batches(samples, batch_tokens, MAX_BATCH_SIZE) if padded
                       else packed_batches(samples, batch_tokens, MAX_BATCH_SIZE))
            for batch in batches:
                writer.write(captured.rows(batch, padded), None)
            writer.commit({"samples": len(samples), "tokens": sum(len(s) for s in samples)}, [], len(samples))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="/tmp", help="folder to write the shards under (a fresh subfolder)")
    parser.add_argument("--units", type=int, default=3, help="work units (shards) per path and round")
    parser.add_argument("--rows-per-unit", type=int, default=24, help="rows per unit (output.shard_size)")
    parser.add_argument("--batch-tokens", type=int, default=4096, help="tokens per captured batch")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (the table gives medians)")
    parser.add_argument("--writers", type=int, default=int(PIPELINE_DEFAULTS.writers),
                        help="writer threads of the last path (default: pipeline.writers)")
    parser.add_argument("--depth", type=int, default=int(PIPELINE_DEFAULTS.write_queue), help="pipeline.write_queue")
    parser.add_argument("--padded", action="store_true", help="rows of padded batches (capture.packing=false)")
    args = parser.parse_args()

    spec = llama8b_spec()
    units = draw_units(args.units, args.rows_per_unit)
    captured = CapturedBatches(spec, args.batch_tokens)
    tokens = sum(len(s) for samples in units for s in samples)
    bytes_per_token = sum((c.width or 1) * c.storage_dtype.itemsize for c in columns(spec) if c.per_token)
    paths = {"before": (1, functools.partial(ShardWriter, overlap_hash=False, fewer_copies=False)),
             "writers=1": (1, ShardWriter)}
    if args.writers != 1:
        paths[f"writers={args.writers}"] = (args.writers, ShardWriter)

    root = Path(tempfile.mkdtemp(prefix="specgen-write-path-", dir=args.out))
    seconds = {name: [] for name in paths}
    checksums, sizes = {}, {}
    try:
        for writers, shard_writer in paths.values():  # untimed: pyarrow's first string array takes ~0.5 s
            write_units(root / "warm-up", spec, [units[0][:4]], captured, batch_tokens=args.batch_tokens,
                        padded=args.padded, depth=args.depth, writers=writers, shard_writer=shard_writer)
            shutil.rmtree(root / "warm-up")
        for round_ in range(args.repeats):
            for name, (writers, shard_writer) in paths.items():
                out_dir = root / f"{name}-{round_}"
                seconds[name].append(write_units(out_dir, spec, units, captured, batch_tokens=args.batch_tokens,
                                                 padded=args.padded, depth=args.depth, writers=writers,
                                                 shard_writer=shard_writer))
                shards = finished_shards(out_dir)
                checksums.setdefault(name, set()).add(json.dumps(
                    [read_sidecar(out_dir, index)["checksum"] for index in sorted(shards)]))
                sizes[name] = sum(path.stat().st_size for path in shards.values())
                shutil.rmtree(out_dir)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    layout = "padded" if args.padded else "packed"
    total = next(iter(sizes.values()))
    print(f"Llama-3.1-8B shape (hidden {HIDDEN}, {spec.num_aux} aux layers, bf16, {bytes_per_token:,} B/token) · "
          f"{args.units} units x {args.rows_per_unit} rows, {tokens:,} tokens, {total / 1e9:.2f} GB of shards · "
          f"{layout} batches of {args.batch_tokens} tokens · queue {args.depth} · into {args.out} · "
          f"median of {args.repeats}")
    print(f"{'path':<12} {'GB/s':>6} {'tokens/s':>10} {'seconds':>8}   rounds (GB/s)")
    for name, times in seconds.items():
        median = statistics.median(times)
        rounds = " ".join(f"{sizes[name] / t / 1e9:.2f}" for t in times)
        print(f"{name:<12} {sizes[name] / median / 1e9:>6.2f} {tokens / median:>10,.0f} {median:>8.2f}   {rounds}")
    same = len({digest for digests in checksums.values() for digest in digests}) == 1
    print(f"byte-identical shards across paths and rounds (sha256 in the sidecars): {'yes' if same else 'NO'}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
