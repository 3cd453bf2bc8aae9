"""While streams decode, a new prompt's prefill is spread over steps of at most `decode_prefill_budget` prompt
tokens with the decodes riding along: no stream waits for a whole prompt, and the answers are the ones the
unbudgeted scheduler gives."""

import random

import pytest

import radixlm
from tests.helpers import assert_engine_idle, make_tiny_checkpoint

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("budget") / "llama", "llama", vocab_size=512)


def _engine(path, **kw):
    return radixlm.Engine(str(path), log_level="warning", max_total_tokens=4096, **kw)


def _run(engine, long_prompt, short_prompt):
    """One stream decoding, then a long prompt arrives. Per scheduled extend step: (prompt tokens taken, decodes
    riding along, the stream was decoding); and the two answers."""
    stream = engine.add_request(input_ids=short_prompt, sampling_params={**GREEDY, "max_new_tokens": 40})[0]
    for _ in range(3):
        engine.step()
    late = engine.add_request(input_ids=long_prompt, sampling_params={**GREEDY, "max_new_tokens": 4})[0]
    steps, outputs, seen = [], {}, None
    while engine.has_unfinished_requests():
        decoding = any(r.rid == stream for r in engine.scheduler.running)
        updates = engine.step()
        last = engine.scheduler.last_step
        if last is not None and last.mode == "extend" and last is not seen:
            steps.append((last.tokens, last.decode_riders, decoding))
        seen = last
        for u in updates:
            if u["finished"]:
                outputs[u["meta_info"]["id"]] = u["output_ids"]
    return steps, outputs[stream], outputs[late]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_long_prompt_does_not_stall_a_decoding_stream(tiny_dir, overlap):
    rng = random.Random(0)
    long_prompt = [rng.randrange(3, 512) for _ in range(200)]
    short_prompt = [rng.randrange(3, 512) for _ in range(8)]
    mode = {"force_overlap_schedule": overlap, "disable_overlap_schedule": not overlap}
    budgeted = _engine(tiny_dir, decode_prefill_budget=32, **mode)
    assert budgeted.scheduler.decode_prefill_budget == 32
    steps, stream_ids, late_ids = _run(budgeted, long_prompt, short_prompt)
    late_steps = [(tokens, riders) for tokens, riders, decoding in steps if decoding]
    assert len(late_steps) >= 200 // 32  # the late prompt spread over steps of at most 32 prompt tokens
    assert all(0 < taken <= 32 and riders == 1 for taken, riders in late_steps)  # the stream rode along each
    assert_engine_idle(budgeted)

    whole = _engine(tiny_dir, chunked_prefill_size=-1, **mode)  # the default: no budget
    assert whole.scheduler.decode_prefill_budget is None
    w_steps, w_stream, w_late = _run(whole, long_prompt, short_prompt)
    ((taken, riders),) = [(t, r) for t, r, decoding in w_steps if decoding]  # one step, the stream waiting
    assert taken >= 190 and riders == 0  # (a token or two may come from the radix cache)
    assert (stream_ids, late_ids) == (w_stream, w_late)  # same answers either way
    assert_engine_idle(whole)


def test_budget_flag_is_checked():
    with pytest.raises(ValueError, match="decode_prefill_budget"):
        radixlm.ServerArgs(decode_prefill_budget=0)


def test_mixed_chunks_default_on_cuda_only_and_contradicting_flags_are_refused():
    """Running requests ride along prompt chunks by default on CUDA (what the GPU default runs; the CPU tests
    exercise it with --enable-mixed-chunk), not on a CPU; --disable-mixed-chunk turns the CUDA default off, and
    both flags together are an error rather than one silently winning."""
    from radixlm.srt.server_args import ServerArgs

    assert ServerArgs().mixed_chunks("cuda") and not ServerArgs().mixed_chunks("cpu")
    assert not ServerArgs(disable_mixed_chunk=True).mixed_chunks("cuda")
    assert ServerArgs(enable_mixed_chunk=True).mixed_chunks("cpu")
    with pytest.raises(ValueError, match="contradict"):
        ServerArgs(enable_mixed_chunk=True, disable_mixed_chunk=True)
