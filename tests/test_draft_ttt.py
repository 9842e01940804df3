"""TTT loss: the loss-mask shift on a hand-built example, and the loss against a position-by-position reference."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from specgen.draft.batch import batch_target, collate
from specgen.draft.loss import predicted_token_mask, step_metrics, target_positions_needed
from specgen.draft.target_head import ArgmaxCache, TargetDistribution, TargetHead
from specgen.draft.vocab import VocabMapping
from specgen.methods.eagle3.ttt import ttt_forward
from tests.test_draft_model import one_thread, tiny_draft, unroll  # noqa: F401 (fixture)

# A conversation: two prompt tokens, a 3-token reply, one prompt token, a 1-token reply.
#            index:  0  1  2  3  4  5  6
LOSS_MASK = [0, 0, 1, 1, 1, 0, 1]


def one_step(initial, batch, target, **kwargs) -> tuple:
    """`ttt_forward` and backward on a copy of the draft `initial` over `batch`: its output and its gradients."""
    draft = copy.deepcopy(initial)
    out = ttt_forward(draft, batch.input_ids, batch.loss_mask, batch.aux_hidden_states, target,
                      position_ids=batch.position_ids, document_ids=batch.document_ids, **kwargs)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}


def test_predicted_token_mask_shifts_with_the_tokens():
    mask = torch.tensor([LOSS_MASK])
    # Step 0 at index i reads x[i+1] and predicts x[i+2]: trained where x[i+2] is a reply token.
    assert predicted_token_mask(mask, 0).long().tolist() == [[1, 1, 1, 0, 1, 0, 0]]
    # Step 1 at index i reads x[i+2] (its own previous guess) and predicts x[i+3].
    assert predicted_token_mask(mask, 1).long().tolist() == [[1, 1, 0, 1, 0, 0, 0]]
    assert predicted_token_mask(mask, 2).long().tolist() == [[1, 0, 1, 0, 0, 0, 0]]
    # The target distribution at position t is over x[t+1]: needed where x[t+1] is a reply token.
    assert target_positions_needed(mask).long().tolist() == [[0, 1, 1, 1, 0, 1, 0]]
    # speculators' convention (mask_shift=1): scored where the step's input token x[i+1+j] is a reply token.
    assert predicted_token_mask(mask, 0, mask_shift=1).long().tolist() == [[0, 1, 1, 1, 0, 1, 0]]
    assert predicted_token_mask(mask, 1, mask_shift=1).long().tolist() == [[1, 1, 1, 0, 1, 0, 0]]
    assert target_positions_needed(mask, mask_shift=1).long().tolist() == [LOSS_MASK]


def test_loss_reads_targets_only_where_the_predicted_token_is_trained():
    """Poison every target the loss must not use with NaN: the loss and its gradient stay finite."""
    draft = tiny_draft(draft_vocab=50)
    draft.t2d.fill_(True)
    mask = torch.tensor([LOSS_MASK])
    needed = target_positions_needed(mask)[0]
    probs = torch.full((1, 7, 50), float("nan"))
    probs[0, needed] = torch.softmax(torch.randn(int(needed.sum()), 50), dim=-1)
    argmax = torch.where(needed, probs[0].nan_to_num().argmax(-1), -1)[None]
    out = ttt_forward(draft, torch.randint(0, 50, (1, 7)), mask, torch.randn(1, 7, 96),
                      TargetDistribution(probs, argmax), ttt_length=3, decay=0.8)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(torch.isfinite(p.grad).all() for p in draft.parameters() if p.grad is not None)
    # Positions scored per step: the hand-counted mask above.
    assert out.stats[:, 3].tolist() == [4, 3, 2]


@pytest.mark.parametrize("mask_shift,drop", [(2, True), (1, True), (2, False)])
def test_loss_and_accuracy_match_a_position_by_position_reference(mask_shift, drop):
    torch.manual_seed(0)
    draft = tiny_draft(draft_vocab=20)
    target_vocab, steps, decay = 50, 3, 0.8
    mapping = VocabMapping(torch.tensor(sorted(torch.randperm(target_vocab)[:20].tolist())), target_vocab)
    draft.d2t.copy_(mapping.d2t)
    draft.t2d.copy_(mapping.t2d)
    head = TargetHead(torch.randn(target_vocab, 32), mapping, chunk_tokens=3)  # chunks smaller than a sample
    rows = [{"input_ids": torch.randint(0, target_vocab, (n,)), "loss_mask": torch.tensor(mask),
             "aux_hidden_states": torch.randn(n, 96), "last_hidden_state": torch.randn(n, 32)}
            for n, mask in [(7, LOSS_MASK), (5, [0, 1, 1, 1, 1])]]
    batch = collate(rows)
    target = head.distribution(batch.last_hidden_state, target_positions_needed(batch.loss_mask, mask_shift))
    out = ttt_forward(draft, batch.input_ids, batch.loss_mask, batch.aux_hidden_states, target,
                      ttt_length=steps, decay=decay, mask_shift=mask_shift, drop_out_of_vocab=drop)

    sums = torch.zeros(steps, 6, dtype=torch.float64)
    with torch.no_grad():
        for row in rows:  # each sample alone: padding must not matter
            n, ids, mask = len(row["input_ids"]), row["input_ids"], row["loss_mask"]
            outputs = unroll(draft, ids[None], row["aux_hidden_states"][None], steps)
            alive = [True] * n  # index i's chain: every step so far scored and right
            for step in range(steps):
                for i in range(n):
                    scored = i < n - 1 - step and i + mask_shift + step < n and bool(mask[i + mask_shift + step])
                    if not scored:
                        alive[i] = False
                        continue
                    target_logits = head.weight @ row["last_hidden_state"][i + 1 + step]
                    p = torch.softmax(target_logits[mapping.draft_to_target], dim=-1)
                    log_q = F.log_softmax(draft.logits(outputs[step][0, i]), dim=-1)
                    in_vocab = bool(mapping.t2d[target_logits.argmax()])
                    in_loss = in_vocab or not drop  # keep: every position is in the loss
                    right = int(mapping.draft_to_target[log_q.argmax()] == target_logits.argmax())
                    alive[i] = alive[i] and bool(right)
                    sums[step, :4] += torch.tensor([float(-(p * log_q).sum()) if in_loss else 0.0, in_loss,
                                                    right, 1.0], dtype=torch.float64)
                    sums[step, 5] += in_vocab
                sums[step, 4] += sum(alive)
    torch.testing.assert_close(out.stats, sums, rtol=1e-4, atol=1e-4)
    # Some scored positions have their target's top token outside the draft vocabulary (20 of 50 tokens):
    # dropping them changes the loss, keeping them scores every position.
    assert (sums[:, 5] < sums[:, 3]).any()
    assert (sums[:, 1] == sums[:, 5]).all() if drop else (sums[:, 1] == sums[:, 3]).all()
    expected_loss = sum(decay ** j * sums[j, 0] / max(sums[j, 1], 1) for j in range(steps))
    assert out.loss.item() == pytest.approx(float(expected_loss), rel=1e-4)
    metrics = step_metrics(out.stats, decay)
    assert metrics["loss"] == pytest.approx(out.loss.item(), rel=1e-4)
    assert metrics["acc_0"] == pytest.approx(float(sums[0, 2] / sums[0, 3]))
    chains = [float(sums[0, 3])] + sums[:, 4].tolist()
    assert metrics["accept_len_sim"] == pytest.approx(1 + sum(chains[1:]) / chains[0])
    for step in range(steps):
        assert metrics[f"cacc_{step}"] == pytest.approx(chains[step + 1] / max(chains[step], 1))
    # The same figure from the conditional accuracies: 1 + sum_k prod_{j<=k} cacc_j.
    assert metrics["accept_len_sim"] == pytest.approx(
        1 + sum(math.prod(metrics[f"cacc_{j}"] for j in range(k + 1)) for k in range(steps)))
    assert not math.isnan(metrics["loss_2"])


@pytest.mark.parametrize("mask_shift", [2, 1])
def test_a_packed_row_trains_exactly_like_padded_rows(mask_shift):
    """Three samples end to end in one row (train.packing) give the padded batch's statistics, loss and gradient:
    no step attends to, reads from or is scored on a neighbouring sample."""
    torch.manual_seed(1)
    target_vocab, steps = 50, 4
    mapping = VocabMapping(torch.arange(target_vocab), target_vocab)
    head = TargetHead(torch.randn(target_vocab, 32), mapping)
    rows = [{"input_ids": torch.randint(0, target_vocab, (n,)), "loss_mask": torch.tensor(mask),
             "aux_hidden_states": torch.randn(n, 96), "last_hidden_state": torch.randn(n, 32)}
            for n, mask in [(7, LOSS_MASK), (5, [0, 1, 1, 1, 1]), (6, [0, 0, 1, 1, 0, 1])]]
    initial = tiny_draft(draft_vocab=target_vocab)
    initial.t2d.fill_(True)
    results = []
    for packed in (False, True):
        batch = collate(rows, packed=packed)
        assert batch.input_ids.shape == ((1, 18) if packed else (3, 7))
        target = head.distribution(batch.last_hidden_state, target_positions_needed(batch.loss_mask, mask_shift))
        results.append(one_step(initial, batch, target, ttt_length=steps, decay=1.0, mask_shift=mask_shift))
    (padded, padded_grads), (packed, packed_grads) = results
    assert padded.stats[:, 3].sum() > 0
    torch.testing.assert_close(packed.stats, padded.stats)
    torch.testing.assert_close(packed.loss, padded.loss)
    assert packed_grads.keys() == padded_grads.keys()
    for name in padded_grads:
        torch.testing.assert_close(packed_grads[name], padded_grads[name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("chunk", [1, 40])
def test_long_rows_attend_in_chunks_exactly_like_one_dense_pass(monkeypatch, packed, chunk):
    """Above ATTENTION_CHUNK score elements the draft attends in query chunks over each chunk's visible keys
    (recomputed in backward): same loss, statistics and gradients as one dense pass, in packed and padded rows,
    with chunks that cross sample boundaries (40 elements: 2-3 queries of 4 heads)."""
    import specgen.methods.eagle3.model as draft_model

    torch.manual_seed(2)
    target_vocab = 50
    head = TargetHead(torch.randn(target_vocab, 32), VocabMapping(torch.arange(target_vocab), target_vocab))
    rows = [{"input_ids": torch.randint(0, target_vocab, (n,)), "loss_mask": torch.tensor(mask),
             "aux_hidden_states": torch.randn(n, 96), "last_hidden_state": torch.randn(n, 32)}
            for n, mask in [(7, LOSS_MASK), (5, [0, 1, 1, 1, 1]), (6, [0, 0, 1, 1, 0, 1])]]
    initial = tiny_draft(draft_vocab=target_vocab)
    initial.t2d.fill_(True)
    batch = collate(rows, packed=packed)
    target = head.distribution(batch.last_hidden_state, target_positions_needed(batch.loss_mask))
    results = []
    for limit in (10 ** 12, chunk):
        monkeypatch.setitem(draft_model.ATTENTION_CHUNK, "cpu", limit)
        results.append(one_step(initial, batch, target, ttt_length=4, decay=1.0))
    (dense, dense_grads), (chunked, chunked_grads) = results
    assert dense.stats[:, 3].sum() > 0
    assert torch.equal(chunked.stats[:, 1:], dense.stats[:, 1:])  # the counts; the loss sums to rounding
    torch.testing.assert_close(chunked.stats, dense.stats, rtol=1e-5, atol=0)
    torch.testing.assert_close(chunked.loss, dense.loss, rtol=1e-5, atol=0)
    for name in dense_grads:
        torch.testing.assert_close(chunked_grads[name], dense_grads[name], rtol=1e-4, atol=1e-6)


def test_soft_cross_entropy_is_the_log_softmax_cross_entropy_and_its_gradient():
    """The loss every TTT step scores: -sum_v p_v log softmax(z)_v, also where p is not normalised (rows of zeros:
    positions no step requested) and at large logits; the same value and gradient as the plain formula."""
    from specgen.draft.loss import soft_cross_entropy

    torch.manual_seed(3)
    logits = (torch.randn(6, 11) * torch.tensor([1, 1, 1, 1, 30, 1])[:, None]).requires_grad_()
    target = torch.softmax(torch.randn(6, 11), dim=-1)
    target[2] = 0
    target[3] *= 0.5
    got = soft_cross_entropy(logits, target)
    (got * torch.arange(1.0, 7.0)).sum().backward()
    mine, logits.grad = logits.grad, None
    expected = -(target * F.log_softmax(logits, dim=-1)).sum(-1)
    (expected * torch.arange(1.0, 7.0)).sum().backward()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mine, logits.grad, rtol=1e-5, atol=1e-6)
    assert got[2] == 0 and torch.all(mine[2] == 0)


def test_chunked_attention_recomputes_each_chunk_under_the_forwards_autocast():
    """Backward recomputes every chunk in the forward's autocast state (bf16 here), so its gradient is that of the
    computation the forward ran; key ranges that overlap add their gradients."""
    from specgen.methods.eagle3.model import Chunk, attend_in_chunks

    seen = []

    def attend(q, keys, values, chain_keys, chain_values, documents, q_start):
        product = q @ keys.transpose(2, 3)
        seen.append((torch.is_grad_enabled(), product.dtype))
        return product.float().softmax(-1).to(q.dtype) @ values

    torch.manual_seed(4)
    q, keys, values = (torch.randn(1, 2, 6, 4, requires_grad=True) for _ in range(3))
    chunks = [Chunk(0, 3, 0, 3, 0), Chunk(3, 6, 1, 6, 2)]  # keys 1..2 are read by both chunks
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attend_in_chunks(attend, chunks, q, keys, values, None, None, None)
    out.float().square().sum().backward()
    assert seen == [(False, torch.bfloat16)] * 2 + [(True, torch.bfloat16)] * 2
    grads = [t.grad.clone() for t in (q, keys, values)]
    for t in (q, keys, values):
        t.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = torch.cat([attend(*chunk.inputs(q, keys, values, None, None, None)) for chunk in chunks], dim=2)
    reference.float().square().sum().backward()
    assert torch.equal(out, reference)
    for mine, plain in zip(grads, (q.grad, keys.grad, values.grad), strict=True):
        torch.testing.assert_close(mine, plain, rtol=1e-2, atol=1e-2)
    assert torch.all(grads[1][:, :, 1:3] != 0)


def test_sample_starts_finds_where_each_sample_of_a_row_begins():
    from specgen.methods.eagle3.model import sample_starts

    documents = torch.tensor([[0, 0, 0, 1, 1, 2, -1, -1], [3, 3, 3, 3, 3, -1, -1, -1]])
    assert sample_starts(documents).tolist() == [[0, 0, 0, 3, 3, 5, 6, 6], [0, 0, 0, 0, 0, 5, 5, 5]]


def test_long_steps_score_in_chunks_exactly_like_one_pass(monkeypatch):
    """Above SCORE_CHUNK positions a step's loss runs a chunk at a time (recomputed in backward): same loss,
    statistics and gradients as scoring every position at once."""
    import specgen.methods.eagle3.ttt as ttt

    torch.manual_seed(3)
    target_vocab = 50
    head = TargetHead(torch.randn(target_vocab, 32), VocabMapping(torch.arange(target_vocab), target_vocab))
    rows = [{"input_ids": torch.randint(0, target_vocab, (n,)), "loss_mask": torch.tensor(mask),
             "aux_hidden_states": torch.randn(n, 96), "last_hidden_state": torch.randn(n, 32)}
            for n, mask in [(7, LOSS_MASK), (5, [0, 1, 1, 1, 1])]]
    initial = tiny_draft(draft_vocab=target_vocab)
    initial.t2d[::3] = True  # some targets out of the draft vocabulary: dropped from the loss, counted as misses
    batch = collate(rows)
    target = head.distribution(batch.last_hidden_state, target_positions_needed(batch.loss_mask))
    results = []
    for limit in (ttt.SCORE_CHUNK, 2):
        monkeypatch.setattr(ttt, "SCORE_CHUNK", limit)
        results.append(one_step(initial, batch, target, ttt_length=3, decay=0.8))
    (whole, whole_grads), (chunked, chunked_grads) = results
    assert whole.stats[0, 1] > 0 and whole.stats[0, 1] < whole.stats[0, 3]  # some dropped, some scored
    assert torch.equal(chunked.stats[:, 1:], whole.stats[:, 1:])  # the counts; the loss sums to rounding
    torch.testing.assert_close(chunked.stats, whole.stats, rtol=1e-5, atol=0)
    torch.testing.assert_close(chunked.loss, whole.loss, rtol=1e-5, atol=0)
    for name in whole_grads:
        torch.testing.assert_close(chunked_grads[name], whole_grads[name], rtol=1e-4, atol=1e-6)


def _identified_rows(target_vocab: int, hidden: int) -> list[dict]:
    """Four samples of a dataset (`sample_index`), the second starting on a trained token, so that packed after the
    first its first loss-mask entry asks for the first sample's last position."""
    masks = [[0, 0, 1, 1, 1, 0, 1], [1, 1, 0, 1], [0, 1, 1, 1, 1], [0, 0, 1]]
    return [{"input_ids": torch.randint(0, target_vocab, (len(mask),)), "loss_mask": torch.tensor(mask),
             "aux_hidden_states": torch.randn(len(mask), 3 * hidden),
             "last_hidden_state": torch.randn(len(mask), hidden), "sample_index": index} for index, mask in enumerate(masks)]


