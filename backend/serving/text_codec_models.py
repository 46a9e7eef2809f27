"""The ensemble's stateless `preprocessing` and `postprocessing` Triton models; the tokenizer comes from the
model folder their version's model.json names."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from tritium.backend.model_config import ModelConfig
from tritium.backend.models.registry import resolve_model
from tritium.backend.serving.request import decode_text, scalar
from tritium.backend.serving.settings import load_settings
from tritium.backend.tokenizer import TOKENIZER_NICE, Tokenizer

logger = logging.getLogger(__name__)


def _tokenizer(args: dict[str, Any]) -> tuple[Tokenizer, int]:
    """The tokenizer of the version's model folder and the model's context length."""
    settings = load_settings(Path(args["model_repository"]) / args["model_version"])
    folder = resolve_model(settings.engine.model)
    context = settings.engine.max_model_len or ModelConfig.from_folder(folder).max_position_embeddings
    return Tokenizer(folder), context


def _error(pb_utils: Any, message: str) -> Any:
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message))


def encode_prompt(tokenizer: Tokenizer, text: str, chat: bool) -> list[int]:
    """Token ids of `text`, or of `text` as the user turn of the chat template."""
    if chat:
        return tokenizer.encode(tokenizer.user_turn(text), add_special_tokens=False)
    return tokenizer.encode(text)


def decode_delta(tokenizer: Tokenizer, context: list[int], ids: list[int]) -> str:
    """The text `ids` add after `context` (decoding them alone would drop e.g. a leading space)."""
    before = tokenizer.decode(context)
    return tokenizer.decode(context + ids)[len(before):]


class _TokenizerModel:
    def initialize(self, args: dict[str, Any]) -> None:
        import triton_python_backend_utils as pb_utils

        self.pb = pb_utils
        self.tokenizer, self.context_len = _tokenizer(args)


class PreprocessingModel(_TokenizerModel):
    def initialize(self, args: dict[str, Any]) -> None:
        super().initialize(args)
        # Tokenizing a big prompt must not take the CPU from the engine's running streams (threads the
        # tokenizer starts later inherit this nice value).
        with contextlib.suppress(OSError):
            os.nice(TOKENIZER_NICE)

    def execute(self, requests: list[Any]) -> list[Any]:
        pb = self.pb
        responses = []
        for request in requests:
            try:
                text_t = pb.get_input_tensor_by_name(request, "text_input")
                if text_t is None:
                    raise ValueError("text_input is required")
                text = decode_text("text_input", scalar("text_input", text_t.as_numpy()))
                if not text:
                    raise ValueError("text_input must not be empty")
                chat_t = pb.get_input_tensor_by_name(request, "apply_chat_template")
                chat = bool(scalar("apply_chat_template", chat_t.as_numpy())) if chat_t is not None else False
                self.tokenizer.check_can_fit(text, self.context_len)
                ids = encode_prompt(self.tokenizer, text, chat)
                responses.append(pb.InferenceResponse(output_tensors=[
                    pb.Tensor("input_ids", np.array(ids, dtype=np.int32)),
                    pb.Tensor("input_length", np.array([len(ids)], dtype=np.int32)),
                ]))
            except ValueError as exc:
                responses.append(_error(pb, f"invalid request: {exc}"))
            except Exception:  # the details go to the log only
                logger.exception("preprocessing a request failed")
                responses.append(_error(pb, "internal error while tokenizing the request"))
        return responses


class PostprocessingModel(_TokenizerModel):
    def execute(self, requests: list[Any]) -> list[Any]:
        pb = self.pb
        responses = []
        for request in requests:
            try:
                ids = pb.get_input_tensor_by_name(request, "output_ids").as_numpy().reshape(-1).tolist()
                ctx_t = pb.get_input_tensor_by_name(request, "context_ids")
                context = ctx_t.as_numpy().reshape(-1).tolist() if ctx_t is not None else []
                text = decode_delta(self.tokenizer, context, ids)
                responses.append(pb.InferenceResponse(output_tensors=[
                    pb.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_))]))
            except Exception:  # the details go to the log only
                logger.exception("postprocessing a response failed")
                responses.append(_error(pb, "internal error while detokenizing the response"))
        return responses
