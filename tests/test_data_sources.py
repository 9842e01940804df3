"""Reading rows from JSON arrays, JSON lines, Parquet and datasets folders, lazily and row by row."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import DATASETS, require_shared
from specgen.data import count_records, iter_records, normalize
from specgen.errors import RowError, SpecgenError

ROWS = [
    {"id": "a", "text": "brackets ] and , commas inside \"strings\" [", "n": 123456789},
    {"id": "b", "nested": {"list": [1, 2.5e-3, None, True, {"deep": "ünïcode 日本"}]}, "n": -0.5},
    {"id": "c", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]},
]


def records(path, **kwargs) -> list:
    return [(r.index, r.record, None if r.error is None else r.error.reason) for r in iter_records(path, **kwargs)]


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 7, 64, 1 << 20])
def test_json_array_parses_like_json_load_at_any_chunk_size(tmp_path, chunk_size):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(ROWS, indent=2, ensure_ascii=False), encoding="utf-8")

    assert records(path, chunk_size=chunk_size) == [(i, row, None) for i, row in enumerate(json.load(open(path)))]
    assert count_records(path) == len(ROWS)


@pytest.mark.parametrize("chunk_size", [1, 3, 1 << 20])
def test_json_array_rejects_non_objects_and_keeps_numbers_whole_across_chunks(tmp_path, chunk_size):
    path = tmp_path / "mixed.json"
    path.write_text('[123456789, {"id": 1}, [1], "s"  ,{"id": 2}]')

    result = list(iter_records(path, chunk_size=chunk_size))
    assert [(r.index, r.record) for r in result] == [(0, None), (1, {"id": 1}), (2, None), (3, None), (4, {"id": 2})]
    assert [r.error.reason for r in result if r.error] == ["not_an_object"] * 3
    assert "int" in result[0].error.message and "element 0" in result[0].error.message


@pytest.mark.parametrize("text", ["[]", "  [ ]\n", "[\n\n]"])
def test_empty_json_array_has_no_rows(tmp_path, text):
    path = tmp_path / "empty.json"
    path.write_text(text)
    assert records(path, chunk_size=1) == [] and count_records(path) == 0


def test_json_array_is_streamed_not_loaded_whole(tmp_path):
    """A large array whose tail is broken: rows come out before the parser ever reaches the tail."""
    path = tmp_path / "big.json"
    row = {"conversations": [{"from": "human", "value": "x" * 200}, {"from": "gpt", "value": "y" * 200}]}
    with open(path, "w") as f:
        f.write("[" + ",".join(json.dumps({"id": i, **row}) for i in range(5000)) + ", {broken")

    stream = iter_records(path, chunk_size=4096)  # the file is ~2 MB, 500 chunks
    first = [next(stream) for _ in range(3)]
    assert [r.record["id"] for r in first] == [0, 1, 2]
    with pytest.raises(SpecgenError, match=r"big\.json.*broken at element 5000"):
        for _ in stream:
            pass
    assert count_records(path) is None  # unknown rather than wrong


def test_element_larger_than_the_chunk_is_read_whole(tmp_path):
    path = tmp_path / "long.json"
    rows = [{"id": i, "text": "z" * 100_000} for i in range(3)]
    path.write_text(json.dumps(rows))
    assert records(path, chunk_size=16) == [(i, row, None) for i, row in enumerate(rows)]


def test_jsonl_bad_lines_are_row_errors_and_the_run_goes_on(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"id": 0}\n\n{"id": 1\n[1, 2]\n\xff\xfe{"id": 3}\n  \n{"id": 4}\n')

    result = list(iter_records(path))
    assert [(r.index, r.record) for r in result] == [(0, {"id": 0}), (1, None), (2, None), (3, None), (4, {"id": 4})]
    assert [r.error.reason if r.error else None for r in result] == [
        None, "invalid_json", "not_an_object", "invalid_json", None]
    assert result[1].error.message.startswith("line 3:") and result[3].error.message.startswith("line 5:")
    assert all(isinstance(r.error, RowError) for r in result if r.error)
    assert count_records(path) == 5


def test_json_lines_saved_as_json_fall_back_to_line_mode(tmp_path):
    path = tmp_path / "lines.json"
    path.write_text("\n".join(json.dumps(row) for row in ROWS) + "\nnot json\n")

    assert records(path) == [(i, row, None) for i, row in enumerate(ROWS)] + [(3, None, "invalid_json")]
    assert count_records(path) == 4


def test_parquet_rows_come_out_as_dicts_and_normalise(tmp_path):
    path = tmp_path / "rows.parquet"
    messages = [[{"role": "user", "content": "Hi", "reasoning_content": None},
                 {"role": "assistant", "content": "Hello", "reasoning_content": "Greet back."}]] * 2500
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(2500)], "messages": messages}), path, row_group_size=1000)

    result = list(iter_records(path))
    assert [r.index for r in result] == list(range(2500)) and count_records(path) == 2500
    assert result[1234].record == {"id": "r1234", "messages": messages[0]}
    conversation = normalize(result[0].record)  # arrow fills absent struct fields with None
    assert conversation.messages[0] == {"role": "user", "content": "Hi"}
    assert conversation.messages[1]["reasoning_content"] == "Greet back."


def test_save_to_disk_folder_is_read_memory_mapped(tmp_path):
    import datasets

    rows = [{"id": str(i), "instruction": f"Say {i}", "output": str(i)} for i in range(10)]
    datasets.Dataset.from_list(rows).save_to_disk(tmp_path / "saved")

    assert records(tmp_path / "saved") == [(i, row, None) for i, row in enumerate(rows)]
    assert count_records(tmp_path / "saved") == 10

    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(tmp_path / "dict")
    with pytest.raises(SpecgenError, match=r"DatasetDict with splits \['train'\].*dict/train"):
        iter_records(tmp_path / "dict")


@pytest.mark.parametrize("name", ["missing.jsonl", "rows.csv", "plain_folder"])
def test_unusable_paths_fail_at_once_naming_data_path_and_formats(tmp_path, name):
    (tmp_path / "rows.csv").write_text("a,b\n")
    (tmp_path / "plain_folder").mkdir()
    for function in (iter_records, count_records):
        with pytest.raises(SpecgenError) as raised:
            function(tmp_path / name)  # raised on the call, before any row is requested
        assert "data.path" in str(raised.value) and ".jsonl, .parquet" in str(raised.value)


@pytest.mark.parametrize("dataset", sorted(DATASETS))
def test_real_datasets_read_cleanly(dataset):
    path = require_shared(DATASETS[dataset])
    result = list(iter_records(path))
    assert result and all(r.error is None and isinstance(r.record, dict) for r in result)
    assert [r.index for r in result] == list(range(len(result))) == list(range(count_records(path)))


def test_a_file_that_is_not_parquet_is_a_user_error(tmp_path):
    (tmp_path / "fake.parquet").write_text('{"id": 1}\n')
    with pytest.raises(SpecgenError, match="data.path .*fake.parquet is not a readable Parquet file"):
        iter_records(tmp_path / "fake.parquet")


def test_folder_of_part_files_reads_as_one_source(tmp_path):
    folder = tmp_path / "parts"
    folder.mkdir()
    (folder / "part-00000.jsonl").write_text('{"id": "a"}\n{"id": "b"}\n')
    (folder / "part-00001.jsonl").write_text('{"id": "c"}\nnot json\n')
    pq.write_table(pa.table({"id": ["d", "e"]}), folder / "part-00002.parquet")
    (folder / "manifest.txt").write_text("ignored: not a data file")
    records = list(iter_records(folder))
    assert [r.index for r in records] == [0, 1, 2, 3, 4, 5]
    assert [r.record["id"] if r.record else None for r in records] == ["a", "b", "c", None, "d", "e"]
    assert records[3].error.reason == "invalid_json" and "part-00001.jsonl line 2" in records[3].error.message
    assert count_records(folder) == 6


def test_folder_with_a_parts_manifest_reads_only_the_listed_parts(tmp_path):
    folder = tmp_path / "regenerated"
    folder.mkdir()
    (folder / "part-00000.jsonl").write_text('{"id": "a"}\n')
    (folder / "part-00000.json").write_text('{"stats": {"rows": 1}}')  # a sidecar, not data
    (folder / "part-00001.jsonl").write_text('{"id": "b"}\n')
    (folder / "rejected.jsonl").write_text('{"source_index": 3, "reason": "invalid_json"}\n')
    (folder / "manifest.json").write_text(json.dumps({"parts": ["part-00000.jsonl", "part-00001.jsonl"]}))
    assert [r.record["id"] for r in iter_records(folder)] == ["a", "b"]
    assert count_records(folder) == 2


HUB_ROWS = {("default", "train"): [{"id": f"t{i}", "conversations": [{"from": "human", "value": f"Say {i}."},
                                                                     {"from": "gpt", "value": f"{i}."}]}
                                   for i in range(5)],
            ("default", "test"): [{"id": "x0", "conversations": [{"from": "human", "value": "Hi"},
                                                                 {"from": "gpt", "value": "Hello"}]}],
            ("short", "train"): [{"id": "s0", "instruction": "Add 2 and 3.", "input": "", "output": "5"}]}


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A Hugging Face datasets cache in tmp holding `myorg/chat` (subsets default and short, splits train and test),
    laid out as `load_dataset` leaves it after a download, and the hub offline: nothing is downloaded."""
    import shutil

    import datasets
    import huggingface_hub

    cache = tmp_path / "hf-datasets"
    for subset in ("default", "short"):
        files = {}
        for (name, split), rows in HUB_ROWS.items():
            if name == subset:
                files[split] = tmp_path / f"{subset}-{split}.jsonl"
                files[split].write_text("".join(json.dumps(row) + "\n" for row in rows))
        built = datasets.load_dataset("json", data_files={k: str(v) for k, v in files.items()},
                                      cache_dir=str(tmp_path / "build"))
        folder = Path(next(iter(built.values())).cache_files[0]["filename"]).parent
        target = cache / "myorg___chat" / subset / "0.0.0" / folder.name
        shutil.copytree(folder, target)
        for arrow in target.glob("json-*.arrow"):  # named after the dataset, as the hub builder names them
            arrow.rename(target / arrow.name.replace("json-", "chat-", 1))
        info = json.loads((target / "dataset_info.json").read_text())
        (target / "dataset_info.json").write_text(json.dumps({**info, "dataset_name": "chat", "config_name": subset}))
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(key, "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    return cache


def test_a_hub_dataset_by_name_reads_from_the_local_cache(hub_cache):
    rows = [(i, row, None) for i, row in enumerate(HUB_ROWS[("default", "train")])]
    assert records("myorg/chat", subset="default") == rows
    assert count_records("myorg/chat", subset="default") == 5
    assert records("myorg/chat", subset="default", split="test") == [(0, HUB_ROWS[("default", "test")][0], None)]
    assert records("myorg/chat", subset="short") == [(0, HUB_ROWS[("short", "train")][0], None)]
    # offline, the cache cannot say which of two subsets is the default: one line says so
    with pytest.raises(SpecgenError, match=r"^data.path myorg/chat is not a local path, nor a hub dataset .*"
                                           r"multiple 'myorg/chat' configurations in the cache"):
        iter_records("myorg/chat")


def test_a_name_neither_local_nor_cached_is_one_line(hub_cache, tmp_path, monkeypatch):
    with pytest.raises(SpecgenError, match=r"^data.path myorg/absent is not a local path, nor a hub dataset found "
                                           r"in the local datasets cache") as error:
        iter_records("myorg/absent")
    assert "\n" not in str(error.value)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SpecgenError, match="does not exist"):  # a local file path is not taken for a name
        iter_records("some/rows.jsonl")
    (tmp_path / "myorg").mkdir()
    (tmp_path / "myorg" / "chat").mkdir()  # a local folder of that name wins over the hub name
    with pytest.raises(SpecgenError, match="is a folder with neither"):
        iter_records("myorg/chat")


