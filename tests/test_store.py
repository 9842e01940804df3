"""The store against real Arrow files: bit-exact round trips, no padding, atomic commits, readers."""

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from torch.utils.data import DataLoader

from specgen.errors import SpecgenError
from specgen.store.commit import content_hash
from specgen.store import (ShardSpec, ShardWriter, finished_shards, merge_rejected, open_shards, read_manifest,
                           read_sidecar, remove_partial, shard_name, summarize_shards, write_manifest)

REPO = Path(__file__).resolve().parent.parent

# Integer dtypes of the same width, to compare floating tensors bit for bit (NaN payloads, -0.0).
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def random_hidden(num_tokens: int, width: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs, infinities, subnormals included) plus hand-picked edge values."""
    bits = BITS[dtype]
    info = torch.iinfo(bits)
    tensor = torch.randint(info.min, info.max, (num_tokens, width), dtype=bits, generator=generator).view(dtype)
    edge = torch.tensor([-0.0, 0.0, torch.finfo(dtype).max, -torch.finfo(dtype).max, torch.finfo(dtype).tiny,
                         torch.finfo(dtype).smallest_normal / 4, 1.0, -1.0], dtype=dtype)
    tensor.view(-1)[: min(len(edge), tensor.numel())] = edge[: tensor.numel()]
    return tensor


def make_rows(spec: ShardSpec, lengths: list[int], seed: int = 0, prefix: str = "s") -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for number, length in enumerate(lengths):
        rows.append({
            "sample_id": f"{prefix}{number}",
            "input_ids": torch.randint(0, 150_000, (length,), generator=generator),
            "loss_mask": torch.randint(0, 2, (length,), generator=generator).tolist(),
            "aux_hidden_states": random_hidden(length, spec.num_aux * spec.hidden_size, spec.torch_dtype, generator),
            "last_hidden_state": random_hidden(length, spec.hidden_size, spec.torch_dtype, generator),
        })
    return rows


def write_shard(out_dir: Path, index: int, spec: ShardSpec, rows: list[dict], batch_size: int = 2,
                stats: dict | None = None, rejected: list[dict] | None = None) -> Path:
    with ShardWriter(out_dir, index, spec) as writer:
        for start in range(0, len(rows), batch_size):
            writer.write(rows[start:start + batch_size])
        return writer.commit(stats or {"samples": len(rows)}, rejected or [])


def assert_item_matches(item: dict, row: dict, spec: ShardSpec) -> None:
    length = len(row["input_ids"])
    assert item["sample_id"] == row["sample_id"]
    assert item["input_ids"].dtype == torch.long and item["loss_mask"].dtype == torch.long
    assert torch.equal(item["input_ids"], torch.as_tensor(row["input_ids"]))
    assert torch.equal(item["loss_mask"], torch.as_tensor(row["loss_mask"]))
    for name, width in [("aux_hidden_states", spec.num_aux * spec.hidden_size), ("last_hidden_state", spec.hidden_size)]:
        tensor = item[name]
        assert tensor.dtype == spec.torch_dtype and tensor.shape == (length, width)
        bits = BITS[spec.torch_dtype]
        assert torch.equal(tensor.view(bits), row[name].view(bits)), name


def files_in(directory: Path) -> set[str]:
    return {path.name for path in directory.iterdir()}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_round_trip_is_bit_exact(tmp_path, dtype):
    spec = ShardSpec(hidden_size=16, num_aux=3, dtype=dtype)
    rows = make_rows(spec, [5, 1, 9, 3, 7])
    path = write_shard(tmp_path, 0, spec, rows)

    assert path == tmp_path / "shard-00000.arrow"
    for dataset in (open_shards(path), open_shards(tmp_path)):
        assert dataset.spec == spec and len(dataset) == len(rows)
        for index, row in enumerate(rows):
            assert_item_matches(dataset[index], row, spec)
    assert_item_matches(open_shards(path)[-1], rows[-1], spec)


def test_no_padding_is_stored(tmp_path):
    spec = ShardSpec(hidden_size=256, num_aux=3, dtype="bfloat16")
    lengths = torch.randint(150, 250, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    path = write_shard(tmp_path, 0, spec, make_rows(spec, lengths), batch_size=4)

    bytes_per_token = (spec.num_aux + 1) * spec.hidden_size * 2 + 4 + 1  # hidden states + int32 id + int8 mask
    payload = sum(lengths) * bytes_per_token
    assert path.stat().st_size <= 1.05 * payload
    assert open_shards(path).lengths() == lengths


def test_lengths_and_order_span_shards_and_batches(tmp_path):
    spec = ShardSpec(hidden_size=4, num_aux=2, dtype="float32")
    first, second = make_rows(spec, [3, 8, 2], prefix="a"), make_rows(spec, [6, 1], seed=1, prefix="b")
    write_shard(tmp_path, 0, spec, first, batch_size=2)
    write_shard(tmp_path, 1, spec, second, batch_size=1)

    dataset = open_shards(tmp_path)
    assert dataset.lengths() == [3, 8, 2, 6, 1]
    assert [dataset[index]["sample_id"] for index in range(len(dataset))] == ["a0", "a1", "a2", "b0", "b1"]
    assert [len(dataset[index]["input_ids"]) for index in range(len(dataset))] == dataset.lengths()
    with pytest.raises(IndexError):
        dataset[len(dataset)]


def test_shards_load_with_pyarrow_and_datasets(tmp_path):
    import datasets

    spec = ShardSpec(hidden_size=8, num_aux=3, dtype="bfloat16")
    rows = make_rows(spec, [4, 2, 6])
    path = write_shard(tmp_path, 0, spec, rows)

    table = pa.ipc.open_file(pa.memory_map(str(path))).read_all()
    assert ShardSpec.from_schema(table.schema, str(path)) == spec
    assert table.column("sample_id").to_pylist() == ["s0", "s1", "s2"]
    stored = table.column("aux_hidden_states")[2][5].as_py()
    assert stored == rows[2]["aux_hidden_states"][5].view(torch.uint16).tolist()

    hf = datasets.load_dataset("arrow", data_files=[str(path)], split="train", cache_dir=str(tmp_path / "hf"))
    assert hf["sample_id"] == ["s0", "s1", "s2"]
    assert hf[1]["input_ids"] == rows[1]["input_ids"].tolist()
    decoded = torch.tensor(hf[2]["last_hidden_state"][3], dtype=torch.int32).to(torch.uint16).view(torch.bfloat16)
    assert torch.equal(decoded.view(torch.int16), rows[2]["last_hidden_state"][3].view(torch.int16))


def test_exception_inside_writer_leaves_no_files(tmp_path):
    spec = ShardSpec(hidden_size=4, num_aux=1, dtype="float16")
    with pytest.raises(RuntimeError, match="boom"):
        with ShardWriter(tmp_path, 0, spec) as writer:
            writer.write(make_rows(spec, [3, 2]))
            raise RuntimeError("boom")
    with ShardWriter(tmp_path, 1, spec) as writer:
        writer.write(make_rows(spec, [1]))  # never committed
    assert files_in(tmp_path) == set()
    assert finished_shards(tmp_path) == {}


def test_rows_back_to_back_in_memory_are_handed_over_without_a_copy():
    from specgen.store.writer import _joined

    packed = torch.arange(40, dtype=torch.float32).view(10, 4)  # one packed capture: rows are consecutive slices
    view = _joined([packed[0:3], packed[3:3], packed[3:7]])
    assert view.data_ptr() == packed.data_ptr() and torch.equal(view, packed[:7].reshape(-1))
    assert _joined([packed[2:10]]).data_ptr() == packed[2].data_ptr()
    assert _joined([packed[0:3], packed[4:7]]) is None  # a gap: the sample filter dropped a row
    assert _joined([packed[3:5], packed[0:3]]) is None  # out of order
    padded = torch.zeros(2, 5, 4)
    assert _joined([padded[0, :3], padded[1, :2]]) is None  # padding between the rows
    assert _joined([torch.zeros(3, 4), torch.zeros(2, 4)]) is None  # separate tensors
    assert _joined([torch.zeros(0, 4)]) is None


def test_invalid_rows_are_rejected_with_the_sample_id(tmp_path):
    spec = ShardSpec(hidden_size=4, num_aux=1, dtype="bfloat16")
    wrong_dtype = make_rows(spec, [3])
    wrong_dtype[0]["last_hidden_state"] = wrong_dtype[0]["last_hidden_state"].float()
    wrong_length = make_rows(spec, [3])
    wrong_length[0]["loss_mask"] = [1, 1]
    wrong_width = make_rows(spec, [3])
    wrong_width[0]["aux_hidden_states"] = wrong_width[0]["aux_hidden_states"][:, :3]
    for rows, message in [(wrong_dtype, "dtype is torch.float32"), (wrong_length, "token count"),
                          (wrong_width, r"shape \[3, 3\] does not match the stored layout \['T', 4\]")]:
        with pytest.raises(ValueError, match=f"s0.*{message}"):
            with ShardWriter(tmp_path, 0, spec) as writer:
                writer.write(rows)
    assert files_in(tmp_path) == set()


KILLED_WRITER = """
import os, signal, sys
import torch
sys.path.insert(0, {tests!r})
from test_store import make_rows
from specgen.store import ShardSpec, ShardWriter

