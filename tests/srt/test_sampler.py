"""The batched sampler on hand-made logits: distributions, filters, seeds."""

import torch

from radixlm.srt.layers.sampler import Sampler, SamplingBatchInfo, top_k_top_p

V = 8
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def _info(b, temperature=1.0, top_p=1.0, top_k=V, min_p=0.0, seed0=0, step=0, greedy=False):
    return SamplingBatchInfo(
        temperatures=torch.full((b, 1), temperature),
        top_ps=torch.full((b,), top_p),
        top_ks=torch.full((b,), top_k, dtype=torch.int64),
        min_ps=torch.full((b,), min_p),
        seeds=torch.arange(seed0, seed0 + b, dtype=torch.int64) * 7919 + 17,
        steps=torch.full((b,), step, dtype=torch.int64),
        greedy=torch.full((b,), greedy),
        all_greedy=greedy,
        need_top_k_p=top_p < 1 or top_k < V,
        need_min_p=min_p > 0,
    )


def _freqs(ids):
    return torch.bincount(torch.tensor(ids), minlength=V).double() / len(ids)


def test_sampling_follows_softmax():
    b = 40000
    for t in (1.0, 0.5):
        out = Sampler(V, torch.device("cpu"))(LOGITS.expand(b, V).clone(), _info(b, temperature=t))
        expected = torch.softmax(LOGITS.double() / t, -1)
        assert (_freqs(out.next_ids) - expected).abs().max() < 0.01


def test_top_k_top_p_min_p_restrict_support():
    b = 20000
    s = Sampler(V, torch.device("cpu"))
    probs = torch.softmax(LOGITS, -1)
    k3 = _freqs(s(LOGITS.expand(b, V).clone(), _info(b, top_k=3)).next_ids)
    assert k3[3:].sum() == 0
    assert (k3[:3] - probs[:3] / probs[:3].sum()).abs().max() < 0.015
    # top_p=0.6: the smallest head with mass >= 0.6 is the first two tokens (0.40 + 0.24)
    assert probs[0] < 0.6 <= probs[:2].sum()
    p = _freqs(s(LOGITS.expand(b, V).clone(), _info(b, top_p=0.6)).next_ids)
    assert p[2:].sum() == 0 and p[1] > 0.3
    m = _freqs(s(LOGITS.expand(b, V).clone(), _info(b, min_p=0.3)).next_ids)
    allowed = probs >= 0.3 * probs.max()
    assert m[~allowed].sum() == 0 and (m[allowed] > 0).all()


def test_top_k_top_p_keeps_first_token_even_with_tiny_top_p():
    probs = torch.softmax(LOGITS, -1)[None]
    out = top_k_top_p(probs, torch.tensor([V]), torch.tensor([1e-6]))
    assert out[0, 0] == probs[0, 0] and out[0, 1:].sum() == 0


def test_seeded_noise_is_deterministic_and_depends_on_step():
    s = Sampler(V, torch.device("cpu"))
    flat = torch.zeros(64, V)  # uniform: the noise alone decides
    a = s(flat.clone(), _info(64)).next_ids
    assert a == s(flat.clone(), _info(64)).next_ids
    assert a[10:20] == s(flat[10:20].clone(), _info(10, seed0=10)).next_ids  # independent of the batch
    assert a != s(flat.clone(), _info(64, step=1)).next_ids


def test_greedy_rows_take_argmax_and_logprobs():
    s = Sampler(V, torch.device("cpu"))
    info = _info(2, greedy=True)
    info.return_logprob, info.top_logprobs_num = True, 2
    out = s(torch.stack([LOGITS, LOGITS.flip(0)]), info)
    assert out.next_ids == [0, V - 1]
    expected = torch.log_softmax(LOGITS, -1)[0].item()
    assert abs(out.logprobs[0] - expected) < 1e-6 and out.top_ids[0] == [0, 1]
