"""The closing summary of a training run: checkpoint, data, draft, vocabulary coverage, figures of the last step."""

import json
from pathlib import Path

from torch import nn

from specgen.draft.exports import trained_draft_tokens, vllm_speculative_config
from specgen.draft.vocab import VocabMapping
from specgen.progress import format_table
from specgen.stream import StreamBatches
from specgen.training.data import TrainingData
from specgen.training.trainer import METRICS, TrainerState


def vocab_coverage(draft: nn.Module, data: TrainingData) -> str:
    """How much of the data's trained tokens and of the target's top tokens the draft vocabulary covers."""
    in_vocab = set(VocabMapping.from_d2t(draft.d2t, draft.config.vocab_size).draft_to_target.tolist())
    parts = []
    for name, counts in (("of the trained tokens", data.token_counts),
                         ("of the target's top tokens at trainable positions", data.target_top_counts)):
        if counts:
            share = sum(n for token, n in counts.items() if token in in_vocab) / max(1, sum(counts.values()))
            parts.append(f"{100 * share:.1f}% {name}")
    return "covers " + ", ".join(parts) if parts else "coverage unknown"


def vocab_clipped(asked: int | None, draft: nn.Module) -> str:
    """'; draft.vocab_size=N asked, only M distinct ...' when the vocabulary came out smaller than asked."""
    got = draft.config.draft_vocab_size
    if asked is None or got >= asked:
        return ""
    return f"; draft.vocab_size={asked:,} asked, only {got:,} distinct tokens seen, so {got:,} used"


def serve_line(out_dir: Path, target: str, draft: nn.Module, ttt_length: int) -> str:
    """How vLLM serves the checkpoint beside `target`, K = the draft positions it trained (`trained_draft_tokens`)."""
    k = trained_draft_tokens(draft.method_name, draft.config, ttt_length)
    spec = vllm_speculative_config(draft.method_name, Path(out_dir).resolve(), k)
    trained = ("draft.dflash.block_size - 1" if draft.method_name == "dflash" else "train.ttt_length")
    return (f"vLLM: LLM(model={json.dumps(target)}, speculative_config={json.dumps(spec)}) "
            f"(K={k}: {trained}, the positions it trained)")


def print_summary(out_dir: Path, data: TrainingData, draft: nn.Module, state: TrainerState, metrics: dict,
                   seconds: float, optimizer: str, vocab_source: str = "data", vocab_asked: int | None = None,
                   keep_best: str | None = None, *, ttt_length: int, target_head: str | None = None,
                   tensorboard: str | None = None) -> None:
    accuracies = " ".join(f"{metrics[k]:.2f}" for k in sorted((k for k in metrics if k.startswith("acc_")),
                                                              key=lambda k: int(k.split("_")[1])))
    print(format_table([
        ("checkpoint", f"{out_dir} (config.json + model.safetensors, servable as {draft.config.architectures[0]})"),
        ("data", data.description),
        *([("target dtype", data.target_dtype)] if data.target_dtype else []),
        ("draft", f"{sum(p.numel() for p in draft.trainable_parameters()) / 1e6:.2f}M trainable parameters, "
                  f"vocabulary {draft.config.draft_vocab_size} of {draft.config.vocab_size}"),
        ("vocabulary", f"from {vocab_source}: {vocab_coverage(draft, data)}{vocab_clipped(vocab_asked, draft)}"),
        ("optimizer", optimizer),
        ("steps", f"{state.step} ({state.tokens_seen:,} tokens, {seconds:.1f}s in this run)"),
        ("last loss", f"{metrics.get('loss', float('nan')):.4f}"),
        ("accuracy per TTT step", accuracies or "n/a"),
        ("scored positions", f"{100 * metrics.get('scored', 0):.1f}% of the trainable positions (last logging "
                             "window; the rest have the target's top token outside the draft vocabulary)"),
        ("simulated acceptance", f"{metrics.get('accept_len_sim', float('nan')):.2f} (chain of "
                                 f"{sum(k.startswith('acc_') for k in metrics)} drafts, greedy, last logging window)"),
        *([("held-out samples", f"loss {metrics['heldout_loss']:.4f}, accuracy per TTT step " + " ".join(
            f"{metrics[k]:.2f}" for k in sorted((k for k in metrics if k.startswith("heldout_acc_")),
                                                key=lambda k: int(k.rsplit("_", 1)[1]))) +
            (f", simulated acceptance {metrics['heldout_accept_len_sim']:.2f}"
             if "heldout_accept_len_sim" in metrics else "") + " (train.heldout_samples, last step; the lines "
            "above are on training samples)")] if "heldout_loss" in metrics else []),
        *([("acceptance (decoded)", f"{metrics['accept_len']:.2f} = 1 + accepted / rounds over "
                                    f"{metrics['accept_rounds']} rounds of real speculative decoding on the "
                                    "train.eval_prompts, last step; lossless in "
                                    f"{metrics['accept_lossless']:.0%} of them")] if "accept_len" in metrics else []),
        *([("kept draft", f"step {state.best_step} of {state.step}: {keep_best} {state.best_value:.4f}, the best "
                          f"probe (train.keep_best; the last step's: {metrics[keep_best]:.4f}); in {out_dir} and "
                          "checkpoints/best")] if keep_best and state.best_step else []),
        ("throughput", f"{metrics.get('tokens_per_s', 0):,.0f} tokens/s (last logging window)"),
        *([("target head", f"this process: {target_head}")] if target_head else []),
        *([("stream", f"this process: {data.source.report()}")] if isinstance(data.source, StreamBatches) else []),
        ("serve", serve_line(out_dir, data.target_path, draft, ttt_length)),
        ("metrics", str(out_dir / METRICS)),
        *([("tensorboard", tensorboard)] if tensorboard else []),
    ]))
