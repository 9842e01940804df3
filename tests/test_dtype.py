"""model.dtype=auto: the checkpoint's dtype on accelerators; on a CPU only where it multiplies that dtype natively
(else float32); an explicit dtype as given. Every stage that loads the target says the choice and why."""

import json

import pytest

from conftest import BUNDLED_CHAT, REPO
from specgen.config import compose
from specgen.errors import SpecgenError
from specgen.runtime.dtype import checkpoint_dtype, choose_dtype, resolve_model_dtype

TINY = REPO / "specgen" / "assets" / "tiny-target"  # a bfloat16 checkpoint
AVX2 = frozenset({"avx", "avx2", "fma"})


@pytest.mark.parametrize("device, saved, flags, expected", [
    ("cuda", "bfloat16", AVX2, "bfloat16"),            # accelerators: the checkpoint's dtype, whatever the CPU
    ("cuda:1", "float16", frozenset(), "float16"),
    ("cpu", "bfloat16", AVX2, "float32"),              # no native bf16 matmul: float32
    ("cpu", "bfloat16", AVX2 | {"avx512_bf16"}, "bfloat16"),
    ("cpu", "bfloat16", AVX2 | {"amx_bf16"}, "bfloat16"),
    ("cpu", "float16", AVX2 | {"avx512_bf16"}, "float32"),  # bf16 support says nothing about fp16
    ("cpu", "float16", AVX2 | {"avx512_fp16"}, "float16"),
    ("cpu", "float16", AVX2 | {"amx_fp16"}, "float16"),
    ("cpu", "float32", AVX2, "float32"),
    ("cpu", None, AVX2, "float32"),                    # unrecorded: float32, as transformers loads it
    ("cuda", None, AVX2, "float32"),
])
def test_auto_follows_the_device_and_the_cpu(device, saved, flags, expected):
    choice = choose_dtype("auto", device, saved, cpu_flags=flags)
    assert choice.name == expected and choice.reason.startswith("model.dtype=auto")
    if saved == "bfloat16" and device == "cpu" and expected == "float32":
        assert "no native bfloat16 matmul (no avx512_bf16 or amx_bf16)" in choice.reason


def test_an_explicit_dtype_is_used_as_given():
    assert choose_dtype("bfloat16", "cpu", "float32", cpu_flags=AVX2).name == "bfloat16"
    assert str(choose_dtype("float32", "cuda", "bfloat16")) == "float32 (model.dtype)"
    with pytest.raises(SpecgenError, match="model.dtype=fp8"):
        choose_dtype("fp8", "cpu", None)


def test_the_checkpoint_dtype_is_read_from_config_json(tmp_path):
    assert checkpoint_dtype(TINY) == "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"torch_dtype": "float16"}}))
    assert checkpoint_dtype(tmp_path) == "float16"
    assert checkpoint_dtype(tmp_path / "absent") is None
    assert resolve_model_dtype("auto", "cuda", tmp_path).name == "float16"


def test_generate_says_the_dtype_it_chose_and_why(tmp_path, capsys):
    from specgen.generate import run

    manifest = run(compose("generate", [f"model.path={TINY}", f"data.path={BUNDLED_CHAT}", "data.max_rows=2",
                                        f"output.dir={tmp_path / 'out'}", "runtime.progress=false"]))
    expected = resolve_model_dtype("auto", "cpu", TINY)
    line = next(line for line in capsys.readouterr().out.splitlines() if "target dtype" in line)
    assert line.split("target dtype", 1)[1].strip() == str(expected)
    assert manifest["dtype"] == expected.name and manifest["last_run"]["dtype"] == str(expected)
