"""`python -m specgen.evaluate draft.path=CKPT`: acceptance length of a draft, and a losslessness check.

For every prompt turn the target decodes greedily twice: alone (the reference) and speculatively with the draft
(`specgen.draft.speculative`). Acceptance length is counted as vLLM, SGLang and the EAGLE papers count it:
1 + accepted draft tokens / verification rounds (the bonus token included), so 1.0 means the draft never helped
and K+1 is the ceiling; `acceptance_rate_per_position[j]` is the share of rounds whose first j+1 draft tokens were
all accepted (vLLM's num_accepted_tokens_per_pos / num_drafts). `emitted_tokens_per_round` is another figure:
tokens actually emitted per round, which is lower because the last round of a turn is cut at its end.
Multi-turn prompts build their history from the reference answers, so both decodings of a turn always see the
same prompt.

The lossless verdict (`specgen.draft.lossless`): in float32 both decodings agree exactly; in bf16 a turn may diverge
where the target's two best tokens are nearly tied, and each diverging turn is diagnosed at its first differing token
as a near-tie (rounding: counted, listed, left out of the verdict) or a failure (a clear margin: the verdict is NO).
`evaluate.reference=replay` replaces the one-token greedy reference by the greedy choices replayed in the speculative
run's own forward shapes, exact in any dtype (every divergence is then a failure).

Writes output.dir/eval.json (overall and per-category acceptance, per-position acceptance rates, accepted-token
histogram, tokens/s of both decodings, lossless with its near-tie and failed turns, matches_target_greedy,
`warnings`: a DFlash draft asked for more drafts than its block trained, also logged and printed) and
output.dir/samples.jsonl (one line per prompt turn, with its prompt and output token ids, so another engine can
replay exactly the same prompts, and the divergence record of a turn that differs).

Long runs can be watched and interrupted: a progress bar counts prompts, and each finished prompt is appended to
output.dir/progress.jsonl (flushed and fsync'd) under a first line naming the settings (draft and target files'
checksums, prompts, K, max_new_tokens, turns, dtype). Re-running the same command in the same output.dir skips the
prompts already there (a line cut by a kill is discarded) and ends with the same eval.json as an uninterrupted run
(except the wall-clock tokens/s); other settings in that output.dir are refused.
"""

if __name__ == "__main__":  # a config error or `--cfg job` is answered before torch is imported (specgen.config)
    from specgen.config import check_command_line

    check_command_line("evaluate")

import json
import logging
import os
from collections import defaultdict
from pathlib import Path

from omegaconf import DictConfig

from specgen.capture.target import load_target
from specgen.config import stage_main
from specgen.data.prompts import Prompt, chat_prompt_ids, read_prompts
from specgen.draft.aux import aux_layers_of
from specgen.draft.checkpoint import load_draft, read_raw_config, specgen_info
from specgen.draft.exports import dflash_block_positions
from specgen.draft.lossless import diagnose, verdict
from specgen.draft.speculative import Generation, TargetRunner, greedy_generate, replayed_greedy, speculative_generate
from specgen.errors import SpecgenError
from specgen.progress import Progress, format_table
from specgen.runtime import load_tokenizer, resolve_device, resolve_model_dtype, set_threads, stop_token_ids
from specgen.store.commit import content_hash, write_json_atomic, write_text_atomic

log = logging.getLogger(__name__)
TURNS = ("all", "first")
PROGRESS = "progress.jsonl"


