"""What every tritium Triton model shares: reading inputs, FINAL bookkeeping and error replies."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


def read_inputs(pb_utils: Any, request: Any, names: Iterable[str]) -> dict[str, np.ndarray | None]:
    """The request's input tensors by name as numpy arrays; None for an input it does not carry."""
    inputs = {}
    for name in names:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        inputs[name] = None if tensor is None else tensor.as_numpy()
    return inputs


def reject(pb_utils: Any, sender: Any, message: str) -> None:
    """Answer a request that failed validation with one final error response."""
    response = pb_utils.InferenceResponse(error=pb_utils.TritonError(f"invalid request: {message}"))
    sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


class TritonSink:
    """Sends one request's responses; never touches the sender after the FINAL flag (calling
    is_cancelled() then crashes Triton). Subclasses implement `send_output`."""

    def __init__(self, pb_utils: Any, sender: Any) -> None:
        self.pb = pb_utils
        self.sender = sender
        self.final_sent = False

    def is_cancelled(self) -> bool:
        return not self.final_sent and bool(self.sender.is_cancelled())

    def send_error(self, message: str) -> None:
        if not self.final_sent:
            self._send(self.pb.InferenceResponse(error=self.pb.TritonError(message)), final=True)

    def _send(self, response: Any, final: bool) -> None:
        flags = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        self.final_sent = self.final_sent or final
        try:
            self.sender.send(response, flags=flags)
        except Exception as exc:  # e.g. the client is gone; nothing else to do for this request
            logger.warning("could not send a response: %s", exc)
