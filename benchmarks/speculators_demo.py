"""Train vLLM's `speculators` (0.9) EAGLE-3 trainer on specgen's demo shards, on CPU; write a specgen checkpoint.

    .venv-vllm/bin/python benchmarks/speculators_demo.py --shards DIR --out CKPT [--seed 0] [--max-steps N]
        [--norm-before-residual] [--batch-tokens 1024] [--target DIR] [--draft-vocab-size 1024]
        [--ttt-steps 4] [--epochs 2] [--lr 5e-3]

Used by `benchmarks/draft_quality.py --speculators` to compare trainers on the same data: the demo shards, the same
draft architecture (one Llama layer shaped like the tiny target's, `norm_before_residual=False` unless asked), the
same draft vocabulary mapping (specgen's d2t/t2d from the shards' token counts, clipped as specgen clips it to the
distinct trained tokens), 4 TTT steps, 2 epochs, lr 5e-3, 1024-token batches by default (--batch-tokens:
speculators packs samples, in shuffled order, to that budget; `benchmarks/levers.py` passes a real target's shards
and its train config's values),
speculators' norm_before_fc and norm_output off (specgen's draft has neither; speculators 0.9 turns both on for
EAGLE-3, and norm_before_residual too). Everything else is speculators' own defaults (LM head from the target,
frozen; Muon on the hidden matrices and AdamW, betas (0.9, 0.999), on the rest; clipping 1.0; linear decay to 0
after a 1% warmup; loss mask m[i+1+j]; 0.1% of the samples held out for its validation pass).

Data conversion: speculators reads a `datasets` folder (input_ids, loss_mask, seq_len) and one
`hidden_states/hs_{i}.safetensors` per sample holding [T, 4, H] (3 aux layers + the last layer before the final
norm, which it normalises itself with the target's norm). specgen stores the last state after the final norm, y;
y / norm.weight has unit RMS, so the target's norm maps it back to y (exactly up to RMSNorm's eps).

CPU patches (runtime only, no change to the algorithm), applied in `_patch_for_cpu` where torch finds no
accelerator (on a GPU speculators runs unpatched, with its own device handling and precision):
  1. `Trainer.device_type`: speculators falls back to "cuda" when no accelerator exists -> "cpu" (autocast, moves);
  2. `get_local_rank()` is used as the device of `.to(...)` -> "cpu";
  3. `torch.accelerator.synchronize` (its step timer) is a no-op when there is no accelerator;
  4. on a CPU without native bfloat16 matmuls, `torch.optim.Muon` (speculators' optimizer) iterates Newton-Schulz in
     float32 instead of emulated bfloat16, exactly as specgen's own Muon does there (specgen.training.optim): the same
     update up to bfloat16 rounding, 5-6x faster steps (docs/benchmarks/2026-11-26-cpu-muon.md), so both trainers'
     wall times compare. Said on stdout when applied.
The result is converted to specgen's checkpoint layout (`midlayer.*`, config with eagle_config) for evaluation.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from specgen.draft.checkpoint import save_draft
from specgen.draft.target_head import load_target_weights
from specgen.draft.vocab import build_vocab_mapping, read_token_counts
from specgen.methods.eagle3.model import Eagle3Draft, draft_config
from specgen.store.reader import open_shards


def convert_shards(shards: Path, out: Path, target: Path, draft_vocab_size: int) -> tuple[Path, Path, Path, int]:
    """specgen shards -> speculators' offline data folder, plus d2t/t2d .npy files (specgen's mapping) and the
    draft vocabulary's size (clipped, as specgen's trainer clips it, to the distinct trained tokens)."""
    import datasets

    data_dir = out / "data"
    dataset = open_shards(shards)
    norm = load_file(str(target / "model.safetensors"))["model.norm.weight"].float()
    (data_dir / "hidden_states").mkdir(parents=True, exist_ok=True)
    columns = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for index in range(len(dataset)):
        row = dataset[index]
        ids = torch.as_tensor(row["input_ids"]).long()
        aux = torch.as_tensor(row["aux_hidden_states"]).float()
        last = torch.as_tensor(row["last_hidden_state"]).float() / norm
        states = torch.cat([aux.view(len(ids), -1, last.shape[-1]), last[:, None]], dim=1)
        save_file({"hidden_states": states.contiguous(), "token_ids": ids},
                  str(data_dir / "hidden_states" / f"hs_{index}.safetensors"))
        columns["input_ids"].append(ids.tolist())
        columns["loss_mask"].append(torch.as_tensor(row["loss_mask"]).long().tolist())
        columns["seq_len"].append(len(ids))
    datasets.Dataset.from_dict(columns).with_format("torch").save_to_disk(str(data_dir))
    counts, vocab = read_token_counts(shards / "token_counts.json")
    mapping = build_vocab_mapping(counts, vocab, draft_vocab_size)
    d2t, t2d = out / "d2t.npy", out / "t2d.npy"
    np.save(d2t, mapping.d2t.numpy())
    np.save(t2d, mapping.t2d.numpy())
    return data_dir, d2t, t2d, len(mapping.d2t)


def _patch_for_cpu() -> None:
    """The CPU patches named in the module docstring; none where torch finds an accelerator (speculators then runs
    as it does on its own GPUs)."""
    import speculators.train.trainer as trainer_module

    if torch.accelerator.is_available():
        print(f"speculators_demo: training on {torch.accelerator.current_accelerator()}, no CPU patches", flush=True)
        return
    setup_model = trainer_module.Trainer.setup_model

    def setup_model_on_cpu(self, *args, **kwargs):
        self.device_type = "cpu"  # patch 1: speculators assumes "cuda" when torch finds no accelerator
        return setup_model(self, *args, **kwargs)

    trainer_module.Trainer.setup_model = setup_model_on_cpu
    trainer_module.get_local_rank = lambda: "cpu"  # patch 2: the rank doubles as the device of .to(...)
    # patch 3: the step timer synchronizes the accelerator, which fails when there is none
    torch.accelerator.synchronize = lambda *a, **k: None
    from specgen.training.optim import newton_schulz_dtype, orthogonalize

    choice = newton_schulz_dtype("cpu")
    if choice.name == "float32":  # patch 4
        import torch.optim._muon as muon

        muon._zeropower_via_newtonschulz = (lambda grad, coefficients, steps, eps:
                                            orthogonalize(grad, coefficients, steps, eps, torch.float32))
        print(f"speculators_demo: torch.optim.Muon's Newton-Schulz iteration in float32 ({choice.reason})", flush=True)


def train(args: argparse.Namespace) -> Path:
    """Run speculators' trainer in this process; returns the folder holding its final model.safetensors."""
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    work = args.out / "speculators"
    data_dir, d2t, t2d, draft_vocab_size = convert_shards(args.shards, work, args.target, args.draft_vocab_size)
    _patch_for_cpu()
    argv = ["--verifier-name-or-path", str(args.target), "--data-path", str(data_dir), "--save-path",
            str(work / "checkpoints"), "--d2t-path", str(d2t), "--t2d-path", str(t2d),
            "--draft-vocab-size", str(draft_vocab_size), "--ttt-steps", str(args.ttt_steps),
            "--epochs", str(args.epochs), "--lr", str(args.lr),
            "--total-seq-len", str(args.batch_tokens), "--train-data-ratio", "0.999", "--num-workers", "0",
            "--hidden-states-dtype", "float32", "--draft-attn-impl", "eager", "--seed", str(args.seed),
            "--loss-implementation", "eager", "--logger", "", "--log-dir", str(work / "logs"), "--num-layers", "1",
            "--no-norm-before-fc", "--no-norm-output"]
    argv.append("--norm-before-residual" if args.norm_before_residual else "--no-norm-before-residual")
    if args.max_steps:
        argv += ["--max-steps", str(args.max_steps)]
    torch.set_num_threads(1)
    main(TrainConfig.resolve(argv))
    weights = sorted((work / "checkpoints").rglob("model.safetensors"), key=lambda p: p.stat().st_mtime)
    if not weights:
        raise SystemExit(f"speculators wrote no model.safetensors under {work / 'checkpoints'}")
    return weights[-1].parent


