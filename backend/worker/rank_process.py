"""A tensor-parallel rank other than 0, in a process of its own (worker/ranks.py starts it): builds its shard as rank 0
builds its own (the same runner, KV cache and warm-up, so their collectives pair up), then runs each step rank 0
sends. It samples nothing; its logits go to rank 0. Errors are logged with the rank named and sent to rank 0."""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing.connection
import os
import threading
import time
from pathlib import Path

import numpy as np
import numpy.typing as npt
from torch._C._distributed_c10d import TCPStore

from tritium.backend.config import EngineConfig
from tritium.backend.layers.attention import get_attention_backend
from tritium.backend.models.loader import load_model
from tritium.backend.worker.decode_graphs import engine_graphs, graph_buckets, use_decode_graphs
from tritium.backend.worker.device import use_device
from tritium.backend.worker.kv_sizing import num_kv_blocks
from tritium.backend.worker.model_runner import ModelRunner, PreparedStep, logit_rows, staging_capacity
from tritium.backend.worker.ranks import START_TIMEOUT_S, make_group, rank_device
from tritium.backend.worker.staging import StagingBuffer
from tritium.backend.worker.threads import set_up_threads

logger = logging.getLogger("tritium.rank")
PARENT_POLL_S = 1.0


def run_rank(config: EngineConfig, model_path: Path, rank: int, store_port: int, parent_pid: int,
             pipe: multiprocessing.connection.Connection) -> None:
    """The process's whole life: build, answer "ready" (or the error), run steps until told to stop or rank 0's
    process is gone."""
    logging.basicConfig(level=logging.INFO, format=f"tritium rank {rank}: %(levelname)s %(name)s: %(message)s")
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), name="tritium-parent", daemon=True).start()
    try:
        runner = _build(config, model_path, rank, store_port)
    except BaseException as exc:
        logger.exception("tensor-parallel rank %d failed to start", rank)
        _tell(pipe, f"rank {rank} failed to start: {type(exc).__name__}: {exc}")
        return
    pipe.send(("ready", None))
    while True:
        try:
            message = pipe.recv()
        except (EOFError, OSError):  # rank 0's end closed
            return
        if message is None:
            return
        step, staged = message
        try:
            _execute(runner, step, staged)
        except BaseException as exc:
            logger.exception("tensor-parallel rank %d: a step failed", rank)
            _tell(pipe, f"rank {rank}: a step failed: {type(exc).__name__}: {exc}")
            return


def _build(config: EngineConfig, model_path: Path, rank: int, store_port: int) -> ModelRunner:
    device = rank_device(config, rank)
    use_device(device)
    set_up_threads(config.num_threads, device.type, config.tensor_parallel_size, rank)
    timeout = datetime.timedelta(seconds=START_TIMEOUT_S)
    store = TCPStore("127.0.0.1", store_port, config.tensor_parallel_size, False, timeout=timeout)
    group = make_group(store, rank, config.tensor_parallel_size, device)
    dtype = config.torch_dtype(device)
    backend = get_attention_backend(config.attention_backend, device).on_ranks(group)
    model = load_model(model_path, dtype, device, config.max_model_len, config.quantization, backend=backend)
    max_model_len = config.max_model_len or model.config.max_position_embeddings
    buckets = graph_buckets(config.max_num_seqs) if use_decode_graphs(device.type, backend.name,
                                                                      config.enforce_eager)[0] else []
    graphs = engine_graphs(config, buckets, device)
    sizing = num_kv_blocks(config, model, device, dtype, max_model_len, graphs.largest_tokens,
                           logit_rows=logit_rows(config))
    num_blocks = group.min_int(sizing.num_blocks)  # rank 0 also holds the draft model and adapters
    staging = StagingBuffer(staging_capacity(config, max_model_len), device)
    runner = ModelRunner(model, backend, num_blocks, config.block_size, dtype, device, config.max_num_seqs,
                         max_model_len, staging, graphs)
    runner.warm_up(config.max_num_batched_tokens)
    return runner


def _execute(runner: ModelRunner, step: PreparedStep, staged: npt.NDArray[np.int32]) -> None:
    staging = runner.staging
    staging.begin()
    staging.put(staged)
    staging.upload()
    runner.execute(step)


def _tell(pipe: multiprocessing.connection.Connection, text: str) -> None:
    with contextlib.suppress(OSError):
        pipe.send(("error", text))


def _exit_with_parent(parent_pid: int) -> None:
    """Rank 0's process gone (killed: no stop message, and this rank may wait in a collective): exit at once."""
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent_pid:
            logger.error("rank 0's process %d is gone; exiting", parent_pid)
            os._exit(1)

