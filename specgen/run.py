"""`python -m specgen.run recipe=NAME run.dir=DIR [key=value ...]`: a recipe's stages in order, one resumable command.

The recipe lists its stages (`run.stages`, e.g. `[generate, train, evaluate]`); each runs as its own process,
`python -m specgen.STAGE recipe=NAME <its keys>`, in its own folder of run.dir (`01-generate`, `02-train`, ...), so
stages never import each other. What a stage writes feeds the next (FEEDS): regenerate's folder is generate's
data.path (a list when several regenerate entries came before), generate's is train's and verify's data.shards,
train's is evaluate's and export's draft.path; every stage's output.dir is its folder.

A `key=value` on the command line goes to every stage whose own config has the key (`train.max_steps` to train,
`runtime.device` to all but export, `GROUP=OPTION` to the stages with that group); a key no stage of the run has is a
one-line error before anything runs. The recipe's `run.overrides` (or `run.overrides.ENTRY.key=value` on the command
line) sets a key for one entry only, over the command line's; `"{entry}"` in such a value is that entry's folder and
`"{key}"` the command line's (else the recipe's) value of key, so a recipe can pool its input with regenerated data:
`data.path: ["{data.path}", "{regenerate}"]`. A stage name with a `-label` suffix (`regenerate-synth`) runs a stage a
second time, in a folder of its own.

Every stage's command is composed and validated before the first one starts. Each stage's output goes to the
console and to its folder's `stage.log`; once it exits 0, `stage.json` (its command, wall time and headline figure)
is written atomically. Re-running the same command resumes: finished stages are skipped, the stage a kill
interrupted runs again where it resumes by itself (generate, regenerate and evaluate continue their folder; train
gets `train.resume=true` when its folder holds a complete checkpoint and starts over otherwise; export rewrites its
folder), and every stage after a stage that ran is run again. `run.json` records the run's settings: the same
run.dir with another recipe, other stages or other keys is refused. A failing stage stops the run with its exit
status, naming the stage and its log. The run ends with a table: per stage, ran or skipped, wall time, folder and
headline figure.
"""

import sys

from specgen.errors import SpecgenError
from specgen.runner import execute, make_plan
from specgen.runtime.reaper import guard_job


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(arg in ("-h", "--help") for arg in argv):
        print(__doc__)
        return
    try:
        plan = make_plan(argv)  # every stage's command composed and checked before the first one starts
        guard_job()  # whatever ends this run ends the stage it runs (specgen.runtime.reaper)
        code = execute(plan, argv)
    except SpecgenError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    sys.exit(code)


if __name__ == "__main__":
    main()
