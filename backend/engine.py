"""The streaming engine: add requests, step, abort. One thread drives it (see docs/architecture.md)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from itertools import count

import torch

from tritium.backend.attention import get_attention_backend, resolve_backend_name
from tritium.backend.block_manager import BlockManager
from tritium.backend.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig, RequestOutput
from tritium.backend.detokenizer import IncrementalDetokenizer
from tritium.backend.fault_injection import FaultInjector
from tritium.backend.memory_budget import (
    check_fits_one_sequence,
    check_free_memory,
    estimate_activation_bytes,
    kv_cache_budget,
    module_bytes,
)
from tritium.backend.model_runner import ModelRunner, kv_bytes_per_block
from tritium.backend.models.config import ModelConfig, check_attention_backend
from tritium.backend.models.loader import load_model
from tritium.backend.models.registry import resolve_model
from tritium.backend.sampler import Sampler
from tritium.backend.sampling_params import SamplingParams
from tritium.backend.scheduler import Scheduler
from tritium.backend.sequence import Sequence
from tritium.backend.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """Cumulative timings: `model_s` is the forward pass, the rest of `step_s` is Python overhead
    (scheduling, packing, sampling, detokenizing)."""

    steps: int = 0
    step_s: float = 0.0
    model_s: float = 0.0
    scheduled_tokens: int = 0

    @property
    def overhead_s(self) -> float:
        return self.step_s - self.model_s


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.torch_device()
        self.dtype = config.torch_dtype(self.device)
        self.model_path = resolve_model(config.model)
        self.tokenizer = Tokenizer(self.model_path)
        backend = get_attention_backend(config.attention_backend, self.device)
        # Before the weights load: a head size the attention backend cannot run is refused at once.
        check_attention_backend(ModelConfig.from_folder(self.model_path),
                                resolve_backend_name(config.attention_backend, self.device))
        model = load_model(self.model_path, self.dtype, self.device, config.max_model_len)
        self.model_config = model.config
        self.max_model_len = config.max_model_len or model.config.max_position_embeddings
        num_blocks = self._num_blocks(model)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.runner = ModelRunner(model, backend, num_blocks, config.block_size, self.dtype, self.device)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill
        )
        self.eos_token_ids = list(model.config.eos_token_ids)
        self.sampler = Sampler(self.eos_token_ids, seed=config.seed)
        self.requests: dict[str, Sequence] = {}
        self.stats = EngineStats()
        self._arrivals = count()
        self._pending: list[RequestOutput] = []
        self.faults = FaultInjector.from_env()
        logger.info(
            "tritium engine: %s, %s on %s, %s attention, %d KV blocks of %d tokens",
            self.model_path, self.dtype, self.device, backend.name, num_blocks, config.block_size,
        )

    def _num_blocks(self, model: torch.nn.Module) -> int:
        """KV blocks for this engine: kv_cache_bytes when set, else 1 GiB on a CPU and on CUDA its share
        (gpu_memory_utilization) of the device less weights, activations and overhead (memory_budget.py).
        Raises ValueError (numbers in it) when that cannot hold one sequence of max_model_len tokens."""
        cfg = self.config
        per_block = kv_bytes_per_block(model, cfg.block_size, self.dtype)
        weights = module_bytes(model)
        budget = cfg.kv_cache_bytes
        if budget is None and self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            activations = estimate_activation_bytes(
                self.model_config, cfg.max_num_batched_tokens, cfg.max_num_seqs, self.dtype.itemsize
            )
            budget = kv_cache_budget(total, cfg.gpu_memory_utilization, weights, activations)
            check_free_memory(budget, activations, free, cfg.gpu_memory_utilization)
        elif budget is None:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
        num_blocks = budget // per_block
        check_fits_one_sequence(num_blocks, cfg.block_size, per_block, self.max_model_len, weights)
        return num_blocks

    @property
    def kv_capacity_tokens(self) -> int:
        return self.block_manager.num_blocks * self.config.block_size

    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        """Queue a request (text `prompt` or `prompt_token_ids`). Raises ValueError naming the field
        and the rule for a bad request; nothing is queued then."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling params must be a SamplingParams")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise ValueError("prompt must be a string (or pass prompt_token_ids)")
            if not prompt:
                raise ValueError("prompt must not be empty")
            self.tokenizer.check_can_fit(prompt, self.max_model_len)
            prompt_token_ids = self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt_token_ids]
        self.check_request(ids, params)
        max_tokens = params.max_tokens
        detok = IncrementalDetokenizer(
            self.tokenizer, ids, params.stop, params.include_stop_str_in_output, params.skip_special_tokens
        )
        seq = Sequence(request_id, prompt, ids, params, detok, next(self._arrivals), max_tokens=max_tokens)
        if params.seed is not None:
            seq.generator = torch.Generator().manual_seed(params.seed)
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def check_request(self, ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError when token ids `ids` with `params` cannot be served by this engine (empty, ids
        outside the vocabulary, too long for the context or the KV cache). Reads only settings: any thread
        may call it (the serving tokenizer thread does, so that hopeless prompts never reach the engine)."""
        if not ids:
            raise ValueError("prompt must not be empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens; the model's context is {self.max_model_len} tokens, "
                "which must hold the prompt and at least one generated token"
            )
        vocab = self.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt_token_ids must be in [0, {vocab})")
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids in [0, {vocab})")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens ({params.max_tokens}) + prompt ({len(ids)} tokens) exceeds the model's context "
                f"of {self.max_model_len} tokens; ask for at most {self.max_model_len - len(ids)} tokens"
            )
        if len(ids) + params.max_tokens > self.kv_capacity_tokens:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the KV cache "
                f"capacity of {self.kv_capacity_tokens} tokens"
            )

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks; its final output (finish_reason "abort") comes with
        the next step(). Unknown or finished ids are ignored."""
        seq = self.requests.get(request_id)
        if seq is None or seq.finished:
            return
        self._finish(seq, "abort")
        try:
            self._pending.append(self._output(seq))
        except Exception:
            logger.exception("building the abort output of %s failed", request_id)
            self._pending.append(self._error_output(seq, "aborted", reason="abort"))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._pending)

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step and return an output for every request that changed."""
        t0 = time.perf_counter()
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return outputs
        t_model = time.perf_counter()
        try:
            self.faults.check(s.seq.prompt for s in sched.scheduled)
            logits = self.runner.run(sched.scheduled)
        except Exception:  # fail only the requests of this step; the engine goes on
            logger.exception("model step failed for %s", [s.seq.request_id for s in sched.scheduled])
            for s in sched.scheduled:
                self._finish(s.seq, "error")
                outputs.append(self._error_output(s.seq, "the model step failed"))
            return outputs
        model_s = time.perf_counter() - t_model
        sampling = [s.seq for s in sched.scheduled if s.samples]
        for s in sched.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            self.block_manager.commit_full_blocks(s.seq)
        if sampling:
            sampled = self.sampler(logits, sampling)
            for seq, token, lp, error in zip(sampling, sampled.token_ids, sampled.logprobs, sampled.errors,
                                             strict=True):
                outputs.append(self._advance(seq, token, lp, error))
        self.stats.steps += 1
        self.stats.model_s += model_s
        self.stats.scheduled_tokens += sched.num_tokens
        self.stats.step_s += time.perf_counter() - t0
        return outputs

    def _advance(self, seq: Sequence, token: int | None, logprobs: dict[int, float] | None,
                 error: str | None) -> RequestOutput:
        """Append a sampled token and build the request's output; whatever fails here (stop checks,
        detokenizing) ends this request alone with an error."""
        if error is None and token is not None:
            try:
                self._append_token(seq, token, logprobs)
                return self._output(seq)
            except Exception:
                logger.exception("processing the output of %s failed", seq.request_id)
                error = "internal error while processing the generated token"
        if not seq.finished:
            self._finish(seq, "error")
        return self._error_output(seq, error or "no token was sampled")

    def _append_token(self, seq: Sequence, token: int, logprobs: dict[int, float] | None) -> None:
        seq.token_ids.append(token)
        if logprobs is not None:
            seq.logprobs.append(logprobs)
        p = seq.params
        hit_stop_string = seq.detokenizer.add_token(token)
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids or hit_stop_string:
            self._finish(seq, "stop")
        elif seq.num_output_tokens >= seq.max_tokens:
            seq.detokenizer.flush()
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self.requests.pop(seq.request_id, None)

    def _error_output(self, seq: Sequence, error: str, reason: str = "error") -> RequestOutput:
        """A final output that touches nothing that may have failed (the detokenizer, the logprobs)."""
        return RequestOutput(
            request_id=seq.request_id, prompt=seq.prompt, prompt_token_ids=seq.prompt_token_ids, text="",
            token_ids=seq.output_token_ids, delta_text="", delta_token_ids=[], finished=True, finish_reason=reason,
            num_input_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens, error=error,
        )

    def _output(self, seq: Sequence) -> RequestOutput:
        delta = seq.detokenizer.take_delta(seq.finished)
        new_ids = seq.output_token_ids[seq.num_sent_tokens :]
        seq.num_sent_tokens = seq.num_output_tokens
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            text=seq.detokenizer.text if seq.finished else seq.detokenizer.text[: seq.detokenizer.emitted],
            token_ids=seq.output_token_ids,
            delta_text=delta,
            delta_token_ids=new_ids,
            finished=seq.finished,
            finish_reason=seq.finish_reason,
            num_input_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
        )
