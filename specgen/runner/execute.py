"""Running a `specgen run` plan: each stage as its own process in its folder, output teed to its log, completion
recorded atomically in stage.json, resumption, the run's identity in run.json, and the closing table
(`specgen.run` describes the behaviour).
"""

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from specgen.errors import SpecgenError
from specgen.progress import format_table
from specgen.runner.plan import Plan, Step, jsonable
from specgen.store.commit import write_json_atomic
from specgen.store.lease import hold_lease

RUN_FILE, STAGE_FILE, STAGE_LOG = "run.json", "stage.json", "stage.log"


def execute(plan: Plan, argv: list[str]) -> int:
    """Run the plan's stages (`specgen.run`); returns the exit status (a failing stage's)."""
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    with hold_lease(plan.run_dir, stage="run"):  # one `specgen run` per run.dir at a time
        _claim_run_dir(plan, argv)
        rows, upstream_ran = [], False
        for step in plan.steps:
            done = _read_stage_file(step.folder)
            if done is not None and not upstream_ran:
                rows.append((step, "skipped: finished earlier", done.get("wall_s"), done.get("headline", "")))
                print(f"specgen run: {step.label} finished earlier ({step.folder / STAGE_FILE}): skipped", flush=True)
                continue
            if done is not None:  # an earlier stage ran again: this one's inputs may have changed
                shutil.rmtree(step.folder)
            extra = _resume_args(step)
            command = [sys.executable, "-m", f"specgen.{step.stage}", *step.args, *extra]
            print(f"specgen run: {step.label}: {shlex.join(['python', *command[1:]])}", flush=True)
            code, seconds = _run_stage(command, step.folder)
            if code != 0:
                status = code if code > 0 else 128 - code  # killed by signal N: 128 + N, as a shell says
                print(f"error: stage {step.label} failed (exit status {status}); its log: {step.folder / STAGE_LOG}",
                      file=sys.stderr, flush=True)
                return status
            headline = _headline(step)
            write_json_atomic(step.folder / STAGE_FILE, {
                "entry": step.entry, "stage": step.stage, "command": ["python", *command[1:]],
                "wall_s": round(seconds, 3), "headline": headline, "resumed_with": extra,
                "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
            rows.append((step, "ran" + (f" ({' '.join(extra)})" if extra else ""), seconds, headline))
            upstream_ran = True
    print(closing_table(plan, rows), flush=True)
    return 0


def _claim_run_dir(plan: Plan, argv: list[str]) -> None:
    """Write run.json on the first invocation; refuse a run.dir whose run.json names other settings."""
    path = plan.run_dir / RUN_FILE
    identity = jsonable(plan.identity)
    if path.exists():
        previous = json.loads(path.read_text()).get("identity")
        if previous != identity:
            changed = [name for name in identity if (previous or {}).get(name) != identity[name]]
            raise SpecgenError(f"run.dir={plan.run_dir} holds a run with other settings (changed: "
                               f"{', '.join(changed) or 'all'}; its {RUN_FILE}: {_describe(previous)}); pass "
                               "another run.dir, or the same recipe, stages and keys to resume it")
        return
    write_json_atomic(path, {"identity": identity, "command": ["specgen", "run", *argv],
                             "stages": {step.entry: step.label for step in plan.steps}})


def _describe(identity: dict | None) -> str:
    if not identity:
        return "unreadable"
    return " ".join([f"recipe={identity.get('recipe')}", f"run.stages=[{','.join(identity.get('stages', []))}]",
                     *identity.get("keys", [])])


def _read_stage_file(folder: Path) -> dict | None:
    try:
        return json.loads((folder / STAGE_FILE).read_text())
    except (OSError, ValueError):
        return None


def _resume_args(step: Step) -> list[str]:
    """What a stage needs to continue the folder an interrupted run left (generate, regenerate and evaluate resume
    the same command by themselves; verify keeps nothing)."""
    folder = step.folder
    if not folder.is_dir():
        return []
    if step.stage == "train":
        checkpoints = folder / "checkpoints"
        complete = checkpoints.is_dir() and any(p.is_dir() and re.fullmatch(r"step-\d+", p.name)
                                                for p in checkpoints.iterdir())
        if complete or (folder / "training_state").is_dir():
            return ["train.resume=true"]
        if any((folder / name).exists() for name in ("model.safetensors", "config.json", "checkpoints")):
            return ["output.overwrite=true"]  # killed during its first save: nothing to resume, start over
    if step.stage == "export" and (folder / "config.json").exists():
        return ["output.overwrite=true"]
    return []


def _run_stage(command: list[str], folder: Path) -> tuple[int, float]:
    """Run one stage, its stdout and stderr to the console and to folder/stage.log; (exit status, seconds)."""
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    with open(folder / STAGE_LOG, "ab") as log:
        log.write(f"$ {shlex.join(['python', *command[1:]])}\n".encode())
        log.flush()
        lock = threading.Lock()
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        pumps = [threading.Thread(target=_tee, args=(pipe, console, log, lock), daemon=True)
                 for pipe, console in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr))]
        for pump in pumps:
            pump.start()
        try:
            code = proc.wait()
        except KeyboardInterrupt:  # Ctrl-C reached the stage too (same process group): let it end
            try:
                code = proc.wait(timeout=30)
            except (subprocess.TimeoutExpired, KeyboardInterrupt):
                proc.kill()
                code = proc.wait()
            code = code or -signal.SIGINT
        for pump in pumps:
            pump.join()
    return code, time.perf_counter() - start


