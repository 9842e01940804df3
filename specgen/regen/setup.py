"""What `specgen.regenerate` builds from its config: the target (or, for engine=vllm, its class on the meta device),
the prompt limits, the generator and turn policy, and the settings that shaped the text (for the manifest)."""

import json

import torch
from omegaconf import DictConfig
from transformers import AutoConfig

from specgen.capture.target import load_target
from specgen.config import to_container
from specgen.errors import SpecgenError
from specgen.regen.engine import Generator, Sampling, derived_seed, static_shape
from specgen.regen.turns import ConversationRegenerator, TurnPolicy


def unit_seed(seed: int, unit: int) -> int:
    """The sampling seed of one work unit, derived from the run's seed and the unit index."""
    return derived_seed(seed, unit)


def template_kwargs(cfg: DictConfig, tokenizer) -> dict:
    """data.chat_template_kwargs, with `enable_thinking` set from regenerate.thinking when that is not null."""
    kwargs = to_container(cfg.data)["chat_template_kwargs"] or {}
    thinking = cfg.regenerate.thinking
    if thinking is None:
        return kwargs
    if not isinstance(thinking, bool):
        raise SpecgenError(f"regenerate.thinking must be null, true or false, got {thinking!r}")
    if "enable_thinking" not in json.dumps(tokenizer.chat_template):
        raise SpecgenError(f"regenerate.thinking={str(thinking).lower()} but the chat template of "
                           f"{cfg.tokenizer.path} has no enable_thinking switch; leave regenerate.thinking=null")
    if kwargs.get("enable_thinking", thinking) != thinking:
        raise SpecgenError(f"regenerate.thinking={str(thinking).lower()} contradicts data.chat_template_kwargs."
                           f"enable_thinking={kwargs['enable_thinking']}; set only one of them")
    return {**kwargs, "enable_thinking": thinking}


def load_model(cfg: DictConfig, device: torch.device):
    """The target: loaded with transformers (engine=hf), or its class on the meta device for engine=vllm, whose
    engine loads the weights (`specgen.regen.vllm`)."""
    if cfg.engine.name == "vllm":
        from specgen.capture.vllm import meta_target, require_vllm

        if cfg.regenerate.kv_cache != "dynamic":
            raise SpecgenError(f"regenerate.kv_cache={cfg.regenerate.kv_cache} is a setting of engine=hf; vLLM "
                               "manages its own paged cache: leave regenerate.kv_cache=dynamic")
        require_vllm()
        return meta_target(cfg.model.path, cfg.model.dtype)
    if cfg.engine.name != "hf":
        raise SpecgenError(f"engine={cfg.engine.name} does not regenerate; use engine=hf (the default) or "
                           "engine=vllm")
    if cfg.regenerate.kv_cache == "static":  # its shape, checked before the weights load
        _, max_length, _ = context_limits(cfg, AutoConfig.from_pretrained(cfg.model.path))
        static_shape(max_length, cfg.regenerate.batch_size, cfg.regenerate.batch_tokens,
                     cfg.regenerate.max_new_tokens)
    return load_target(cfg.model.path, dtype=cfg.model.dtype, device=str(device),
                       attn_implementation=cfg.model.attn_implementation)


