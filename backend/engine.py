"""The streaming engine: add requests, step, abort. One thread drives it (docs/architecture.md#the-engine-step)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tritium.backend.config import EngineConfig, SpeculativeConfig
from tritium.backend.core.batch import ScheduledSequence, SchedulerOutput
from tritium.backend.core.block_manager import BlockManager
from tritium.backend.core.embed_batches import embedding_batches
from tritium.backend.core.rotary_rule import RotaryLengthRule
from tritium.backend.core.scheduler import Scheduler
from tritium.backend.core.sequence import Sequence
from tritium.backend.core.stop_checker import StopChecker
from tritium.backend.lora.manager import LoraManager
from tritium.backend.model_config import ModelConfig
from tritium.backend.models.registry import resolve_model
from tritium.backend.output_processor import OutputProcessor
from tritium.backend.outputs import RequestOutput, SpecDecodingStats
from tritium.backend.sampling_params import SamplingParams
from tritium.backend.structured_output.compiler import CompileCallback, GrammarCompiler
from tritium.backend.tokenizer import Tokenizer
from tritium.backend.worker.pooling import PoolingConfig, pooling_config
from tritium.backend.worker.worker import StepResult, Worker, WorkerInfo

if TYPE_CHECKING:
    import llguidance

    from tritium.backend.lora.adapter import LoraAdapter

logger = logging.getLogger(__name__)
MODEL_STEP_FAILED = "the model step failed"


@dataclass
class SpecTotals:
    """Over all requests; `num_drafts` counts steps that verified drafts, `num_refused_tokens` drafts a grammar cut."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_refused_tokens: int = 0


@dataclass
class EngineStats:
    """Cumulative timings of `LLMEngine.step`: `step_s` = scheduling + `model_s` + `update_s`."""

    steps: int = 0
    step_s: float = 0.0
    model_s: float = 0.0  # the worker's step: the forward pass and sampling
    update_s: float = 0.0  # the scheduler's bookkeeping, detokenizing, building outputs
    scheduled_tokens: int = 0
    running_seqs: int = 0  # summed over steps: divided by steps, the mean batch size

    @property
    def overhead_s(self) -> float:
        return self.step_s - self.model_s

    def add(self, batch: SchedulerOutput, start: float, executed: float, updated: float, end: float) -> None:
        """Count one step (perf_counter times): its start, the worker's start and end, the step's end."""
        self.steps += 1
        self.model_s += updated - executed
        self.scheduled_tokens += batch.num_tokens
        self.running_seqs += len(batch.scheduled)
        self.update_s += end - updated
        self.step_s += end - start


