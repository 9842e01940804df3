"""The typed configuration schema: every key of every stage, its type, allowed values and range.

The YAML files in `conf/` give each key its default and its one-line comment; this table gives its type.
`validate(cfg, stage)` runs on the composed config of a stage before anything is loaded and raises a one-line
`SpecgenError` naming the first offending key: an unknown key (with the closest valid one), a required key left
unset (`???`), a value of the wrong type, outside its choices or below its minimum. One key means one thing in
every stage: the table is the project's single vocabulary of keys. The configuration reference of the docs
(`docs/reference/configuration.md`) is generated from it and the YAML (`docs/gen_config_reference.py`).
"""

import dataclasses
import difflib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from specgen.errors import SpecgenError


@dataclass(frozen=True)
class Key:
    """One configuration key: `kind` is int, float, bool, str, str|int, bool|str, str|list, list or dict (free-form, not
    descended)."""

    kind: str
    nullable: bool = False
    choices: tuple = ()
    min: float | None = None
    items: str | None = None  # list (or str|list given a list): the kind of every element


def _k(kind: str, *, null: bool = False, choices: tuple = (), min: float | None = None,
       items: str | None = None) -> Key:
    return Key(kind, null, choices, min, items)


POSITIVE = 1
KEEP_BEST = ("heldout_accept_len_sim", "heldout_acc_0", "accept_len")  # train.keep_best: higher is better
REFERENCE = "docs/reference/configuration.md"  # where error messages send the user: every key, generated from here
DTYPES = ("auto", "bfloat16", "float16", "float32")

