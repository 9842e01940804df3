"""How much of what the target writes a draft vocabulary can propose at all (issue #42: is the vocabulary the limit?).

    python benchmarks/vocab_coverage.py --served DIR [--draft C ...] [--counts S/token_counts.json --sizes 8192 16384]

DIR is a `benchmarks/served_acceptance.py --out` folder: its target.json holds the tokens the target alone wrote on
the prompt set (greedy). A draft with a reduced vocabulary can only propose the tokens in it, so the share of those
tokens that lie in a draft's vocabulary (its t2d) bounds the share of its first positions that can be accepted.
Each --draft is a trained draft folder (model.safetensors with d2t); --counts (the token_counts.json generate writes
beside the shards) with --sizes shows what specgen.train would choose at each draft.vocab_size on that data
(specgen.draft.vocab.build_vocab_mapping) and the share each would cover. Prints a markdown table.
"""

import argparse
import json
import sys
from collections import Counter
from pathlib import Path


def target_tokens(served: Path) -> Counter:
    """Occurrences of each token id the target alone wrote (served_acceptance.py's target.json)."""
    path = served / "target.json"
    if not path.is_file():
        raise SystemExit(f"{path} not found: pass a benchmarks/served_acceptance.py --out folder")
    return Counter(int(token) for row in json.loads(path.read_text())["output_token_ids"] for token in row)


def covered(tokens: Counter, vocab: set[int]) -> float:
    """The share of `tokens` (with multiplicity) whose id is in `vocab`."""
    return sum(count for token, count in tokens.items() if token in vocab) / max(sum(tokens.values()), 1)


def draft_vocab(folder: Path) -> set[int]:
    """The target ids of a trained draft's vocabulary, from its d2t (specgen.draft.vocab conventions)."""
    from safetensors import safe_open

    from specgen.draft.vocab import VocabMapping

    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        if "d2t" not in set(weights.keys()):
            raise SystemExit(f"{folder}: no d2t in model.safetensors (a draft over the whole target vocabulary)")
        d2t = weights.get_tensor("d2t")
    return {int(token) for token in VocabMapping.from_d2t(d2t, sys.maxsize).draft_to_target}


def rows(args, tokens: Counter) -> list[tuple[str, int, float]]:
    """(what, vocabulary size, share of the target's tokens covered), the drafts first, then the --sizes."""
    from specgen.draft.vocab import build_vocab_mapping, read_token_counts

    found = []
    for folder in args.draft:
        vocab = draft_vocab(folder)
        found.append((f"draft {folder.name}", len(vocab), covered(tokens, vocab)))
    if args.counts:
        counts, vocab_size = read_token_counts(args.counts)
        for size in args.sizes:
            vocab = {int(t) for t in build_vocab_mapping(counts, vocab_size, size).draft_to_target}
            found.append((f"{args.counts.parent.name}: draft.vocab_size={size}", len(vocab), covered(tokens, vocab)))
        found.append((f"{args.counts.parent.name}: every trained token", len(counts), covered(tokens, set(counts))))
    return found


def table(found: list[tuple[str, int, float]], tokens: Counter) -> str:
    lines = [f"target's tokens: {sum(tokens.values()):,} ({len(tokens):,} distinct)", "",
             "| vocabulary | tokens in it | share of the target's tokens it contains |", "|---|---|---|"]
    lines += [f"| {what} | {size:,} | {share:.4f} |" for what, size, share in found]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--served", type=Path, required=True, help="a served_acceptance.py --out folder")
    parser.add_argument("--draft", type=Path, action="append", default=[], help="a trained draft folder (repeat)")
    parser.add_argument("--counts", type=Path, help="token_counts.json beside the shards")
    parser.add_argument("--sizes", type=int, nargs="+", default=[8192], help="draft.vocab_size values for --counts")
    args = parser.parse_args(argv)
    if not args.draft and not args.counts:
        parser.error("pass --draft or --counts")
    tokens = target_tokens(args.served)
    print(table(rows(args, tokens), tokens))


if __name__ == "__main__":
    main()
