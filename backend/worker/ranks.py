"""Tensor parallelism's processes, seen from rank 0 (docs/architecture.md, "Tensor parallelism"): ranks 1..N-1 are
spawned with the engine, each builds its shard (rank_process.py), and every step rank 0 sends them the staged inputs
over a pipe; the layers' collectives run on a process group made for this one model (gloo on a CPU, NCCL on CUDA).
A rank that exits fails the engine at its next step (its collectives fail at once); one that hangs, when a
collective times out; none outlives the engine: stopped with it, and each rank exits when rank 0's process is gone."""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
import weakref
from pathlib import Path
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store, TCPStore

from tritium.backend.config import EngineConfig
from tritium.backend.layers.parallel import Collectives, RankGroup

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0  # a rank's start: loading its shard, warming up (compiling kernels on CUDA)
STEP_TIMEOUT_S = 10.0  # a step's collective on a CPU waits this long for a rank (they arrive together unless one hangs)
NCCL_TIMEOUT_S = 600.0  # on CUDA the first steps may wait for another rank's kernel compiles
STOP_WAIT_S = 5.0


class RanksFailed(RuntimeError):
    """A tensor-parallel rank exited, failed or did not answer: the engine cannot step again."""


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank `rank`'s device: the CPU, or the `rank`-th CUDA device after the one `config.device` names."""
    device = config.torch_device()
    if device.type != "cuda":
        return device
    first = device.index or 0
    if first + config.tensor_parallel_size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size {config.tensor_parallel_size} from {device} needs "
                         f"{first + config.tensor_parallel_size} CUDA devices; {torch.cuda.device_count()} are "
                         "visible (CUDA_VISIBLE_DEVICES)")
    return torch.device("cuda", first + rank)


def make_group(store: Store, rank: int, size: int, device: torch.device) -> RankGroup:
    """This rank's member of the model's process group (blocks until every rank joined)."""
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = datetime.timedelta(seconds=NCCL_TIMEOUT_S)
        group: object = dist.ProcessGroupNCCL(store, rank, size, options)
    else:
        gloo = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # the options with devices
        gloo._timeout = datetime.timedelta(seconds=START_TIMEOUT_S)  # the start's collectives; steps': STEP_TIMEOUT_S
        gloo._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]  # ranks share one host
        group = dist.ProcessGroupGloo(store, rank, size, gloo)
    # the stubs omit the collectives; timed on a CPU, where timing costs no device synchronization
    cpu = device.type != "cuda"
    return RankGroup(rank, size, cast(Collectives, group), STEP_TIMEOUT_S if cpu else None, device, timed=cpu)


def _python_executable() -> str:
    """The interpreter spawned ranks run: this one, or beside the prefix inside Triton's stub (not a python)."""
    exe = sys.executable
    if exe and Path(exe).name.startswith("python"):
        return exe
    for name in (f"python{sys.version_info.major}.{sys.version_info.minor}", "python3", "python"):
        candidate = Path(sys.prefix) / "bin" / name
        if candidate.is_file():
            return str(candidate)
    return exe


