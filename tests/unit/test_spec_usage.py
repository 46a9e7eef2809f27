"""A request's speculative figures on their way to clients: the Triton sinks' output tensors (and response
parameters where the python backend has them), the OpenAI `usage.speculative_decoding` object, and the vLLM-named
counters the endpoint's /metrics derives from the engines' `tritium_spec_decode_*` counters."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from tritium.backend.outputs import RequestOutput, SpecDecodingStats
from tritium.backend.serving.triton_sink import SPEC_COUNTS, SPEC_MEAN, TritonSink, spec_figures
from tritium.client.cluster.replica_load import engine_load, vllm_metrics
from tritium.client.cluster.upstream import Chunk
from tritium.client.openai.protocol import speculative_usage
from tritium.client.openai.service import ChoiceResult, usage

FIGURES = {"num_drafts": 4, "num_draft_tokens": 12, "num_accepted_tokens": 6}


def output(finished: bool = True, stats: SpecDecodingStats | None = None) -> RequestOutput:
    return RequestOutput("req-1", "x", [5], finished, "length" if finished else None, 3, 1, 0, spec_decoding=stats)


def stats(steps: int = 4, drafted: int = 12, accepted: int = 6) -> SpecDecodingStats:
    return SpecDecodingStats(num_spec_steps=steps, num_draft_tokens=drafted, num_accepted_tokens=accepted)


# --- the Triton sinks ---------------------------------------------------------------------------------------


class Tensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        self.name, self.array = name, array


class Response:
    """The python backend before 25.02: no response parameters (as tritonserver 2.51's stub)."""

    def __init__(self, output_tensors: list[Tensor] | None = None, error: Any = None) -> None:
        self.tensors = {t.name: t.array for t in output_tensors or []}
        self.parameters: dict[str, Any] = {}


class ResponseWithParameters(Response):
    """The python backend from 25.02 on."""

    def __init__(self, output_tensors: list[Tensor] | None = None, error: Any = None,
                 parameters: dict[str, Any] | None = None) -> None:
        super().__init__(output_tensors, error)
        self.parameters = dict(parameters or {})


class Sender:
    def __init__(self) -> None:
        self.sent: list[tuple[Response, int]] = []

    def send(self, response: Response, flags: int = 0) -> None:
        self.sent.append((response, flags))


class TextOnlySink(TritonSink):
    def send_output(self, output: RequestOutput) -> None:
        self._send_tensors([self.pb.Tensor("text_output", np.array([b"x"], dtype=np.object_))], output)


def sent(response_type: type, out: RequestOutput) -> tuple[Response, int]:
    pb = SimpleNamespace(Tensor=Tensor, InferenceResponse=response_type, TRITONSERVER_RESPONSE_COMPLETE_FINAL=1)
    sender = Sender()
    TextOnlySink(pb, sender).send_output(out)
    (response, flags), = sender.sent
    return response, flags


def test_figures_are_vllms_names_on_the_final_output_of_a_request_that_verified_drafts() -> None:
    assert spec_figures(output(stats=stats())) == {
        "spec_num_drafts": 4, "spec_num_draft_tokens": 12, "spec_num_accepted_tokens": 6,
        "spec_mean_acceptance_length": 2.5}
    assert spec_figures(output(finished=False, stats=stats())) is None
    assert spec_figures(output(stats=None)) is None  # speculation off
    assert spec_figures(output(stats=stats(0, 0, 0))) is None  # it could have, but never verified a draft


@pytest.mark.parametrize("response_type", [Response, ResponseWithParameters])
def test_final_response_carries_the_figures_as_tensors_and_parameters_where_the_backend_has_them(
        response_type: type) -> None:
    response, flags = sent(response_type, output(stats=stats()))
    assert flags == 1 and response.tensors["text_output"].tolist() == [b"x"]
    assert {name: response.tensors[name].tolist() for name in SPEC_COUNTS} == {
        "spec_num_drafts": [4], "spec_num_draft_tokens": [12], "spec_num_accepted_tokens": [6]}
    assert response.tensors["spec_num_drafts"].dtype == np.uint32
    assert response.tensors[SPEC_MEAN].dtype == np.float32 and response.tensors[SPEC_MEAN].tolist() == [2.5]
    if response_type is ResponseWithParameters:
        assert response.parameters == {"spec_num_drafts": 4, "spec_num_draft_tokens": 12,
                                       "spec_num_accepted_tokens": 6, SPEC_MEAN: "2.5"}
    else:
        assert response.parameters == {}


@pytest.mark.parametrize("out", [output(stats=None), output(stats=stats(0, 0, 0)), output(False, stats())])
def test_responses_without_figures_carry_only_their_tensors(out: RequestOutput) -> None:
    response, flags = sent(ResponseWithParameters, out)
    assert set(response.tensors) == {"text_output"} and response.parameters == {}
    assert flags == int(out.finished)


# --- the OpenAI usage object ------------------------------------------------------------------------------


def test_speculative_usage_sums_the_choices_and_derives_the_mean_acceptance_length() -> None:
    other = {"num_drafts": 2, "num_draft_tokens": 4, "num_accepted_tokens": 0}
    assert speculative_usage([FIGURES, other]) == {"num_drafts": 6, "num_draft_tokens": 16,
                                                   "num_accepted_tokens": 6, "mean_acceptance_length": 2.0}
    assert speculative_usage([]) is None
    assert speculative_usage([{"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}]) is None


def choice(completion_tokens: int, spec: dict[str, int] | None) -> ChoiceResult:
    result = ChoiceResult()
    result.add(Chunk("partial", final=False, spec_decoding={"num_drafts": 99, "num_draft_tokens": 99,
                                                            "num_accepted_tokens": 99}))  # only the final counts
    result.add(Chunk(" end", final=True, finish_reason="length", num_input_tokens=7,
                     num_output_tokens=completion_tokens, spec_decoding=spec))
    return result


def test_usage_gains_speculative_decoding_only_when_a_choice_verified_drafts() -> None:
    plain = usage({0: choice(5, None)}, 1)
    assert plain == {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12,
                     "prompt_tokens_details": {"cached_tokens": 0}}
    two = usage({0: choice(5, FIGURES), 1: choice(3, None)}, 2)
    assert two == {"prompt_tokens": 7, "completion_tokens": 8, "total_tokens": 15,
                   "prompt_tokens_details": {"cached_tokens": 0}, "speculative_decoding": {
                       "num_drafts": 4, "num_draft_tokens": 12, "num_accepted_tokens": 6,
                       "mean_acceptance_length": 2.5}}


# --- /metrics -----------------------------------------------------------------------------------------------

ENGINE_PAGE = """\
tritium_engine_healthy{model="tritium",version="1"} 1
tritium_spec_decode_num_drafts_total{model="tritium",version="1"} 10
tritium_spec_decode_num_draft_tokens_total{model="tritium",version="1"} 30
tritium_spec_decode_num_accepted_tokens_total{model="tritium",version="1"} 12
tritium_spec_decode_num_drafts_total{model="tritium_ids",version="1"} 1000
"""


def test_metrics_serve_vllms_spec_decode_counters_from_the_engines() -> None:
    load = engine_load(ENGINE_PAGE, "tritium")
    page = vllm_metrics(load.add(load), "tritium")  # two replicas' engines add up
    assert 'vllm:spec_decode_num_drafts_total{engine="0",model_name="tritium"} 20' in page
    assert 'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="tritium"} 60' in page
    assert 'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="tritium"} 24' in page
    assert "# TYPE vllm:spec_decode_num_drafts_total counter" in page