KEYS: dict[str, Key] = {
    # model / tokenizer / data: what goes in
    "model.path": _k("str", null=True),
    "model.dtype": _k("str", choices=DTYPES),
    "model.attn_implementation": _k("str", choices=("sdpa", "eager", "flash_attention_2")),
    "tokenizer.path": _k("str", null=True),
    "data.path": _k("str|list", null=True, items="str"),  # one source, or a list read one after another
    "data.split": _k("str"),
    "data.subset": _k("str", null=True),
    "data.shards": _k("str", null=True),
    "data.max_length": _k("int", min=POSITIVE),
    "data.max_rows": _k("int", null=True, min=POSITIVE),
    "data.train_turns": _k("str", choices=("all", "last")),
    "data.mask_empty_think": _k("bool"),
    "data.on_bad_row": _k("str", choices=("skip", "fail")),
    "data.chat_template_kwargs": _k("dict", null=True),
    # capture: what to keep from the target's forward
    "capture.aux_layers": _k("list", null=True, items="int"),
    "capture.batch_tokens": _k("int", min=POSITIVE),
    "capture.max_batch_size": _k("int", min=POSITIVE),
    "capture.packing": _k("bool"),
    "capture.compile": _k("bool"),
    "capture.prefill_chunk_tokens": _k("int", null=True, min=POSITIVE),
    "capture.logits": _k("str", choices=("none", "topk", "full")),
    "capture.topk": _k("int", min=POSITIVE),
    "capture.token_logprobs": _k("bool"),
    "capture.logprob_temperature": _k("float", min=0),
    "capture.pooled": _k("str", choices=("none", "mean", "mean_trainable", "last")),
    "capture.pooled_layer": _k("str|int"),  # last, or one of capture.aux_layers
    "capture.lm_head_chunk_tokens": _k("int", min=POSITIVE),
    "capture.prefix_reuse": _k("bool|str", choices=("auto", True, False)),  # auto: on for the CPU, off for CUDA
    "capture.prefix_min_tokens": _k("int", min=POSITIVE),
    "capture.prefix_cache_tokens": _k("int", min=0),
    "capture.count_target_tokens": _k("bool"),
    # filter: drop samples by per-sample statistics
    "filter.min_mean_logprob": _k("float", null=True),
    "filter.max_mean_logprob": _k("float", null=True),
    # output: where results go
    "output.dir": _k("str"),
    "output.shard_size": _k("int", min=POSITIVE),
    "output.overwrite": _k("bool"),
    "output.lease_stale_s": _k("float", min=1),
    "output.codec": _k("str", null=True, choices=("fp8",)),
    "output.store_prefix_once": _k("bool"),
    # runtime / pipeline / engine: how the work runs
    "runtime.device": _k("str"),
    "runtime.seed": _k("int"),
    "runtime.progress": _k("bool"),
    "runtime.threads": _k("int", null=True, min=POSITIVE),
    "pipeline.prefetch_units": _k("int", min=0),
    "pipeline.write_queue": _k("int", min=POSITIVE),
    "pipeline.writers": _k("int", min=POSITIVE),
    "pipeline.heartbeat_s": _k("float", min=0),
    "engine.name": _k("str", choices=("hf", "deepspeed", "vllm")),
    "engine.tensor_parallel_size": _k("int", min=POSITIVE),
    "engine.pipeline_parallel_size": _k("int", min=POSITIVE),
    "engine.gpu_memory_utilization": _k("float", null=True, min=0),
    "engine.max_model_len": _k("int", null=True, min=POSITIVE),
    "engine.max_num_seqs": _k("int", null=True, min=POSITIVE),
    "engine.max_num_batched_tokens": _k("int", null=True, min=POSITIVE),
    "engine.enable_prefix_caching": _k("bool"),
    "engine.enforce_eager": _k("bool"),
    "engine.block_size": _k("int", null=True, min=POSITIVE),
    "engine.distributed_executor_backend": _k("str", null=True, choices=("mp", "ray", "uni")),
    "engine.cpu_kvcache_space_gb": _k("float", min=0),
    "engine.extra": _k("dict"),
    "engine.dist_backend": _k("str", choices=("auto", "nccl", "gloo")),
    "engine.config": _k("dict"),
    # train: the draft and its optimisation
    "mode": _k("str", choices=("offline", "online", "disaggregated")),
    # stream: disaggregated training's shared folder (train mode=disaggregated, capture_server)
    "stream.dir": _k("str", null=True),
    "stream.window": _k("int", min=POSITIVE),
    "stream.max_bytes": _k("int", min=POSITIVE),
    "stream.poll_s": _k("float", min=0),
    "stream.wait_timeout_s": _k("float", min=0),
    "stream.stale_s": _k("float", min=0),
    "stream.exit_when_done": _k("bool"),
    "stream.idle_exit_s": _k("float", null=True, min=0),
    "stream.server_id": _k("str", null=True),
    "distributed.strategy": _k("str", choices=("ddp", "deepspeed")),
    "distributed.deepspeed": _k("dict"),
    "draft.path": _k("str", null=True),
    "draft.init": _k("str", null=True),
    "draft.vocab_size": _k("int", min=POSITIVE),
    "draft.vocab_source": _k("str", choices=("data", "target")),
    "draft.overrides": _k("dict"),
    "draft.foreign_aux_ids": _k("str", choices=("layer_outputs", "hidden_states")),
    "draft.init_lm_head": _k("str", choices=("target", "random")),
    "draft.freeze_lm_head": _k("bool"),
    "draft.norm_before_residual": _k("bool"),
    "draft.method": _k("str", null=True, choices=("eagle3", "eagle3.1", "p-eagle", "dflash")),
    "draft.fc_norm": _k("bool", null=True),
    "draft.norm_before_fc": _k("bool", null=True),
    "draft.norm_output": _k("bool", null=True),
    "draft.mask_token_id": _k("int", null=True, min=0),
    "draft.dflash.num_layers": _k("int", min=POSITIVE),
    "draft.dflash.block_size": _k("int", min=2),
    "draft.dflash.max_anchors": _k("int", min=POSITIVE),
    "draft.dflash.loss_decay_gamma": _k("float", null=True, min=0),
    "draft.dflash.causal": _k("bool"),
    "train.max_steps": _k("int", null=True, min=POSITIVE),
    "train.cod_ratio": _k("float", null=True, min=0),
    "train.cod_ratio_min": _k("float", min=0),
    "train.epochs": _k("int", min=POSITIVE),
    "train.schedule_steps": _k("int", null=True, min=POSITIVE),
    "train.batch_tokens": _k("int", min=POSITIVE),
    "train.max_batch_size": _k("int", null=True, min=POSITIVE),
    "train.packing": _k("bool"),
    "train.grad_accum": _k("int", min=POSITIVE),
    "train.lr": _k("float", min=0),
    "train.min_lr_ratio": _k("float", min=0),
    "train.warmup_steps": _k("int", null=True, min=0),
    "train.schedule": _k("str", choices=("cosine", "linear")),
    "train.optimizer": _k("str", choices=("adamw", "muon")),
    "train.weight_decay": _k("float", min=0),
    "train.muon_weight_decay": _k("float", min=0),
    "train.betas": _k("list", items="float"),
    "train.grad_clip": _k("float", min=0),
    "train.ttt_length": _k("int", min=POSITIVE),
    "train.ttt_decay": _k("float", min=0),
    "train.loss_mask": _k("str", choices=("predicted", "input")),
    "train.out_of_vocab": _k("str", choices=("drop", "keep")),
    "train.precision": _k("str", choices=("auto", "fp32", "bf16")),
    "train.num_workers": _k("int", min=0),
    "train.cache_target_argmax": _k("bool|str", choices=("auto", True, False)),  # auto: when over one epoch
    "train.log_every": _k("int", min=POSITIVE),
    "train.save_every": _k("int", null=True, min=POSITIVE),
    "train.keep_checkpoints": _k("int", min=POSITIVE),
    "train.resume": _k("bool"),
    "train.tensorboard": _k("bool|str", choices=("auto", True, False)),  # auto: when tensorboard is installed
    "train.eval_every": _k("int", min=0),
    "train.eval_prompts": _k("str", null=True),
    "train.eval_max_prompts": _k("int", min=POSITIVE),
    "train.heldout_samples": _k("int", min=0),
    "train.keep_best": _k("str", null=True, choices=KEEP_BEST),
    # evaluate: speculative decoding on prompts
    "evaluate.num_draft_tokens": _k("int", min=POSITIVE),
    "evaluate.max_new_tokens": _k("int", min=POSITIVE),
    "evaluate.max_prompts": _k("int", null=True, min=POSITIVE),
    "evaluate.turns": _k("str", choices=("all", "first")),
    "evaluate.near_tie_tolerance": _k("float", min=0),
    "evaluate.reference": _k("str", choices=("greedy", "replay")),
    # export: a draft in the layout an engine reads
    "export.format": _k("str", choices=("vllm", "sglang", "specforge", "speculators")),
    "export.speculative_tokens": _k("int", min=POSITIVE),
    "export.dtype": _k("str", null=True, choices=("float32", "bfloat16", "float16")),
    # verify: audit a dataset
    "verify.samples": _k("int", min=0),
    "verify.tolerance": _k("float", null=True, min=0),
    # regenerate: the target's own answers
    "regenerate.temperature": _k("float", min=0),
    "regenerate.top_p": _k("float", min=0),
    "regenerate.top_k": _k("int", min=0),
    "regenerate.max_new_tokens": _k("int", min=POSITIVE),
    "regenerate.seed": _k("int"),
    "regenerate.thinking": _k("bool", null=True),
    "regenerate.turns": _k("str", choices=("all", "last")),
    "regenerate.user_turns": _k("str", choices=("keep", "synthesize")),
    "regenerate.on_truncated": _k("str", choices=("keep", "drop")),
    "regenerate.on_empty": _k("str", choices=("keep", "drop", "resample")),
    "regenerate.on_loop": _k("str", choices=("keep", "drop", "resample")),
    "regenerate.resample_tries": _k("int", min=POSITIVE),
    "regenerate.loop_ngram": _k("int", min=POSITIVE),
    "regenerate.loop_repeats": _k("int", min=0),
    "regenerate.batch_size": _k("int", min=POSITIVE),
    "regenerate.batch_tokens": _k("int", min=POSITIVE),
    "regenerate.kv_cache": _k("str", choices=("dynamic", "static")),
    # run: a recipe's stages in order, as one resumable command (specgen.run)
    "run.dir": _k("str"),
    "run.stages": _k("list", null=True, items="str"),
    "run.overrides": _k("dict"),
}