spec = ShardSpec(hidden_size=8, num_aux=2, dtype="bfloat16")
with ShardWriter({out_dir!r}, 1, spec) as writer:
    writer.write(make_rows(spec, [4, 5]))
    writer.write(make_rows(spec, [6]))
    if {at_commit!r}:
        real_replace = os.replace
        def replace_then_die(src, dst):
            if str(src).endswith(".arrow.tmp"):  # killed at the commit point, sidecar already written
                os.kill(os.getpid(), signal.SIGKILL)
            real_replace(src, dst)
        os.replace = replace_then_die
        writer.commit({{"samples": 3}}, [])
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("at_commit", [False, True], ids=["mid_shard", "before_rename"])
def test_killed_writer_leaves_only_removable_partial_files(tmp_path, at_commit):
    spec = ShardSpec(hidden_size=8, num_aux=2, dtype="bfloat16")
    rows = make_rows(spec, [2, 3], prefix="done")
    write_shard(tmp_path, 0, spec, rows)
    script = KILLED_WRITER.format(tests=str(REPO / "tests"), out_dir=str(tmp_path), at_commit=at_commit)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == -9, result.stderr

    partial = {"shard-00001.arrow.tmp"} | ({"shard-00001.json"} if at_commit else set())
    assert files_in(tmp_path) == {"shard-00000.arrow", "shard-00000.json"} | partial
    assert (tmp_path / "shard-00001.arrow.tmp").stat().st_size > 0
    assert list(finished_shards(tmp_path)) == [0]
    assert [item["sample_id"] for item in open_shards(tmp_path)] == ["done0", "done1"]

    assert {path.name for path in remove_partial(tmp_path)} == partial
    assert files_in(tmp_path) == {"shard-00000.arrow", "shard-00000.json"}


