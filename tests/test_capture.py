"""Selective capture against the Hugging Face reference forward on tiny real architectures.

Reference: `model(input_ids, output_hidden_states=True)` run on each sample alone, unpadded.
Aux layer i must equal `hidden_states[i + 1]`, `last_hidden_state` must equal `hidden_states[-1]`
(post final norm), at every real position of a right-padded batch.
"""

import shutil
import warnings

import pytest
import torch
import transformers

from conftest import build_tiny_model
from specgen.capture import CaptureOutput, config_hash, load_target, make_capture
from specgen.errors import SpecgenError

NUM_LAYERS = 8
HIDDEN = 64
VOCAB = 512
LLAMA_FAMILY = ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe"]
ALL_ARCHS = LLAMA_FAMILY + ["gpt2"]
# Unsorted on purpose: the aux output must follow this order. Layer L-1 is left out here because
# its HF counterpart is post-norm; it has its own test.
AUX_LAYERS = [6, 0, 3]
LENGTHS = [11, 5, 8]


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """saved_model(arch) -> folder of a tiny saved model, built once per module."""
    folders = {}

    def get(arch: str):
        if arch not in folders:
            folders[arch] = build_tiny_model(arch, tmp_path_factory.mktemp(arch), vocab_size=VOCAB,
                                             num_layers=NUM_LAYERS, hidden_size=HIDDEN)
        return folders[arch]

    return get


