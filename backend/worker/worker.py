"""The device side of the engine: `execute(batch)` once a step (docs/architecture.md, "A request's path")."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tritium.backend.config import EngineConfig, SpeculativeConfig
from tritium.backend.core.batch import ScheduledSequence, SchedulerOutput
from tritium.backend.core.sequence import Sequence
from tritium.backend.layers.attention import AttentionBackend, check_attention_backend, get_attention_backend
from tritium.backend.layers.parallel import CollectiveTime
from tritium.backend.lora.weights import LoraStacks
from tritium.backend.model_config import ModelConfig, ModelFolderError
from tritium.backend.models.loader import load_model
from tritium.backend.models.sharding import shard_config
from tritium.backend.sample.sampler import Sampler, SamplerOutput
from tritium.backend.sample.step_inputs import SamplingInputs
from tritium.backend.sampling_params import SamplingParams
from tritium.backend.spec.draft_model import DraftModel, draft_footprint
from tritium.backend.spec.proposer import DraftProposer
from tritium.backend.spec.verify import Verified, accept_runs, position_views
from tritium.backend.structured_output.compiler import GrammarCompiler
from tritium.backend.structured_output.decoding import StructuredDecoding
from tritium.backend.worker.decode_graphs import engine_graphs, graph_buckets, use_decode_graphs
from tritium.backend.worker.device import set_up_device, use_device
from tritium.backend.worker.kv_sizing import num_kv_blocks
from tritium.backend.worker.memory_budget import MemoryPlan, module_bytes
from tritium.backend.worker.model_runner import ModelRunner, logit_rows, staging_capacity
from tritium.backend.worker.pooling import PoolingConfig, pooled
from tritium.backend.worker.ranks import RankProcesses, RanksFailed, rank_device
from tritium.backend.worker.staging import StagingBuffer, stage_sampling_inputs
from tritium.backend.worker.threads import CoreBinding, ThreadChoice, set_up_threads

if TYPE_CHECKING:
    import llguidance

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    """Per sampling sequence (`SchedulerOutput.sampling` order); a None token: `errors` says why. `failed`: the
    forward pass raised, every scheduled sequence fails (the lists are empty)."""

    token_ids: list[int | None] = field(default_factory=list)
    logprobs: list[dict[int, float] | None] = field(default_factory=list)
    errors: list[str | None] = field(default_factory=list)
    grammar_complete: list[bool] = field(default_factory=list)
    failed: bool = False
    # Speculative decoding, per sequence: the drafts verification kept, before `token_ids[row]`, and their
    # logprobs (empty when no sequence of the step speculated); the drafts proposed for its next step.
    accepted: list[list[int]] = field(default_factory=list)
    accepted_logprobs: list[list[dict[int, float] | None]] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    refused_drafts: int = 0  # drafts a grammar cut before they were proposed


@dataclass(frozen=True)
class WorkerInfo:

    device: torch.device
    dtype: torch.dtype
    model_config: ModelConfig
    max_model_len: int
    num_blocks: int
    attention_backend: str  # "torch" or "triton"
    graph_buckets: list[int]  # decode batch sizes captured as CUDA graphs ([]: eager)
    warm_up_s: float
    threads: ThreadChoice | None  # a CPU engine's intra-op threads and why
    memory_plan: MemoryPlan | None  # on CUDA without kv_cache_bytes: what the device share is spent on
    lora_stacks: LoraStacks | None  # the adapter slots on the device (the engine's LoraManager writes them)
    # (rope type, original context) of a rotary whose rotation depends on a sequence's length within max_model_len
    length_dependent_rope: tuple[str, int] | None
    tensor_parallel_size: int = 1  # the model's ranks (model_config is the whole model's; each rank holds a shard)
    weight_bytes: int = 0  # the model's weights this process holds (rank 0's shard)
    kv_cache_bytes: int = 0  # the KV cache this process holds
    collective_time: CollectiveTime | None = None  # rank 0's collectives so far (counted on a CPU)


class Worker:
    """Raises ValueError (or ModelFolderError) when the model cannot run here: an unsupported checkpoint or head
    size, or a KV cache that cannot hold one `max_model_len` sequence."""

    def __init__(self, config: EngineConfig, model_path: Path, grammars: GrammarCompiler) -> None:
        device = set_up_device(config)
        dtype = config.torch_dtype(device)
        backend = get_attention_backend(config.attention_backend, device)
        model_config = ModelConfig.from_folder(model_path)
        check_attention_backend(model_config, backend.name)  # before the weights load
        if config.enable_lora and model_config.is_moe:
            raise ModelFolderError(f"enable_lora: LoRA of a mixture-of-experts model ({model_config.architecture}) "
                                   "is not implemented")
        self.ranks: RankProcesses | None = None
        if config.tensor_parallel_size > 1:
            shard_config(model_config, config.tensor_parallel_size)  # sizes the ranks cannot split: refused first
            rank_device(config, 0)
            self.ranks = RankProcesses(config, model_path, device)  # spawned before rank 0 binds its cores
        self._bound = CoreBinding.of_this_thread()  # restored by shutdown
        threads = set_up_threads(config.num_threads, device.type, config.tensor_parallel_size)
        try:
            self._build(config, model_path, grammars, device, dtype, backend, model_config, threads)
        except BaseException:
            self.shutdown()
            raise

    def _build(self, config: EngineConfig, model_path: Path, grammars: GrammarCompiler, device: torch.device,
               dtype: torch.dtype, backend: AttentionBackend, model_config: ModelConfig,
               threads: ThreadChoice | None) -> None:
        ranks = self.ranks
        # the model's layers sum over the ranks; a draft model (rank 0's alone) keeps the one-rank backend
        model_backend = backend.on_ranks(ranks.group) if ranks is not None else backend
        model = load_model(model_path, dtype, device, config.max_model_len, config.quantization,
                           backend=model_backend)
        max_model_len = config.max_model_len or model.config.max_position_embeddings
        seqs = config.max_num_seqs
        use_graphs, why = use_decode_graphs(device.type, backend.name, config.enforce_eager)
        if not use_graphs and device.type == "cuda":
            log = logger.warning if config.enforce_eager is False else logger.info
            log("decode CUDA graphs are off: %s; decode steps run eagerly", why)
        buckets = graph_buckets(seqs) if use_graphs else []
        # The resident adapters' slots (LoraManager writes them); allocated before the KV cache is sized.
        stacks = LoraStacks(model.config, config.max_loras, config.max_lora_rank, dtype, device,
                            b_rank_major=backend.name != "triton") if config.enable_lora else None
        spec = SpeculativeConfig.parse(config.speculative_config)
        draft_weights, draft_block = draft_footprint(spec.model, dtype, config.block_size) \
            if spec is not None and spec.model is not None else (0, 0)
        adapters = stacks.nbytes if stacks is not None else 0
        rows = logit_rows(config)  # a row and row settings per verified position
        graphs = engine_graphs(config, buckets, device)
        sizing = num_kv_blocks(config, model, device, dtype, max_model_len, graphs.largest_tokens,
                               adapters + draft_weights, draft_block, rows)
        num_blocks = model_backend.parallel.min_int(sizing.num_blocks)  # every rank's cache the same size
        self.device = device
        self.staging = StagingBuffer(staging_capacity(config, max_model_len), device)
        self.runner = ModelRunner(model, model_backend, num_blocks, config.block_size, dtype, device, seqs,
                                  max_model_len, self.staging, graphs, stacks)
        self.sampler = Sampler(list(model.config.eos_token_ids), seed=config.seed, device=device,
                               vocab_size=model.config.vocab_size, max_requests=seqs)
        self.structured = StructuredDecoding(grammars, device, rows)  # a mask per verified position too
        self.proposer: DraftProposer | None = None
        if spec is not None:
            drafter = DraftModel(spec.model, model_path, model_config, dtype, device, max_model_len,
                                 num_blocks, config.block_size, backend) if spec.model is not None else None
            self.proposer = DraftProposer(spec, max_model_len, config.block_size, self.structured.draft_prefix,
                                          drafter)
        warm_up_s = self.runner.warm_up(config.max_num_batched_tokens)
        if self.proposer is not None and self.proposer.drafter is not None:
            started = time.perf_counter()
            self.proposer.drafter.warm_up()
            warm_up_s += time.perf_counter() - started
        if ranks is not None:
            ranks.wait_ready()
        rope = self.runner.rope
        rule = (rope.kind, rope.original) if rope is not None and max_model_len > rope.original else None
        self.info = WorkerInfo(device, dtype, model_config, max_model_len, num_blocks, backend.name, buckets,
                               warm_up_s, threads, sizing.plan, stacks, rule, config.tensor_parallel_size,
                               module_bytes(model), sum(k.nbytes + v.nbytes for k, v in self.runner.kv_caches),
                               model_backend.parallel.time if ranks is not None else None)

    def check_alive(self) -> None:
        """Raises RanksFailed once a tensor-parallel rank is gone; nothing for one rank."""
        if self.ranks is not None and self.ranks.lost is not None:
            raise RanksFailed(self.ranks.lost)

    def shutdown(self) -> None:
        """End the tensor-parallel ranks' processes (none: nothing to do) and give the thread that built the engine
        its cores back (when called on it); idempotent."""
        if self.ranks is not None:
            self.ranks.stop()
            self._bound.restore()

    def add_request(self, request_id: str, params: SamplingParams, matcher: llguidance.LLMatcher | None) -> None:
        """`matcher` None: compiled here. Raises ValueError, holding nothing of the request, when its
        structured output cannot be enforced."""
        if params.structured_output is not None:
            self.structured.add(request_id, params.structured_output, matcher)
        self.sampler.add_request(request_id, params.seed)
        if self.proposer is not None:
            self.proposer.add_request(request_id)

    def release(self, request_id: str) -> None:
        """Drop a finished request's state (unknown ids: ignored)."""
        self.sampler.remove_request(request_id)
        self.structured.remove(request_id)
        self.runner.release(request_id)
        if self.proposer is not None:
            self.proposer.remove_request(request_id)

    def held_requests(self) -> set[str]:
        """The requests the worker holds any state for."""
        held = set(self.sampler.generators) | set(self.sampler.penalties.slot) | set(self.structured.matchers)
        held |= self.runner.block_tables.request_ids()
        return held | set(self.proposer.lengths) if self.proposer is not None else held

    def execute(self, batch: SchedulerOutput) -> StepResult:
        """A forward pass that raises is logged and returns a failed result; sampling failures are per row. The
        worker is ready for the next step either way."""
        use_device(self.device)  # the serving loop steps on a thread of its own
        for seq in batch.preempted:  # readmitted later with new blocks: a new row, no draft KV, penalties recounted
            self.runner.release(seq.request_id)
            self.sampler.penalties.remove(seq.request_id)
            if self.proposer is not None:
                self.proposer.forget_cache(seq.request_id)
        self.check_alive()
        speculating = any(batch.drafts)
        rows = position_views(batch.sampling, batch.drafts) if speculating else batch.sampling
        pending_masks = self.structured.start(batch.sampling, batch.drafts if speculating else None)
        try:
            logits, inputs = self.forward(batch, rows)
        except RanksFailed:  # the ranks' collectives are out of step: no further step can run
            self.structured.wait(pending_masks)
            raise
        except Exception:
            logger.exception("model step failed for %s", [s.seq.request_id for s in batch.scheduled])
            self.structured.wait(pending_masks)  # the mask thread must be done with its buffer before the next step
            return StepResult(failed=True)
        masks = self.structured.wait(pending_masks)
        if not batch.sampling:
            return StepResult()
        sampled = self.sampler(logits, rows, inputs, masks)
        verified = self._verify(batch, sampled) if speculating else None
        result = self._accept(batch.sampling, verified.sampled if verified is not None else sampled, verified)
        if self.proposer is not None:
            self._propose(batch.sampling, result)
        return result

    def embed(self, batch: list[ScheduledSequence], pooling: PoolingConfig) -> torch.Tensor:
        """Pooled fp32 vectors `[len(batch), hidden]` on the CPU: each whole prompt (blocks allocated by the engine, as
        for a prefill) run as one prefill-only forward pass; the block-table rows are released after, whatever happens.
        Raises ValueError for a tensor-parallel engine (its ranks run only scheduled steps)."""
        if self.ranks is not None:
            raise ValueError("embeddings with tensor_parallel_size > 1 are not implemented")
        use_device(self.device)
        try:
            self.staging.begin()
            step = self.runner.prepare(batch, prefill_only=True)
            self.staging.upload()
            hidden = self.runner.hidden_states(step)
            return pooled(hidden, [s.num_new_tokens for s in batch], pooling).cpu()
        finally:
            for s in batch:
                self.runner.release(s.seq.request_id)

    def forward(self, batch: SchedulerOutput, rows: list[Sequence]) -> tuple[torch.Tensor, SamplingInputs]:
        """Stage and upload the inputs and `rows`' sampling inputs (sent to the other ranks), run the forward pass:
        logits and sampling inputs on device. Raises RanksFailed when the ranks cannot finish the step together."""
        self.staging.begin()
        step = self.runner.prepare(batch.scheduled)
        staged = stage_sampling_inputs(self.staging, self.sampler.host_inputs(rows))
        self.staging.upload()
        if self.ranks is None:
            logits = self.runner.execute(step)
        else:
            self.ranks.send(step, self.staging.staged())
            try:
                logits = self.runner.execute(step)
            except Exception as exc:
                raise self.ranks.failure(exc) from exc
        return logits, staged.tensors(self.staging)

    def _verify(self, batch: SchedulerOutput, sampled: SamplerOutput) -> Verified:
        """Each sequence's run (accept_runs); its draft length learns and its seeded generator keeps the run's draws."""
        verified = accept_runs(batch.drafts, sampled)
        first = 0
        for seq, draft, kept in zip(batch.sampling, batch.drafts, verified.accepted, strict=True):
            if draft:
                self.sampler.rewind_after(first + len(kept))
                if self.proposer is not None:
                    self.proposer.record(seq.request_id, len(draft), len(kept))
            first += 1 + len(draft)
        return verified

    def _accept(self, seqs: list[Sequence], sampled: SamplerOutput, verified: Verified | None) -> StepResult:
        """Advance the grammars: a token breaking one becomes its row's error; a run completing one ends there."""
        complete = [False] * len(seqs)
        runs = verified.accepted if verified is not None else None
        for row, verdict in self.structured.accept(seqs, sampled.token_ids, runs).items():
            if verdict.error is not None:
                sampled.token_ids[row], sampled.errors[row] = None, verdict.error
            elif verdict.cut is not None and verified is not None:
                verified.end_run(row, verdict.cut)
            complete[row] = verdict.complete
        result = StepResult(sampled.token_ids, sampled.logprobs, sampled.errors, complete)
        if verified is not None:
            result.accepted, result.accepted_logprobs = verified.accepted, verified.accepted_logprobs
        return result

    def _propose(self, seqs: list[Sequence], result: StepResult) -> None:
        """Fill `result.drafts` (none for a row without a token or with a complete grammar)."""
        assert self.proposer is not None
        rows, runs = [], []
        for row, token in enumerate(result.token_ids):
            if token is not None and not result.grammar_complete[row]:
                rows.append(row)
                runs.append((seqs[row], [*(result.accepted[row] if result.accepted else []), token]))
        proposed = self.proposer.propose_all(runs)
        result.drafts = [[] for _ in seqs]
        for row, (drafts, refused) in zip(rows, proposed, strict=True):
            result.drafts[row] = drafts
            result.refused_drafts += refused
