"""Kill soak: SIGKILL `specgen.generate` at random moments, re-run it, and compare the dataset with an uninterrupted run.

Each trial starts the same generate command in a fresh output.dir and kills it with SIGKILL at a random moment of
its working life: it draws k uniformly from 0..shards-1, waits until k shards are finished (k = 0: until the job has
taken the output directory's lease, before the target is even loaded), then waits a further uniform random time of
up to one shard's duration (measured on an uninterrupted run first), so kills land anywhere from loading to the last
commit whatever the machine's load: mid-shard, between the Arrow file and its sidecar, right after a rename. It
re-runs the same command at once (which must take over the killed job's lease and
resume), and compares every file that holds data byte for byte with the uninterrupted run's: the shards, their
sidecars (stats, rejected rows, checksums), token_counts.json, target_token_counts.json and rejected.jsonl, plus the
manifest's shard list and checksums (the manifest's timings differ by nature). It prints one line per trial (where
the kill landed: finished shards, a temp file in flight) and the count of identical datasets.

The job: the bundled tiny target (bf16, hidden 128, 8 layers) over the bundled chat sample, 32 rows in units of 4
(8 shards), small forward batches, one compute thread per process: cheap on a shared CPU.

  nice python benchmarks/kill_soak.py [--trials 20] [--rows 40] [--seed 0]
"""

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LEASE = ".specgen-lease.json"
COMPARED = ("token_counts.json", "target_token_counts.json", "rejected.jsonl")


def command(out_dir: Path, rows: int) -> list[str]:
    return [sys.executable, "-m", "specgen.generate", f"output.dir={out_dir}", f"data.max_rows={rows}",
            "output.shard_size=4", "capture.batch_tokens=512", "runtime.progress=false",
            "capture.count_target_tokens=true"]


def environment() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def run_to_end(out_dir: Path, rows: int) -> None:
    result = subprocess.run(command(out_dir, rows), cwd=REPO, env=environment(), capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"generate failed in {out_dir}:\n{result.stderr[-2000:]}")


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> float:
    """Poll until `path` exists (or the process ends); returns the time it appeared."""
    deadline = time.monotonic() + timeout
    while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return time.monotonic()


def dataset_files(out_dir: Path) -> dict[str, bytes]:
    """The bytes that define the dataset (everything but the manifest's timings and the log)."""
    files = {path.name: path.read_bytes() for path in sorted(out_dir.glob("shard-*"))}
    files.update({name: (out_dir / name).read_bytes() for name in COMPARED if (out_dir / name).exists()})
    manifest = json.loads((out_dir / "manifest.json").read_text())
    files["manifest:shards+checksums+stats"] = json.dumps(
        [manifest["shards"], manifest["checksums"], {k: v for k, v in manifest["stats"].items()}],
        sort_keys=True).encode()
    return files


def wait_for_shards(out_dir: Path, count: int, proc: subprocess.Popen, timeout: float = 600) -> None:
    """Poll until `count` shards are finished (k = 0: until the lease is taken) or the process ends."""
    if count == 0:
        wait_for(out_dir / LEASE, proc, timeout)
        return
    deadline = time.monotonic() + timeout
    while len(list(out_dir.glob("shard-*.arrow"))) < count and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)


def trial(index: int, reference: dict[str, bytes], timing: tuple[float, float], shards: int, rows: int,
          rng: random.Random, root: Path) -> dict:
    """timing: (seconds from taking the lease to the first shard, seconds per shard) of the uninterrupted run."""
    out_dir = root / f"trial-{index:02d}"
    proc = subprocess.Popen(command(out_dir, rows), cwd=REPO, env=environment(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    after_shards = rng.randrange(shards)
    delay = rng.uniform(0, timing[1] + (timing[0] if after_shards == 0 else 0))
    wait_for_shards(out_dir, after_shards, proc)
    time.sleep(delay)
    ended_before_kill = proc.poll() is not None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    at_kill = {"finished": len(list(out_dir.glob("shard-*.arrow"))), "tmp": len(list(out_dir.glob("*.tmp"))),
               "manifest": (out_dir / "manifest.json").exists(), "lease_left": (out_dir / LEASE).exists()}
    start = time.monotonic()
    run_to_end(out_dir, rows)
    got = dataset_files(out_dir)
    identical = got == reference
    differing = sorted(name for name in set(got) | set(reference) if got.get(name) != reference.get(name))
    shutil.rmtree(out_dir)
    return {"trial": index, "kill": f"{delay:.2f}s after {after_shards} shards", "ended_before_kill": ended_before_kill,
            **at_kill,
            "rerun_s": round(time.monotonic() - start, 1), "identical": identical, "differing": differing[:5]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="specgen-kill-soak-") as tmp:
        root = Path(tmp)
        reference_dir = root / "reference"
        proc = subprocess.Popen(command(reference_dir, args.rows), cwd=REPO, env=environment(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        leased = wait_for(reference_dir / LEASE, proc)
        first = wait_for(reference_dir / "shard-00000.arrow", proc)
        _, stderr = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"the uninterrupted run failed:\n{stderr[-2000:]}")
        reference = dataset_files(reference_dir)
        shards = len(list(reference_dir.glob("shard-*.arrow")))
        shard_s = (time.monotonic() - first) / max(1, shards - 1)
        print(f"uninterrupted run: {shards} shards; {first - leased:.1f}s from taking the lease to the first shard, "
              f"then {shard_s:.1f}s per shard; {args.trials} kills", flush=True)
        results = []
        for index in range(args.trials):
            result = trial(index, reference, (first - leased, shard_s), shards, args.rows, rng, root)
            results.append(result)
            print(json.dumps(result), flush=True)
    identical = sum(result["identical"] for result in results)
    mid = sum(0 < result["finished"] < shards for result in results)
    print(f"identical datasets: {identical} of {len(results)} kills ({mid} landed with some but not all shards "
          f"finished, {sum(r['tmp'] > 0 for r in results)} with a shard in flight, "
          f"{sum(r['lease_left'] for r in results)} left a lease that the re-run took over)")
    sys.exit(0 if identical == len(results) else 1)


if __name__ == "__main__":
    main()
