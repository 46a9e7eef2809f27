"""The `tritium` Triton model: text in, streamed text out (vLLM backend's I/O contract).

Loaded by `model_repository/tritium/<version>/model.py`, which only re-exports `TritonPythonModel`.
`triton_python_backend_utils` exists only inside Triton's python backend stub, so it is imported there.
"""

from __future__ import annotations

import json
import os
from itertools import count
from pathlib import Path
from typing import Any

import numpy as np

from tritium.backend.config import RequestOutput
from tritium.backend.engine import LLMEngine
from tritium.backend.serving.engine_loop import EngineLoop, Job
from tritium.backend.serving.metrics import EngineMetrics
from tritium.backend.serving.request import TextRequest, parse_text_request
from tritium.backend.serving.settings import load_settings
from tritium.backend.serving.triton_sink import TritonSink, parse_or_reject, read_inputs

TEXT_INPUTS = ("text_input", "sampling_parameters", "stream", "exclude_input_in_output", "return_finish_reason",
               "return_num_input_tokens", "return_num_output_tokens", "return_logprobs")


def _bytes_tensor(pb_utils: Any, name: str, text: str) -> Any:
    return pb_utils.Tensor(name, np.array([text.encode("utf-8")], dtype=np.object_))


class TextSink(TritonSink):
    """Turns engine outputs into the text model's responses for one request."""

    def __init__(self, pb_utils: Any, sender: Any, request: TextRequest) -> None:
        super().__init__(pb_utils, sender)
        self.request = request
        self.num_logprobs_sent = 0

    def send_output(self, out: RequestOutput) -> None:
        if self.final_sent or (not self.request.stream and not out.finished):
            return
        req = self.request
        if req.stream:
            text = out.delta_text
        elif req.exclude_input_in_output:
            text = out.text
        else:
            text = req.prompt + out.text
        tensors = [_bytes_tensor(self.pb, "text_output", text)]
        if req.return_finish_reason:
            tensors.append(_bytes_tensor(self.pb, "finish_reason", out.finish_reason or ""))
        if req.return_num_input_tokens:
            tensors.append(self.pb.Tensor("num_input_tokens", np.array([out.num_input_tokens], dtype=np.uint32)))
        if req.return_num_output_tokens:
            tensors.append(self.pb.Tensor("num_output_tokens", np.array([out.num_output_tokens], dtype=np.uint32)))
        if req.return_logprobs:
            new = (out.logprobs or [])[self.num_logprobs_sent :] if req.stream else (out.logprobs or [])
            self.num_logprobs_sent += len(new)
            payload = [{str(k): v for k, v in entry.items()} for entry in new]
            tensors.append(_bytes_tensor(self.pb, "logprobs", json.dumps(payload)))
        self._send(self.pb.InferenceResponse(output_tensors=tensors), final=out.finished)


class TritonPythonModel:
    """Triton's entry points: initialize, execute (validate + enqueue only), finalize."""

    def initialize(self, args: dict[str, Any]) -> None:
        import triton_python_backend_utils as pb_utils

        self.pb = pb_utils
        # Tokenize on the (low-priority) calling thread, not on a pool of the tokenizers library's own.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise ValueError("the tritium model must use model_transaction_policy { decoupled: true }")
        version_dir = Path(args["model_repository"]) / args["model_version"]
        settings = load_settings(version_dir)
        self.timeout_s = settings.request_timeout_s
        self.engine = LLMEngine(settings.engine)
        metrics = EngineMetrics(pb_utils, args["model_name"], args["model_version"])
        self.loop = EngineLoop(self.engine, metrics, settings.max_pending_requests)
        self.loop.start()
        self._ids = count()
        import torch

        print(f"tritium {args['model_name']} version {args['model_version']} ready "
              f"({torch.get_num_threads()} torch threads)", flush=True)

    @staticmethod
    def _parameters(request: Any) -> dict[str, Any]:
        raw = request.parameters()
        if not raw:
            return {}
        value = json.loads(raw)
        return value if isinstance(value, dict) else {}

    def execute(self, requests: list[Any]) -> None:
        """Parse each request on its own (a bad one gets its error, the others go on) and submit it; the
        prompt is tokenized on the engine loop's tokenizer thread, not here."""
        for request in requests:
            request_id = f"req-{next(self._ids)}"
            sender = request.get_response_sender()
            parsed = parse_or_reject(self.pb, sender, request_id, lambda request=request: parse_text_request(
                read_inputs(self.pb, request, TEXT_INPUTS), self._parameters(request)))
            if parsed is None:
                continue
            job = Job(request_id=request_id, params=parsed.params,
                      sink=TextSink(self.pb, sender, parsed), prompt=parsed.prompt)
            if self.timeout_s is not None:
                job.deadline = job.arrival + self.timeout_s
            self.loop.submit(job)
        return None

    def finalize(self) -> None:
        self.loop.stop()
