"""Owns the model and the KV cache; turns a scheduled step into one packed forward pass (docs/architecture.md,
"The engine step"; adapter rows: "LoRA")."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from itertools import accumulate, pairwise

import torch

from tritium.backend.config import EngineConfig, SpeculativeConfig
from tritium.backend.core.batch import ScheduledSequence
from tritium.backend.layers.attention import AttentionBackend, AttentionMetadata
from tritium.backend.layers.rotary import RopeChunk, length_dependent_rotary
from tritium.backend.lora.ops import LoraGroups, Segment, lora_groups, segment_arrays
from tritium.backend.lora.weights import LoraBatch, LoraStacks
from tritium.backend.lora.windows import LoraWindows, plan_windows
from tritium.backend.models.base import CausalLM
from tritium.backend.models.kernel_shape import kernel_shape
from tritium.backend.sample.settings import sampling_slots
from tritium.backend.worker.block_tables import DeviceBlockTables
from tritium.backend.worker.decode_graphs import DecodeGraphs
from tritium.backend.worker.staging import StagingBuffer
from tritium.kernels.cpu_lora import load_cpu_lora
from tritium.kernels.warmup import warm_up as warm_up_kernels


def step_input_slots(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, block_size: int,
                     lora: bool = False) -> int:
    """The most staging-buffer slots one step's runner inputs take."""
    width = -(-max_model_len // block_size)
    # A step carries at most max_num_batched_tokens, or one whole prompt when chunked prefill is off.
    seqs, tokens = max_num_seqs, max(max_num_batched_tokens, max_num_seqs, max_model_len)
    # ids, positions, slots (and LoRA slots); decode and prefill rows/lengths; logit rows; table updates (a step
    # may rewrite every scheduled row).
    # LoRA: rows sorted by slot (or a slot per decode row) and the device segments (starts and slots).
    return (4 if lora else 3) * tokens + (10 if lora else 8) * seqs + (2 if lora else 1) + 2 * seqs * width


def logit_rows(config: EngineConfig) -> int:
    """The most logit rows a step samples: a speculating sequence samples at each verified position too."""
    spec = SpeculativeConfig.parse(config.speculative_config)
    return config.max_num_seqs * (1 + spec.num_speculative_tokens) if spec is not None else config.max_num_seqs


def staging_capacity(config: EngineConfig, max_model_len: int) -> int:
    """Staging-buffer slots for a step's runner inputs and its rows' sampling inputs (every rank the same)."""
    rows = logit_rows(config)
    slots = step_input_slots(config.max_num_seqs, config.max_num_batched_tokens, max_model_len, config.block_size,
                             lora=config.enable_lora)
    return slots + (rows - config.max_num_seqs) + sampling_slots(rows)


def warm_up_prefills(max_prefill_tokens: int, max_model_len: int, max_num_seqs: int, cuda: bool) -> list[list[int]]:
    """`ModelRunner.warm_up`'s prefill steps as sequence lengths: on CUDA 1, up to 64 and `max_prefill_tokens`
    tokens (a CPU: 1), split as the scheduler would (at most `max_num_seqs` sequences of `max_model_len`)."""
    sizes = {1, max(2, min(max_prefill_tokens, 64)), max_prefill_tokens} if cuda else {1}
    capped = sorted({min(tokens, max_num_seqs * max_model_len) for tokens in sizes})
    return [split_tokens(tokens, max_model_len) for tokens in capped]


def split_tokens(tokens: int, max_len: int) -> list[int]:
    full, rest = divmod(tokens, max_len)
    return [max_len] * full + ([rest] if rest else [])


@dataclass
class HostStep:
    """A step's inputs as plain lists, decode rows first (one token each), then prefill chunks."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    decode_rows: list[int] = field(default_factory=list)  # rows of the device block tables
    decode_seq_lens: list[int] = field(default_factory=list)
    decode_width: int = 0  # block-table columns the decode rows need
    prefill_rows: list[int] = field(default_factory=list)
    prefill_cu_seqlens: list[int] = field(default_factory=lambda: [0])
    prefill_seq_lens: list[int] = field(default_factory=list)
    prefill_width: int = 0
    logit_rows: list[int] = field(default_factory=list)
    update_index: list[int] = field(default_factory=list)  # block-table entries to write (flat index, block)
    update_value: list[int] = field(default_factory=list)
    lora_slots: list[int] = field(default_factory=list)  # per row when a row has an adapter: its slot, -1 for base
    lora_windows: LoraWindows | None = None  # the decode rows' windows (lora/windows.py), when laid out so
    rope_chunks: list[RopeChunk] = field(default_factory=list)  # rotary rows the step computes (layers/rotary.py)


@dataclass
class PreparedStep:
    """Where one step's inputs lie in the staging buffer, and the sizes the launch needs from the host."""

    num_tokens: int  # packed rows run through the model (a decode bucket's padding included)
    input_ids: slice
    positions: slice
    slots: slice
    num_decode: int
    decode_rows: slice  # rows of the device block tables
    decode_seq_lens: slice
    decode_width: int  # block-table columns the decode rows need
    prefill_rows: slice
    prefill_cu_seqlens: slice
    prefill_seq_lens: slice
    prefill_width: int
    max_query_len: int
    logit_rows: slice  # packed row of each sampling sequence's last token (and drafts), in scheduled order
    num_logit_rows: int
    update_index: slice
    update_value: slice
    bucket: int | None = None  # the decode graph this step replays
    width: int = 1  # tokens per row of that graph: 1 + drafts for a verification graph
    lora_rows: slice | None = None  # the adapter rows sorted by slot (ops.lora_groups); None when there are none
    lora_segments: list[Segment] = field(default_factory=list)  # (slot, start, end) into lora_rows
    lora_seg_starts: slice | None = None  # the segments staged for the kernels: starts (end appended), slots
    lora_seg_slots: slice | None = None
    lora_row_slots: slice | None = None  # a LoRA decode graph's step: each padded row's slot (-1: none)
    lora_windows: LoraWindows | None = None  # the torch form's eager steps: the decode rows' windows
    rope_chunks: list[RopeChunk] = field(default_factory=list)  # rotary rows to write before the forward pass


class ModelRunner:
    """The model, its KV cache and block tables: stages a step's inputs and runs its forward pass."""

    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        max_num_seqs: int,
        max_model_len: int,
        staging: StagingBuffer,
        graphs: DecodeGraphs,
        lora_stacks: LoraStacks | None = None,
    ) -> None:
        self.model = model
        self.lora_stacks = lora_stacks
        self.backend = backend
        self.block_size = block_size
        self.device = device
        c = model.config
        shape = (num_blocks, block_size, c.num_key_value_heads, c.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(c.num_hidden_layers)
        ]
        self.block_tables = DeviceBlockTables(max_num_seqs, -(-max_model_len // block_size), device)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        # longrope / dynamic NTK: positions are staged as the rotary's rows, which depend on the prompt's length
        self.rope = length_dependent_rotary(model.rotaries())
        self.staging = staging
        self.graphs = graphs
        # the torch form lays eager decode rows out by adapter; its CPU kernel runs fp32 (built once per machine)
        self.windowed_decode = lora_stacks is not None and backend.name != "triton"
        self.cpu_lora = load_cpu_lora() if self.windowed_decode and device.type == "cpu" and dtype == torch.float32 \
            else None

    def release(self, request_id: str) -> None:
        self.block_tables.release(request_id)

    def prepare(self, batch: list[ScheduledSequence], prefill_only: bool = False) -> PreparedStep:
        """Stage the step's inputs (decode rows first) in the buffer the caller began and uploads after.
        `prefill_only`: every sequence a prefill chunk in batch order, one-token ones too (embeddings)."""
        verify = None if prefill_only else self._verify_shape(batch)
        if verify is not None:
            return self._prepare_verify(batch, *verify)
        bs = self.block_size
        tables = self.block_tables
        host = HostStep()
        last_row: dict[int, int] = {}  # id(scheduled) -> its last packed row
        decode = [s for s in batch if s.num_new_tokens == 1 and not prefill_only]
        graphable = len(decode) == len(batch)  # with adapter rows: the bucket's LoRA graph
        bucket = self.graphs.bucket_for(len(decode)) if graphable else None
        if self.windowed_decode and bucket is None and decode:
            decode = self._windowed(decode, host)
        rope = self.rope
        for s in decode:
            seq = s.seq
            pos = seq.num_computed_tokens
            last_row[id(s)] = len(host.input_ids)
            host.input_ids.append(seq.token_ids[pos])
            host.positions.append(pos if rope is None else rope.rows(pos, pos + 1, seq.num_prompt_tokens,
                                                                     seq.num_tokens, host.rope_chunks)[0])
            host.slots.append(seq.block_table[pos // bs] * bs + pos % bs)
            host.decode_rows.append(tables.row(seq))
            host.decode_seq_lens.append(pos + 1)
            host.decode_width = max(host.decode_width, pos // bs + 1)
            if self.lora_stacks is not None:
                host.lora_slots.append(seq.lora_slot)
        for s in batch:
            if s.num_new_tokens == 1 and not prefill_only:
                continue
            seq, start = s.seq, s.seq.num_computed_tokens
            end = start + s.num_new_tokens
            table = seq.block_table
            host.input_ids.extend(seq.token_ids[start : end - len(s.draft)])
            host.input_ids.extend(s.draft)  # a verification step: the drafts after the last token
            host.positions.extend(range(start, end) if rope is None else
                                  rope.rows(start, end, seq.num_prompt_tokens, seq.num_tokens,
                                            host.rope_chunks))
            host.slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            last_row[id(s)] = len(host.input_ids) - 1
            host.prefill_rows.append(tables.row(seq))
            host.prefill_cu_seqlens.append(host.prefill_cu_seqlens[-1] + s.num_new_tokens)
            host.prefill_seq_lens.append(end)
            host.prefill_width = max(host.prefill_width, -(-end // bs))
            if self.lora_stacks is not None:
                host.lora_slots.extend([seq.lora_slot] * s.num_new_tokens)
        # A speculating sequence's logits at its last token and at each draft (spec/verify.py), in that order.
        host.logit_rows = [row for s in batch if s.samples
                           for row in range(last_row[id(s)] - len(s.draft), last_row[id(s)] + 1)]
        host.update_index, host.update_value = tables.take_updates()
        if not any(slot >= 0 for slot in host.lora_slots):
            host.lora_slots.clear()  # a base-only step stages no LoRA rows and may replay a graph
        return self._stage(host, bucket)

    def _verify_shape(self, batch: list[ScheduledSequence]) -> tuple[int, int] | None:
        """The verification graph's (bucket, width) of a step whose rows are all one token plus drafts (at least one
        row drafting); None when it has a prefill chunk, a length-dependent rotary, or no graph fits it."""
        if self.rope is not None or not any(s.draft for s in batch) \
                or any(s.num_new_tokens != 1 + len(s.draft) for s in batch):
            return None
        shape = self.graphs.verify_shape_for(len(batch), max(s.num_new_tokens for s in batch))
        if shape is None or any(s.seq.num_computed_tokens + shape[1] > self.max_model_len for s in batch):
            return None  # a padded row's positions must stay inside the rotary table and its block-table row
        return shape

    def _prepare_verify(self, batch: list[ScheduledSequence], bucket: int, width: int) -> PreparedStep:
        """A verification step padded to `bucket` rows of `width` tokens each, as prefill rows of one query length:
        a row's padding tokens follow its drafts (id 0, writing nothing; no real token attends to them) and padding
        rows sit on the zero table row."""
        bs, tables = self.block_size, self.block_tables
        host = HostStep(prefill_width=tables.width)
        for i, s in enumerate(batch):
            seq, start, real = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
            host.input_ids += [seq.token_ids[start], *s.draft] + [0] * (width - real)
            host.positions += range(start, start + width)
            host.slots += [seq.block_table[p // bs] * bs + p % bs for p in range(start, start + real)]
            host.slots += [-1] * (width - real)
            host.prefill_rows.append(tables.row(seq))
            host.prefill_seq_lens.append(start + width)
            host.logit_rows += range(i * width, i * width + real)
            if self.lora_stacks is not None:
                host.lora_slots += [seq.lora_slot] * width
        self._pad_verify(host, bucket - len(batch), width, lora=self.lora_stacks is not None)
        host.update_index, host.update_value = tables.take_updates()
        if not any(slot >= 0 for slot in host.lora_slots):
            host.lora_slots.clear()
        return self._stage(host, bucket, width)

    def _pad_verify(self, host: HostStep, rows: int, width: int, lora: bool) -> None:
        """`rows` padding rows of `width` tokens (on the zero table row, writing nothing, of no adapter), and the
        query offsets."""
        host.input_ids += [0] * (rows * width)
        host.positions += list(range(width)) * rows
        host.slots += [-1] * (rows * width)
        host.prefill_rows += [self.block_tables.padding_row] * rows
        host.prefill_seq_lens += [width] * rows
        if lora:
            host.lora_slots += [-1] * (rows * width)
        host.prefill_cu_seqlens = list(range(0, len(host.input_ids) + 1, width))

    def _windowed(self, decode: list[ScheduledSequence], host: HostStep) -> list[ScheduledSequence]:
        """The decode rows in lora/windows.py's order, their windows kept in `host` (as they are when none fit)."""
        plan = plan_windows([s.seq.lora_slot for s in decode], packed=self.cpu_lora is not None)
        if plan is None:
            return decode
        order, host.lora_windows = plan
        return [decode[i] for i in order]

    def _stage(self, host: HostStep, bucket: int | None, query_width: int = 1) -> PreparedStep:
        """Decode sections are padded to `bucket`: padding rows write nothing and attend to the zero table row. A
        verification step (`query_width` > 1) comes padded already."""
        st, tables = self.staging, self.block_tables
        for name, width in (("decode", host.decode_width), ("prefill", host.prefill_width)):
            if width > tables.width:  # the table slice would silently give fewer columns than the kernels read
                raise RuntimeError(f"a step's {name} rows need {width} block-table columns; a row has {tables.width} "
                                 f"(max_model_len {self.max_model_len} / block_size {self.block_size})")
        pad = (bucket or 0) if query_width == 1 else 0
        cu = host.prefill_cu_seqlens
        # a LoRA graph's row slots go first: the same offsets for each step of its bucket
        row_slots = st.put(host.lora_slots, pad, fill=-1) if host.lora_slots and bucket is not None else None
        step = PreparedStep(
            num_tokens=max(len(host.input_ids), pad),
            input_ids=st.put(host.input_ids, pad),
            positions=st.put(host.positions, pad),
            slots=st.put(host.slots, pad, fill=-1),
            num_decode=max(len(host.decode_rows), pad),
            decode_rows=st.put(host.decode_rows, pad, fill=tables.padding_row),
            decode_seq_lens=st.put(host.decode_seq_lens, pad, fill=1),
            decode_width=tables.width if pad else host.decode_width,
            prefill_rows=st.put(host.prefill_rows),
            prefill_cu_seqlens=st.put(cu),
            prefill_seq_lens=st.put(host.prefill_seq_lens),
            prefill_width=host.prefill_width,
            max_query_len=max((b - a for a, b in pairwise(cu)), default=0),
            logit_rows=st.put(host.logit_rows),
            num_logit_rows=len(host.logit_rows),
            update_index=st.put(host.update_index),
            update_value=st.put(host.update_value),
            bucket=bucket,
            width=query_width,
        )
        step.lora_row_slots = row_slots
        step.lora_windows = host.lora_windows
        step.rope_chunks = host.rope_chunks
        grouped = host.lora_slots
        if host.lora_windows is not None:  # the windows take the decode rows: the prefill rows left to group
            grouped = [-1] * len(host.decode_rows) + host.lora_slots[len(host.decode_rows) :]
        if bucket is None and any(slot >= 0 for slot in grouped):
            rows, step.lora_segments = lora_groups(grouped)
            step.lora_rows = st.put(rows)
            starts, slots = segment_arrays(step.lora_segments)
            step.lora_seg_starts, step.lora_seg_slots = st.put(starts), st.put(slots)
        return step

    def metadata(self, step: PreparedStep) -> AttentionMetadata:
        """The kernels' view of a staged step (device ops only)."""
        st, table = self.staging, self.block_tables.tensor
        return AttentionMetadata(
            slot_mapping=st.ints(step.slots),
            num_decode_tokens=step.num_decode,
            decode_block_tables=table.index_select(0, st.ints(step.decode_rows))[:, : step.decode_width],
            decode_seq_lens=st.ints(step.decode_seq_lens),
            prefill_block_tables=table.index_select(0, st.ints(step.prefill_rows))[:, : step.prefill_width],
            prefill_cu_seqlens_q=st.ints(step.prefill_cu_seqlens),
            prefill_seq_lens=st.ints(step.prefill_seq_lens),
            prefill_max_query_len=step.max_query_len,
        )

    def forward(self, step: PreparedStep) -> torch.Tensor:
        """Hidden states of the staged step's packed rows (what a decode graph captures)."""
        st = self.staging
        lora = None
        kernels = self.backend.ops if self.backend.name == "triton" else None
        if step.lora_rows is not None and step.lora_seg_starts is not None and step.lora_seg_slots is not None:
            assert self.lora_stacks is not None
            groups = LoraGroups(st.ints(step.lora_rows), step.lora_segments, st.ints(step.lora_seg_starts),
                                st.ints(step.lora_seg_slots))
            lora = LoraBatch(groups, self.lora_stacks, kernels=kernels, windows=step.lora_windows, native=self.cpu_lora)
        elif step.lora_windows is not None:
            assert self.lora_stacks is not None
            lora = LoraBatch(None, self.lora_stacks, windows=step.lora_windows, native=self.cpu_lora)
        elif step.lora_row_slots is not None:
            assert self.lora_stacks is not None
            lora = LoraBatch(None, self.lora_stacks, st.ints(step.lora_row_slots), kernels)
        hidden: torch.Tensor = self.model(st.ints(step.input_ids), st.ints(step.positions), self.kv_caches,
                                          self.metadata(step), lora)
        return hidden

    @torch.inference_mode()
    def execute(self, step: PreparedStep) -> torch.Tensor:
        """fp32 logits, a row per sampling sequence (and per verified draft), scheduled order. Needs the upload."""
        st = self.staging
        self.block_tables.apply(st.ints(step.update_index), st.ints(step.update_value))
        if step.rope_chunks:
            assert self.rope is not None
            self.rope.fill(step.rope_chunks)
        if step.bucket is not None:
            hidden = self.graphs.run(step.bucket, lambda: self.forward(step), lora=step.lora_row_slots is not None,
                                     width=step.width)
        else:
            hidden = self.forward(step)
        if step.num_logit_rows == 0:
            return torch.empty(0, self.model.config.vocab_size, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, st.ints(step.logit_rows)))

    @torch.inference_mode()
    def hidden_states(self, step: PreparedStep) -> torch.Tensor:
        """The final hidden states of a staged prefill-only step's packed rows (embeddings: eager, no logits)."""
        self.block_tables.apply(self.staging.ints(step.update_index), self.staging.ints(step.update_value))
        if step.rope_chunks:
            assert self.rope is not None
            self.rope.fill(step.rope_chunks)
        return self.forward(step)[: step.num_tokens]

    @torch.inference_mode()
    def warm_up(self, max_prefill_tokens: int) -> float:
        """Launch every kernel variant and step shape, capturing the graphs, so nothing compiles later; seconds."""
        t0 = time.perf_counter()
        if self.rope is not None:  # a step's prompt tokens, at most max_prefill_tokens or one whole prompt
            self.rope.reserve(max(max_prefill_tokens, self.max_model_len))
        if self.backend.name == "triton":  # every kernel variant, each decode split count included
            lora_rank = self.lora_stacks.max_rank if self.lora_stacks is not None else None
            warm_up_kernels(self.backend.ops, kernel_shape(self.model, self.block_size, self.block_tables.width,
                                                           self.kv_caches[0][0].dtype, self.device, lora_rank))
        for prefill in warm_up_prefills(max_prefill_tokens, self.max_model_len, self.max_num_seqs,
                                        self.device.type == "cuda"):
            self.execute(self._dummy_step(num_decode=0, prefill=prefill))
        self.execute(self._dummy_step(num_decode=1, prefill=split_tokens(2, self.max_model_len)))
        for bucket in sorted(self.graphs.buckets, reverse=True):  # largest first: later graphs reuse its pool
            step = self._dummy_step(num_decode=0, prefill=[], bucket=bucket)  # all padding rows
            self.graphs.capture(bucket, partial(self.forward, step))
            if self.lora_stacks is not None:  # the bucket's LoRA graph: padding rows of no adapter (slot -1)
                step = self._dummy_step(num_decode=0, prefill=[], bucket=bucket, lora=True)
                self.graphs.capture(bucket, partial(self.forward, step), lora=True)
        for bucket, width in self.graphs.verify_shapes():
            for lora in (False, True) if self.lora_stacks is not None else (False,):
                step = self._dummy_verify_step(bucket, width, lora)
                self.graphs.capture(bucket, partial(self.forward, step), lora=lora, width=width)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def _dummy_step(self, num_decode: int, prefill: list[int], bucket: int | None = None,
                    lora: bool = False) -> PreparedStep:
        """A staged, uploaded step whose sequences all use the zero padding row and write nothing."""
        pad_row = self.block_tables.padding_row
        tokens = num_decode + sum(prefill)
        host = HostStep(
            input_ids=[0] * tokens, positions=[0] * tokens, slots=[-1] * tokens,
            decode_rows=[pad_row] * num_decode, decode_seq_lens=[1] * num_decode, decode_width=min(num_decode, 1),
            prefill_rows=[pad_row] * len(prefill), prefill_cu_seqlens=[0, *accumulate(prefill)],
            prefill_seq_lens=list(prefill), prefill_width=-(-max(prefill, default=0) // self.block_size),
            logit_rows=[tokens - 1] if tokens else [],
            lora_slots=[-1] * max(tokens, bucket or 0) if lora else [],
        )
        self.staging.begin()
        step = self._stage(host, bucket)
        self.staging.upload()
        return step

    def _dummy_verify_step(self, bucket: int, width: int, lora: bool) -> PreparedStep:
        """A staged, uploaded verification step of padding rows only, laid out as `_prepare_verify` lays one."""
        host = HostStep(prefill_width=self.block_tables.width)
        self._pad_verify(host, bucket, width, lora)
        host.logit_rows = [0]
        self.staging.begin()
        step = self._stage(host, bucket, width)
        self.staging.upload()
        return step
