"""The drafter's rules without a model: draft lengths and back-off after what held, the free look at the host's
tokens, the GPU's doubling ramp, and the verify step's token budget (srt/speculative/drafter.py)."""

from __future__ import annotations

import pytest


def test_draft_length_and_back_off_follow_what_held():
    from radixlm.srt.mem_cache.radix_cache import ChunkCache
    from radixlm.srt.sampling.sampling_params import SamplingParams
    from radixlm.srt.scheduler.req import Req
    from radixlm.srt.speculative.drafter import Drafter, SpecConfig

    drafter = Drafter(SpecConfig(4, 2, 4, 8, shared_floor=0.7), ChunkCache(None), 4096)
    r = Req("a", [5, 6, 7, 8, 9, 5, 6], SamplingParams(max_new_tokens=64), seed=0, max_new_tokens=64)
    r.output_ids = [7]
    assert drafter.propose([r], 100) == [[8, 9, 5, 6]]
    drafter.record(r, 4, 4)  # held in full: full length again
    assert drafter.propose([r], 100) == [[8, 9, 5, 6]]
    assert drafter.propose([r], 2) == [[8, 9]]  # no more than the KV room
    drafter.record(r, 4, 1)  # mostly wrong: one plain step, then one token more than held
    assert drafter.propose([r], 100) == [[]]
    assert drafter.propose([r], 100) == [[8, 9]]
    drafter.record(r, 2, 0)  # wrong again: two plain steps
    assert drafter.propose([r], 100) == [[]] and drafter.propose([r], 100) == [[]]
    # Several requests decoding: one whose drafts mostly failed is parked (16 steps), the other drafts.
    other = Req("b", [5, 6, 7, 8, 9, 5, 6], SamplingParams(max_new_tokens=64), seed=0, max_new_tokens=64)
    other.output_ids = [7]
    assert r.spec_rate < 0.7 and drafter.propose([r, other], 100) == [[], [8, 9, 5, 6]]
    assert r.spec_skip == 16
    penalised = Req("c", [5, 6, 7, 5, 6], SamplingParams(max_new_tokens=64, presence_penalty=0.5), seed=0)
    penalised.max_new_tokens = 64
    assert drafter.propose([penalised], 100) == [[]]  # its later positions would need the draft's own counts


def test_may_draft_looks_at_the_host_tokens_for_free_and_counts_back_offs():
    """Under overlap the scheduler asks, before a look that would cost a step its overlap, whether the tokens
    on the host (all but the one in flight) match anything. It answers what a look at those tokens would, and
    a 'no' counts as a look for requests backing off (else a request that missed would never draft again)."""
    from radixlm.srt.mem_cache.radix_cache import ChunkCache
    from radixlm.srt.sampling.sampling_params import SamplingParams
    from radixlm.srt.scheduler.req import Req
    from radixlm.srt.speculative.drafter import Drafter, SpecConfig

    drafter = Drafter(SpecConfig(4, 2, 4, 8), ChunkCache(None), 4096)

    def req(tokens, **params):
        return Req("a", tokens, SamplingParams(max_new_tokens=64, **params), seed=0, max_new_tokens=64)

    copying, free = req([5, 6, 7, 8, 9, 5, 6]), req([5, 6, 7, 8, 9, 10, 11])
    assert drafter.may_draft([copying]) and drafter.propose([copying], 100) == [[7, 8, 9, 5]]
    assert not drafter.may_draft([free]) and drafter.propose([free], 100) == [[]]
    assert drafter.may_draft([free, copying])
    copying.spec_skip = 2  # backing off after a missed draft: not a candidate, and a 'no' counts one look
    assert not drafter.may_draft([free, copying]) and copying.spec_skip == 1
    assert not drafter.may_draft([copying]) and copying.spec_skip == 0
    assert drafter.may_draft([copying]) and copying.spec_skip == 0  # a 'yes' leaves the counts to the look
    near_end = req([5, 6, 7, 8, 9, 5, 6])
    near_end.output_ids, near_end.pending_ref = [7] * 62, 0  # its last token is in flight: no room for a draft
    assert not drafter.may_draft([near_end])
    assert not drafter.may_draft([req([5, 6, 7, 5, 6], presence_penalty=0.5)])


