"""The `tritium_ids` Triton model: token ids in, streamed token ids out, for the ensemble
`preprocessing -> tritium_ids -> postprocessing` (TensorRT-LLM ensemble inputs).

Each response carries `output_ids` (new tokens) and `context_ids` (the up to 5 tokens before them), so
the stateless postprocessing step can decode exactly the text those tokens add. Responses are cut
where the engine's detokenizer releases text, so a multi-byte character is never split across them.

Triton does not pass cancellation through an ensemble to this step, so a request still running after
`request_timeout_s` (model.json, default 300 s) is aborted: a client that left does not keep a slot.
"""

from __future__ import annotations

import json
from itertools import count
from pathlib import Path
from typing import Any

import numpy as np

from tritium.backend.config import RequestOutput
from tritium.backend.detokenizer import PROMPT_CONTEXT_TOKENS
from tritium.backend.engine import LLMEngine
from tritium.backend.sampling_params import SamplingParams
from tritium.backend.serving.engine_loop import EngineLoop, Job
from tritium.backend.serving.metrics import EngineMetrics
from tritium.backend.serving.request import decode_text, sampling_from_dict, scalar
from tritium.backend.serving.settings import load_settings
from tritium.backend.serving.triton_sink import TritonSink, parse_or_reject, read_inputs

DEFAULT_TIMEOUT_S = 300.0
SCALAR_INPUTS = {  # tensor name -> SamplingParams field
    "max_tokens": "max_tokens", "min_tokens": "min_tokens", "temperature": "temperature", "top_p": "top_p",
    "top_k": "top_k", "seed": "seed", "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
}


def parse_ids_request(inputs: dict[str, np.ndarray | None]) -> tuple[list[int], dict[str, Any], bool]:
    """(prompt token ids, sampling fields, stream) from TensorRT-LLM style tensors. Raises ValueError."""
    ids = inputs.get("input_ids")
    if ids is None or ids.size == 0:
        raise ValueError("input_ids is required and must not be empty")
    sampling: dict[str, Any] = {}
    for name, field in SCALAR_INPUTS.items():
        value = scalar(name, inputs.get(name))
        if value is not None:
            sampling[field] = value.item() if hasattr(value, "item") else value
    if sampling.get("top_p") == 0:
        sampling["top_p"] = 1.0  # TensorRT-LLM's "off"
    stop_words = inputs.get("stop_words")
    if stop_words is not None and stop_words.size:
        sampling["stop"] = [decode_text("stop_words", w) for w in stop_words.reshape(-1) if len(w)]
    stream = scalar("stream", inputs.get("stream"))
    return [int(t) for t in ids.reshape(-1)], sampling, bool(stream) if stream is not None else False


class IdsSink(TritonSink):
    def __init__(self, pb_utils: Any, sender: Any, prompt_ids: list[int], stream: bool) -> None:
        super().__init__(pb_utils, sender)
        self.stream = stream
        self.history = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])  # tokens already sent (tail) for context
        self.pending: list[int] = []

    def send_output(self, out: RequestOutput) -> None:
        if self.final_sent:
            return
        self.pending.extend(out.delta_token_ids)
        if not (out.finished or (self.stream and out.delta_text)):
            return
        ids, self.pending = self.pending, []
        context = self.history[-PROMPT_CONTEXT_TOKENS:]
        self.history = (self.history + ids)[-PROMPT_CONTEXT_TOKENS:]
        tensors = [self.pb.Tensor("output_ids", np.array(ids, dtype=np.int32)),
                   self.pb.Tensor("context_ids", np.array(context, dtype=np.int32))]
        self._send(self.pb.InferenceResponse(output_tensors=tensors), out.finished)


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        import triton_python_backend_utils as pb_utils

        self.pb = pb_utils
        settings = load_settings(Path(args["model_repository"]) / args["model_version"])
        self.timeout_s = settings.request_timeout_s or DEFAULT_TIMEOUT_S
        self.engine = LLMEngine(settings.engine)
        self.loop = EngineLoop(self.engine, EngineMetrics(pb_utils, args["model_name"], args["model_version"]),
                               settings.max_pending_requests)
        self.loop.start()
        self._ids = count()
        self.input_names = [i["name"] for i in json.loads(args["model_config"])["input"]]

    def _parse(self, request: Any) -> tuple[list[int], SamplingParams, bool]:
        prompt_ids, sampling, stream = parse_ids_request(read_inputs(self.pb, request, self.input_names))
        return prompt_ids, sampling_from_dict(sampling), stream

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            request_id = f"ids-{next(self._ids)}"
            sender = request.get_response_sender()
            parsed = parse_or_reject(self.pb, sender, request_id, lambda request=request: self._parse(request))
            if parsed is None:
                continue
            prompt_ids, params, stream = parsed
            job = Job(request_id=request_id, params=params,
                      sink=IdsSink(self.pb, sender, prompt_ids, stream), prompt_token_ids=prompt_ids)
            job.deadline = job.arrival + self.timeout_s
            self.loop.submit(job)
        return None

    def finalize(self) -> None:
        self.loop.stop()