def test_generate_reads_a_hub_dataset_by_name(hub_cache, tmp_path):
    from specgen.assets import asset_path
    from specgen.config import compose
    from specgen.generate import run

    manifest = run(compose("generate", [f"model.path={asset_path('tiny-target')}", "data.path=myorg/chat",
                                        "data.split=train", "data.subset=default", f"output.dir={tmp_path / 'out'}",
                                        "runtime.progress=false"]))
    assert manifest["stats"]["samples"] == 5 and manifest["config"]["data"]["path"] == "myorg/chat"


def test_a_list_of_sources_reads_as_one_with_continuing_indices(tmp_path):
    from specgen.data.sources import capped_source

    first, second = tmp_path / "a.jsonl", tmp_path / "b"
    first.write_text("\n".join(json.dumps(row) for row in ROWS) + "\n")
    second.mkdir()
    (second / "part-0.jsonl").write_text(json.dumps({"id": "d"}) + "\n[1]\n" + json.dumps({"id": "e"}) + "\n")

    result = list(iter_records([str(first), str(second)]))
    assert [r.index for r in result] == [0, 1, 2, 3, 4, 5]
    assert [r.record["id"] for r in result if r.record] == ["a", "b", "c", "d", "e"]
    assert str(second) in result[4].error.message  # a row error names its source
    assert count_records([first, second]) == 6

    # data.max_rows caps each source: the first 2 rows of each (indices count the rows read), and the summary says so
    capped = capped_source([str(first), str(second)], 2)
    assert [(r.index, r.record and r.record["id"]) for r in capped.records] == [(0, "a"), (1, "b"), (2, "d"), (3, None)]
    assert capped.expected_rows == 4
    assert capped.describe(4) == "4 source rows read of 2 sources (stopped at data.max_rows=2 each; the sources have 6)"
    assert capped_source([first, second], None).describe(6) == "6 source rows read of 2 sources (all of 6)"
    # one source reads exactly as before
    assert capped_source(first, 2).describe(2) == "2 source rows read (stopped at data.max_rows=2; the source has 3)"


def test_a_list_with_a_wrong_path_or_no_path_fails_before_reading(tmp_path):
    good = tmp_path / "a.jsonl"
    good.write_text(json.dumps(ROWS[0]) + "\n")
    with pytest.raises(SpecgenError, match="missing.jsonl"):
        iter_records([str(good), str(tmp_path / "missing.jsonl")])
    with pytest.raises(SpecgenError, match=r"data.path=\[\] names no source"):
        iter_records([])
