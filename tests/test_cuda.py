"""The CUDA paths, where a GPU is present (CI has none: every test here skips there).

Packed capture's varlen kernels (flash-attn's, else PyTorch's own) and its per-segment SDPA fallback against the
Hugging Face forward of each sequence alone; `specgen generate` on the GPU against the same run on the CPU (packed,
padded, prefix reuse); the draft's chunked attention and scoring against one dense pass on the GPU; `specgen train`
on the GPU from shards generated there.
"""

import json
import math
import warnings

import pytest
import torch
import transformers
from conftest import BUNDLED_CHAT, build_tiny_model

from specgen.assets import ASSETS_DIR
from specgen.capture import load_target, make_capture
from specgen.capture import packed as packed_module
from specgen.config import compose
from specgen.draft.batch import collate
from specgen.draft.loss import target_positions_needed
from specgen.draft.target_head import TargetHead
from specgen.draft.vocab import VocabMapping
from specgen.train import run as train
from tests.test_draft_model import tiny_draft
from tests.test_draft_ttt import one_step
from tests.test_packing import (
    AUX_LAYERS,
    HIDDEN,
    NUM_LAYERS,
    VOCAB,
    assert_matches_each_alone,
    assert_same_dataset,
    generate,
    packed_row,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

LENGTHS = [37, 5, 130, 1, 64]


def cuda_model(arch: str, folder, dtype: str) -> transformers.PreTrainedModel:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_target(build_tiny_model(arch, folder, vocab_size=VOCAB), dtype=dtype, device="cuda",
                           attn_implementation="sdpa")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_packed_capture_on_cuda_matches_each_sequence_alone(tmp_path, arch, dtype):
    """bf16/fp16 rows run one varlen call (flash-attn's, else torch's); fp32 rows SDPA per segment."""
    model = cuda_model(arch, tmp_path / arch, dtype)
    input_ids, segments = packed_row(LENGTHS)
    input_ids = input_ids.cuda()

    output = make_capture(model, AUX_LAYERS).packed(input_ids, segments)

    expected = packed_module.KERNELS[2] if dtype == "float32" else \
        packed_module.KERNELS[0] if packed_module._flash_varlen() else packed_module.KERNELS[1]
    assert segments.kernel == expected
    assert output.aux_hidden_states.is_cuda
    assert_matches_each_alone(model, output, input_ids, segments, AUX_LAYERS)


def test_packed_capture_on_cuda_falls_back_to_sdpa_per_segment(tmp_path, monkeypatch):
    monkeypatch.setattr(packed_module, "_flash_varlen", lambda: None)
    monkeypatch.setattr(packed_module, "_torch_varlen", lambda: None)
    model = cuda_model("llama", tmp_path / "llama", "bfloat16")
    input_ids, segments = packed_row(LENGTHS)
    output = make_capture(model, AUX_LAYERS).packed(input_ids.cuda(), segments)
    assert segments.kernel == packed_module.KERNELS[2]
    assert_matches_each_alone(model, output, input_ids.cuda(), segments, AUX_LAYERS)


def test_packed_sliding_window_on_cuda_matches_each_sequence_alone():
    config = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                        num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=512, sliding_window=16)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16)
    model = model.cuda().eval()
    input_ids, segments = packed_row([40, 3, 17, 16])  # longer than the window, within it, at it
    output = make_capture(model, [2, 5]).packed(input_ids.cuda(), segments)
    assert segments.kernel in packed_module.KERNELS[:2]
    assert_matches_each_alone(model, output, input_ids.cuda(), segments, [2, 5])


@pytest.mark.parametrize("overrides", [[], ["capture.packing=false"], ["capture.prefix_reuse=true"]],
                         ids=["packed", "padded", "reuse"])
def test_generate_on_cuda_equals_generate_on_cpu(tmp_path, overrides):
    target = build_tiny_model("llama", tmp_path / "llama", vocab_size=2048, tokenizer_dir=ASSETS_DIR / "tokenizer")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gpu = generate(target, tmp_path / "gpu", "runtime.device=cuda", "model.dtype=float32", *overrides)
        cpu = generate(target, tmp_path / "cpu", "runtime.device=cpu", "model.dtype=float32", *overrides)
    assert gpu["stats"]["tokens"] == cpu["stats"]["tokens"] > 0
    assert_same_dataset(tmp_path / "gpu", tmp_path / "cpu", ("aux_hidden_states", "last_hidden_state"))


