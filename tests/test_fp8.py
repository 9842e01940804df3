"""fp8 storage (`output.codec=fp8`): the codec's error bound, shards that decode transparently, old shards."""

import json

import pyarrow as pa
import pytest
import torch

from specgen import open_shards
from specgen.config import compose
from specgen.errors import SpecgenError
from specgen.generate import run
from specgen.store import ShardSpec, ShardWriter, fp8
from specgen.store.columns import METADATA_KEY


def decode_error_bound(hidden: torch.Tensor, decoded: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Per element: e4m3 rounding (2^-4 relative, or 2^-10 * scale in the subnormal range), then the rounding of
    the decoded value to its dtype (2^-9 relative for bf16, nothing for float32)."""
    groups = scales.shape[-1]
    scale = scales.unsqueeze(-1).expand(*scales.shape, hidden.shape[-1] // groups).flatten(-2)
    output_rounding = 2.0 ** -9 if decoded.dtype == torch.bfloat16 else 1e-6
    x, y = hidden.float().abs(), decoded.float().abs()
    return 2.0 ** -4 * x + 2.0 ** -10 * scale + output_rounding * y + 1e-6 * scale


def layered_states(tokens: int, hidden: int, magnitudes: list[float], seed: int = 0) -> torch.Tensor:
    """Aux-like states: one block per layer with its own magnitude, plus a massive-activation channel in the last
    block of some tokens (as real targets have), so one shared scale would crush the small layers."""
    generator = torch.Generator().manual_seed(seed)
    blocks = [torch.randn(tokens, hidden, generator=generator) * m for m in magnitudes]
    blocks[-1][::3, 7] = 2000.0 * magnitudes[-1]
    return torch.cat(blocks, dim=-1).to(torch.bfloat16)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_trip_error_bound_on_random_states(dtype):
    magnitudes = [0.02, 1.0, 30.0]
    hidden = layered_states(64, 96, magnitudes)
    hidden[5] = 0.0  # an all-zero token decodes to zeros
    codes, scales = fp8.encode(hidden, groups=3)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == hidden.shape and scales.shape == (64, 3)
    decoded = fp8.decode(codes, scales, dtype)
    assert decoded.dtype == dtype
    error = (decoded.float() - hidden.float()).abs()
    assert bool((error <= decode_error_bound(hidden, decoded, scales)).all())
    assert bool((decoded[5] == 0).all())
    for layer, block in enumerate(hidden.float().split(96, dim=-1)):  # every layer keeps its precision
        assert relative_error(decoded.float().split(96, dim=-1)[layer], block) < 0.03
    # One scale for all layers is what per-layer scales avoid: the smallest layer loses most of its precision.
    shared_codes, shared_scales = fp8.encode(hidden, groups=1)
    shared = fp8.decode(shared_codes, shared_scales, torch.float32).split(96, dim=-1)[0]
    assert relative_error(shared, hidden.float().split(96, dim=-1)[0]) > 0.1


def test_fp8_shard_round_trip_and_reader_dtype(tmp_path):
    spec = ShardSpec(hidden_size=32, num_aux=3, dtype="bfloat16", codec="fp8")
    generator = torch.Generator().manual_seed(0)
    rows, originals = [], []
    for number, length in enumerate([5, 1, 9]):
        aux, last = layered_states(length, 32, [0.1, 1.0, 8.0], seed=number), layered_states(length, 32, [3.0])
        aux_codes, aux_scales = fp8.encode(aux, 3)
        last_codes, last_scales = fp8.encode(last, 1)
        rows.append({"sample_id": f"s{number}", "input_ids": torch.randint(0, 1000, (length,), generator=generator),
                     "loss_mask": [0] + [1] * (length - 1), "aux_hidden_states": aux_codes,
                     "aux_hidden_states_scale": aux_scales, "last_hidden_state": last_codes,
                     "last_hidden_state_scale": last_scales[:, 0]})
        originals.append((aux_codes, aux_scales, last_codes, last_scales))
    with ShardWriter(tmp_path, 0, spec) as writer:
        writer.write(rows)
        writer.commit({"samples": 3}, [])

    for dtype, expected_dtype in [(None, torch.bfloat16), (torch.float32, torch.float32)]:
        dataset = open_shards(tmp_path, dtype=dtype)
        assert dataset.spec == spec
        for index, (aux_codes, aux_scales, last_codes, last_scales) in enumerate(originals):
            item = dataset[index]
            assert "aux_hidden_states_scale" not in item and "last_hidden_state_scale" not in item
            assert item["aux_hidden_states"].dtype == expected_dtype
            assert torch.equal(item["aux_hidden_states"], fp8.decode(aux_codes, aux_scales, expected_dtype))
            assert torch.equal(item["last_hidden_state"], fp8.decode(last_codes, last_scales, expected_dtype))


def test_plain_shards_cast_on_request_and_version_1_shards_still_load(tmp_path):
    spec = ShardSpec(hidden_size=8, num_aux=2, dtype="bfloat16")
    hidden = torch.randn(4, 16).to(torch.bfloat16)
    with ShardWriter(tmp_path, 0, spec) as writer:
        writer.write([{"sample_id": "a", "input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1],
                       "aux_hidden_states": hidden, "last_hidden_state": hidden[:, :8]}])
        writer.commit({"samples": 1}, [])
    assert torch.equal(open_shards(tmp_path, dtype=torch.float32)[0]["aux_hidden_states"], hidden.float())

    # Rewrite the schema metadata as the first shard format had it: no optional-output fields.
    table = pa.ipc.open_file(pa.memory_map(str(tmp_path / "shard-00000.arrow"))).read_all()
    old = {"format_version": 1, "hidden_size": 8, "num_aux": 2, "dtype": "bfloat16"}
    table = table.replace_schema_metadata({METADATA_KEY: json.dumps(old).encode()})
    path = tmp_path / "version-1.arrow"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    dataset = open_shards(path)
    assert dataset.spec == spec
    assert torch.equal(dataset[0]["aux_hidden_states"], hidden)


def test_invalid_spec_is_refused():
    with pytest.raises(SpecgenError, match="codec"):
        ShardSpec(hidden_size=8, num_aux=1, dtype="bfloat16", codec="int4")
    with pytest.raises(SpecgenError, match="topk"):
        ShardSpec(hidden_size=8, num_aux=1, dtype="bfloat16", logits="topk")


def test_fp8_dataset_from_the_bundled_target(tmp_path):
    """Real-model hidden states (the bundled trained bf16 target): error bound, bytes, manifest, verify."""
    common = ["runtime.progress=false", "data.max_rows=8", "data.max_length=256", "output.shard_size=4",
              "model.dtype=bfloat16"]  # bf16 storage whatever the CPU (auto is float32 without native bf16)
    plain = run(compose("generate", [f"output.dir={tmp_path / 'plain'}", *common]))
    packed = run(compose("generate", [f"output.dir={tmp_path / 'fp8'}", "output.codec=fp8", *common]))

    assert plain["codec"] == "bfloat16" and packed["codec"] == "fp8"
    assert packed["outputs"]["codec"] == "fp8" and "float8_e4m3fn" in packed["outputs"]["fp8"]["format"]
    ratio = packed["stats"]["bytes_per_token"] / plain["stats"]["bytes_per_token"]
    assert ratio <= 0.55, ratio

    exact, decoded = open_shards(tmp_path / "plain"), open_shards(tmp_path / "fp8")
    raw = pa.ipc.open_file(pa.memory_map(str(tmp_path / "fp8" / "shard-00000.arrow"))).read_all()
    assert len(exact) == len(decoded) > 0
    for index in range(len(exact)):
        want, got = exact[index], decoded[index]
        assert got["sample_id"] == want["sample_id"] and torch.equal(got["input_ids"], want["input_ids"])
        for name in ("aux_hidden_states", "last_hidden_state"):
            assert got[name].dtype == torch.bfloat16
            assert relative_error(got[name], want[name]) < 0.03
        if index < raw.num_rows:  # the element-wise bound needs the stored scales
            scales = torch.tensor(raw.column("aux_hidden_states_scale")[index].as_py())
            bound = decode_error_bound(want["aux_hidden_states"], got["aux_hidden_states"], scales)
            assert bool(((got["aux_hidden_states"].float() - want["aux_hidden_states"].float()).abs() <= bound).all())

    from specgen.verify import run as verify_run
    verify_run(compose("verify", [f"data.shards={tmp_path / 'fp8'}", "verify.samples=2"]))  # fp8 tolerance applies