def closest_key(name: str, known: list[str] | None = None) -> str:
    """' (did you mean X?)' for the known key nearest to `name`, or '' when nothing is close."""
    match = difflib.get_close_matches(name, known or list(KEYS), n=1, cutoff=0.6)
    return f" (did you mean {match[0]}?)" if match else ""


def leaves(cfg: DictConfig, prefix: str = "") -> Iterator[str]:
    """Dotted names of the config's leaf keys; free-form `dict` keys count as leaves."""
    for name in cfg.keys():
        dotted = f"{prefix}{name}"
        if dotted == "hydra":
            continue
        node = cfg._get_node(name)
        spec = KEYS.get(dotted)
        if isinstance(node, DictConfig) and not (spec and spec.kind == "dict") and not node._is_missing():
            yield from leaves(node, f"{dotted}.")
        else:
            yield dotted


def validate(cfg: DictConfig, stage: str) -> None:
    """Check every key of a composed stage config against KEYS; raise a one-line SpecgenError on the first problem."""
    for name in leaves(cfg):
        spec = KEYS.get(name)
        if spec is None:
            raise SpecgenError(f"unknown config key {name}{closest_key(name)}; see {REFERENCE}")
        if is_missing(cfg, name):
            raise SpecgenError(f"{name} is required by specgen.{stage}: pass {name}=...")
        _check_value(name, OmegaConf.select(cfg, name), spec)


