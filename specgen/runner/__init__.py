"""`specgen run`: a recipe's stages in order as one resumable command. `plan` composes every stage's command,
`execute` runs them (the behaviour: `specgen.run`)."""

from specgen.runner.execute import execute
from specgen.runner.plan import Plan, Step, make_plan

__all__ = ["Plan", "Step", "execute", "make_plan"]
