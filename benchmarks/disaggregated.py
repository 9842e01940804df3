"""Disaggregated training beside offline and online training of the same samples: samples/s, data wait, buffer bytes.

  offline    specgen.generate (shards) then specgen.train from them; `s` is the train stage's own loop time, and
             the generate time is printed beside it
  online     specgen.train mode=online: the target runs in the training process, batch by batch
  S x T      S capture servers (`specgen.capture_server`, processes of their own) feeding T trainer processes
             (`specgen.train mode=disaggregated`, `accelerate launch` for T > 1) through a stream folder

Every run trains the same samples for one epoch with the same plan and runtime.threads=1 per process. `s` is the
trainer's own loop time (model loading excluded; its summary line), `samples/s` the samples of the epoch over it,
`wait` the share of it the main trainer process spent waiting for captured batches, and `peak MiB` the most bytes
the stream folder's objects held (sampled every 5 ms) against `stream.max_bytes`.

  python benchmarks/disaggregated.py [--rows 400] [--recipe demo] [--max-bytes 67108864] [--window 4]
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
LAUNCH_TWO = ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
              "--mixed_precision", "no", "--dynamo_backend", "no"]


def run(args: list[str], *, launch_two: bool = False) -> str:
    command = [sys.executable, *(LAUNCH_TWO if launch_two else []), *args]
    done = subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"failed: {' '.join(command)}\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done.stdout


def loop_seconds(summary: str) -> float:
    return float(re.search(r"tokens, ([\d.]+)s in this run\)", summary).group(1))


def stream_numbers(summary: str) -> tuple[float, dict[str, int]]:
    line = next(line for line in summary.splitlines() if line.strip().startswith("stream"))
    waited = float(re.search(r"waited ([\d.]+)s", line).group(1))
    servers = {name: int(count) for name, count in re.findall(r"([\w.-]+): (\d+)", line.split("(", 1)[1])}
    return waited, servers


class PeakBytes:
    """The most bytes a folder held, sampled every 5 ms in a thread."""

    def __init__(self, folder: Path):
        self.folder, self.peak, self._stop = folder, 0, threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self):
        while not self._stop.is_set():
            total = 0
            if self.folder.is_dir():
                for path in self.folder.iterdir():
                    try:
                        total += path.stat().st_size
                    except FileNotFoundError:
                        pass
            self.peak = max(self.peak, total)
            time.sleep(0.005)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=400)
    parser.add_argument("--recipe", default="demo")
    parser.add_argument("--max-bytes", type=int, default=64 << 20)
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--layouts", default="1x1,2x1,1x2,2x2", help="SxT: servers x trainer processes")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="specgen-disagg-"))
    target = f"{REPO}/specgen/assets/tiny-target" if args.recipe == "demo" else None
    common = [f"recipe={args.recipe}", f"data.max_rows={args.rows}", "runtime.threads=1", "runtime.progress=false"]
    trainer = [*common, "train.epochs=1", "train.eval_every=0", "train.tensorboard=false", "output.overwrite=true"]
    rows = []

    start = time.perf_counter()
    run(["-m", "specgen.generate", *common, f"output.dir={work / 'shards'}"])
    generate_s = time.perf_counter() - start
    out = run(["-m", "specgen.train", *trainer, f"data.shards={work / 'shards'}", f"output.dir={work / 'offline'}"])
    samples = int(re.search(r"\((\d+) samples\)", out).group(1))
    rows.append(("offline", loop_seconds(out), None, None, f"+ generate {generate_s:.0f}s (process)"))
    out = run(["-m", "specgen.train", *trainer, "mode=online", f"output.dir={work / 'online'}"])
    rows.append(("online", loop_seconds(out), None, None, ""))

    for layout in args.layouts.split(","):
        servers, trainers = (int(n) for n in layout.split("x"))
        stream = work / f"stream-{layout}"
        started = [subprocess.Popen([sys.executable, "-m", "specgen.capture_server", f"stream.dir={stream}",
                                     f"model.path={target}", f"stream.server_id=s{i}", "runtime.threads=1"],
                                    cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                   for i in range(servers)]
        with PeakBytes(stream / "objects") as peak:
            out = run(["-m", "specgen.train", *trainer, "mode=disaggregated", f"stream.dir={stream}",
                       f"stream.window={args.window}", f"stream.max_bytes={args.max_bytes}",
                       f"output.dir={work / f'disagg-{layout}'}"], launch_two=trainers == 2)
        for server in started:
            server.wait(timeout=120)
        waited, by_server = stream_numbers(out)
        seconds = loop_seconds(out)
        rows.append((f"{servers} x {trainers}", seconds, waited / seconds, peak.peak,
                     "batches by server (main process): " + ", ".join(f"{k} {v}" for k, v in by_server.items())))
    shutil.rmtree(work, ignore_errors=True)

    print(f"\n{samples} samples, one epoch, recipe={args.recipe}, stream.max_bytes={args.max_bytes / 2**20:.0f} MiB, "
          f"stream.window={args.window}\n")
    print("| run | s | samples/s | wait | peak MiB | notes |\n|---|---|---|---|---|---|")
    for name, seconds, wait, peak_bytes, notes in rows:
        print(f"| {name} | {seconds:.1f} | {samples / seconds:.1f} | "
              f"{'' if wait is None else f'{100 * wait:.0f}%'} | "
              f"{'' if peak_bytes is None else f'{peak_bytes / 2**20:.1f}'} | {notes} |")


if __name__ == "__main__":
    main()
