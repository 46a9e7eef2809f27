"""What every tritium Triton model shares: reading inputs, FINAL bookkeeping and error replies."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from tritium.backend.outputs import RequestOutput
from tritium.backend.serving.jobs import ErrorKind

logger = logging.getLogger(__name__)
T = TypeVar("T")
ERROR_CODES = {  # pb_utils.TritonError code names; tritonserver maps them to gRPC / HTTP statuses
    ErrorKind.INVALID: "INVALID_ARG", ErrorKind.OVERLOADED: "UNAVAILABLE", ErrorKind.UNAVAILABLE: "UNAVAILABLE",
    ErrorKind.INTERNAL: "INTERNAL", ErrorKind.FORBIDDEN: "UNAVAILABLE",
}


# A final response's speculative decoding figures (docs/speculative-decoding.md#per-request-figures).
SPEC_COUNTS = ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens")
SPEC_MEAN = "spec_mean_acceptance_length"


def spec_figures(output: RequestOutput) -> dict[str, int | float] | None:
    """By output name; None unless `output` is final and its request verified a draft."""
    stats = output.spec_decoding
    if not output.finished or stats is None or stats.num_spec_steps == 0:
        return None
    return {"spec_num_drafts": stats.num_spec_steps, "spec_num_draft_tokens": stats.num_draft_tokens,
            "spec_num_accepted_tokens": stats.num_accepted_tokens, SPEC_MEAN: stats.mean_acceptance_length}


def triton_error(pb_utils: Any, message: str, kind: ErrorKind) -> Any:
    """A TritonError with the status code for `kind` (a stub without codes gets the message alone)."""
    code = getattr(pb_utils.TritonError, ERROR_CODES[kind], None)
    return pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)


def read_inputs(pb_utils: Any, request: Any, names: Iterable[str]) -> dict[str, npt.NDArray[Any] | None]:
    """The request's input tensors by name as numpy arrays; None for an input it does not carry."""
    inputs = {}
    for name in names:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        inputs[name] = None if tensor is None else tensor.as_numpy()
    return inputs


def reject(pb_utils: Any, sender: Any, message: str, request_id: str) -> None:
    """Answer a request that failed validation with one final error response."""
    error = triton_error(pb_utils, f"invalid request: {message} (request id {request_id})", ErrorKind.INVALID)
    try:
        sender.send(pb_utils.InferenceResponse(error=error), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    except Exception as exc:  # the client is gone
        logger.warning("could not send the error response for %s: %s", request_id, exc)


def parse_or_reject(pb_utils: Any, sender: Any, request_id: str, parse: Callable[[], T]) -> T | None:
    """`parse()`'s result, or None once the request is answered with one error: a ValueError's message, or (for
    anything else, logged under `request_id`) only the id."""
    try:
        return parse()
    except ValueError as exc:
        reject(pb_utils, sender, str(exc), request_id)
    except Exception:
        logger.exception("parsing request %s failed", request_id)
        reject(pb_utils, sender, "the request could not be parsed", request_id)
    return None


class TritonSink(ABC):
    """Sends one request's responses; never touches the sender after the FINAL flag (calling
    is_cancelled() then crashes Triton). Subclasses implement `send_output`."""

    def __init__(self, pb_utils: Any, sender: Any) -> None:
        self.pb = pb_utils
        self.sender = sender
        self.final_sent = False

    @abstractmethod
    def send_output(self, output: RequestOutput) -> None:
        """Send what `output` adds as this model's response (final when `output.finished`)."""

    def is_cancelled(self) -> bool:
        """Whether the client cancelled; False once the final response went (asking then crashes Triton)."""
        return not self.final_sent and bool(self.sender.is_cancelled())

    def send_error(self, message: str, kind: ErrorKind = ErrorKind.INTERNAL) -> None:
        """Send the final error, unless a final response went already."""
        if not self.final_sent:
            self._send(self.pb.InferenceResponse(error=triton_error(self.pb, message, kind)), final=True)

    def _send_tensors(self, tensors: list[Any], output: RequestOutput) -> None:
        """Final when `output` is, with its speculative figures."""
        figures = spec_figures(output)
        if figures is None:
            self._send(self.pb.InferenceResponse(output_tensors=tensors), final=output.finished)
            return
        counts = [self.pb.Tensor(name, np.array([figures[name]], dtype=np.uint32)) for name in SPEC_COUNTS]
        tensors = [*tensors, *counts, self.pb.Tensor(SPEC_MEAN, np.array([figures[SPEC_MEAN]], dtype=np.float32))]
        parameters = {name: figures[name] for name in SPEC_COUNTS} | {SPEC_MEAN: f"{figures[SPEC_MEAN]:.6g}"}
        try:
            response = self.pb.InferenceResponse(output_tensors=tensors, parameters=parameters)
        except TypeError:  # a python backend before 25.02 has no response parameters: the tensors alone
            response = self.pb.InferenceResponse(output_tensors=tensors)
        self._send(response, final=output.finished)

    def _send(self, response: Any, final: bool) -> None:
        flags = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        self.final_sent = self.final_sent or final
        try:
            self.sender.send(response, flags=flags)
        except Exception as exc:  # e.g. the client is gone; nothing else to do for this request
            logger.warning("could not send a response: %s", exc)
