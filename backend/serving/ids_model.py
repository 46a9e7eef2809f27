"""The `tritium_ids` Triton model, the middle of `tritium_ensemble` (docs/serving.md). A response carries
`output_ids` and the up to PROMPT_CONTEXT_TOKENS `context_ids` before them, so the stateless postprocessing
decodes exactly their text; responses are cut where the detokenizer releases text (no split characters)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from tritium.backend.detokenizer import PROMPT_CONTEXT_TOKENS
from tritium.backend.outputs import RequestOutput
from tritium.backend.sampling_params import SAMPLING_FIELDS
from tritium.backend.serving.request import (
    EngineRequest,
    coerce_field,
    decode_text,
    parse_lora_name,
    read_flag,
    sampling_from_dict,
    scalar,
)
from tritium.backend.serving.triton_model import EngineModel, request_parameters
from tritium.backend.serving.triton_sink import TritonSink, read_inputs

DEFAULT_TIMEOUT_S = 300.0
# TensorRT-LLM style scalar inputs (config.pbtxt), each coerced to its SamplingParams field's type.
SCALAR_INPUTS: dict[str, type] = {name: SAMPLING_FIELDS[name].type for name in (
    "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "seed", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "priority")}


@dataclass
class IdsRequest(EngineRequest):
    stream: bool = False
    return_num_cached_tokens: bool = False


def parse_ids_request(inputs: dict[str, npt.NDArray[Any] | None]) -> tuple[list[int], dict[str, Any], bool]:
    """(prompt token ids, sampling fields, stream) from TensorRT-LLM style tensors. Raises ValueError."""
    ids = inputs.get("input_ids")
    if ids is None or ids.size == 0:
        raise ValueError("input_ids is required and must not be empty")
    sampling: dict[str, Any] = {}
    for name in SCALAR_INPUTS:
        value = scalar(name, inputs.get(name))
        if value is not None:
            sampling[name] = coerce_field(name, value)
    if sampling.get("top_p") == 0:
        sampling["top_p"] = 1.0  # TensorRT-LLM's "off"
    stop_words = inputs.get("stop_words")
    if stop_words is not None and stop_words.size:
        sampling["stop"] = [decode_text("stop_words", w) for w in stop_words.reshape(-1) if len(w)]
    stream = scalar("stream", inputs.get("stream"))
    return [int(t) for t in ids.reshape(-1)], sampling, bool(stream) if stream is not None else False


class IdsSink(TritonSink):
    def __init__(self, pb_utils: Any, sender: Any, prompt_ids: list[int], stream: bool,
                 return_num_cached_tokens: bool = False) -> None:
        super().__init__(pb_utils, sender)
        self.stream = stream
        self.return_num_cached_tokens = return_num_cached_tokens
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
        if self.return_num_cached_tokens and out.finished:
            tensors.append(self.pb.Tensor("num_cached_tokens", np.array([out.num_cached_tokens], dtype=np.uint32)))
        self._send_tensors(tensors, out)


class TritonPythonModel(EngineModel[IdsRequest]):
    request_id_prefix = "ids"
    default_timeout_s = DEFAULT_TIMEOUT_S  # cancellation does not reach an ensemble's steps

    def parse(self, request: Any) -> IdsRequest:
        inputs = read_inputs(self.pb, request, self.input_names)
        prompt_ids, sampling, stream = parse_ids_request(inputs)
        # An ensemble passes its request's parameters on to this step: take `lora_name` and `priority` from
        # them (they win over the inputs) and leave the others alone.
        parameters = request_parameters(request)
        lora = parameters["lora_name"] if "lora_name" in parameters else scalar("lora_name", inputs.get("lora_name"))
        if "priority" in parameters:
            sampling["priority"] = coerce_field("priority", parameters["priority"])
        return IdsRequest(params=sampling_from_dict(sampling), prompt_token_ids=prompt_ids, stream=stream,
                          lora_name=parse_lora_name(lora),
                          return_num_cached_tokens=read_flag("return_num_cached_tokens", inputs))

    def make_sink(self, sender: Any, parsed: IdsRequest) -> TritonSink:
        return IdsSink(self.pb, sender, parsed.prompt_token_ids or [], parsed.stream, parsed.return_num_cached_tokens)
