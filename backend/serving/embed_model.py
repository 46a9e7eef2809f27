"""The `tritium_embed` Triton model (docs/serving.md#the-tritium_embed-model): one response per request, an
`embedding` vector pooled from the engine's final hidden states.

Triton's execute thread parses each request and queues it (refusing at once, UNAVAILABLE, past
`max_pending_requests`); one embedding thread takes every queued request, tokenizes and checks each on its own, runs
the valid ones together through `LLMEngine.embed` and answers each with one final response. The model is not
decoupled: execute returns None and each request's one response goes through its response sender."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from tritium.backend.engine import LLMEngine
from tritium.backend.serving.device_selection import select_device
from tritium.backend.serving.jobs import ErrorKind
from tritium.backend.serving.request import decode_text
from tritium.backend.serving.settings import load_settings
from tritium.backend.serving.triton_sink import read_inputs, triton_error

logger = logging.getLogger(__name__)
INPUTS = ("text_input", "input_ids")


@dataclass
class EmbedJob:
    request_id: str
    text: str | None
    ids: list[int] | None
    reply: Callable[[npt.NDArray[np.float32] | None, int, str | None, ErrorKind], None]  # vector, tokens, error


def parse_embed_inputs(inputs: dict[str, npt.NDArray[Any] | None]) -> tuple[str | None, list[int] | None]:
    """(text, None) or (None, token ids): exactly one of text_input and input_ids. Raises ValueError naming it."""
    text, ids = inputs.get("text_input"), inputs.get("input_ids")
    if (text is None) == (ids is None):
        raise ValueError("give exactly one of text_input and input_ids")
    if text is not None:
        if text.size != 1:
            raise ValueError(f"text_input must hold one text, got {text.size}")
        value = decode_text("text_input", text.reshape(-1)[0])
        if not value:
            raise ValueError("text_input must not be empty")
        return value, None
    assert ids is not None
    if ids.size == 0:
        raise ValueError("input_ids must not be empty")
    return None, [int(t) for t in ids.reshape(-1)]


class EmbedQueue:
    """Bounded pending jobs and the thread that embeds them (no job can fail another)."""

    def __init__(self, engine: LLMEngine, max_pending: int) -> None:
        self.engine = engine
        self.max_pending = max_pending
        self._jobs: list[EmbedJob] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="tritium-embed", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: EmbedJob) -> None:
        with self._cond:
            refusal: tuple[str, ErrorKind] | None = None
            if self._stopping:
                refusal = ("unavailable: the model is shutting down", ErrorKind.UNAVAILABLE)
            elif len(self._jobs) >= self.max_pending:
                refusal = (f"overloaded: {len(self._jobs)} requests are waiting (max_pending_requests "
                           f"{self.max_pending}); retry later", ErrorKind.OVERLOADED)
            else:
                self._jobs.append(job)
                self._cond.notify()
        if refusal is not None:
            job.reply(None, 0, f"{refusal[0]} (request id {job.request_id})", refusal[1])

    def stop(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._stopping:
                    self._cond.wait()
                jobs, self._jobs = self._jobs, []
                if not jobs and self._stopping:
                    return
            self.run_batch(jobs)

    def run_batch(self, jobs: list[EmbedJob]) -> None:
        """Tokenize and check each job alone, embed the valid ones together (each alone if that fails), reply."""
        valid: list[tuple[EmbedJob, list[int]]] = []
        for job in jobs:
            try:
                ids = job.ids if job.ids is not None else self.engine.tokenizer.encode(job.text or "")
                self.engine.check_embedding_input(ids, "text_input" if job.ids is None else "input_ids")
                valid.append((job, ids))
            except ValueError as exc:
                job.reply(None, 0, f"invalid request: {exc} (request id {job.request_id})", ErrorKind.INVALID)
            except Exception:
                logger.exception("preparing embedding request %s failed", job.request_id)
                job.reply(None, 0, f"internal error (request id {job.request_id})", ErrorKind.INTERNAL)
        try:
            vectors = self.engine.embed([ids for _, ids in valid]).numpy() if valid else None
        except Exception:
            logger.exception("embedding %d requests together failed; running each alone", len(valid))
            vectors = None
            for job, ids in valid:
                self._alone(job, ids)
        if vectors is not None:
            for (job, ids), vector in zip(valid, vectors, strict=True):
                job.reply(vector, len(ids), None, ErrorKind.INTERNAL)

    def _alone(self, job: EmbedJob, ids: list[int]) -> None:
        try:
            vector = self.engine.embed([ids]).numpy()[0]
        except Exception:
            logger.exception("embedding request %s failed", job.request_id)
            job.reply(None, 0, f"the embedding forward pass failed (request id {job.request_id})", ErrorKind.INTERNAL)
        else:
            job.reply(vector, len(ids), None, ErrorKind.INTERNAL)


class TritonPythonModel:
    """Triton's entry points for `tritium_embed`."""

    def initialize(self, args: dict[str, Any]) -> None:
        import triton_python_backend_utils as pb_utils  # only inside Triton's python backend stub

        self.pb = pb_utils
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        model_config = json.loads(args["model_config"])
        if pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise ValueError(f"the {args['model_name']} model answers once per request: it must not be decoupled")
        settings = load_settings(Path(args["model_repository"]) / args["model_version"])
        config = dataclasses.replace(settings.engine, device=select_device(
            args, settings.engine.device, settings.engine.tensor_parallel_size))
        self.engine = LLMEngine(config)
        pooling = self.engine.pooling  # a pooling mode it cannot run is refused at load
        self.queue = EmbedQueue(self.engine, settings.max_pending_requests)
        self.queue.start()
        self._ids = count()
        print(f"tritium {args['model_name']} version {args['model_version']} ready on {self.engine.device} "
              f"(pooling {pooling.pooling}, normalize {pooling.normalize}, from {pooling.source})", flush=True)

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            request_id = f"emb-{next(self._ids)}"
            reply = self._replier(request.get_response_sender(), request_id)
            try:
                text, ids = parse_embed_inputs(read_inputs(self.pb, request, INPUTS))
            except ValueError as exc:
                reply(None, 0, f"invalid request: {exc} (request id {request_id})", ErrorKind.INVALID)
                continue
            except Exception:
                logger.exception("parsing request %s failed", request_id)
                reply(None, 0, f"invalid request: the request could not be parsed (request id {request_id})",
                      ErrorKind.INVALID)
                continue
            self.queue.submit(EmbedJob(request_id, text, ids, reply))
        return None

    def _replier(self, sender: Any, request_id: str) -> Callable[..., None]:
        pb = self.pb

        def reply(vector: npt.NDArray[np.float32] | None, tokens: int, error: str | None, kind: ErrorKind) -> None:
            if error is not None or vector is None:
                response = pb.InferenceResponse(error=triton_error(pb, error or "no embedding", kind))
            else:
                response = pb.InferenceResponse(output_tensors=[
                    pb.Tensor("embedding", np.ascontiguousarray(vector, dtype=np.float32)),
                    pb.Tensor("num_input_tokens", np.array([tokens], dtype=np.int32))])
            try:
                sender.send(response, flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception as exc:  # the client is gone
                logger.warning("could not send the response of %s: %s", request_id, exc)

        return reply

    def finalize(self) -> None:
        self.queue.stop()
        self.engine.shutdown()
