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
