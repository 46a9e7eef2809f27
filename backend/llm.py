"""The offline API in vLLM's shape: `LLM(...).generate(prompts, params)` and `.chat(messages)`."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from itertools import count
from pathlib import Path

from tqdm import tqdm

from tritium.backend.config import EngineConfig
from tritium.backend.engine import LLMEngine
from tritium.backend.outputs import RequestOutput
from tritium.backend.sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, str]


class LLM:
    """Batches of prompts through one LLMEngine (docs/python.md#llm). `model=None` is the embedded default;
    other keyword arguments are EngineConfig fields."""

    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        block_size: int = 16,
        kv_cache_bytes: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 1024,
        attention_backend: str = "auto",
        **kwargs: object,
    ) -> None:
        config = EngineConfig(
            model=model, dtype=dtype, block_size=block_size, kv_cache_bytes=kv_cache_bytes,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            attention_backend=attention_backend, **kwargs,  # type: ignore[arg-type]
        )
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self._ids = count()

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_name: str | Seq[str | None] | None = None,
        priority: int | Seq[int] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in prompt order. `sampling_params`, `lora_name` (None: the base model) and `priority` (None:
        the params' own) are one for every prompt or one per prompt. Raises ValueError before queueing any."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        if lora_name is None or isinstance(lora_name, str):
            loras: list[str | None] = [lora_name] * len(prompts)
        else:
            loras = list(lora_name)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} lora names for {len(prompts)} prompts")
        if priority is None or isinstance(priority, int):
            priorities: list[int | None] = [priority] * len(prompts)
        else:
            priorities = list(priority)
            if len(priorities) != len(prompts):
                raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        added: list[str] = []
        try:
            for rid, prompt, p, lora, prio in zip(ids, prompts, params, loras, priorities, strict=True):
                if isinstance(prompt, str):
                    self.engine.add_request(rid, prompt, p, lora_name=lora, priority=prio)
                else:
                    self.engine.add_request(rid, None, p, prompt_token_ids=list(prompt), lora_name=lora,
                                            priority=prio)
                added.append(rid)
        except ValueError:
            for rid in added:
                self.engine.abort(rid)
            self.engine.step()
            raise
        return self._run(ids, use_tqdm)

    def embed(self, prompts: Prompt | Seq[Prompt]) -> list[list[float]]:
        """One vector per prompt (text or token ids), in order, pooled as the engine's `pooling` says
        (docs/python.md#llm). Raises ValueError naming a bad input before running any."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if not p:
                    raise ValueError(f"input {i} must not be empty")
                ids.append(self.tokenizer.encode(p))
            else:
                ids.append(list(p))
        return [row.tolist() for row in self.engine.embed(ids)]

    def shutdown(self) -> None:
        """End the engine's tensor-parallel ranks now (otherwise: when the LLM is collected or the process exits)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def load_lora(self, name: str, folder: str | Path) -> None:
        """Load the PEFT adapter in `folder` as `name`. Raises ValueError naming what is wrong."""
        self.engine.load_lora(name, folder)

    def unload_lora(self, name: str) -> None:
        """Forget adapter `name`; requests running on it finish first. Raises ValueError naming an unknown one."""
        self.engine.unload_lora(name)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.encode(
                self.tokenizer.apply_chat_template(conv, add_generation_prompt),  # type: ignore[arg-type]
                add_special_tokens=False,
            )
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        wanted = set(ids)
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while len(final) < len(ids) and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        final[out.request_id] = out
                        bar.update(1)
        return [final[i] for i in ids]