class RankProcesses:
    """Ranks 1..N-1 of one engine. Raises RanksFailed when one cannot start (its error in the message)."""

    def __init__(self, config: EngineConfig, model_path: Path, device: torch.device) -> None:
        from tritium.backend.worker.rank_process import run_rank

        size = config.tensor_parallel_size
        timeout = datetime.timedelta(seconds=START_TIMEOUT_S)
        store = TCPStore("127.0.0.1", 0, size, True, timeout=timeout, wait_for_workers=False)
        context = multiprocessing.get_context("spawn")
        if (python := _python_executable()) != sys.executable:  # inside Triton's stub
            context.set_executable(python)
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self.pipes: list[multiprocessing.connection.Connection] = []
        self.lost: str | None = None  # why the ranks cannot step any more
        for rank in range(1, size):
            ours, theirs = context.Pipe()
            process = context.Process(target=run_rank, name=f"tritium-rank-{rank}", daemon=True,
                                      args=(config, model_path, rank, store.port, os.getpid(), theirs))
            process.start()
            theirs.close()
            self.processes.append(process)
            self.pipes.append(ours)
        self._finalizer = weakref.finalize(self, _stop, self.processes, self.pipes)
        self.group = self._join(store, size, device)
        self._stopping = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="tritium-ranks", daemon=True)
        self._monitor.start()

    def _join(self, store: Store, size: int, device: torch.device) -> RankGroup:
        """Rank 0's member of the group, made on a thread so that a rank exiting meanwhile fails the start at once."""
        made: list[RankGroup | BaseException] = []
        thread = threading.Thread(target=lambda: made.append(_call(make_group, store, 0, size, device)), daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            if thread.is_alive() and (gone := self._exited()) is not None:
                self.stop()
                raise RanksFailed(f"tensor-parallel start failed: {gone}")
        result = made[0]
        if isinstance(result, BaseException):
            self.stop()
            raise RanksFailed(f"tensor-parallel start failed: {result}") from result
        return result

    def wait_ready(self) -> None:
        """Once rank 0 warmed up: every rank's "ready", or RanksFailed naming the rank and its error."""
        for rank, pipe in enumerate(self.pipes, start=1):
            try:
                kind, text = pipe.recv() if pipe.poll(START_TIMEOUT_S) else ("error", "no answer")
            except EOFError:
                kind, text = "error", self._describe(rank)
            if kind != "ready":
                self._monitor.join(0.5)
                self.stop()
                raise RanksFailed(self.lost or f"tensor-parallel rank {rank} failed to start: {text}")

    def send(self, step: Any, staged: npt.NDArray[np.int32]) -> None:
        """A step's staged inputs to every rank. Raises RanksFailed when one is gone."""
        if self.lost is not None:
            raise RanksFailed(self.lost)
        for rank, pipe in enumerate(self.pipes, start=1):
            try:
                pipe.send((step, staged))
            except OSError as exc:
                raise RanksFailed(f"tensor-parallel rank {rank} is gone: {self._describe(rank)}") from exc

    def failure(self, exc: BaseException) -> RanksFailed:
        """What failed while the ranks ran a step: a rank's own error when one sent it."""
        self._monitor.join(0.5)  # a rank that exited: its error read by the monitor
        return RanksFailed(self.lost or f"a tensor-parallel step failed on rank 0: {type(exc).__name__}: {exc}")

    def stop(self) -> None:
        """End every rank (asked, then terminated); idempotent."""
        if hasattr(self, "_stopping"):
            self._stopping.set()
        self._finalizer()

    def _watch(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.processes, start=1)}
        while not self._stopping.is_set():
            ready = multiprocessing.connection.wait(list(sentinels), timeout=0.5)
            if ready and not self._stopping.is_set():
                rank = sentinels[ready[0]]  # type: ignore[index]
                self.lost = f"tensor-parallel rank {rank} exited: {self._describe(rank)}"
                logger.error("%s; the engine fails at its next step", self.lost)
                return

    def _exited(self) -> str | None:
        for rank, process in enumerate(self.processes, start=1):
            if not process.is_alive():
                return f"rank {rank}: {self._describe(rank)}"
        return None

    def _describe(self, rank: int) -> str:
        """The error rank `rank` sent, else how its process ended."""
        pipe, process = self.pipes[rank - 1], self.processes[rank - 1]
        try:
            while pipe.poll():
                kind, text = pipe.recv()
                if kind == "error":
                    return str(text)
        except (EOFError, OSError):
            pass
        process.join(0.5)
        code = process.exitcode
        return f"process {process.pid} " + ("is still running" if code is None else f"ended with exit code {code}")


def _call(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except BaseException as exc:  # handed to the waiting thread
        return exc


def _stop(processes: list[multiprocessing.process.BaseProcess],
          pipes: list[multiprocessing.connection.Connection]) -> None:
    for pipe in pipes:
        with contextlib.suppress(OSError):
            pipe.send(None)
    for process in processes:
        process.join(STOP_WAIT_S)
        if process.is_alive():
            process.terminate()
            process.join(STOP_WAIT_S)
        if process.is_alive():
            process.kill()
            process.join()
    for pipe in pipes:
        pipe.close()
