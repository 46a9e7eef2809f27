"""The streaming engine: add requests, step, abort. One thread drives it (see docs/architecture.md)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from itertools import count
from typing import Any

import torch

from tritium.backend.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig, RequestOutput
from tritium.backend.core.block_manager import BlockManager
from tritium.backend.core.scheduler import Scheduler, SchedulerOutput
from tritium.backend.core.sequence import Sequence
from tritium.backend.core.stop_checker import StopChecker
from tritium.backend.models.config import ModelConfig, check_attention_backend
from tritium.backend.models.loader import load_model
from tritium.backend.models.registry import resolve_model
from tritium.backend.output_processor import OutputProcessor
from tritium.backend.sample.sampler import Sampler, SamplerOutput, stage_random_rows
from tritium.backend.sampling_params import SamplingParams
from tritium.backend.structured_output.compiler import CompileCallback, GrammarCompiler
from tritium.backend.structured_output.decoding import StructuredDecoding, Verdict
from tritium.backend.testing.faults import FaultInjector
from tritium.backend.tokenizer import Tokenizer
from tritium.backend.worker.attention import get_attention_backend, resolve_backend_name
from tritium.backend.worker.memory_budget import (
    check_fits_one_sequence,
    check_free_memory,
    estimate_activation_bytes,
    kv_cache_budget,
    module_bytes,
)
from tritium.backend.worker.model_runner import ModelRunner, kv_bytes_per_block

logger = logging.getLogger(__name__)
NOT_CONSTRAINED = Verdict()


def use_device(device: torch.device) -> None:
    """Make `device` the calling thread's current CUDA device (CUDA's current device is per thread, and Triton
    kernels and graph capture use it, not their tensors' device). A no-op for a CPU, an index-less "cuda" or
    when it already is."""
    if device.type == "cuda" and device.index is not None and torch.cuda.current_device() != device.index:
        torch.cuda.set_device(device)


@dataclass
class EngineStats:
    """Cumulative timings of `LLMEngine.step`: `step_s` = scheduling + `model_s` + `update_s`."""

    steps: int = 0
    step_s: float = 0.0
    model_s: float = 0.0  # the forward pass and sampling
    update_s: float = 0.0  # the scheduler's bookkeeping, detokenizing, building outputs
    scheduled_tokens: int = 0
    running_seqs: int = 0  # summed over steps: divided by steps, the mean batch size

    @property
    def overhead_s(self) -> float:
        return self.step_s - self.model_s


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.torch_device()
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        use_device(self.device)  # this thread's kernels, graphs and allocations go there
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
        use_graphs = not config.enforce_eager if config.enforce_eager is not None else self.device.type == "cuda"
        self.runner = ModelRunner(model, backend, num_blocks, config.block_size, self.dtype, self.device,
                                  config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len, use_graphs)
        self.eos_token_ids = list(model.config.eos_token_ids)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill,
            StopChecker(self.eos_token_ids),
        )
        self.sampler = Sampler(self.eos_token_ids, seed=config.seed, device=self.device)
        self.grammars = GrammarCompiler(self.tokenizer, self.eos_token_ids, cache_bytes=config.grammar_cache_bytes)
        self.structured = StructuredDecoding(self.grammars, self.device, config.max_num_seqs)
        self.outputs = OutputProcessor(self.tokenizer)
        self.requests: dict[str, Sequence] = {}
        self.stats = EngineStats()
        self._arrivals = count()
        self._pending: list[RequestOutput] = []
        self.faults = FaultInjector.from_env()
        self.warm_up_s = self.runner.warm_up(config.max_num_batched_tokens)
        logger.info(
            "tritium engine: %s, %s on %s, %s attention, %d KV blocks of %d tokens, %s; warm-up %.2f s",
            self.model_path, self.dtype, self.device, backend.name, num_blocks, config.block_size,
            f"decode graphs for batch sizes {self.runner.graphs.buckets}" if use_graphs else "eager", self.warm_up_s,
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
        matcher: Any = None,
    ) -> None:
        """Queue a request (text `prompt` or `prompt_token_ids`). `matcher`: its structured output compiled
        already (`compile_structured_output`); without it the grammar is compiled here. Raises ValueError
        naming the field and the rule for a bad request; nothing is queued then."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling params must be a SamplingParams")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise ValueError("prompt must be a string (or pass prompt_token_ids)")
            prompt_token_ids = self.tokenize(prompt)
        ids = [int(t) for t in prompt_token_ids]
        self.check_request(ids, params)
        if params.structured_output is not None:
            self.structured.add(request_id, params.structured_output, matcher)
        seq = Sequence(request_id, prompt, ids, params, next(self._arrivals))
        self.outputs.add(seq)
        self.sampler.add_request(request_id, params.seed)
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def tokenize(self, prompt: str) -> list[int]:
        """The token ids of `prompt`; raises ValueError when it is empty or cannot fit the context (checked
        before tokenizing a huge text). Reads only settings: any thread may call it (the serving tokenizer
        thread does)."""
        if not prompt:
            raise ValueError("prompt must not be empty")
        self.tokenizer.check_can_fit(prompt, self.max_model_len)
        return self.tokenizer.encode(prompt)

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
        if params.structured_output is not None and \
                (size := params.structured_output.source_bytes) > self.config.max_structured_output_bytes:
            raise ValueError(
                f"structured_output.{params.structured_output.kind} is {size} bytes; this engine takes at most "
                f"{self.config.max_structured_output_bytes} (max_structured_output_bytes)"
            )
        if len(ids) + params.max_tokens > self.kv_capacity_tokens:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the KV cache "
                f"capacity of {self.kv_capacity_tokens} tokens"
            )

    def compile_structured_output(self, params: SamplingParams, done: CompileCallback) -> None:
        """Compile `params.structured_output` off the calling thread (any thread: the serving tokenizer thread
        does) and call `done(matcher, None)`, or `done(None, why)` when it cannot be enforced; at once when
        the grammar cache has it. Pass the matcher to `add_request`."""
        assert params.structured_output is not None
        self.grammars.submit(params.structured_output, done)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks; its final output (finish_reason "abort") comes with
        the next step(). Unknown or finished ids are ignored."""
        seq = self.requests.get(request_id)
        if seq is None or seq.finished:
            return
        self._end(seq, "abort")
        try:
            self._pending.append(self.outputs.output(seq))
        except Exception:
            logger.exception("building the abort output of %s failed", request_id)
            self._pending.append(self.outputs.error_output(seq, "aborted", reason="abort"))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._pending)

    def step(self) -> list[RequestOutput]:
        """One step: schedule -> execute (forward pass and sampling) -> update (the scheduler's bookkeeping,
        then text and outputs). Returns an output for every request that changed: delta-only, the final
        one with the totals."""
        t0 = time.perf_counter()
        outputs, self._pending = self._pending, []
        batch = self.scheduler.schedule()
        if not batch.scheduled:
            return outputs
        t_model = time.perf_counter()
        use_device(self.device)  # the serving loop steps on a thread of its own
        sampled = self._execute(batch)
        t_update = time.perf_counter()
        if sampled is None:  # the forward pass failed: fail only the requests of this step; the engine goes on
            for s in batch.scheduled:
                self._end(s.seq, "error")
                outputs.append(self.outputs.error_output(s.seq, "the model step failed"))
            return outputs
        verdicts = self.structured.accept(batch.sampling, sampled.token_ids)
        for row, verdict in verdicts.items():
            if verdict.error is not None:
                sampled.token_ids[row], sampled.errors[row] = None, verdict.error
        self.scheduler.update(batch, sampled.token_ids)
        for row, (seq, token, logprobs, error) in enumerate(zip(batch.sampling, sampled.token_ids, sampled.logprobs,
                                                                 sampled.errors, strict=True)):
            outputs.append(self._process(seq, token, logprobs, error, verdicts.get(row, NOT_CONSTRAINED)))
        stats = self.stats
        stats.steps += 1
        stats.model_s += t_update - t_model
        stats.scheduled_tokens += batch.num_tokens
        stats.running_seqs += len(batch.scheduled)
        now = time.perf_counter()
        stats.update_s += now - t_update
        stats.step_s += now - t0
        return outputs

    def _execute(self, batch: SchedulerOutput) -> SamplerOutput | None:
        """The forward pass and sampling; None when the forward pass failed (logged)."""
        for seq in batch.preempted:  # readmitted later with new blocks: a new row then
            self.runner.release(seq.request_id)
        staging = self.runner.staging
        pending_masks = self.structured.start(batch.sampling)  # computed while the forward pass runs
        try:
            self.faults.check(s.seq.prompt for s in batch.scheduled)
            staging.begin()
            step = self.runner.prepare(batch.scheduled)
            random = stage_random_rows(staging, batch.sampling)
            staging.upload()
            logits = self.runner.execute(step)
        except Exception:
            logger.exception("model step failed for %s", [s.seq.request_id for s in batch.scheduled])
            self.structured.wait(pending_masks)  # the worker must be done with the buffer before the next step
            return None
        masks = self.structured.wait(pending_masks)
        if not batch.sampling:
            return SamplerOutput([], [], [])
        return self.sampler(logits, batch.sampling, random.tensors(staging) if random is not None else None, masks)

    def _process(self, seq: Sequence, token: int | None, logprobs: dict[int, float] | None,
                 error: str | None, verdict: Verdict) -> RequestOutput:
        """The output of a sequence that sampled (the scheduler already appended `token`): text, stop strings,
        a complete grammar; whatever fails here ends this request alone with an error."""
        if error is None and token is not None:
            try:
                if self.outputs.append_token(seq, token, logprobs) or seq.finished or verdict.complete:
                    self._end(seq, "stop")  # a stop string, the grammar's end, or the scheduler's stop (its reason)
                return self.outputs.output(seq)
            except Exception:
                logger.exception("processing the output of %s failed", seq.request_id)
                error = "internal error while processing the generated token"
        self._end(seq, "error")
        return self.outputs.error_output(seq, error or "no token was sampled")

    def _end(self, seq: Sequence, reason: str) -> None:
        """Finish `seq` with `reason` unless it already finished (the scheduler's reason then stands), and drop
        the engine's own state of it."""
        if not seq.finished:
            self.scheduler.finish(seq, reason)
        self._forget(seq)

    def _forget(self, seq: Sequence) -> None:
        self.requests.pop(seq.request_id, None)
        self.sampler.remove_request(seq.request_id)
        self.structured.remove(seq.request_id)
        self.runner.release(seq.request_id)
