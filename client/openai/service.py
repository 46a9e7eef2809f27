"""What the OpenAI endpoint's routes share (`OpenAIService`): the router to the upstream tritonservers, the
seats for upstream requests, the tokenizer, the served model's name and facts; and how a request's choices
run upstream: one upstream request per (prompt, sample), their streams merged, each holding a seat while
it runs."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from tritium.backend.tokenizer import Tokenizer
from tritium.client.cluster.router import Router
from tritium.client.cluster.upstream import Chunk, UpstreamError
from tritium.client.openai.errors import client_gone, model_not_found, upstream_response
from tritium.client.openai.guard import Admission, new_request_id, unless_disconnected
from tritium.client.openai.lora import AdapterCatalog, AdminClient
from tritium.client.openai.protocol import MAX_SEED, speculative_usage
from tritium.client.openai.reasoning import reasoning_parser as reasoning_parser_class

DECODE_CACHE_SIZE = 1 << 17  # token ids whose text is kept for logprobs

TokenEntry = tuple[str, float, list[tuple[str, float]]]


@dataclass
class ChoiceResult:
    """One choice's output as its chunks arrive; `finish_reason` and the token counts come with the last."""

    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, those served from the engine's prefix cache
    logprobs: list[dict[str, float]] = field(default_factory=list)
    spec_decoding: dict[str, int] | None = None  # the final chunk's speculative figures, when it verified drafts

    def add(self, chunk: Chunk) -> None:
        """Append the chunk's text and logprobs, and take its facts if it is the last."""
        self.text += chunk.text
        self.logprobs += chunk.logprobs
        self.count(chunk)

    def count(self, chunk: Chunk) -> None:
        """Take `finish_reason` and the token counts from the choice's final chunk; any other is ignored."""
        if chunk.final:
            self.finish_reason = chunk.finish_reason
            self.prompt_tokens = chunk.num_input_tokens or 0
            self.completion_tokens = chunk.num_output_tokens or 0
            self.cached_tokens = chunk.num_cached_tokens or 0
            self.spec_decoding = chunk.spec_decoding


def usage(choices: dict[int, ChoiceResult], n: int) -> dict[str, Any]:
    """OpenAI's `usage` of a request with `n` samples per prompt: each prompt's tokens counted once (choice
    index p * n), every choice's completion tokens, `prompt_tokens_details.cached_tokens` (always, 0 when
    nothing was cached) counted as the prompt tokens are; plus `speculative_decoding` (`speculative_usage`)
    when a choice verified drafts."""
    firsts = [c for i, c in choices.items() if i % n == 0]
    prompt_tokens = sum(c.prompt_tokens for c in firsts)
    completion = sum(c.completion_tokens for c in choices.values())
    counts: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                              "total_tokens": prompt_tokens + completion,
                              "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in firsts)}}
    spec = speculative_usage([c.spec_decoding for c in choices.values() if c.spec_decoding is not None])
    return counts if spec is None else counts | {"speculative_decoding": spec}


