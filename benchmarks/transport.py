"""How fast a captured batch travels from one process to another: specgen's FileTransport against Mooncake's store.

A producer (this process) stores an object of --size-mb, a consumer (a second process) fetches it as soon as it is
told the name, checks its size and ends, and the producer deletes it: --repeats times, medians. `put` and `get` are
each side's own time, `end-to-end` is from the start of the put to the consumer's answer.

  file /dev/shm, file /tmp   specgen.stream.FileTransport (safetensors, temporary name + rename) in that folder
  mooncake put/get           Mooncake's store over TCP (bytes `put` / `get`, both clients lending no memory, a holder
                             process lending it), with --mooncake-python: an interpreter where `mooncake.store`
                             imports (the non-CUDA wheel: pip install mooncake-transfer-engine-non-cuda; its master
                             needs libibverbs). Start the master and a holder first:
      mooncake_master --enable_http_metadata_server=true --http_metadata_server_port=8080 --rpc_port=50051 &
      mooncake_client --global_segment_size="1 GB" --local_buffer_size="64 MB" \\
          --master_server_address=127.0.0.1:50051 --metadata_server=http://127.0.0.1:8080/metadata \\
          --host=127.0.0.1 --port=50052 --protocol=tcp &

  python benchmarks/transport.py [--size-mb 32] [--repeats 20] [--mooncake-python /path/to/python]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MB = 1 << 20
MASTER, METADATA = "127.0.0.1:50051", "http://127.0.0.1:8080/metadata"


def _mooncake_store(local_buffer: int):
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    if store.setup("127.0.0.1", METADATA, 0, local_buffer, "tcp", "", MASTER) != 0:
        raise SystemExit("mooncake setup failed: is the master (and a holder) running?")
    return store


def consume(kind: str, where: str, size: int) -> None:
    """The consumer: one object name per stdin line; answers with its get time and the bytes it got."""
    if kind == "file":
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from specgen.stream.transport import FileTransport

        transport = FileTransport(where)
    else:
        store = _mooncake_store(size + 16 * MB)
    print("ready", flush=True)
    for line in sys.stdin:
        name, start = line.strip(), time.perf_counter()
        if kind == "file":
            tensors, _ = transport.get(name)
            got = sum(t.numel() * t.element_size() for t in tensors.values())
        else:
            got = len(store.get(name))
        print(json.dumps({"get": time.perf_counter() - start, "bytes": got}), flush=True)


def produce(kind: str, where: str, size: int, repeats: int, python: str) -> dict:
    consumer = subprocess.Popen([python, __file__, "--consume", kind, "--where", where, "--size-mb", str(size // MB)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
    assert consumer.stdout.readline().strip() == "ready"
    if kind == "file":
        import torch

        from specgen.stream.transport import FileTransport

        transport = FileTransport(where)
        payload = {"aux": torch.randn(size // 4 // 256, 256)}
    else:
        store = _mooncake_store(size + 16 * MB)
        payload = os.urandom(size)
    puts, gets, ends = [], [], []
    for i in range(repeats):
        name, start = f"bench-{i}", time.perf_counter()
        if kind == "file":
            transport.put(name, payload, {"i": i})
        elif store.put(name, payload) != 0:
            raise SystemExit("mooncake put failed")
        put = time.perf_counter()
        consumer.stdin.write(name + "\n")
        answer = json.loads(consumer.stdout.readline())
        ends.append(time.perf_counter() - start)
        puts.append(put - start)
        gets.append(answer["get"])
        assert answer["bytes"] == size, answer
        transport.delete(name) if kind == "file" else store.remove(name, True)
    consumer.stdin.close()
    consumer.wait()
    rate = lambda seconds: size / MB / statistics.median(seconds)  # noqa: E731
    return {"put": rate(puts), "get": rate(gets), "end-to-end": rate(ends), "ms": 1000 * statistics.median(ends)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--mooncake-python", help="an interpreter where mooncake.store imports")
    parser.add_argument("--consume", help=argparse.SUPPRESS)
    parser.add_argument("--where", help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = args.size_mb * MB
    if args.consume:
        return consume(args.consume, args.where, size)
    rows = []
    for folder in ("/dev/shm", tempfile.gettempdir()):
        where = tempfile.mkdtemp(prefix="specgen-transport-", dir=folder)
        rows.append((f"file {folder}", produce("file", where, size, args.repeats, sys.executable)))
        os.rmdir(where)
    if args.mooncake_python:
        done = subprocess.run([args.mooncake_python, __file__, "--mooncake-only", str(args.size_mb), str(args.repeats)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(done.stderr[-2000:])
        rows.append(("mooncake put/get", json.loads(done.stdout.strip().splitlines()[-1])))
    print(f"\n{args.size_mb} MB objects, {args.repeats} repeats, medians\n")
    print("| transport | put MB/s | get MB/s | end-to-end MB/s | end-to-end ms |\n|---|---|---|---|---|")
    for name, row in rows:
        print(f"| {name} | {row['put']:,.0f} | {row['get']:,.0f} | {row['end-to-end']:,.0f} | {row['ms']:.1f} |")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--mooncake-only":  # run by --mooncake-python: no torch needed
        print(json.dumps(produce("mooncake", "", int(sys.argv[2]) * MB, int(sys.argv[3]), sys.executable)))
    else:
        main()