def test_a_folder_killed_before_its_first_shard_says_how_to_finish_it(tmp_path):
    """Only a half-written shard (a generate run killed early): reading it says to finish it with generate."""
    (tmp_path / "shard-00000.arrow.tmp").write_bytes(b"partial")
    with pytest.raises(SpecgenError, match=r"no finished shards in .*: finish it with specgen generate \(the same "
                                           r"command and output.dir resume"):
        open_shards(tmp_path)


def test_truncated_shard_is_not_finished(tmp_path):
    spec = ShardSpec(hidden_size=8, num_aux=2, dtype="float32")
    write_shard(tmp_path, 0, spec, make_rows(spec, [3]))
    damaged = write_shard(tmp_path, 1, spec, make_rows(spec, [4, 2]))
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])

    assert list(finished_shards(tmp_path)) == [0]
    assert len(open_shards(tmp_path)) == 1
    with pytest.raises(SpecgenError, match="damaged"):
        open_shards(damaged)
    assert {path.name for path in remove_partial(tmp_path)} == {"shard-00001.arrow", "shard-00001.json"}


def test_shard_names_and_sidecars(tmp_path):
    assert shard_name(3) == "shard-00003.arrow"
    assert shard_name(123456) == "shard-123456.arrow"
    spec = ShardSpec(hidden_size=4, num_aux=1, dtype="float16")
    write_shard(tmp_path, 123456, spec, make_rows(spec, [2, 5, 3]), batch_size=1, stats={"samples": 1},
                rejected=[{"id": "x"}])  # three record batches: the checksum is taken as they are written
    assert list(finished_shards(tmp_path)) == [123456]
    sidecar = read_sidecar(tmp_path, 123456)
    assert {k: sidecar[k] for k in ("stats", "rejected")} == {"stats": {"samples": 1}, "rejected": [{"id": "x"}]}
    shard = tmp_path / shard_name(123456)
    assert sidecar["checksum"] == {"sha256": content_hash(shard), "bytes": shard.stat().st_size}
    with pytest.raises(SpecgenError, match="re-run"):
        read_sidecar(tmp_path, 0)


def test_summary_manifest_and_rejected_rows(tmp_path):
    spec = ShardSpec(hidden_size=4, num_aux=2, dtype="bfloat16")
    shards = [
        ({"samples": 2, "tokens": 7, "trainable_tokens": 3, "rejected": {"too_long": 1}, "model": "m"},
         [{"id": "r1", "reason": "too_long"}]),
        ({"samples": 1, "tokens": 5, "trainable_tokens": 5, "rejected": {"too_long": 2, "empty": 1}},
         [{"id": "r2", "reason": "too_long"}, {"id": "r3", "reason": "too_long"}, {"id": "r4", "reason": "empty"}]),
    ]
    paths = [write_shard(tmp_path, index, spec, make_rows(spec, [3, 4][: stats["samples"]]), stats=stats,
                         rejected=rejected) for index, (stats, rejected) in enumerate(shards)]
    with ShardWriter(tmp_path, 2, spec) as writer:  # an unfinished shard is not counted
        writer.write(make_rows(spec, [9]))
        (tmp_path / "shard-00002.json").write_text(json.dumps({"stats": {"samples": 100}, "rejected": []}))

        summary = summarize_shards(tmp_path)
        assert merge_rejected(tmp_path) == 4

    bytes_on_disk = sum(path.stat().st_size for path in paths)
    assert summary == {"samples": 3, "tokens": 12, "trainable_tokens": 8, "rejected": {"too_long": 3, "empty": 1},
                       "num_shards": 2, "shards": ["shard-00000.arrow", "shard-00001.arrow"],
                       "bytes_on_disk": bytes_on_disk, "bytes_per_token": bytes_on_disk / 12}
    lines = (tmp_path / "rejected.jsonl").read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == ["r1", "r2", "r3", "r4"]

    with pytest.raises(SpecgenError, match="did not finish; re-run the same command"):
        read_manifest(tmp_path)
    manifest = {**summary, "target": "tiny"}
    write_manifest(tmp_path, manifest)
    assert read_manifest(tmp_path) == manifest


