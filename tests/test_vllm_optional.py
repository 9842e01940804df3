"""vLLM is an optional extra: without it, engine=vllm is a one-line error that says how to install it."""

import importlib.util

import pytest

from specgen.config import compose
from specgen.errors import SpecgenError


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
@pytest.mark.parametrize("stage", ["generate", "regenerate"])
def test_engine_vllm_without_vllm_says_how_to_install(stage, tmp_path):
    from specgen.generate import run as generate
    from specgen.regenerate import run as regenerate

    cfg = compose(stage, ["engine=vllm", f"output.dir={tmp_path / 'out'}", "runtime.progress=false"])
    with pytest.raises(SpecgenError, match=r'pip install "specgen\[vllm\]"'):
        {"generate": generate, "regenerate": regenerate}[stage](cfg)
    assert not any(m == "vllm" or m.startswith("vllm.") for m in __import__("sys").modules)
