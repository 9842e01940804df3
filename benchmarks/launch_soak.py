"""Launch soak: a two-process training launch, run over and over with others beside it, counting launches that hang.

A rare hang (one launch in twenty) fails CI without failing any run a developer makes by hand. This runs the command of
`tests/test_train_distributed.py::test_two_processes_equal_one_process_accumulating[ddp]` (`accelerate launch`, 2
CPU processes over gloo, DDP, 2 steps, the acceptance probe at step 1) `--launches` times, `--side-by-side` at once
(2: as `pytest -n 2` runs them on 2 cores). A launch still running after `--timeout` seconds is a hang: where `py-spy`
is on PATH each of its processes' native stacks (`py-spy dump --native`) go to OUT/hang-N.txt, then it is killed. It
prints a line per launch and a table of the counts.

The data: the embedded default's tiny target over 12 bundled conversations (`python -m specgen.generate`).

  python benchmarks/launch_soak.py [--launches 150] [--side-by-side 2] [--timeout 120] [--out /tmp/launch-soak]
"""

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from specgen.assets import ASSETS_DIR
from specgen.runtime.reaper import descendants

REPO = Path(__file__).resolve().parent.parent
TRAIN = ["train.num_workers=0", "runtime.progress=false", "runtime.threads=1", "train.tensorboard=false",
         "train.batch_tokens=256", "train.ttt_length=3", "draft.vocab_size=300", "train.lr=1e-3", "distributed=ddp",
         "train.max_steps=2", "train.schedule_steps=2", "train.log_every=2", "train.eval_every=1",
         f"train.eval_prompts={ASSETS_DIR / 'chat' / 'heldout.jsonl'}", "train.eval_max_prompts=2",
         "evaluate.max_new_tokens=8"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONFAULTHANDLER": "1"}


def launch(shards: Path, out_dir: Path, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
           "-m", "specgen.train", *TRAIN, f"data.shards={shards}", f"output.dir={out_dir}"]
    with open(log, "w") as f:
        return subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def end_hung(proc: subprocess.Popen, stacks: Path) -> None:
    """Native stacks of the launcher and every process below it (when py-spy is there), then SIGKILL to them all."""
    pids = [proc.pid, *descendants([proc.pid])]
    if shutil.which("py-spy"):
        with open(stacks, "w") as f:
            for pid in pids:
                f.write(f"=== pid {pid}\n")
                f.flush()
                subprocess.run(["py-spy", "dump", "--native", "--pid", str(pid)], stdout=f, stderr=subprocess.STDOUT)
    for pid in reversed(pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=150)
    parser.add_argument("--side-by-side", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--out", type=Path, default=Path("/tmp/launch-soak"))
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    shards = args.out / "shards"
    subprocess.run([sys.executable, "-m", "specgen.generate", f"output.dir={shards}", "data.max_rows=12",
                    "output.shard_size=5", "runtime.progress=false"], cwd=REPO, env=ENV, check=True,
                   capture_output=True)
    counts = {"ended": 0, "failed": 0, "hung": 0}
    running: dict[int, tuple[subprocess.Popen, float]] = {}
    started = 0
    while started < args.launches or running:
        while started < args.launches and len(running) < args.side_by_side:
            started += 1
            proc = launch(shards, args.out / f"run-{started}", args.out / f"log-{started}.txt")
            running[started] = proc, time.monotonic()
        time.sleep(0.5)
        for n, (proc, t0) in list(running.items()):
            seconds = time.monotonic() - t0
            if proc.poll() is None and seconds < args.timeout:
                continue
            if proc.poll() is None:
                end_hung(proc, args.out / f"hang-{n}.txt")
                outcome = "hung"
            else:
                outcome = "ended" if proc.returncode == 0 else "failed"
            counts[outcome] += 1
            print(f"launch {n:4d}: {outcome} after {seconds:.0f} s (log-{n}.txt)", flush=True)
            del running[n]
    print(f"\n| launches | ended | failed | hung |\n|---|---|---|---|\n"
          f"| {args.launches} | {counts['ended']} | {counts['failed']} | {counts['hung']} |")
    print(f"logs and stacks: {args.out}")


if __name__ == "__main__":
    main()