def test_draft_length_doubles_after_full_holds_where_rows_are_cheap():
    """Off a CPU a verify step's rows cost little at small batches, so a draft that held in full earns one twice
    as long (1, 2, 4, 8: copied text reaches k in three steps); on a CPU one token longer. A partial hold gives
    one more than what held either way."""
    from radixlm.srt.mem_cache.radix_cache import ChunkCache
    from radixlm.srt.sampling.sampling_params import SamplingParams
    from radixlm.srt.scheduler.req import Req
    from radixlm.srt.speculative.drafter import Drafter, SpecConfig

    for doubles, lengths in ((True, [2, 4, 8, 8]), (False, [2, 3, 4, 5])):
        drafter = Drafter(SpecConfig(8, 2, 4, 8, ramp_doubles=doubles), ChunkCache(None), 4096)
        r = Req("a", list(range(5, 40)) * 2, SamplingParams(max_new_tokens=64), seed=0, max_new_tokens=64)
        drafted, seen = 1, []
        for _ in lengths:
            drafter.record(r, drafted, drafted)
            drafted = r.spec_len
            seen.append(drafted)
        assert seen == lengths
        drafter.record(r, drafted, 2)  # a partial hold: one more than held (after a plain step: under half held)
        assert r.spec_len == 3
        r.output_ids = [5, 6, 7]
        assert drafter.propose([r], 100) == [[]] and drafter.propose([r], 100) == [[8, 9, 10]]
    gpu = SpecConfig.from_args(_spec_args(), "cuda")
    cpu = SpecConfig.from_args(_spec_args(), "cpu")
    assert gpu.ramp_doubles and not cpu.ramp_doubles
    assert (gpu.num_draft_tokens, cpu.num_draft_tokens) == (8, 4)  # the defaults; an explicit k is kept
    args = _spec_args()
    args.speculative_num_draft_tokens = 5
    assert [SpecConfig.from_args(args, d).num_draft_tokens for d in ("cuda", "cpu")] == [5, 5]


def test_verify_step_tokens_stay_within_the_budget():
    """A verify step computes at most max_verify_tokens tokens: B requests draft at most budget // B - 1 each
    (none past half the budget's worth of requests), below that the draft length rules alone; the GPU
    default is 256 tokens, a CPU has none, an operator's value wins on both."""
    from radixlm.srt.mem_cache.radix_cache import ChunkCache
    from radixlm.srt.sampling.sampling_params import SamplingParams
    from radixlm.srt.scheduler.req import Req
    from radixlm.srt.speculative.drafter import Drafter, SpecConfig

    def reqs(n):
        out = []
        for i in range(n):
            r = Req(str(i), list(range(5, 40)) * 2, SamplingParams(max_new_tokens=64), seed=0, max_new_tokens=64)
            r.output_ids = [5, 6, 7]
            out.append(r)
        return out

    drafter = Drafter(SpecConfig(8, 2, 4, None, ramp_doubles=True, max_verify_tokens=32), ChunkCache(None), 4096)
    assert drafter.propose(reqs(2), 100) == [list(range(8, 16))] * 2  # 2 x 9 rows: k alone
    assert drafter.propose(reqs(8), 100) == [[8, 9, 10]] * 8  # 8 x (1 + 3) = 32
    assert drafter.propose(reqs(10), 100) == [[8, 9]] * 10  # 30 rows
    assert drafter.propose(reqs(16), 100) == [[8]] * 16  # 32 rows
    assert drafter.propose(reqs(17), 100) == [[]] * 17  # two rows each would not fit
    unlimited = Drafter(SpecConfig(8, 2, 4, None), ChunkCache(None), 4096)
    assert unlimited.propose(reqs(16), 1000) == [list(range(8, 16))] * 16
    assert SpecConfig.from_args(_spec_args(), "cuda").max_verify_tokens == 256
    assert SpecConfig.from_args(_spec_args(), "cpu").max_verify_tokens is None
    args = _spec_args()
    args.speculative_max_verify_tokens = 64
    assert [SpecConfig.from_args(args, d).max_verify_tokens for d in ("cuda", "cpu")] == [64, 64]
    with pytest.raises(ValueError, match="speculative_max_verify_tokens must be positive"):
        from radixlm.srt.server_args import ServerArgs

        ServerArgs(model_path=None, speculative_algorithm="ngram", speculative_max_verify_tokens=0)


def _spec_args():
    from radixlm.srt.server_args import ServerArgs

    return ServerArgs(model_path=None, speculative_algorithm="ngram")