@pytest.mark.parametrize("mask_shift", [2, 1])
def test_the_argmax_cache_gives_the_full_heads_distribution_whatever_the_batch(mask_shift):
    """A head with an ArgmaxCache gives the plain head's argmax at every needed position and its probabilities (from
    the draft vocabulary's rows alone), computes each sample's full-vocabulary argmax once, and stores the same
    values whichever batch (packed with neighbours or padded alone) held the sample first."""
    torch.manual_seed(2)
    target_vocab, hidden = 60, 32
    mapping = VocabMapping(torch.tensor(sorted(torch.randperm(target_vocab)[:20].tolist())), target_vocab)
    weight = torch.randn(target_vocab, hidden)
    plain = TargetHead(weight, mapping, chunk_tokens=3)
    rows = _identified_rows(target_vocab, hidden)
    lengths = [len(row["input_ids"]) for row in rows]
    first, second = ArgmaxCache(lengths), ArgmaxCache(lengths)
    cached, other = (TargetHead(weight, mapping, chunk_tokens=3, argmax_cache=c) for c in (first, second))
    packed, padded = collate(rows[:3], packed=True), collate([rows[3], rows[1], rows[0]])
    assert packed.samples.tolist() == [[0, 0, 0], [1, 0, 7], [2, 0, 11]]
    assert padded.samples.tolist() == [[3, 0, 0], [1, 1, 0], [0, 2, 0]]
    # The packed neighbour asks for sample 0's last position (mask_shift 2): the cache must know it.
    assert not mask_shift == 2 or bool(target_positions_needed(packed.loss_mask, mask_shift)[0, 6])

    for batch in (packed, padded, packed):
        expected, got = plain.distribution(batch.last_hidden_state, target_positions_needed(batch.loss_mask,
                                                                                             mask_shift)), \
            batch_target(cached, batch, mask_shift)
        assert torch.equal(got.argmax, expected.argmax)
        torch.testing.assert_close(got.probs, expected.probs, rtol=1e-5, atol=1e-6)
    # Hand-counted: mask_shift 2 needs t where mask[t + 1], plus each sample's last position (5 + 3 + 5 + 2);
    # mask_shift 1 needs t where mask[t] (4 + 3 + 4 + 1).
    assert first.computed_samples == 4 and first.computed_positions == {2: 15, 1: 12}[mask_shift]
    assert first.reused_samples == 2 + 3  # sample 1 and 0 in the padded batch, all three in the second packed one
    for batch in (padded, packed):  # the other order: the same stored values, to the bit
        batch_target(other, batch, mask_shift)
    assert torch.equal(first.values, second.values) and bool(first.known.all())


