"""The parts of `python -m specgen.regenerate`: replace assistant turns with the target's own completions.

- `engine`: batched generation on the transformers backend (left-padded `model.generate` with the KV cache);
- `reply`: a completion's text -> an assistant message (reasoning split off for thinking templates);
- `turns`: conversations -> regenerated conversations, turn by turn, batched across conversations;
- `parts`: the output folder of atomically written `part-NNNNN.jsonl` files that `specgen.generate` reads;
- `setup`: the stage's config -> target, prompt limits, generator and turn policy;
- `manifest`: the dataset identity, `rejected.jsonl`, the manifest and the summary.
- `grow`: a re-run with a larger `data.max_rows` on the same output.dir keeps the finished parts and adds the rest.
"""

from specgen.regen.engine import Completion, Generator, Sampling
from specgen.regen.parts import finished_parts, part_name, read_sidecar, remove_partial, write_part
from specgen.regen.reply import assistant_reply, renders_reasoning
from specgen.regen.turns import ConversationRegenerator, TurnPolicy, UnitResult

__all__ = [
    "Completion", "ConversationRegenerator", "Generator", "Sampling", "TurnPolicy", "UnitResult", "assistant_reply",
    "finished_parts", "part_name", "read_sidecar", "remove_partial", "renders_reasoning", "write_part",
]