def test_reader_follows_the_manifest(tmp_path):
    spec = ShardSpec(hidden_size=4, num_aux=1, dtype="float32")
    write_shard(tmp_path, 0, spec, make_rows(spec, [2], prefix="a"))
    write_shard(tmp_path, 1, spec, make_rows(spec, [3], prefix="b"))
    manifest = {"shards": ["shard-00001.arrow", "shard-00000.arrow"]}
    write_manifest(tmp_path, manifest)

    dataset = open_shards(tmp_path)
    assert dataset.manifest == manifest
    assert [item["sample_id"] for item in dataset] == ["b0", "a0"]

    write_manifest(tmp_path, {"shards": ["shard-00000.arrow", "shard-00007.arrow"]})
    with pytest.raises(SpecgenError, match="shard-00007.arrow"):
        open_shards(tmp_path)


def test_shards_with_different_specs_are_not_mixed(tmp_path):
    write_shard(tmp_path, 0, ShardSpec(4, 1, "float32"), make_rows(ShardSpec(4, 1, "float32"), [2]))
    write_shard(tmp_path, 1, ShardSpec(8, 1, "float32"), make_rows(ShardSpec(8, 1, "float32"), [2]))
    with pytest.raises(SpecgenError, match="read shards of one run together"):
        open_shards(tmp_path)


def mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """Address ranges where `path` is memory-mapped into this process (Linux /proc/self/maps)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path):
            start, end = (int(address, 16) for address in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc/self/maps")
def test_hidden_states_point_into_the_mapped_file(tmp_path):
    spec = ShardSpec(hidden_size=64, num_aux=3, dtype="bfloat16")
    path = write_shard(tmp_path, 0, spec, make_rows(spec, [50, 70, 30]))
    item = open_shards(path)[1]

    ranges = mapped_ranges(path.resolve())
    for name in ("aux_hidden_states", "last_hidden_state"):
        tensor = item[name]
        first, last = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
        assert any(start <= first and last <= end for start, end in ranges), f"{name} is not memory-mapped"


def test_dataset_pickles_and_feeds_spawned_dataloader_workers(tmp_path):
    spec = ShardSpec(hidden_size=8, num_aux=3, dtype="bfloat16")
    rows = make_rows(spec, [3, 5, 2]) + make_rows(spec, [4, 1], seed=1, prefix="t")
    write_shard(tmp_path, 0, spec, rows[:3])
    write_shard(tmp_path, 1, spec, rows[3:])
    dataset = open_shards(tmp_path)
    dataset[0]  # opens memory maps that must not travel with the pickle

    clone = pickle.loads(pickle.dumps(dataset))
    assert clone.lengths() == dataset.lengths() and clone.spec == spec
    assert_item_matches(clone[4], rows[4], spec)

    loader = DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context="spawn")
    for item, row in zip(loader, rows, strict=True):
        assert_item_matches(item, row, spec)


def test_open_with_verify_checks_the_sidecar_checksums_without_a_manifest(tmp_path):
    spec = ShardSpec(hidden_size=8, num_aux=2, dtype="bfloat16")
    write_shard(tmp_path, 0, spec, make_rows(spec, [5, 3]))
    damaged = write_shard(tmp_path, 1, spec, make_rows(spec, [6, 4]))
    assert len(open_shards(tmp_path, verify=True)) == 4
    data = bytearray(damaged.read_bytes())
    data[(len(data) // 2) & ~1] ^= 1  # the lowest bit of one bf16 value
    damaged.write_bytes(bytes(data))
    assert len(open_shards(tmp_path)) == 4  # unnoticed without verify
    with pytest.raises(SpecgenError, match=r"damaged shards .*shard-00001.arrow: checksum mismatch"):
        open_shards(tmp_path, verify=True)
    with pytest.raises(SpecgenError, match="shard-00001.arrow: checksum mismatch"):
        open_shards(damaged, verify=True)  # one shard file: its sidecar beside it