def test_batches_without_sample_identity_use_the_full_head():
    """Rows with no `sample_index` (online capture) carry no samples: the head computes the full vocabulary."""
    torch.manual_seed(3)
    rows = [{k: v for k, v in row.items() if k != "sample_index"} for row in _identified_rows(40, 16)]
    mapping = VocabMapping(torch.arange(10) * 4, 40)
    cache = ArgmaxCache([len(row["input_ids"]) for row in rows])
    batch = collate(rows, packed=True)
    assert batch.samples is None and batch.to("cpu").samples is None
    batch_target(TargetHead(torch.randn(40, 16), mapping, argmax_cache=cache), batch)
    assert cache.computed_samples == 0 and not bool(cache.known.any())


def test_sample_argmax_is_chunk_independent_and_takes_a_sample_with_no_needed_position():
    """`TargetHead.sample_argmax` gives the full-vocabulary argmax whatever the chunk size, as int32, and an empty
    result (not an error) for a sample with no needed position."""
    torch.manual_seed(4)
    weight, hidden = torch.randn(50, 16), torch.randn(7, 16)
    mapping = VocabMapping(torch.arange(10), 50)
    expected = (hidden @ weight.T).argmax(-1)
    for chunk in (1, 3, 7, 100):
        got = TargetHead(weight, mapping, chunk_tokens=chunk).sample_argmax(hidden)
        assert got.dtype == torch.int32 and torch.equal(got.long(), expected)
    empty = TargetHead(weight, mapping).sample_argmax(hidden[:0])
    assert empty.dtype == torch.int32 and empty.shape == (0,)
