"""A generated turn's text -> the assistant message that renders back to it.

For a template without reasoning the whole text is the message content. A template that renders reasoning
(Qwen3 and its kin write `<think>\\nREASONING\\n</think>\\n\\nCONTENT`) expects it in `reasoning_content`, and
may drop it from earlier turns when the conversation goes on; so the text is split there and the template
decides, as it does when serving, where reasoning appears. Either way the message renders back to the tokens
the model generated followed by the end-of-turn token.
"""

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def renders_reasoning(tokenizer) -> bool:
    """True when the tokenizer's chat template renders `<think>` reasoning blocks."""
    template = tokenizer.chat_template
    templates = template.values() if isinstance(template, dict) else [template or ""]
    return any(THINK_CLOSE in text for text in templates)


def opens_reasoning(prompt: str) -> bool:
    """True when the generation prompt leaves a `<think>` block open, i.e. the completion starts inside it
    (templates that force thinking end their generation prompt with `<think>\\n`)."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


def assistant_reply(text: str, *, prompt: str, split_reasoning: bool) -> dict:
    """The assistant message for a generated `text` (the stop token already removed) that followed `prompt`."""
    if not split_reasoning:
        return {"role": "assistant", "content": text}
    if opens_reasoning(prompt) and not text.lstrip().startswith(THINK_OPEN):
        text = THINK_OPEN + text
    reasoning, closed, content = text.partition(THINK_CLOSE)
    if not closed:
        # No finished block: either no reasoning at all, or a turn cut off while still thinking.
        reasoning, content = (text, "") if THINK_OPEN in text else ("", text)
    reasoning = reasoning.partition(THINK_OPEN)[2] if THINK_OPEN in reasoning else reasoning
    return {"role": "assistant", "content": content.lstrip("\n"), "reasoning_content": reasoning.strip("\n")}
