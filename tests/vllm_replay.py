"""Replay specgen.evaluate's prompts in vLLM (its CPU build), greedy, and report what vLLM itself counted.

    python tests/vllm_replay.py SAMPLES_JSONL OUT_JSON --target DIR
                                [--draft DIR [--parallel-drafting | --method dflash]] [--k 4] [--max-new-tokens N]
                                [--in-process]
    python tests/vllm_replay.py SAMPLES_JSONL OUT_JSON --target DIR --speculative-config JSON  # as given, e.g. what
                                             # specgen.train's summary prints (specgen.draft.exports)
    python tests/vllm_replay.py SAMPLES_JSONL OUT_JSON --speculators DIR      # no method flag: vLLM reads the
                                                                             # speculators_config in DIR/config.json
SAMPLES_JSONL is specgen.evaluate's samples.jsonl (prompt_token_ids per turn). OUT_JSON receives the output token ids
per turn and vLLM's spec-decode counters (num_drafts, num_draft_tokens, num_accepted_tokens,
num_accepted_tokens_per_pos) with vLLM's acceptance length 1 + accepted / drafts, and generate()'s wall time. Run
it in vLLM's venv; vLLM spawns workers, hence the __main__ guard. --in-process runs vLLM's engine core and its one
worker in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the uni executor): the same outputs and counters, without
starting two more interpreters that import torch and vLLM (the tests' replays: 17 s instead of 37 on 2 cores);
without it the engine runs as `vllm serve` and `LLM()` run it by default (the benchmarks' timings).

    python tests/vllm_replay.py --serve     # the tests' replayer: one replay per line of stdin

--serve reads one JSON list of the arguments above per line of stdin, replays each in this process (in-process, one
`LLM` after another, each deleted before the next) and answers one JSON line per request on stdout ({"ok": true} or
{"ok": false, "error": traceback}); vLLM's own output goes to stderr. One replayer per test worker imports torch and
vLLM once instead of once a replay (14 of a replay's 25 CPU-seconds here).
"""

import argparse
import gc
import json
import os
import sys
import time
import traceback


def counters(llm) -> dict:
    """vLLM's own spec-decode counters (prometheus metrics of the offline engine)."""
    found = {}
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:spec_decode_")
        if name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            found[name] = found.get(name, 0) + metric.value
        elif name == "num_accepted_tokens_per_pos":
            values = found.setdefault(name, [0] * len(metric.values))
            found[name] = [a + b for a, b in zip(values, metric.values)]
    return found


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("samples")
    parser.add_argument("out")
    parser.add_argument("--target")
    parser.add_argument("--draft")
    parser.add_argument("--speculators")
    parser.add_argument("--method", default="eagle3")  # eagle3 | dflash: speculative_config.method for --draft
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--parallel-drafting", action="store_true")  # P-EAGLE drafts: all K in one forward
    parser.add_argument("--speculative-config", type=json.loads)  # the whole speculative_config, instead of the above
    parser.add_argument("--in-process", action="store_true")  # engine core and worker in this process
    return parser.parse_args(argv)


def replay(args: argparse.Namespace) -> None:
    """Serve args.samples' prompts with args' target (and draft); write outputs and counters to args.out."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    samples = [json.loads(line) for line in open(args.samples)]
    options = dict(dtype=args.dtype, enforce_eager=True, disable_log_stats=False, max_model_len=1024,
                   max_num_seqs=8, seed=0, **({"distributed_executor_backend": "uni"} if args.in_process else {}))
    if args.speculators:
        llm = LLM(model=args.speculators, **options)  # the speculators config names the target and the method
    else:
        spec = ({"method": args.method, "model": args.draft, "num_speculative_tokens": args.k}
                if args.draft else None)
        if spec and args.parallel_drafting:
            spec["parallel_drafting"] = True
        if args.speculative_config:
            spec = args.speculative_config
        llm = LLM(model=args.target, speculative_config=spec, **options)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    start = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=s["prompt_token_ids"]) for s in samples], params)
    seconds = time.perf_counter() - start
    result = {"output_token_ids": [list(o.outputs[0].token_ids) for o in outputs], **counters(llm)}
    # Wall time of generate() alone (engine start excluded), for benchmarks: generated tokens per second.
    result["generate_seconds"] = seconds
    result["output_tokens_per_second"] = sum(len(ids) for ids in result["output_token_ids"]) / seconds
    if result.get("num_drafts"):
        result["acceptance_length"] = 1 + result["num_accepted_tokens"] / result["num_drafts"]
        result["acceptance_rate_per_position"] = [n / result["num_drafts"]
                                                  for n in result["num_accepted_tokens_per_pos"]]
    with open(args.out, "w") as handle:
        json.dump(result, handle)
    del llm, outputs  # the engine and its KV cache go before the next replay of a --serve process
    gc.collect()


def serve() -> None:
    """--serve: replays requested on stdin, one JSON argument list a line, answered one JSON line each on stdout."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # vLLM logs to stdout: everything but the answers goes to stderr
    for line in sys.stdin:
        try:
            replay(parse([*json.loads(line), "--in-process"]))
            answer = {"ok": True}
        except Exception:  # noqa: BLE001 - the test that asked gets the traceback; the next replay still runs
            answer = {"ok": False, "error": traceback.format_exc()}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


def main() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if sys.argv[1:] == ["--serve"]:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read when vllm is imported
        serve()
        return
    args = parse(sys.argv[1:])
    if args.in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    replay(args)


if __name__ == "__main__":
    main()