class OpenAIService:
    """The state of one endpoint. `model`: the served model's id (`router.model`, the Triton model's name, is
    accepted for it too); `model_path`, `max_model_len`: what `/model_info` and `/tokenize` report; `adapters`:
    the LoRA adapters the upstreams serve (each a model of its own, `parent` the base); `reasoning_parser`: the
    class that splits chat replies into reasoning and content (`--reasoning-parser`), None when off."""

    def __init__(self, router: Router, tokenizer: Tokenizer, model: str, default_max_tokens: int,
                 max_concurrency: int, model_path: str | None = None, max_model_len: int | None = None,
                 reasoning_parser: str | None = None) -> None:
        self.router = router
        self.admission = Admission(max_concurrency)
        self.tokenizer = tokenizer
        self.model = model
        self.default_max_tokens = default_max_tokens
        self.model_path = model_path
        self.max_model_len = max_model_len
        self.reasoning_parser = None if reasoning_parser is None else reasoning_parser_class(reasoning_parser)
        self.adapters = AdapterCatalog(router, AdminClient(router))
        self._decode_token = functools.lru_cache(maxsize=DECODE_CACHE_SIZE)(self._decode_uncached)

    def _decode_uncached(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    @property
    def healthy_replicas(self) -> int:
        """How many upstream replicas are up now."""
        return sum(r.healthy for r in self.router.replicas)

    @property
    def base_names(self) -> frozenset[str]:
        """The names a request may give the served model: its id, and the name of the Triton model it runs."""
        return frozenset((self.model, self.router.model))

    def served_name(self, name: str | None) -> str:
        """The `model` a response names: the request's (the base or an adapter), the served model without one."""
        return name if name is not None else self.model

    async def resolve_model(self, name: str | None) -> tuple[str | None, JSONResponse | None]:
        """(the LoRA adapter a request's `model` names, None for the base model; None) or (None, the 404) when
        it names neither the served model (`base_names`) nor an adapter the upstreams serve."""
        if name is None or name in self.base_names:
            return None, None
        if await self.adapters.lookup(name) is not None:
            return name, None
        return None, model_not_found(name)

    async def wrong_model(self, name: str | None) -> JSONResponse | None:
        """The 404 when a request names neither the served model nor a served adapter (which share its
        tokenizer); None otherwise."""
        return (await self.resolve_model(name))[1]

    def token_entries(self, logprobs: list[dict[str, float]]) -> list[TokenEntry]:
        """(sampled token text, its logprob, [(token text, logprob)] most likely first) per generated token.
        The engine lists the sampled token first, then the top-n."""
        out = []
        for entry in logprobs:
            items = [(self._decode_token(int(t)), lp) for t, lp in entry.items()]
            out.append((items[0][0], items[0][1], sorted(items, key=lambda item: -item[1])))
        return out

    async def run_choices(self, prompts: list[str], sampling: dict[str, Any], n: int, logprobs: bool
                          ) -> AsyncIterator[tuple[int, Chunk]]:
        """The chunks of every (prompt, sample) choice as they come, each with its choice index
        (prompt index * n + sample index). With `n` > 1 a seed becomes seed + sample index. Each choice holds
        a seat of `admission` until its upstream request ends. Raises UpstreamError: 503 at once without
        enough free seats, or the first choice's upstream failure (the others are then cancelled)."""
        if not self.admission.try_acquire(len(prompts) * n):
            raise UpstreamError(f"over --max-concurrency ({self.admission.limit} upstream requests in flight)", 503,
                                overloaded=True)
        queue: asyncio.Queue[tuple[int, Chunk | BaseException | None]] = asyncio.Queue()
        jobs = []
        for p_idx, prompt in enumerate(prompts):
            for s_idx in range(n):
                params = dict(sampling)
                if "seed" in params and n > 1:
                    params["seed"] = (params["seed"] + s_idx) % (MAX_SEED + 1)
                job = asyncio.create_task(self._pump(queue, p_idx * n + s_idx, prompt, params, logprobs))
                job.add_done_callback(lambda _: self.admission.release())  # also when cancelled before it ran
                jobs.append(job)
        remaining = len(jobs)
        try:
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for job in jobs:
                job.cancel()

    async def _pump(self, queue: asyncio.Queue[tuple[int, Chunk | BaseException | None]], index: int, prompt: str,
                    params: dict[str, Any], logprobs: bool) -> None:
        """Put one choice's chunks on `queue`, then None, or the exception that ended it."""
        try:
            async for chunk in self.router.generate(prompt, params, logprobs):
                await queue.put((index, chunk))
            await queue.put((index, None))
        except BaseException as exc:  # handed to the consumer, which raises it
            await queue.put((index, exc))

    async def collect(self, prompts: list[str], sampling: dict[str, Any], n: int, logprobs: bool
                      ) -> dict[int, ChoiceResult]:
        """Every choice's whole output, by choice index. Raises UpstreamError as `run_choices` does."""
        choices: dict[int, ChoiceResult] = {}
        async for index, chunk in self.run_choices(prompts, sampling, n, logprobs):
            choices.setdefault(index, ChoiceResult()).add(chunk)
        return choices

    async def collect_or_error(self, request: Request, prompts: list[str], sampling: dict[str, Any], n: int,
                               logprobs: bool) -> dict[int, ChoiceResult] | JSONResponse:
        """`collect` for a non-streamed request, or the error response: the upstream failure's, or 499 when
        the client went away first (its upstream requests are then cancelled)."""
        try:
            connected, choices = await unless_disconnected(request, self.collect(prompts, sampling, n, logprobs))
        except UpstreamError as exc:
            return upstream_response(exc, new_request_id())
        return choices if connected and choices is not None else client_gone()
