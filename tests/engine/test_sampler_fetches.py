"""A sampler step waits for the device once: the sampled ids and every logprob asked for come back in one
fetch, whatever the batch mixes (logprobs, penalties, seeded, constrained, min_tokens, random rows); and its
inputs go to the device with the step's, in one copy.

On a CPU nothing waits, so the test counts what would on CUDA: every Tensor method that moves values to the
host (item, tolist, cpu, numpy, truth and number conversions) and every copy to a device that is not
non_blocking, each attributed to the innermost tritium frame that made it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tritium.backend.sample.sampler import Sampler
from tritium.backend.sampling_params import SamplingParams
from tritium.backend.structured_output.decoding import TokenMasks

from support.builders import seq
from support.host_transfers import counting_host_transfers, counting_uploads

VOCAB = 64


def mixed_batch(sampler: Sampler) -> list:
    """Rows asking for every feature that could cost a wait: logprobs (greedy and random), penalties, a seed,
    min_tokens bans, top-k/top-p/min-p, a plain greedy row and a constrained row (masked)."""
    params = [
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, logprobs=1),
        SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2),
        SamplingParams(temperature=1.0, seed=7, min_p=0.05, logprobs=0),
        SamplingParams(temperature=0, min_tokens=4, stop_token_ids=[3]),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, logprobs=2),  # the constrained row
    ]
    seqs = []
    for i, p in enumerate(params):
        s = seq([1, 2, 3, 9], f"r{i}")
        s.params = p
        s.token_ids.extend([4, 4, 5])  # generated tokens, for the penalties
        sampler.add_request(s.request_id, p.seed)
        seqs.append(s)
    return seqs


def constrained_masks(row: int, allowed: list[int]) -> TokenMasks:
    """The grammar mask of one row that allows only `allowed` (llguidance's bit layout, without llguidance)."""
    bitmask = torch.zeros(1, VOCAB // 32, dtype=torch.int32)
    for t in allowed:
        bitmask[0, t // 32] |= 1 << (t % 32)
    return TokenMasks([row], bitmask, torch.tensor([row]))


def test_a_mixed_batch_fetches_once() -> None:
    torch.manual_seed(0)
    sampler = Sampler(eos_token_ids=[0], vocab_size=VOCAB)
    seqs = mixed_batch(sampler)
    logits = torch.randn(len(seqs), VOCAB)
    from tritium.backend.sample.step_inputs import SamplingInputs

    inputs = SamplingInputs.on(logits.device, sampler.host_inputs(seqs))  # staged with the step's in the engine
    masks = constrained_masks(6, [10, 20, 40])
    with counting_host_transfers() as found:
        out = sampler(logits, seqs, inputs, masks)
    # The CPU stand-in of the bitmask kernel reads its rows on the host; on CUDA a Triton kernel applies it.
    waits = [f for f in found if " at kernels/reference.py:" not in f]
    assert len(waits) <= 1, waits
    assert all(e is None for e in out.errors), out.errors
    assert out.token_ids[6] in {10, 20, 40}
    assert out.token_ids[0] == int(logits[0].argmax())
    for row, n in ((0, 3), (1, 1), (3, 0), (6, 2)):
        entry = out.logprobs[row]
        assert entry is not None and out.token_ids[row] in entry and len(entry) <= n + 1
        raw = logits[row].log_softmax(-1)
        assert all(entry[t] == pytest.approx(float(raw[t]), abs=1e-6) for t in entry)
        assert set(raw.topk(n).indices.tolist()) <= set(entry) if n else True
    assert [lp is None for lp in out.logprobs] == [False, False, True, False, True, True, False]


def test_the_counter_sees_what_it_counts() -> None:
    # The counter itself: a fetch and a blocking copy made from tritium's engine are both seen.
    from tritium.backend.sample import sampler as sampler_module

    namespace: dict[str, Any] = {"torch": torch}
    exec(compile("def fetch(t):\n    t.tolist()\n    return t.to('cpu')\n", sampler_module.__file__, "exec"), namespace)
    with counting_host_transfers() as found:
        namespace["fetch"](torch.ones(2))
        torch.ones(2).tolist()  # the test's own fetch is not the engine's
    assert [f.split(" at ")[0] for f in found] == ["tolist", "to"]


def test_engine_steps_upload_the_sampler_inputs_with_the_step_inputs(make_llm: Any, tiny_llama_path: Any) -> None:
    """Per-row sampling state on the device: a batch mixing logprobs, penalties, a seed, min_tokens and
    top-k/top-p copies nothing to the device from the sampler in any step, from the prompts' first tokens on (the
    penalized requests' counts are written with the step's one staged copy); the tokens are each request's alone."""
    params = [SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=3, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3,
                             max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=7, repetition_penalty=1.2, min_tokens=6, max_tokens=8)]
    prompts = ["The cat sat on", "Once upon a time", "A B A B A B A", "Numbers: 1 2 3"]
    llm = make_llm(str(tiny_llama_path), kv_cache_bytes=8 << 20, max_model_len=128)
    alone = [llm.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, params, strict=True)]
    worker = llm.engine.worker
    execute, steps = worker.execute, []

    def counted(*args: object, **kwargs: object) -> object:
        with counting_uploads() as found:
            out = execute(*args, **kwargs)
        steps.append(found)
        return out

    worker.execute = counted
    assert [o.token_ids for o in llm.generate(prompts, params)] == alone
    assert len(steps) >= 8
    for found in steps:  # (kernels/reference.py's copies are the CPU attention's own, on the device)
        engine = [f.split(" at ")[1].split(":")[0] for f in found if " at backend/" in f]
        assert engine == ["backend/worker/staging.py"], found