def to_specgen(folder: Path, args: argparse.Namespace, aux_layers: list[int]) -> None:
    """speculators' weights (layers.0.*, fc, norm, lm_head, d2t, t2d) -> a specgen checkpoint in args.out."""
    state = load_file(str(folder / "model.safetensors"))
    weights = load_target_weights(args.target)
    config = draft_config(weights.config, aux_layers=aux_layers, draft_vocab_size=len(state["d2t"]),
                          norm_before_residual=args.norm_before_residual)
    draft = Eagle3Draft(config)
    renamed = {name.replace("layers.0.", "midlayer."): tensor.float() if tensor.is_floating_point() else tensor
               for name, tensor in state.items() if not name.startswith(("verifier_", "embed_tokens"))}
    missing, unexpected = draft.load_state_dict(renamed, strict=False)
    if [m for m in missing if m != "embed_tokens.weight"] or unexpected:
        raise SystemExit(f"cannot map speculators' checkpoint: missing {missing}, unexpected {unexpected}")
    info = {"target": {"path": str(args.target)}, "aux_layers": aux_layers, "trained_by": "speculators 0.9"}
    save_draft(draft, args.out, info)


def main() -> None:
    from specgen.assets import ASSETS_DIR

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--target", type=Path, default=ASSETS_DIR / "tiny-target")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--draft-vocab-size", type=int, default=1024)
    parser.add_argument("--max-steps", type=int)
    parser.add_argument("--ttt-steps", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--batch-tokens", type=int, default=1024, help="tokens per packed batch (--total-seq-len)")
    parser.add_argument("--norm-before-residual", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    manifest = json.loads((args.shards / "manifest.json").read_text())
    folder = train(args)
    to_specgen(folder, args, list(manifest["capture"]["aux_layers"]))
    print(f"speculators draft -> {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
