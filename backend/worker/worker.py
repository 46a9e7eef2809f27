"""The device side of the engine: one call, `execute(batch)`, per step.

The worker owns the device (device.py), the model and its KV cache (sized by kv_sizing.py), the model runner,
the staging buffer, the decode graphs, the sampler and the constrained requests' grammar matchers. A step
stages the runner's inputs and the random rows' sampling settings into the staging buffer, uploads them in
one copy and runs the forward pass while the grammar masks are computed on their own thread; then it samples
with the masks and advances the grammars with the sampled tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tritium.backend.config import EngineConfig
from tritium.backend.core.scheduler import SchedulerOutput
from tritium.backend.core.sequence import Sequence
from tritium.backend.lora.weights import LoraStacks
from tritium.backend.models.config import ModelConfig, check_attention_backend
from tritium.backend.models.loader import load_model
from tritium.backend.sample.sampler import Sampler, SamplerOutput
from tritium.backend.sample.settings import RowSettings, row_settings_slots, stage_row_settings
from tritium.backend.sampling_params import SamplingParams
from tritium.backend.spec.config import SpeculativeConfig
from tritium.backend.spec.draft_model import draft_footprint
from tritium.backend.spec.verify import Verified, accept_runs, position_views
from tritium.backend.structured_output.compiler import GrammarCompiler
from tritium.backend.structured_output.decoding import StructuredDecoding
from tritium.backend.worker.attention import get_attention_backend, resolve_backend_name
from tritium.backend.worker.decode_graphs import DecodeGraphs, graph_buckets, use_decode_graphs
from tritium.backend.worker.device import set_up_device, use_device
from tritium.backend.worker.kv_sizing import num_kv_blocks
from tritium.backend.worker.model_runner import ModelRunner, step_input_slots
from tritium.backend.worker.staging import StagingBuffer
from tritium.backend.worker.threads import ThreadChoice, set_up_threads

if TYPE_CHECKING:
    import llguidance

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What a step produced for each sequence that sampled (`SchedulerOutput.sampling`, in that order): its
    token (None when it got none: `errors` says why), its logprobs when asked, and whether its grammar is
    complete (only EOS may follow: the request stops). `failed`: the forward pass raised, so no sequence got a
    token and every scheduled one fails (the lists are empty then)."""

    token_ids: list[int | None] = field(default_factory=list)
    logprobs: list[dict[int, float] | None] = field(default_factory=list)
    errors: list[str | None] = field(default_factory=list)
    grammar_complete: list[bool] = field(default_factory=list)
    failed: bool = False
    # Speculative decoding: per sequence the drafts verification kept, before `token_ids[row]`, and their
    # logprobs (empty lists when no sequence of the step speculated).
    accepted: list[list[int]] = field(default_factory=list)
    accepted_logprobs: list[list[dict[int, float] | None]] = field(default_factory=list)


