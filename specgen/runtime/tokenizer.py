"""`tokenizer.path` -> a Hugging Face tokenizer that has a chat template."""

from pathlib import Path

from specgen.errors import SpecgenError


def load_tokenizer(path: str):
    """The tokenizer in folder `path`; a one-line error when it is missing or has no chat template."""
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise SpecgenError(f"tokenizer.path={path} is not a folder; point it at a Hugging Face tokenizer folder "
                           "(it defaults to model.path)")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if not tokenizer.chat_template:
        raise SpecgenError(f"the tokenizer in {path} has no chat template; use an instruct/chat tokenizer or "
                           "add chat_template.jinja to the folder")
    return tokenizer


def stop_token_ids(model, tokenizer) -> list[int]:
    """The tokens that end a turn: the checkpoint's generation eos ids (often several, e.g. Llama-3.1's
    <|eot_id|> and <|eom_id|>) plus the tokenizer's eos token."""
    configured = model.generation_config.eos_token_id
    ids = [configured] if isinstance(configured, int) else list(configured or [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    ids = list(dict.fromkeys(ids))
    if not ids:
        raise SpecgenError("neither the model's generation_config.json nor its tokenizer names an eos token, so a "
                           "turn could never end; add eos_token_id to generation_config.json in model.path")
    return ids