def is_missing(cfg: DictConfig, name: str) -> bool:
    """Whether dotted key `name` is `???` (directly, or through an interpolation to a `???`)."""
    try:
        OmegaConf.select(cfg, name, throw_on_missing=True)
    except MissingMandatoryValue:
        return True
    return False


def _check_value(name: str, value, spec: Key) -> None:
    if value is None:
        if not spec.nullable:
            raise SpecgenError(f"{name} must be set (got null)")
        return
    if isinstance(value, DictConfig | dict):
        value = OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig) else value
    elif OmegaConf.is_config(value):
        value = OmegaConf.to_container(value, resolve=True)
    _check_kind(name, value, spec.kind)
    if value == "" or (isinstance(value, list | tuple) and "" in value):  # `key=$UNSET` in a shell script
        raise SpecgenError(f"{name} is an empty string (an unset shell variable?): pass {name}=VALUE"
                           + (" or null" if spec.nullable else ""))
    if spec.items and isinstance(value, list | tuple):
        for item in value:
            _check_kind(f"{name}[]", item, spec.items)
    if spec.choices and value not in spec.choices:
        allowed = " | ".join(str(c).lower() if isinstance(c, bool) else str(c) for c in spec.choices) + (
            " | null" if spec.nullable else "")
        raise SpecgenError(f"{name}={value} is not one of {allowed}")
    if spec.min is not None and value < spec.min:
        raise SpecgenError(f"{name}={value} must be >= {spec.min}")


_KINDS = {"int": int, "float": (int, float), "bool": bool, "str": str, "str|int": (str, int), "bool|str": (bool, str),
          "str|list": (str, list, tuple), "list": (list, tuple),
          "dict": dict}


def _check_kind(name: str, value, kind: str) -> None:
    ok = isinstance(value, _KINDS[kind]) and not (kind in ("int", "float") and isinstance(value, bool))
    if not ok:
        raise SpecgenError(f"{name}={value!r} must be {'a' if kind != 'int' else 'an'} {kind}, "
                           f"not {type(value).__name__}")


# The schema's dataclasses: what components take instead of a DictConfig. A stage's composed, validated config
# becomes one frozen tree (`settings(cfg)`): a section is a frozen dataclass whose fields are that section's keys,
# typed as KEYS says, with no default of their own: every value is the one the YAML (or the user) gave, so code
# and configuration cannot disagree, and a key the config lacks is an AttributeError, never a silent fallback.
_PY_TYPES = {"int": int, "float": float, "bool": bool, "str": str, "str|int": str | int, "bool|str": bool | str,
             "str|list": str | list, "list": list, "dict": dict}


@functools.cache
def settings_type(section: str, fields: tuple[str, ...]) -> type:
    """The frozen dataclass of config section `section` ("" for the root, "draft.dflash" nested) with `fields`."""
    specs = []
    for name in fields:
        key = KEYS.get(f"{section}.{name}" if section else name)
        kind = object if key is None else _PY_TYPES[key.kind] | None if key.nullable else _PY_TYPES[key.kind]
        specs.append((name, kind))
    title = "".join(part.capitalize() for part in section.replace(".", "_").split("_")) or "Stage"
    return dataclasses.make_dataclass(f"{title}Settings", specs, frozen=True)


def settings(cfg: DictConfig, section: str = ""):
    """`cfg` (a composed, validated stage config) as typed, frozen settings: `settings(cfg).train.lr`; free-form
    (`dict`) and list values come as plain Python."""
    node = OmegaConf.select(cfg, section) if section else cfg
    values = {}
    for name in node.keys():
        dotted = f"{section}.{name}" if section else str(name)
        if dotted == "hydra":
            continue
        spec = KEYS.get(dotted)
        value = OmegaConf.select(cfg, dotted)
        if spec is None and isinstance(value, DictConfig):
            values[str(name)] = settings(cfg, dotted)
        else:
            values[str(name)] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    return settings_type(section, tuple(values))(**values)