def run(cfg: DictConfig) -> dict:
    if cfg.draft.path is None:
        raise SpecgenError("pass draft.path=CKPT: the output.dir of specgen.train")
    if cfg.evaluate.turns not in TURNS:
        raise SpecgenError(f"evaluate.turns must be one of {list(TURNS)}, got {cfg.evaluate.turns!r}")
    set_threads(cfg.runtime.threads)
    info = specgen_info(read_raw_config(cfg.draft.path))
    target_path = cfg.model.path or info.get("target", {}).get("path")
    if target_path is None:
        raise SpecgenError(f"the draft at {cfg.draft.path} does not record its target: pass model.path=TARGET")
    device = resolve_device(cfg.runtime.device)
    dtype = resolve_model_dtype(cfg.model.dtype, device, target_path)
    model = load_target(target_path, dtype=dtype.name, device=str(device),
                        attn_implementation=cfg.model.attn_implementation)
    embedding = model.get_input_embeddings().weight.detach().float()
    draft = load_draft(cfg.draft.path, embedding=embedding, target_config=model.config,
                       foreign_ids=cfg.draft.foreign_aux_ids, method=cfg.draft.method).to(device).eval()
    aux_layers = aux_layers_of(draft.config)
    num_layers = model.config.get_text_config().num_hidden_layers
    if max(aux_layers) >= num_layers or draft.config.target_hidden_size != embedding.shape[1]:
        raise SpecgenError(f"the draft reads aux layers {aux_layers} of size {draft.config.target_hidden_size} but "
                           f"the target {target_path} has {num_layers} layers of size {embedding.shape[1]}: pass "
                           "the draft's own target as model.path")
    warnings = [note] if (note := _untrained_positions(draft, cfg.evaluate.num_draft_tokens)) else []
    for note in warnings:
        log.warning(note)
    target = TargetRunner(model, aux_layers)
    tokenizer = load_tokenizer(cfg.tokenizer.path or target_path)
    eos_ids = set(stop_token_ids(model, tokenizer))

    out_dir = Path(cfg.output.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = list(read_prompts(cfg.data.path, cfg.evaluate.max_prompts))
    if not prompts:
        raise SpecgenError(f"data.path {cfg.data.path} gave no prompt to evaluate")
    journal = PromptJournal(out_dir / PROGRESS, _settings(cfg, target_path, model))
    progress = Progress(len(prompts), desc="evaluate", enabled=cfg.runtime.progress)
    progress.bar.unit = "prompt"
    samples = []
    for index, prompt in enumerate(prompts):
        done = journal.get(index, prompt.id)
        if done is None:
            done = _evaluate_prompt(prompt, target, draft, tokenizer, cfg, eos_ids)
            journal.append(index, prompt.id, done)
        samples.extend(done)
        progress.update(1, sum(s["new_tokens"] for s in done))
    progress.close()
    if journal.resumed:
        log.info("resumed: %d of %d prompts were already in %s", journal.resumed, len(prompts), journal.path)
    # The replayed reference runs the very shapes of the speculative run: there every divergence is a failure.
    report = summarize(samples, num_draft_tokens=cfg.evaluate.num_draft_tokens,
                       near_tie_tolerance=0.0 if cfg.evaluate.reference == "replay" else cfg.evaluate.near_tie_tolerance)
    report.update({"draft": str(Path(cfg.draft.path).resolve()), "target": str(target_path),
                   "data": str(cfg.data.path), "max_new_tokens": cfg.evaluate.max_new_tokens,
                   "target_dtype": str(model.dtype).removeprefix("torch."), "target_dtype_reason": dtype.reason,
                   "device": str(device), "reference": cfg.evaluate.reference, "warnings": warnings})
    write_json_atomic(out_dir / "eval.json", report)
    write_text_atomic(out_dir / "samples.jsonl", "".join(json.dumps(s) + "\n" for s in samples))
    _print_report(report, out_dir)
    return report


def _untrained_positions(draft, num_draft_tokens: int) -> str | None:
    """The warning for a DFlash draft asked for more drafts than its block trained: each round then runs a block
    longer than any it saw in training (on SmolLM2, block 4 accepted 1.455 / 1.442 at K=5 / 7 against 1.466 at 3)."""
    if draft.method_name != "dflash":
        return None
    trained = dflash_block_positions(draft.config)
    if num_draft_tokens <= trained:
        return None
    untrained = (f"position {num_draft_tokens} is" if num_draft_tokens == trained + 1
                 else f"positions {trained + 1}..{num_draft_tokens} are")
    return (f"evaluate.num_draft_tokens={num_draft_tokens} is more than the {trained} draft positions this DFlash "
            f"draft trained (block_size {trained + 1}): {untrained} untrained; serve it with "
            f"num_speculative_tokens <= {trained}")


def _settings(cfg: DictConfig, target_path, model) -> dict:
    """What decides a prompt's result: a journal written under other settings must not be resumed."""
    def files(folder) -> dict:
        folder = Path(folder)
        return {p.name: content_hash(p) for p in sorted(folder.iterdir())
                if p.suffix in (".safetensors", ".bin") or p.name == "config.json"}

    return {"draft": files(cfg.draft.path), "target": files(target_path), "data": str(cfg.data.path),
            "num_draft_tokens": cfg.evaluate.num_draft_tokens, "max_new_tokens": cfg.evaluate.max_new_tokens,
            "turns": cfg.evaluate.turns, "dtype": str(model.dtype), "tokenizer": str(cfg.tokenizer.path),
            "reference": cfg.evaluate.reference}


class PromptJournal:
    """output.dir/progress.jsonl: a settings line, then one line per finished prompt ({"index", "id", "samples"}),
    each appended, flushed and fsync'd. Opening it keeps the complete lines of an earlier run with the same settings
    (a last line cut by a kill is cut off the file) and refuses one with other settings."""

    def __init__(self, path: Path, settings: dict):
        self.path, self.done, self.resumed = path, {}, 0
        settings = json.loads(json.dumps(settings))
        if path.exists():
            data = path.read_bytes()
            complete = data[:data.rfind(b"\n") + 1]
            lines = [json.loads(line) for line in complete.decode().splitlines()]
            if lines and lines[0].get("settings") != settings:
                raise SpecgenError(f"{path} holds prompts evaluated with other settings (draft, target, prompts, K, "
                                   "max_new_tokens, turns or dtype): pass another output.dir, or delete it to start over")
            self.done = {(line["index"], line["id"]): line["samples"] for line in lines[1:]}
            self.resumed = len(self.done)
            if len(complete) != len(data) or not lines:
                with open(path, "r+b") as f:
                    f.truncate(len(complete))
        if not self.done and not (path.exists() and path.stat().st_size):
            self._write({"settings": settings})

    def get(self, index: int, prompt_id: str) -> list[dict] | None:
        return self.done.get((index, prompt_id))

    def append(self, index: int, prompt_id: str, samples: list[dict]) -> None:
        self._write({"index": index, "id": prompt_id, "samples": samples})

    def _write(self, line: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
            f.flush()
            os.fsync(f.fileno())


def _evaluate_prompt(prompt: Prompt, target: TargetRunner, draft, tokenizer, cfg: DictConfig,
                     eos_ids: set[int]) -> list[dict]:
    messages = [{"role": "system", "content": prompt.system}] if prompt.system else []
    turns = prompt.user_turns if cfg.evaluate.turns == "all" else prompt.user_turns[:1]
    results = []
    for turn, text in enumerate(turns):
        messages.append({"role": "user", "content": text})
        prompt_ids = chat_prompt_ids(tokenizer, messages)
        speculative = speculative_generate(target, draft, prompt_ids, num_draft_tokens=cfg.evaluate.num_draft_tokens,
                                           max_new_tokens=cfg.evaluate.max_new_tokens, eos_ids=eos_ids)
        if cfg.evaluate.reference == "replay":
            reference = replayed_greedy(target, prompt_ids, speculative.drafted,
                                        max_new_tokens=cfg.evaluate.max_new_tokens, eos_ids=eos_ids)
        else:
            reference = greedy_generate(target, prompt_ids, max_new_tokens=cfg.evaluate.max_new_tokens,
                                        eos_ids=eos_ids)
        divergence = diagnose(target.model, prompt_ids, reference, speculative, target.model.dtype)
        results.append(_sample_record(prompt, turn, prompt_ids, reference, speculative, divergence))
        messages.append({"role": "assistant",
                         "content": tokenizer.decode(reference.tokens, skip_special_tokens=True)})
    return results


def _sample_record(prompt: Prompt, turn: int, prompt_ids: list[int], reference: Generation,
                   speculative: Generation, divergence: dict | None) -> dict:
    return {"id": prompt.id, "category": prompt.category, "turn": turn, "prompt_tokens": len(prompt_ids),
            "new_tokens": len(speculative.tokens), "rounds": speculative.verification_rounds,
            "emitted_per_round": speculative.rounds_emitted, "accepted": speculative.accepted,
            "matches_target_greedy": speculative.tokens == reference.tokens, "divergence": divergence,
            "seconds_speculative": speculative.seconds, "seconds_greedy": reference.seconds,
            "greedy_tokens": len(reference.tokens), "prompt_token_ids": list(prompt_ids),
            "output_token_ids": list(speculative.tokens)}


def acceptance(samples: list[dict], num_draft_tokens: int) -> dict:
    """Acceptance figures of a group of turns, pooled over their verification rounds.

    acceptance_length: 1 + accepted draft tokens / rounds (vLLM's mean acceptance length);
    acceptance_rate_per_position[j]: share of rounds that accepted at least j + 1 draft tokens;
    emitted_tokens_per_round: tokens emitted / rounds, the last round of a turn cut at its end (a different figure).
    """
    rounds = sum(s["rounds"] for s in samples)
    if not rounds:
        return {"acceptance_length": None, "acceptance_rate_per_position": None, "emitted_tokens_per_round": None}
    accepted = [a for s in samples for a in s["accepted"]]
    return {"acceptance_length": 1 + sum(accepted) / rounds,
            "acceptance_rate_per_position": [sum(a > j for a in accepted) / rounds for j in range(num_draft_tokens)],
            "emitted_tokens_per_round": sum(sum(s["emitted_per_round"]) for s in samples) / rounds}


def summarize(samples: list[dict], *, num_draft_tokens: int, near_tie_tolerance: float) -> dict:
    """Acceptance figures (see `acceptance`) overall and per category, losslessness, histogram and speed.

    `matches_target_greedy` is exact equality of every turn; `lossless` is the verdict of
    `specgen.draft.lossless.verdict`, which leaves out the turns that diverge at a near-tie (rounding)."""
    by_category: dict[str, list[dict]] = defaultdict(list)
    for sample in samples:
        by_category[sample["category"]].append(sample)
    histogram = [0] * (num_draft_tokens + 1)
    for sample in samples:
        for accepted in sample["accepted"]:
            histogram[accepted] += 1
    speculative_seconds = sum(s["seconds_speculative"] for s in samples)
    greedy_seconds = sum(s["seconds_greedy"] for s in samples)
    mismatches = [f"{s['id']}#{s['turn']}" for s in samples if not s["matches_target_greedy"]]
    return {
        **acceptance(samples, num_draft_tokens),
        "num_draft_tokens": num_draft_tokens,
        "matches_target_greedy": not mismatches,
        "mismatched_turns": mismatches,
        **verdict(samples, near_tie_tolerance),
        "num_prompts": len({s["id"] for s in samples}),
        "num_turns": len(samples),
        "new_tokens": sum(s["new_tokens"] for s in samples),
        "verification_rounds": sum(s["rounds"] for s in samples),
        "accepted_draft_tokens": sum(sum(s["accepted"]) for s in samples),
        "accepted_histogram": histogram,
        "per_category": {category: {**acceptance(group, num_draft_tokens), "turns": len(group)}
                         for category, group in sorted(by_category.items())},
        "tokens_per_s": {"speculative": sum(s["new_tokens"] for s in samples) / max(speculative_seconds, 1e-9),
                         "target_greedy": sum(s["greedy_tokens"] for s in samples) / max(greedy_seconds, 1e-9)},
    }


def _print_report(report: dict, out_dir: Path) -> None:
    per_category = ", ".join(f"{name} {values['acceptance_length']:.2f} ({values['turns']})"
                             for name, values in report["per_category"].items()
                             if values["acceptance_length"] is not None)
    speed = report["tokens_per_s"]
    print(format_table([
        ("acceptance length", f"{report['acceptance_length']:.3f} = 1 + accepted drafts per verification "
                              f"(K={report['num_draft_tokens']}, ceiling {report['num_draft_tokens'] + 1})"),
        ("accepted per position", " ".join(f"{rate:.2f}" for rate in report["acceptance_rate_per_position"])),
        ("emitted per round", f"{report['emitted_tokens_per_round']:.3f} tokens (turn ends cut)"),
        ("per category", per_category),
        ("accepted drafts", " ".join(f"{k}:{n}" for k, n in enumerate(report["accepted_histogram"]))),
        ("lossless", f"{report['lossless_line']} [reference: {report['reference']}]"),
        ("target dtype", f"{report['target_dtype']} ({report['target_dtype_reason']})"),
        ("prompts", f"{report['num_prompts']} ({report['num_turns']} turns, {report['new_tokens']:,} tokens)"),
        ("tokens/s", f"speculative {speed['speculative']:,.1f}, target greedy {speed['target_greedy']:,.1f}"),
        *(("warning", note) for note in report["warnings"]),
        ("report", str(out_dir / "eval.json")),
    ]))


main = stage_main("evaluate")(run)

if __name__ == "__main__":
    main()
