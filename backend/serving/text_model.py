"""The `tritium` Triton model: text in, streamed text out (docs/serving.md#tritium-text-in-text-out)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from tritium.backend.outputs import RequestOutput
from tritium.backend.serving.request import TextRequest, parse_text_request
from tritium.backend.serving.triton_model import EngineModel, request_parameters
from tritium.backend.serving.triton_sink import TritonSink, read_inputs


def _bytes_tensor(pb_utils: Any, name: str, text: str) -> Any:
    return pb_utils.Tensor(name, np.array([text.encode("utf-8")], dtype=np.object_))


class TextSink(TritonSink):
    """Streamed: each output's new text; otherwise one response from the final output's totals."""

    def __init__(self, pb_utils: Any, sender: Any, request: TextRequest) -> None:
        super().__init__(pb_utils, sender)
        self.request = request

    def send_output(self, out: RequestOutput) -> None:
        if self.final_sent or (not self.request.stream and not out.finished):
            return
        req = self.request
        if req.stream:
            text, logprobs = out.delta_text, out.delta_logprobs
        else:
            text = out.text if req.exclude_input_in_output else (req.prompt or "") + out.text
            logprobs = out.logprobs
        tensors = [_bytes_tensor(self.pb, "text_output", text)]
        if req.return_finish_reason:
            tensors.append(_bytes_tensor(self.pb, "finish_reason", out.finish_reason or ""))
        if req.return_num_input_tokens:
            tensors.append(self.pb.Tensor("num_input_tokens", np.array([out.num_input_tokens], dtype=np.uint32)))
        if req.return_num_output_tokens:
            tensors.append(self.pb.Tensor("num_output_tokens", np.array([out.num_output_tokens], dtype=np.uint32)))
        if req.return_num_cached_tokens and out.finished:  # the prefix-cache hit, known for sure at the end
            tensors.append(self.pb.Tensor("num_cached_tokens", np.array([out.num_cached_tokens], dtype=np.uint32)))
        if req.return_logprobs:
            payload = [{str(k): v for k, v in entry.items()} for entry in logprobs or []]
            tensors.append(_bytes_tensor(self.pb, "logprobs", json.dumps(payload)))
        self._send_tensors(tensors, out)


class TritonPythonModel(EngineModel[TextRequest]):
    request_id_prefix = "req"

    def parse(self, request: Any) -> TextRequest:
        parsed = parse_text_request(read_inputs(self.pb, request, self.input_names), request_parameters(request))
        if parsed.apply_chat_template:
            parsed.prompt = self.engine.tokenizer.user_turn(parsed.prompt or "", parsed.chat_template_kwargs)
        return parsed

    def make_sink(self, sender: Any, parsed: TextRequest) -> TritonSink:
        return TextSink(self.pb, sender, parsed)