class Worker:
    """Loads the model on the configured device, sizes and allocates its KV cache, captures the decode graphs
    and warms every kernel up (`warm_up_s`). Raises ValueError (or ModelFolderError) when the model cannot
    run here: an unsupported checkpoint or head size, or a KV cache that cannot hold one `max_model_len`
    sequence."""

    def __init__(self, config: EngineConfig, model_path: Path, grammars: GrammarCompiler,
                 served: bool = False) -> None:
        self.device = set_up_device(config)
        # `served`: inside tritonserver, whose threads need cores too (threads.py); a CPU's thread count, or None
        self.threads: ThreadChoice | None = set_up_threads(config.num_threads, served, self.device.type)
        self.dtype = config.torch_dtype(self.device)
        backend = get_attention_backend(config.attention_backend, self.device)
        # Before the weights load: a head size the attention backend cannot run is refused at once.
        backend_name = resolve_backend_name(config.attention_backend, self.device)
        check_attention_backend(ModelConfig.from_folder(model_path), backend_name)
        model = load_model(model_path, self.dtype, self.device, config.max_model_len, config.quantization)
        self.model_config = model.config
        self.max_model_len = config.max_model_len or model.config.max_position_embeddings
        seqs = config.max_num_seqs
        use_graphs, why = use_decode_graphs(self.device.type, backend_name, config.enforce_eager)
        if not use_graphs and self.device.type == "cuda":
            log = logger.warning if config.enforce_eager is False else logger.info
            log("decode CUDA graphs are off: %s; decode steps run eagerly", why)
        buckets = graph_buckets(seqs) if use_graphs else []
        # The resident adapters' slots (LoraManager writes them); allocated before the KV cache is sized.
        self.lora_stacks = LoraStacks(model.config, config.max_loras, config.max_lora_rank, self.dtype, self.device,
                                      b_rank_major=backend_name != "triton") if config.enable_lora else None
        spec = SpeculativeConfig.parse(config.speculative_config)
        draft_weights, draft_block = draft_footprint(spec.model, self.dtype, config.block_size) \
            if spec is not None and spec.model is not None else (0, 0)  # the engine loads the draft model later
        adapters = self.lora_stacks.nbytes if self.lora_stacks is not None else 0
        # A speculating sequence samples at each verified position: a logit row and row settings for each.
        rows = seqs * (1 + spec.num_speculative_tokens) if spec is not None else seqs
        sizing = num_kv_blocks(config, model, self.device, self.dtype, self.max_model_len, max(buckets, default=0),
                               adapters + draft_weights, draft_block, rows)
        self.num_blocks = sizing.num_blocks
        self.memory_plan = sizing.plan  # on CUDA without kv_cache_bytes: what the share is spent on (gpu-check)
        slots = step_input_slots(seqs, config.max_num_batched_tokens, self.max_model_len, config.block_size,
                                 lora=config.enable_lora)
        self.staging = StagingBuffer(slots + (rows - seqs) + row_settings_slots(rows), self.device)
        self.graphs = DecodeGraphs(buckets, self.device)
        self.runner = ModelRunner(model, backend, self.num_blocks, config.block_size, self.dtype, self.device, seqs,
                                  self.max_model_len, self.staging, self.graphs, self.lora_stacks)
        self.sampler = Sampler(list(model.config.eos_token_ids), seed=config.seed, device=self.device)
        self.structured = StructuredDecoding(grammars, self.device, rows)  # a mask per verified position too
        self.warm_up_s = self.runner.warm_up(config.max_num_batched_tokens)

    def add_request(self, request_id: str, params: SamplingParams, matcher: llguidance.LLMatcher | None) -> None:
        """Take on a request's device-side state: its grammar matcher (`matcher`, or compiled here from
        `params.structured_output`) and its seeded generator. Raises ValueError, holding nothing of it, when
        its structured output cannot be enforced."""
        if params.structured_output is not None:
            self.structured.add(request_id, params.structured_output, matcher)
        self.sampler.add_request(request_id, params.seed)

    def release(self, request_id: str) -> None:
        """Drop a finished request's state: its generator, matcher and block-table row (none: nothing happens)."""
        self.sampler.remove_request(request_id)
        self.structured.remove(request_id)
        self.runner.release(request_id)

    def execute(self, batch: SchedulerOutput) -> StepResult:
        """Run one scheduled step: the forward pass (the constrained rows' grammar masks computed meanwhile),
        sampling, the grammars advanced. A forward pass that raised is logged and comes back as a failed
        result; the worker is ready for the next step either way. Sampling failures are per row (`errors`)."""
        use_device(self.device)  # the serving loop steps on a thread of its own
        for seq in batch.preempted:  # readmitted later with new blocks: a new row then
            self.runner.release(seq.request_id)
        speculating = any(batch.drafts)
        rows = position_views(batch.sampling, batch.drafts) if speculating else batch.sampling
        pending_masks = self.structured.start(batch.sampling, batch.drafts if speculating else None)
        try:
            logits, settings = self.forward(batch, rows)
        except Exception:
            logger.exception("model step failed for %s", [s.seq.request_id for s in batch.scheduled])
            self.structured.wait(pending_masks)  # the mask thread must be done with its buffer before the next step
            return StepResult(failed=True)
        masks = self.structured.wait(pending_masks)
        if not batch.sampling:
            return StepResult()
        sampled = self.sampler(logits, rows, settings, masks)
        if not speculating:
            return self._accept(batch.sampling, sampled)
        verified = accept_runs(batch.drafts, sampled)
        result = self._accept(batch.sampling, verified.sampled, verified)
        result.accepted, result.accepted_logprobs = verified.accepted, verified.accepted_logprobs
        return result

    def forward(self, batch: SchedulerOutput, rows: list[Sequence]) -> tuple[torch.Tensor, RowSettings | None]:
        """Stage the runner's inputs and the random rows' settings (`rows`: the sampler's rows, a speculating
        sequence's verified positions included), upload them in one copy and run the forward pass: the sampling
        rows' logits and those settings on the device."""
        self.staging.begin()
        step = self.runner.prepare(batch.scheduled)
        staged = stage_row_settings(self.staging, rows)
        self.staging.upload()
        logits = self.runner.execute(step)
        return logits, staged.tensors(self.staging) if staged is not None else None

    def _accept(self, seqs: list[Sequence], sampled: SamplerOutput, verified: Verified | None = None) -> StepResult:
        """Advance the constrained rows' grammars with their tokens (`verified`: a speculating step's runs,
        accepted drafts first): a token that breaks its grammar becomes that row's error; a grammar that is
        complete says so, and a run that completed it early ends at that token."""
        complete = [False] * len(seqs)
        runs = verified.accepted if verified is not None else None
        for row, verdict in self.structured.accept(seqs, sampled.token_ids, runs).items():
            if verdict.error is not None:
                sampled.token_ids[row], sampled.errors[row] = None, verdict.error
            elif verdict.cut is not None and verified is not None:
                verified.end_run(row, verdict.cut)
            complete[row] = verdict.complete
        return StepResult(sampled.token_ids, sampled.logprobs, sampled.errors, complete)
