"""The front door both engine models share (docs/architecture.md#serving-and-the-openai-endpoint): Triton's
initialize / execute / finalize around one LLMEngine and its EngineLoop."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from abc import ABC, abstractmethod
from functools import partial
from itertools import count
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np

from tritium.backend.engine import LLMEngine
from tritium.backend.outputs import RequestOutput
from tritium.backend.serving.device_selection import select_device
from tritium.backend.serving.engine_loop import EngineLoop
from tritium.backend.serving.jobs import EngineCall, ErrorKind, Job
from tritium.backend.serving.lora_admin import (
    ADMIN_PARAMETER,
    KEY_PARAMETER,
    AdminRefused,
    check_admin_key,
    configured_admin_key,
    parse_admin_action,
    run_admin_action,
)
from tritium.backend.serving.metrics import EngineMetrics
from tritium.backend.serving.request import EngineRequest
from tritium.backend.serving.settings import load_settings
from tritium.backend.serving.triton_sink import TritonSink, parse_or_reject
from tritium.backend.testing.faults import install_from_env as install_faults_from_env

R = TypeVar("R", bound=EngineRequest)
logger = logging.getLogger(__name__)


class ReplySink(TritonSink):
    """Answers a lora_admin request: one final response whose `text_output` holds the reply."""

    def send_output(self, output: RequestOutput) -> None:
        raise NotImplementedError("a lora_admin request has no generated output")

    def send_text(self, text: str) -> None:
        tensor = self.pb.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_))
        self._send(self.pb.InferenceResponse(output_tensors=[tensor]), final=True)


def request_parameters(request: Any) -> dict[str, Any]:
    """A Triton request's parameters (HTTP top-level keys, gRPC parameters) as a dict ({} when none)."""
    raw = request.parameters()
    if not raw:
        return {}
    value = json.loads(raw)
    return value if isinstance(value, dict) else {}


class EngineModel(ABC, Generic[R]):
    """Triton's entry points for a decoupled engine model: execute only parses and submits."""

    request_id_prefix: ClassVar[str] = "req"
    default_timeout_s: ClassVar[float | None] = None  # when model.json sets no request_timeout_s (or 0)

    @abstractmethod
    def parse(self, request: Any) -> R:
        """Raises ValueError naming the field and the rule. Triton's execute thread: no tokenizing here."""

    @abstractmethod
    def make_sink(self, sender: Any, parsed: R) -> TritonSink: ...

    def initialize(self, args: dict[str, Any]) -> None:
        import triton_python_backend_utils as pb_utils  # only inside Triton's python backend stub

        self.pb = pb_utils
        # Tokenize on the (low-priority) calling thread, not on a pool of the tokenizers library's own.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(self.model_config):
            raise ValueError(f"the {args['model_name']} model must use "
                             "model_transaction_policy { decoupled: true }")
        self.input_names = [i["name"] for i in self.model_config.get("input", [])]
        self.version_dir = Path(args["model_repository"]) / args["model_version"]
        settings = load_settings(self.version_dir)
        self.admin_key = configured_admin_key(settings.admin_key, os.environ)
        self.timeout_s = settings.request_timeout_s or self.default_timeout_s
        # One instance per GPU of a KIND_GPU instance group: each engine on the GPU Triton gave it.
        config = dataclasses.replace(settings.engine, device=select_device(
            args, settings.engine.device, settings.engine.tensor_parallel_size))
        self.engine = LLMEngine(config)
        install_faults_from_env(self.engine)
        metrics = EngineMetrics(pb_utils, args["model_name"], args["model_version"], self.engine)
        self.loop = EngineLoop(self.engine, metrics, settings.max_pending_requests, settings.stream_interval,
                               settings.max_stream_interval)
        self.loop.start()
        self._ids = count()
        import torch

        choice = self.engine.worker_info.threads
        threads = f": {choice.reason}" if choice else ""
        print(f"tritium {args['model_name']} version {args['model_version']} ready on {self.engine.device} "
              f"({torch.get_num_threads()} torch threads{threads})", flush=True)

    def execute(self, requests: list[Any]) -> None:
        """Parse each request on its own (a bad one gets its error, the others go on) and submit it."""
        for request in requests:
            request_id = f"{self.request_id_prefix}-{next(self._ids)}"
            sender = request.get_response_sender()
            job = parse_or_reject(self.pb, sender, request_id, partial(self._job, request_id, request, sender))
            if isinstance(job, Job):
                self.loop.submit(job)
            elif isinstance(job, EngineCall):
                self.loop.submit_call(job)
        return None

    def _job(self, request_id: str, request: Any, sender: Any) -> Job | EngineCall | None:
        """None when it was answered already (a refused lora_admin). Raises ValueError naming the field."""
        parameters = request_parameters(request)
        if ADMIN_PARAMETER in parameters:
            return self._admin_call(request_id, parameters, sender)
        if KEY_PARAMETER in parameters:
            raise ValueError(f"{KEY_PARAMETER} is only used with {ADMIN_PARAMETER}")
        parsed = self.parse(request)
        if parsed.lora_name is not None:  # an unknown adapter, or LoRA off: refused here, naming it
            self.engine.lora_adapter(parsed.lora_name)
        return Job(request_id=request_id, params=parsed.params, sink=self.make_sink(sender, parsed),
                   prompt=parsed.prompt, prompt_token_ids=parsed.prompt_token_ids, lora_name=parsed.lora_name,
                   timeout_s=self.timeout_s)

    def _admin_call(self, request_id: str, parameters: dict[str, Any], sender: Any) -> EngineCall | None:
        """None once a refused action (wrong or missing admin_key) is answered. Raises ValueError if malformed."""
        unknown = sorted(k for k in parameters if k not in (ADMIN_PARAMETER, KEY_PARAMETER)
                         and not k.startswith("triton_"))
        if unknown:
            raise ValueError(f"a {ADMIN_PARAMETER} request takes no other parameters, got {', '.join(unknown)}")
        action = parse_admin_action(parameters[ADMIN_PARAMETER])
        sink = ReplySink(self.pb, sender)
        try:
            check_admin_key(action, parameters.get(KEY_PARAMETER), self.admin_key)
        except AdminRefused as exc:
            logger.warning("lora_admin %s refused (request id %s): %s", action.action, request_id, exc)
            sink.send_error(f"{exc} (request id {request_id})", ErrorKind.FORBIDDEN)
            return None
        logger.info("lora_admin %s %s (request id %s)", action.action, action.lora_name or "", request_id)
        return EngineCall(request_id, partial(run_admin_action, action=action, version_dir=self.version_dir), sink)

    def finalize(self) -> None:
        self.loop.stop()
        self.engine.shutdown()
