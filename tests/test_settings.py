"""Components are built from their own typed settings, without Hydra; `specgen.settings` maps a stage's config."""

import math
from dataclasses import replace

import pytest

from specgen.capture.outputs import OutputSettings, identity
from specgen.capture.vllm import check_options
from specgen.config import compose
from specgen.errors import SpecgenError
from specgen.filters import SampleFilter
from specgen.settings import filter_settings, output_settings, vllm_capture_settings, zero3_settings


def test_sample_filter_is_built_and_applied_without_hydra():
    sample_filter = SampleFilter(min_mean_logprob=-3.0).check(token_logprobs=True)
    rows = [{"source_index": i, "sample_id": f"s{i}", "mean_logprob": value, "input_ids": [1, 2, 3],
             "loss_mask": [0, 1, 1]} for i, value in enumerate([-1.0, -5.0, math.nan])]
    stats = {"samples": 3, "tokens": 9, "trainable_tokens": 6}
    kept, rejected = sample_filter.apply(rows, stats)
    assert [row["sample_id"] for row in kept] == ["s0", "s2"]
    assert [entry["reason"] for entry in rejected] == ["mean_logprob_below_min"]
    assert stats == {"samples": 2, "tokens": 6, "trainable_tokens": 4, "filtered_samples": 1, "filtered_tokens": 3}
    with pytest.raises(SpecgenError, match="capture.token_logprobs=true"):
        SampleFilter(max_mean_logprob=-0.1).check(token_logprobs=False)
    assert SampleFilter().check(token_logprobs=False) == SampleFilter()


def test_filter_settings_take_the_configured_values():
    cfg = compose("generate", ["filter.min_mean_logprob=-3", "capture.token_logprobs=true"])
    assert filter_settings(cfg) == SampleFilter(min_mean_logprob=-3, max_mean_logprob=None)
    with pytest.raises(SpecgenError, match="capture.token_logprobs=true"):
        filter_settings(compose("generate", ["filter.max_mean_logprob=-1"]))


def test_output_settings_and_identity_keep_the_configured_values():
    cfg = compose("generate", ["filter.min_mean_logprob=-3"])
    assert output_settings(cfg) == OutputSettings(topk=20)  # the YAML defaults: everything off, K=20 unused
    assert identity(output_settings(cfg), SampleFilter(min_mean_logprob=-3)) == {"filter.min_mean_logprob": -3}
    cfg = compose("generate", ["output.codec=fp8", "capture.logits=topk", "capture.topk=5",
                               "capture.token_logprobs=true", "capture.pooled=mean", "capture.pooled_layer=2"])
    assert identity(output_settings(cfg), SampleFilter()) == {
        "output.codec": "fp8", "capture.logits": "topk", "capture.topk": 5, "capture.token_logprobs": True,
        "capture.logprob_temperature": 1.0, "capture.pooled": "mean", "capture.pooled_layer": 2}


def test_zero3_settings_carry_the_model_and_deepspeed_config():
    cfg = compose("generate", ["engine=deepspeed", "model.path=/m", "data.path=/d", "model.dtype=bfloat16"])
    settings = zero3_settings(cfg)
    assert (settings.path, settings.dtype, settings.attn_implementation, settings.dist_backend) == (
        "/m", "bfloat16", "sdpa", "auto")
    assert settings.config["zero_optimization"]["stage"] == 3 and isinstance(settings.config, dict)


def test_vllm_capture_settings_are_checked_without_hydra():
    cfg = compose("generate", ["engine=vllm", "model.path=/m", "data.path=/d", "capture.aux_layers=[1,2]",
                               "capture.token_logprobs=true"])
    settings = vllm_capture_settings(cfg)
    assert (settings.path, settings.aux_layers, settings.max_length, settings.token_logprobs) == (
        "/m", [1, 2], cfg.data.max_length, True)
    assert settings.engine["enable_prefix_caching"] is True and isinstance(settings.engine, dict)
    check_options(settings)  # nothing vLLM cannot do exactly
    for changed, message in [({"logits": "topk"}, "capture.logits=topk"),
                             ({"logprob_temperature": 0.5}, "capture.logprob_temperature=0.5"),
                             ({"prefill_chunk_tokens": 64}, "engine.max_num_batched_tokens")]:
        with pytest.raises(SpecgenError, match=message):
            check_options(replace(settings, **changed))


def test_vllm_capture_length_stays_within_the_model_positions():
    """engine=vllm generates one token after each sample: data.max_length=2048 on a 2048-position model is a one-line
    error naming the key to change (it was vLLM's pydantic traceback), 2047 fits, engine.max_model_len bounds it too."""
    from specgen.capture.vllm import capture_model_len

    assert capture_model_len(2047, None, 2048) == 2048
    assert capture_model_len(512, 1024, 2048) == 1024
    with pytest.raises(SpecgenError, match=r"^engine=vllm needs data.max_length \+ 1 = 2049 positions .* above the "
                                           r"model's 2048 positions: pass data.max_length=2047 or less$"):
        capture_model_len(2048, None, 2048)
    with pytest.raises(SpecgenError, match=r"above engine.max_model_len=512: pass data.max_length=511 or less$"):
        capture_model_len(1024, 512, 2048)


def test_schema_settings_are_the_composed_config_typed_and_frozen():
    """`specgen.schema.settings`: every key of the stage, its configured value, typed by the schema, frozen; a key
    the stage does not have is an AttributeError (no component can fall back on a default of its own)."""
    import dataclasses

    from specgen.config import settings_of, to_container
    from specgen.schema import settings

    cfg = compose("train", ["recipe=demo", "train.lr=0.002", "draft.dflash.block_size=9"])
    typed = settings(cfg)
    plain = to_container(cfg)
    plain.pop("hydra", None)
    assert dataclasses.asdict(typed) == plain
    assert (typed.train.lr, typed.draft.dflash.block_size, typed.draft.norm_before_residual) == (0.002, 9, True)
    fields = {field.name: field.type for field in dataclasses.fields(typed.train)}
    assert fields["lr"] is float and fields["max_steps"] == int | None and fields["betas"] is list
    with pytest.raises(dataclasses.FrozenInstanceError):
        typed.train.lr = 1.0
    with pytest.raises(AttributeError):
        typed.draft.path  # evaluate's and export's key, not train's
    assert settings_of("train", ["train.ttt_length=3"], "train").ttt_length == 3