@pytest.mark.parametrize("packed", [True, False])
def test_draft_chunked_attention_and_scoring_on_cuda_equal_one_dense_pass(monkeypatch, packed):
    import specgen.methods.eagle3.model as draft_model
    import specgen.methods.eagle3.ttt as ttt

    torch.manual_seed(2)
    target_vocab = 50
    head = TargetHead(torch.randn(target_vocab, 32).cuda(), VocabMapping(torch.arange(target_vocab), target_vocab))
    rows = [{"input_ids": torch.randint(0, target_vocab, (n,)), "loss_mask": (torch.rand(n) > 0.3).long(),
             "aux_hidden_states": torch.randn(n, 96), "last_hidden_state": torch.randn(n, 32)} for n in (70, 9, 41)]
    initial = tiny_draft(draft_vocab=target_vocab).cuda()
    initial.t2d.fill_(True)
    batch = collate(rows, packed=packed).to("cuda")
    target = head.distribution(batch.last_hidden_state, target_positions_needed(batch.loss_mask))
    results = []
    for attention, scoring in ((10 ** 12, 10 ** 12), (300, 16)):
        monkeypatch.setitem(draft_model.ATTENTION_CHUNK, "cuda", attention)
        monkeypatch.setattr(ttt, "SCORE_CHUNK", scoring)
        results.append(one_step(initial, batch, target, ttt_length=5, decay=1.0))
    (dense, dense_grads), (chunked, chunked_grads) = results
    assert torch.equal(chunked.stats[:, 1:], dense.stats[:, 1:])  # the counts; the loss sums to rounding
    torch.testing.assert_close(chunked.stats, dense.stats, rtol=1e-5, atol=0)
    torch.testing.assert_close(chunked.loss, dense.loss, rtol=1e-5, atol=0)
    for name in dense_grads:
        torch.testing.assert_close(chunked_grads[name], dense_grads[name], rtol=1e-4, atol=1e-5)


def test_a_pinned_batch_keeps_its_values_and_sample_identities():
    """DataLoader(pin_memory=True), as offline training on CUDA builds it, pins every tensor of a DraftBatch."""
    from torch.utils.data._utils.pin_memory import pin_memory

    rows = [{"input_ids": torch.arange(n), "loss_mask": torch.ones(n, dtype=torch.long),
             "aux_hidden_states": torch.randn(n, 6), "last_hidden_state": torch.randn(n, 2), "sample_index": i}
            for i, n in enumerate((5, 3))]
    batch = collate(rows, packed=True)
    pinned = pin_memory(batch)
    assert all(t.is_pinned() for t in pinned.tensors())
    assert all(torch.equal(a, b) for a, b in zip(pinned.tensors(), batch.tensors(), strict=True))
    assert torch.equal(pinned.samples, batch.samples)
    assert all(t.is_cuda for t in pinned.to("cuda").tensors())


def test_train_on_cuda_from_shards_generated_there(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = compose("generate", [f"model.path={ASSETS_DIR / 'tiny-target'}", f"data.path={BUNDLED_CHAT}",
                                   f"output.dir={tmp_path / 'shards'}", "runtime.progress=false", "data.max_rows=64",
                                   "runtime.device=cuda"])
        from specgen.generate import run as generate_run

        generate_run(run)
        train(compose("train", [f"model.path={ASSETS_DIR / 'tiny-target'}", f"data.shards={tmp_path / 'shards'}",
                                f"output.dir={tmp_path / 'draft'}", "runtime.progress=false", "runtime.device=cuda",
                                "train.max_steps=6", "train.batch_tokens=2048", "train.log_every=1"]))
    lines = [json.loads(line) for line in (tmp_path / "draft" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(line["loss"]) for line in lines)
    assert json.loads((tmp_path / "draft" / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