def _tee(pipe, console, log, lock: threading.Lock) -> None:
    out = getattr(console, "buffer", None)
    while chunk := os.read(pipe.fileno(), 65536):
        with lock:
            log.write(chunk)
            log.flush()
        if out is not None:
            out.write(chunk)
            out.flush()
        else:
            console.write(chunk.decode(errors="replace"))
            console.flush()
    pipe.close()


# -- the closing table ----------------------------------------------------------------------------------------------

def _headline(step: Step) -> str:
    """The stage's figure that matters, from the files it wrote ('' when they cannot be read)."""
    folder = step.folder
    try:
        if step.stage == "generate":
            stats = json.loads((folder / "manifest.json").read_text())["stats"]
            return (f"{stats['samples']:,} samples, {stats['tokens']:,} tokens "
                    f"({stats['trainable_tokens']:,} trainable)")
        if step.stage == "regenerate":
            stats = json.loads((folder / "manifest.json").read_text())["stats"]
            return f"{stats['rows']:,} rows, {stats['new_tokens']:,} new tokens"
        if step.stage == "train":
            lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
            last = lines[-1]
            parts = [f"step {last['step']}", f"loss {last['loss']:.4f}"]
            if "accept_len" in last:
                parts.append(f"acceptance {last['accept_len']:.2f} (decoded)")
            elif "accept_len_sim" in last:
                parts.append(f"simulated acceptance {last['accept_len_sim']:.2f}")
            return ", ".join(parts)
        if step.stage == "evaluate":
            report = json.loads((folder / "eval.json").read_text())
            return (f"acceptance length {report['acceptance_length']:.3f} (K={report['num_draft_tokens']}), "
                    f"lossless {report['lossless_line']}")
        if step.stage == "export":
            fmt = step.cfg.export.format if step.cfg is not None else "?"
            return f"{folder} ({fmt})"
        if step.stage == "verify":
            return f"audit passed: {step.cfg.data.shards if step.cfg is not None else ''}"
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return ""
    return ""


def _seconds(value) -> str:
    if value is None:
        return "?"
    minutes, seconds = divmod(float(value), 60)
    return f"{seconds:.1f} s" if not minutes else f"{int(minutes)} min {seconds:04.1f} s"


def closing_table(plan: Plan, rows: list[tuple]) -> str:
    status_width = max(len(status) for _, status, _, _ in rows)
    ran = sum(status.startswith("ran") for _, status, _, _ in rows)
    total = sum(seconds or 0 for _, status, seconds, _ in rows if status.startswith("ran"))
    summary = (f"all {len(rows)} stages finished earlier" if not ran else f"{ran} stages ran, in {_seconds(total)}"
               if ran == len(rows) else f"{ran} of {len(rows)} stages ran, in {_seconds(total)}")
    lines = [("run.dir", f"{plan.run_dir} ({summary})")] + [
        (step.label, f"{status:<{status_width}}  {_seconds(seconds):>12}  {headline}")
        for step, status, seconds, headline in rows]
    return format_table(lines)


