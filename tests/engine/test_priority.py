"""Request priority in the engine, with the default model: a high-priority request overtakes a full batch,
preempted requests still produce their own tokens, and an engine on "fcfs" (the default) refuses priorities."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tritium.backend import LLM, SamplingParams

PROMPTS = ["The capital of France is", "Water boils at", "One, two, three,", "The sky is", "My favourite food is"]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.mark.slow  # the default model through many steps: CI's full run, not the inner loop
@pytest.mark.batch_invariant
def test_a_high_priority_request_overtakes_a_full_batch(make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(None, kv_cache_bytes=32 << 20, max_model_len=512, max_num_seqs=2,
                   scheduling_policy="priority")
    solo = {p: llm.generate(p, GREEDY)[0].token_ids for p in PROMPTS}
    engine = llm.engine
    low, high = PROMPTS[:4], PROMPTS[4]
    for i, prompt in enumerate(low):
        engine.add_request(f"low-{i}", prompt, GREEDY, priority=1)
    first_token: list[str] = []
    tokens: dict[str, list[int]] = {}

    def run_step() -> None:
        for out in engine.step():
            if out.request_id not in tokens:
                first_token.append(out.request_id)
            tokens.setdefault(out.request_id, []).extend(out.delta_token_ids)

    run_step()  # low-0 and low-1 take both seats
    engine.add_request("high", high, GREEDY, priority=0)
    run_step()  # high preempts low-1 (of the lowest priority, the newest) and gets its first token
    assert engine.scheduler.num_preemptions == 1 and engine.requests["low-1"].num_preemptions == 1
    while engine.has_unfinished_requests():
        run_step()
    assert first_token.index("high") < first_token.index("low-2") < first_token.index("low-3")
    by_id = dict(zip([f"low-{i}" for i in range(4)] + ["high"], [*low, high], strict=True))
    assert {rid: tokens[rid] for rid in by_id} == {rid: solo[p] for rid, p in by_id.items()}


def test_priority_is_refused_under_fcfs_and_taken_under_priority(make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(None, kv_cache_bytes=32 << 20, max_model_len=512)
    assert llm.engine.config.scheduling_policy == "fcfs"
    with pytest.raises(ValueError, match=r'priority must be 0 \(got 1\).*scheduling_policy "priority"'):
        llm.generate(PROMPTS[0], GREEDY, priority=1)
    with pytest.raises(ValueError, match="priority must be 0"):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, priority=-1))
    with pytest.raises(ValueError, match="got 1 priorities for 2 prompts"):
        llm.generate(PROMPTS[:2], GREEDY, priority=[0])
    assert not llm.engine.requests
    assert llm.generate(PROMPTS[:2], GREEDY, priority=[0, 0])[0].finish_reason == "length"
    with pytest.raises(ValueError, match=r"priority must be <= 2147483647"):
        SamplingParams(priority=2**31)
