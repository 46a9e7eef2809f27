"""The front door both engine models share (`tritium`: text, `tritium_ids`: token ids): Triton's
initialize / execute / finalize around one LLMEngine and its EngineLoop.

A subclass says only what differs: the request-id prefix, how a Triton request parses into an
EngineRequest (sampling settings and a prompt as text or token ids), and the sink that turns the engine's
outputs into its responses. `triton_python_backend_utils` exists only inside Triton's python backend stub,
so it is imported in `initialize`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from abc import ABC, abstractmethod
from functools import partial
from itertools import count
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

from tritium.backend.engine import LLMEngine
from tritium.backend.serving.device_selection import select_device
from tritium.backend.serving.engine_loop import EngineLoop
from tritium.backend.serving.jobs import Job
from tritium.backend.serving.metrics import EngineMetrics
from tritium.backend.serving.request import EngineRequest
from tritium.backend.serving.settings import load_settings
from tritium.backend.serving.triton_sink import TritonSink, parse_or_reject

R = TypeVar("R", bound=EngineRequest)


class EngineModel(ABC, Generic[R]):
    """Triton's entry points for a decoupled engine model: execute only parses and submits."""

    request_id_prefix: ClassVar[str] = "req"
    default_timeout_s: ClassVar[float | None] = None  # when model.json sets no request_timeout_s (or 0)

    @abstractmethod
    def parse(self, request: Any) -> R:
        """The request's EngineRequest; raises ValueError naming the field and the rule. Runs on Triton's
        execute thread: no tokenizing here (the loop's tokenizer thread does it)."""

    @abstractmethod
    def make_sink(self, sender: Any, parsed: R) -> TritonSink:
        """The sink that sends this request's responses."""

    def initialize(self, args: dict[str, Any]) -> None:
        import triton_python_backend_utils as pb_utils

        self.pb = pb_utils
        # Tokenize on the (low-priority) calling thread, not on a pool of the tokenizers library's own.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(self.model_config):
            raise ValueError(f"the {args['model_name']} model must use "
                             "model_transaction_policy { decoupled: true }")
        self.input_names = [i["name"] for i in self.model_config.get("input", [])]
        settings = load_settings(Path(args["model_repository"]) / args["model_version"])
        self.timeout_s = settings.request_timeout_s or self.default_timeout_s
        # One instance per GPU of a KIND_GPU instance group: each engine on the GPU Triton gave it.
        config = dataclasses.replace(settings.engine, device=select_device(args, settings.engine.device))
        self.engine = LLMEngine(config, served=True)  # leaves cores to the server's threads on a CPU
        metrics = EngineMetrics(pb_utils, args["model_name"], args["model_version"], self.engine)
        self.loop = EngineLoop(self.engine, metrics, settings.max_pending_requests, settings.stream_interval,
                               settings.max_stream_interval)
        self.loop.start()
        self._ids = count()
        import torch

        threads = f": {self.engine.worker.threads.reason}" if self.engine.worker.threads else ""
        print(f"tritium {args['model_name']} version {args['model_version']} ready on {self.engine.device} "
              f"({torch.get_num_threads()} torch threads{threads})", flush=True)

    def execute(self, requests: list[Any]) -> None:
        """Parse each request on its own (a bad one gets its error, the others go on) and submit it."""
        for request in requests:
            request_id = f"{self.request_id_prefix}-{next(self._ids)}"
            sender = request.get_response_sender()
            job = parse_or_reject(self.pb, sender, request_id, partial(self._job, request_id, request, sender))
            if job is not None:
                self.loop.submit(job)
        return None

    def _job(self, request_id: str, request: Any, sender: Any) -> Job:
        parsed = self.parse(request)
        job = Job(request_id=request_id, params=parsed.params, sink=self.make_sink(sender, parsed),
                  prompt=parsed.prompt, prompt_token_ids=parsed.prompt_token_ids)
        if self.timeout_s is not None:
            job.deadline = job.arrival + self.timeout_s
        return job

    def finalize(self) -> None:
        self.loop.stop()
