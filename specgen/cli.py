"""`specgen STAGE [recipe=NAME] [key=value ...]`: the console command, one entry for every stage.

`specgen generate ...` is `python -m specgen.generate ...`; under `accelerate launch` use either
`accelerate launch -m specgen.generate ...` or `accelerate launch $(which specgen) generate ...`.
"""

import importlib
import sys

from specgen.config import check_command_line

STAGES = {
    "generate": "conversations -> target capture -> Arrow shards",
    "train": "train a draft: EAGLE-3, EAGLE-3.1, P-EAGLE or DFlash (offline from shards, online, or disaggregated)",
    "evaluate": "acceptance length of a draft by speculative decoding, and a lossless check",
    "verify": "audit a generated dataset",
    "regenerate": "replace assistant turns with the target's own answers",
    "export": "write a draft checkpoint in the layout an engine reads (vllm, sglang, speculators)",
    "capture_server": "capture target hidden states for disaggregated training (train mode=disaggregated)",
    "run": "a recipe's stages in order (run.stages), each in its own folder of run.dir; re-running resumes",
}
CONFIGURED = set(STAGES) - {"run"}  # the Hydra stages (`specgen run` checks its stages' configs itself)


def usage() -> str:
    width = max(map(len, STAGES))
    rows = "\n".join(f"  {name:<{width}}  {what}" for name, what in STAGES.items())
    return f"usage: specgen STAGE [recipe=NAME] [key=value ...]\n\nstages:\n{rows}\n"


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help", "help"):
        print(usage())
        sys.exit(0 if len(sys.argv) >= 2 else 2)
    stage = sys.argv[1]
    if stage not in STAGES:
        sys.exit(f"error: unknown stage {stage!r}; one of: {', '.join(STAGES)}")
    sys.argv = [f"specgen {stage}", *sys.argv[2:]]
    if stage in CONFIGURED:
        check_command_line(stage)  # a config error or `--cfg job` answered before the stage imports torch
    try:
        module = importlib.import_module(f"specgen.{stage}")
    except ModuleNotFoundError:
        sys.exit(f"error: stage {stage!r} is not available in this installation")
    module.main()


if __name__ == "__main__":
    main()