class LLMEngine:
    """Requests in, delta outputs out: the scheduler, the worker and the text side, driven by `step`."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_path = resolve_model(config.model)
        self.tokenizer = Tokenizer(self.model_path)
        # The worker's grammar matchers need the compiler: built from config.json before the weights load.
        checkpoint = ModelConfig.from_folder(self.model_path)
        self.grammars = GrammarCompiler(self.tokenizer, checkpoint.eos_token_ids,
                                        cache_bytes=config.grammar_cache_bytes)
        self.worker = Worker(config, self.model_path, self.grammars)
        info = self.worker_info
        self.device, self.dtype = info.device, info.dtype
        self.model_config = info.model_config
        self.max_model_len = info.max_model_len
        self.eos_token_ids = list(self.model_config.eos_token_ids)
        self.block_manager = BlockManager(info.num_blocks, config.block_size, config.enable_prefix_caching)
        self.lora = LoraManager(info.lora_stacks, self.model_config, self.dtype) \
            if info.lora_stacks is not None else None
        for name, folder in (config.lora_modules or {}).items():
            self.load_lora(name, folder)
        spec = SpeculativeConfig.parse(config.speculative_config)
        # None: speculation is off
        self.spec_totals = SpecTotals() if spec is not None else None
        # A draft model writes its KV at the positions it drafts at: those need blocks before it runs.
        lookahead = spec.num_speculative_tokens if spec is not None and spec.model is not None else 0
        rope = info.length_dependent_rope
        rotary_rule = RotaryLengthRule(*rope) if rope is not None else None
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill,
            StopChecker(self.eos_token_ids), self.lora, config.scheduling_policy, config.priority_aging_s,
            num_lookahead_tokens=lookahead, max_model_len=self.max_model_len, rotary_rule=rotary_rule,
        )
        self.outputs = OutputProcessor(self.tokenizer)
        self.requests: dict[str, Sequence] = {}
        self.stats = EngineStats()
        self._arrivals = count()
        self._embeddings = count()
        self._pooling: PoolingConfig | None = None
        self._pending: list[RequestOutput] = []
        graphs = info.graph_buckets
        logger.info(
            "tritium engine: %s, %s on %s, %s attention, %d KV blocks of %d tokens, %s; warm-up %.2f s",
            self.model_path, self.dtype, self.device, info.attention_backend, info.num_blocks,
            config.block_size, f"decode graphs for batch sizes {graphs}" if graphs else "eager", info.warm_up_s,
        )

    @property
    def worker_info(self) -> WorkerInfo:
        return self.worker.info

    def check_alive(self) -> None:
        """Raises RanksFailed once a tensor-parallel rank is gone (the engine cannot step again)."""
        self.worker.check_alive()

    def shutdown(self) -> None:
        """Release what outlives a dropped engine: the tensor-parallel ranks' processes. Idempotent."""
        self.worker.shutdown()

    @property
    def kv_capacity_tokens(self) -> int:
        return self.block_manager.num_blocks * self.config.block_size

    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        matcher: llguidance.LLMatcher | None = None,
        lora_name: str | None = None,
        priority: int | None = None,
    ) -> None:
        """Queue a request (text `prompt` or `prompt_token_ids`). `matcher`: from `compile_structured_output`
        (None: compiled here); `priority` None: `params.priority`. Raises ValueError naming the field and the
        rule, or the unknown adapter; nothing is queued then."""
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
        priority = params.priority if priority is None else priority
        self.check_priority(priority)
        adapter = self.lora_adapter(lora_name)
        self.worker.add_request(request_id, params, matcher)
        seq = Sequence(request_id, prompt, ids, params, next(self._arrivals), lora=adapter, priority=priority)
        if adapter is not None:
            assert self.lora is not None
            self.lora.retain(adapter)
        if self.spec_totals is not None:
            seq.spec = SpecDecodingStats()
        self.outputs.add(seq)
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def lora_adapter(self, lora_name: str | None) -> LoraAdapter | None:
        """The adapter loaded as `lora_name` (None for None); raises ValueError naming it, or saying LoRA is off."""
        if lora_name is None:
            return None
        if self.lora is None:
            raise ValueError(f"lora_name {lora_name!r}: this engine serves no LoRA adapters (enable_lora is off)")
        return self.lora.get(lora_name)

    def load_lora(self, name: str, folder: str | Path) -> None:
        """Load the PEFT adapter in `folder` as `name` (the engine's thread). Raises ValueError when LoRA is off,
        `name` is loaded already, or the adapter does not fit the model (LoraAdapterError, naming what)."""
        if self.lora is None:
            raise ValueError(f"cannot load LoRA adapter {name!r}: enable_lora is off")
        t0 = time.perf_counter()
        adapter = self.lora.load(name, folder)
        logger.info("loaded LoRA adapter %s (rank %d, %d modules, %.1f MiB) from %s in %.3f s", name, adapter.rank,
                    len(adapter.weights), adapter.nbytes / 2**20, adapter.folder, time.perf_counter() - t0)

    def unload_lora(self, name: str) -> None:
        """Forget adapter `name` (the engine's thread); accepted requests finish on it. Raises ValueError naming
        an unknown adapter (or when LoRA is off)."""
        if self.lora is None:
            raise ValueError(f"cannot unload LoRA adapter {name!r}: enable_lora is off")
        self.lora.unload(name)

    def tokenize(self, prompt: str) -> list[int]:
        """Any thread may call it; raises ValueError when `prompt` is empty or cannot fit the context."""
        if not prompt:
            raise ValueError("prompt must not be empty")
        self.tokenizer.check_can_fit(prompt, self.max_model_len)
        return self.tokenizer.encode(prompt)

    def check_request(self, ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError naming the rule when `ids` with `params` cannot be served here (empty, outside the
        vocabulary, too long for the context or the KV cache). Any thread may call it."""
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
        self.check_priority(params.priority)
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

    def check_priority(self, priority: int) -> None:
        """Raises ValueError when `priority` is outside SamplingParams.priority's bounds, or not 0 under
        scheduling_policy "fcfs" (as vLLM refuses it)."""
        SamplingParams(priority=priority)
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority must be 0 (got {priority}): this model schedules first come first served "
                             "(scheduling_policy \"fcfs\"); set scheduling_policy \"priority\" in its "
                             "settings to use request priorities")

    @property
    def pooling(self) -> PoolingConfig:
        """How `embed` pools: the model folder's sentence-transformers files, else the settings, else "last" and
        normalised (read on first use; raises ValueError naming a pooling mode it cannot run)."""
        if self._pooling is None:
            self._pooling = pooling_config(self.model_path, self.config.embedding_pooling,
                                           self.config.embedding_normalize)
        return self._pooling

    def check_embedding_input(self, ids: list[int], name: str = "input") -> None:
        """Raises ValueError naming `name` when `ids` cannot be embedded here: empty, outside the vocabulary, or
        longer than the model's context. Any thread may call it."""
        if not ids:
            raise ValueError(f"{name} must not be empty")
        if len(ids) > self.max_model_len:
            raise ValueError(f"{name} is {len(ids)} tokens; the model's context is {self.max_model_len} tokens")
        vocab = self.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"{name}: token ids must be in [0, {vocab})")

    def embed(self, prompts: list[list[int]], pooling: PoolingConfig | None = None) -> torch.Tensor:
        """fp32 vectors `[len(prompts), hidden]` on the CPU, one per token-id list, pooled by `pooling` (None: the
        engine's `pooling`). The inputs run as prefill-only forward passes of at most max_num_batched_tokens tokens
        (a longer input alone) on free KV blocks, freed right after; no cache outlives the call. The engine's thread,
        between steps. Raises ValueError naming the first bad input (`input i`) before anything runs."""
        config = pooling or self.pooling
        ids = [[int(t) for t in p] for p in prompts]
        for i, p in enumerate(ids):
            self.check_embedding_input(p, f"input {i}")
        c, bm = self.config, self.block_manager
        vectors = []
        for batch in embedding_batches([len(p) for p in ids], c.max_num_batched_tokens, c.max_num_seqs,
                                       bm.block_size, bm.num_free_blocks):
            seqs = [Sequence(f"embed-{next(self._embeddings)}", None, ids[i], SamplingParams(), -1) for i in batch]
            try:
                for seq in seqs:
                    if not bm.allocate(seq, seq.num_tokens):  # embedding_batches kept within the free blocks
                        raise RuntimeError(f"no free KV blocks for {seq.num_tokens} embedding tokens")
                vectors.append(self.worker.embed([ScheduledSequence(s, s.num_tokens) for s in seqs], config))
            finally:
                for seq in seqs:
                    bm.free_sequence(seq)
        if not vectors:
            return torch.empty(0, self.model_config.hidden_size)
        return torch.cat(vectors)

    def compile_structured_output(self, params: SamplingParams, done: CompileCallback) -> None:
        """Compile `params.structured_output` on the compiler's threads (any thread may call it), then call
        `done(matcher, None)` or `done(None, why)`; at once on a cache hit. Pass the matcher to `add_request`."""
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
        """Whether a request is queued or running, or an output waits for the next `step`."""
        return bool(self.requests) or bool(self._pending)

    def step(self) -> list[RequestOutput]:
        """schedule -> execute -> update; an output per request that changed (delta-only, the last with totals)."""
        start = time.perf_counter()
        outputs, self._pending = self._pending, []
        batch = self.scheduler.schedule()
        if not batch.scheduled:
            return outputs
        executed = time.perf_counter()
        result = self.worker.execute(batch)
        updated = time.perf_counter()
        outputs += self._update(batch, result)
        if not result.failed:
            self.stats.add(batch, start, executed, updated, time.perf_counter())
        return outputs

    def _update(self, batch: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        """An output per sequence that sampled; a failed forward pass ends every scheduled sequence."""
        if result.failed:
            for s in batch.scheduled:
                self._end(s.seq, "error")
            return [self.outputs.error_output(s.seq, MODEL_STEP_FAILED) for s in batch.scheduled]
        if self.spec_totals is not None:
            self._count_drafts(batch, result)
        appended = self.scheduler.update(batch, result.token_ids, result.accepted or None, result.drafts or None)
        return [self._process(seq, result, row, appended[row]) for row, seq in enumerate(batch.sampling)]

    def _count_drafts(self, batch: SchedulerOutput, result: StepResult) -> None:
        totals = self.spec_totals
        assert totals is not None
        totals.num_refused_tokens += result.refused_drafts
        for row, (seq, draft) in enumerate(zip(batch.sampling, batch.drafts, strict=True)):
            if draft and seq.spec is not None and result.token_ids[row] is not None:
                accepted = len(result.accepted[row])
                seq.spec.record(len(draft), accepted)
                totals.num_drafts += 1
                totals.num_draft_tokens += len(draft)
                totals.num_accepted_tokens += accepted

    def _process(self, seq: Sequence, result: StepResult, row: int, appended: int = 1) -> RequestOutput:
        """The scheduler appended `appended` tokens already (accepted drafts, then the sampled one); whatever
        fails here ends this request alone."""
        token, error = result.token_ids[row], result.errors[row]
        if error is None and token is not None:
            try:
                stop_string = self._append_run(seq, result, row, max(appended, 1))
                if stop_string or seq.finished or result.grammar_complete[row]:
                    self._end(seq, "stop")  # a stop string, the grammar's end, or the scheduler's stop (its reason)
                out = self.outputs.output(seq)
                if out.finished and seq.spec is not None:
                    out.spec_decoding = seq.spec
                return out
            except Exception:
                logger.exception("processing the output of %s failed", seq.request_id)
                error = "internal error while processing the generated token"
        self._end(seq, "error")
        return self.outputs.error_output(seq, error or "no token was sampled")

    def _append_run(self, seq: Sequence, result: StepResult, row: int, n: int) -> bool:
        """Detokenize the first `n` tokens of `row`'s run one at a time; at a stop string the tokens after it are
        dropped. Returns whether a stop string appeared."""
        accepted = result.accepted[row] if result.accepted else []
        logprobs = result.accepted_logprobs[row] if result.accepted else []
        run = [*accepted, result.token_ids[row]][:n]
        for i, (token, lp) in enumerate(zip(run, [*logprobs, result.logprobs[row]][:n], strict=True)):
            assert token is not None
            if self.outputs.append_token(seq, token, lp):
                if (after := n - 1 - i) > 0:
                    del seq.token_ids[-after:]
                    if seq.finished:  # the scheduler stopped it at a later token, which is gone now
                        seq.finish_reason = "stop"
                return True
        return False

    def _end(self, seq: Sequence, reason: str) -> None:
        """Finish `seq` (a reason the scheduler gave first stands) and drop the engine's and worker's state."""
        if not seq.finished:
            self.scheduler.finish(seq, reason)
        if self.requests.pop(seq.request_id, None) is not None and seq.lora is not None:
            assert self.lora is not None
            self.lora.drop(seq.lora)
        self.worker.release(seq.request_id)