def capture_quietly(model, aux_layers):
    """make_capture without the generic backend's (expected, separately tested) warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make_capture(model, aux_layers)


def right_padded_batch(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens everywhere, padding included: what sits after lengths[b] must not matter."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (len(lengths), max(lengths)), generator=generator)
    return input_ids, torch.tensor(lengths)


def hf_reference(model, input_ids: torch.Tensor):
    with torch.inference_mode():
        return model(input_ids, output_hidden_states=True)


def aux_slot(output: CaptureOutput, slot: int) -> torch.Tensor:
    return output.aux_hidden_states[..., slot * HIDDEN:(slot + 1) * HIDDEN]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_padded_batch_matches_unpadded_hf_forwards(saved_model, arch, attn_implementation, dtype):
    model = load_target(saved_model(arch), dtype=dtype, attn_implementation=attn_implementation)
    capture = capture_quietly(model, AUX_LAYERS)
    input_ids, lengths = right_padded_batch(LENGTHS)

    output = capture(input_ids, lengths)

    batch, seq_len = input_ids.shape
    assert output.aux_hidden_states.shape == (batch, seq_len, len(AUX_LAYERS) * HIDDEN)
    assert output.last_hidden_state.shape == (batch, seq_len, HIDDEN)
    assert output.aux_hidden_states.dtype == output.last_hidden_state.dtype == getattr(torch, dtype)
    # assert_close's per-dtype defaults: float32 rtol 1.3e-6, bfloat16 rtol 1.6e-2 (about 2 bf16 ulps). In bf16 a
    # padded row runs SDPA with a padding mask and the unpadded reference without one: elements near zero then differ
    # by an ulp of the tensor's scale, so bf16 also allows 2 ulps of the largest value (atol below).
    for row, length in enumerate(LENGTHS):
        reference = hf_reference(model, input_ids[row:row + 1, :length])
        for slot, layer in enumerate(AUX_LAYERS):
            assert_close_at_scale(aux_slot(output, slot)[row, :length], reference.hidden_states[layer + 1][0],
                                  f"aux layer {layer}, row {row}")
        assert_close_at_scale(output.last_hidden_state[row, :length], reference.hidden_states[-1][0], f"row {row}")
        # What the LM head consumes: the logits are rebuilt from last_hidden_state alone.
        assert_close_at_scale(capture.lm_head(output.last_hidden_state[row, :length]), reference.logits[0],
                              f"logits, row {row}")


def assert_close_at_scale(got: torch.Tensor, want: torch.Tensor, msg: str) -> None:
    """assert_close's defaults; in bf16 also an absolute 2 ulps of the tensor's largest value (see above)."""
    atol = 1.6e-2 * float(want.abs().max()) if want.dtype == torch.bfloat16 else None
    torch.testing.assert_close(got, want, atol=atol, rtol=None if atol is None else 1.6e-2, msg=msg)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_every_aux_layer_is_hf_hidden_state_plus_one(saved_model, arch):
    model = load_target(saved_model(arch))
    every_layer_but_last = list(range(NUM_LAYERS - 1))
    capture = capture_quietly(model, every_layer_but_last)
    input_ids, lengths = right_padded_batch([9])

    output = capture(input_ids, lengths)

    reference = hf_reference(model, input_ids)
    for layer in every_layer_but_last:
        torch.testing.assert_close(aux_slot(output, layer), reference.hidden_states[layer + 1], atol=0, rtol=0)


FINAL_NORM = {"llama": lambda model: model.model.norm, "gpt2": lambda model: model.transformer.ln_f}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_last_aux_layer_is_the_raw_pre_norm_output(saved_model, arch):
    """Aux layer L-1 is the last decoder layer's own output, not HF's post-norm hidden_states[L]."""
    model = load_target(saved_model(arch))
    capture = capture_quietly(model, [NUM_LAYERS - 1])
    input_ids, lengths = right_padded_batch([9])

    output = capture(input_ids, lengths)

    reference = hf_reference(model, input_ids)
    last_layer = aux_slot(output, 0)
    assert not torch.allclose(last_layer, reference.hidden_states[NUM_LAYERS], atol=1e-3)
    with torch.inference_mode():
        torch.testing.assert_close(FINAL_NORM[arch](model)(last_layer), output.last_hidden_state)
    torch.testing.assert_close(output.last_hidden_state, reference.hidden_states[NUM_LAYERS])


def sliding_window_model(arch: str, attn_implementation: str, window: int | None) -> transformers.PreTrainedModel:
    """A tiny random model whose attention looks back `window` tokens (None: no window), seed 0."""
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=NUM_LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if arch == "mistral":   # a window on every layer
        config = transformers.MistralConfig(**common, sliding_window=window)
    else:                   # qwen2: full attention on layers 0-3, a window on layers 4-7
        config = transformers.Qwen2Config(**common, use_sliding_window=window is not None, sliding_window=window,
                                          max_window_layers=4)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).eval()


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_sliding_window_layers_match_hf(arch, attn_implementation):
    model = sliding_window_model(arch, attn_implementation, window=4)
    input_ids, lengths = right_padded_batch([12, 7])   # longer than the window

    output = make_capture(model, [2, 5])(input_ids, lengths)

    for row, length in enumerate(lengths.tolist()):
        reference = hf_reference(model, input_ids[row:row + 1, :length])
        torch.testing.assert_close(aux_slot(output, 0)[row, :length], reference.hidden_states[3][0])
        torch.testing.assert_close(aux_slot(output, 1)[row, :length], reference.hidden_states[6][0])
        torch.testing.assert_close(output.last_hidden_state[row, :length], reference.hidden_states[-1][0])
    # Same weights without the window give other states, so the check above did exercise the window.
    unwindowed = sliding_window_model(arch, attn_implementation, window=None)
    unwindowed.load_state_dict(model.state_dict())
    assert not torch.allclose(make_capture(unwindowed, [2, 5])(input_ids, lengths).last_hidden_state[0], output.last_hidden_state[0],
                              atol=1e-4)


def test_sdpa_runs_its_causal_kernel_without_a_mask(saved_model, monkeypatch):
    """No explicit mask under sdpa: only then can it dispatch to the flash / memory-efficient kernels."""
    model = load_target(saved_model("llama"), attn_implementation="sdpa")
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording_sdpa(*args, attn_mask=None, is_causal=False, **kwargs):
        calls.append((attn_mask, is_causal))
        return sdpa(*args, attn_mask=attn_mask, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    make_capture(model, None)(*right_padded_batch([7, 3]))
    assert calls == [(None, True)] * NUM_LAYERS


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_lm_head_never_runs(saved_model, arch):
    model = load_target(saved_model(arch))
    capture = capture_quietly(model, None)

    def refuse(*_):
        raise AssertionError("capture computed logits")

    model.get_output_embeddings().register_forward_hook(refuse)
    input_ids, lengths = right_padded_batch([6, 4])
    capture(input_ids, lengths)


@pytest.mark.parametrize("arch", LLAMA_FAMILY)
def test_llama_family_uses_the_dedicated_backend_silently(saved_model, arch):
    model = load_target(saved_model(arch))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        capture = make_capture(model, None)
    assert capture.backend == "llama"
    assert capture.aux_layers == [1, 3, 4]
    assert (capture.num_layers, capture.hidden_size) == (NUM_LAYERS, HIDDEN)
    assert capture.dtype == torch.float32 and capture.device == torch.device("cpu")
    assert capture.model is model and capture.lm_head is model.lm_head


def test_other_models_use_hooks_and_warn_with_the_class_name(saved_model):
    model = load_target(saved_model("gpt2"))
    with pytest.warns(UserWarning, match="GPT2LMHeadModel"):
        capture = make_capture(model, None)
    assert capture.backend == "generic"
    assert capture.aux_layers == [1, 3, 4]
    assert (capture.num_layers, capture.hidden_size) == (NUM_LAYERS, HIDDEN)
    assert capture.lm_head is model.lm_head
    # Hooks live only for the duration of a call.
    capture(*right_padded_batch([5]))
    assert all(not block._forward_hooks for block in model.transformer.h)


def test_capture_rejects_bad_aux_layers(saved_model):
    model = load_target(saved_model("llama"))
    with pytest.raises(SpecgenError, match=r"capture\.aux_layers entry 8"):
        make_capture(model, [1, NUM_LAYERS])


@pytest.mark.parametrize("input_ids, lengths", [
    (torch.zeros(2, 5, dtype=torch.long), torch.tensor([5, 6])),   # longer than the batch
    (torch.zeros(2, 5, dtype=torch.long), torch.tensor([5, 0])),   # empty row
    (torch.zeros(2, 5, dtype=torch.long), torch.tensor([5])),      # one length for two rows
    (torch.zeros(5, dtype=torch.long), torch.tensor([5])),         # not a batch
])
def test_capture_rejects_inconsistent_batches(saved_model, input_ids, lengths):
    capture = make_capture(load_target(saved_model("llama")), None)
    with pytest.raises(ValueError):
        capture(input_ids, lengths)


def test_load_target_defaults_to_the_dtype_rule_and_inference_mode(tmp_path):
    from specgen.runtime import resolve_model_dtype

    folder = build_tiny_model("llama", tmp_path / "bf16", dtype=torch.bfloat16, num_layers=2)
    model = load_target(folder)  # auto: bf16 where this CPU multiplies it natively, else float32 (tests/test_dtype.py)
    assert model.dtype == resolve_model_dtype("auto", "cpu", folder).torch_dtype
    assert load_target(folder, dtype="bfloat16").dtype == torch.bfloat16
    assert not model.training
    assert not any(parameter.requires_grad for parameter in model.parameters())
    assert load_target(folder, dtype="float32").dtype == torch.float32


def test_load_target_explains_a_bad_path_or_dtype(tmp_path, saved_model):
    with pytest.raises(SpecgenError, match=r"model\.path .*not a folder"):
        load_target(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecgenError, match=r"model\.path .*no config\.json"):
        load_target(tmp_path / "empty")
    with pytest.raises(SpecgenError, match=r"model\.dtype 'fp8'"):
        load_target(saved_model("llama"), dtype="fp8")


def test_config_hash_identifies_the_model_not_how_it_was_loaded(tmp_path, saved_model):
    folder = saved_model("llama")
    reference = config_hash(load_target(folder))
    assert len(reference) == 64 and int(reference, 16) >= 0
    copy = shutil.copytree(folder, tmp_path / "elsewhere")
    assert config_hash(load_target(copy, dtype="bfloat16", attn_implementation="eager")) == reference
    assert config_hash(load_target(saved_model("qwen2"))) != reference
    deeper = build_tiny_model("llama", tmp_path / "deeper", num_layers=NUM_LAYERS + 1)
    assert config_hash(load_target(deeper)) != reference