def context_limits(cfg: DictConfig, model_config) -> tuple[int, int, str]:
    """(longest prompt, sequence length, what sets the prompt limit): a prompt plus regenerate.max_new_tokens fits
    in data.max_length + max_new_tokens, in engine.max_model_len when given, and never beyond the model's positions
    (config.max_position_embeddings). The same for every engine; the sequence length is vLLM's max_model_len."""
    new_tokens = int(cfg.regenerate.max_new_tokens)
    positions = getattr(model_config.get_text_config(), "max_position_embeddings", None)
    asked = to_container(cfg.engine).get("max_model_len")
    if asked and positions and asked > positions:
        raise SpecgenError(f"engine.max_model_len={asked} exceeds the {positions} positions of {cfg.model.path}; "
                           f"pass engine.max_model_len={positions} or less (or null)")
    limits = {f"data.max_length={cfg.data.max_length}": int(cfg.data.max_length) + new_tokens}
    if asked:
        limits[f"engine.max_model_len={asked} - regenerate.max_new_tokens={new_tokens}"] = int(asked)
    if positions:
        limits[f"the model's {positions} positions - regenerate.max_new_tokens={new_tokens}"] = int(positions)
    reason, length = min(limits.items(), key=lambda item: item[1])
    if length - new_tokens < 1:
        raise SpecgenError(f"regenerate.max_new_tokens={new_tokens} leaves no room for a prompt in {length} "
                           f"positions ({reason.split(' - ')[0]}); lower regenerate.max_new_tokens")
    return length - new_tokens, length, reason


def build_regenerator(cfg: DictConfig, tokenizer, model) -> ConversationRegenerator:
    settings = cfg.regenerate
    sampling = Sampling(temperature=float(settings.temperature), top_p=float(settings.top_p),
                        top_k=int(settings.top_k), max_new_tokens=int(settings.max_new_tokens))
    max_prompt_tokens, max_model_len, prompt_limit = context_limits(cfg, model.config)
    if cfg.engine.name == "vllm":
        from specgen.regen.vllm import VllmGenerator

        generator = VllmGenerator(cfg.model.path, model, tokenizer, sampling, engine=to_container(cfg.engine),
                                  seed=int(settings.seed), max_model_len=max_model_len)
    else:
        generator = Generator(model, tokenizer, sampling, batch_size=settings.batch_size,
                              batch_tokens=settings.batch_tokens, kv_cache=settings.kv_cache,
                              max_length=max_model_len)
    policy = TurnPolicy(turns=settings.turns, on_truncated=settings.on_truncated, on_empty=settings.on_empty,
                        on_loop=settings.on_loop, loop_ngram=int(settings.loop_ngram),
                        loop_repeats=int(settings.loop_repeats), resample_tries=int(settings.resample_tries),
                        user_turns=settings.user_turns)
    return ConversationRegenerator(tokenizer, generator, policy, max_prompt_tokens=max_prompt_tokens,
                                   prompt_limit=prompt_limit,
                                   chat_template_kwargs=template_kwargs(cfg, tokenizer),
                                   on_bad_row=cfg.data.on_bad_row)


def generation_settings(cfg: DictConfig, regenerator: ConversationRegenerator) -> dict:
    """Everything that shaped the generated text, for the manifest (and, minus speed knobs, the identity)."""
    sampling = regenerator.generator.sampling
    return {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
            "max_new_tokens": sampling.max_new_tokens, "seed": cfg.regenerate.seed,
            "seeding": regenerator.generator.seeding,
            "thinking": cfg.regenerate.thinking, "chat_template_kwargs": regenerator.chat_template_kwargs,
            "turns": regenerator.policy.turns, "user_turns": regenerator.policy.user_turns,
            "on_truncated": regenerator.policy.on_truncated,
            "on_empty": regenerator.policy.on_empty, "on_loop": regenerator.policy.on_loop,
            "loop_ngram": regenerator.policy.loop_ngram, "loop_repeats": regenerator.policy.loop_repeats,
            **resample_settings(regenerator.policy),
            "max_prompt_tokens": regenerator.max_prompt_tokens, "prompt_limit": regenerator.prompt_limit,
            "stop_token_ids": regenerator.generator.stop_token_ids, "split_reasoning": regenerator.split_reasoning,
            "backend": regenerator.generator.backend}


def resample_settings(policy) -> dict:
    """{"resample_tries": N} where a policy resamples; {} otherwise, so outputs made before it keep their identity."""
    return {"resample_tries": policy.resample_tries} if "resample" in (policy.on_loop, policy.on_empty) else {}
