"""`tritium serve --model FOLDER --tensor-parallel-size 2` on a real tritonserver: each engine model is one KIND_MODEL
instance whose engine spawns its rank 1 from inside Triton's python backend stub; a greedy request answers the
tokens and text one rank gives in this process, and Ctrl-C leaves no tritonserver, stub or rank process behind."""

from __future__ import annotations

import gc
import queue
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from tritium.backend import LLM, SamplingParams

from support.checkpoints import save_tiny
from support.serving import Served, grpc_stream, server_log, start_serve, stub_pids, wait_for

pytestmark = pytest.mark.slow
PROMPT = "Once upon a time, in a small village,"
TOKENS = 8
ENGINES = ("tritium", "tritium_ids")
EXIT_WAIT_S = 90.0  # tritium serve's own stop waits up to 60 s for tritonserver


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Path:
    """A tiny random llama (4 heads, 2 KV heads: split over 2 ranks) in a folder unique to this module."""
    return save_tiny("llama", tmp_path_factory.mktemp("tp-serve") / "tiny-llama", default_model_path)


@pytest.fixture(scope="module")
def expected(tiny: Path) -> tuple[list[int], list[int], str]:
    """(PROMPT's token ids, their greedy continuation's ids, PROMPT's greedy text with ignore_eos) by one rank in
    this process."""
    llm = LLM(str(tiny), kv_cache_bytes=16 << 20, max_model_len=256)
    prompt_ids = llm.tokenizer.encode(PROMPT)
    ids = llm.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=TOKENS))[0].token_ids
    text = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True))[0].text
    del llm
    gc.collect()
    return prompt_ids, list(ids), text


@pytest.fixture(scope="module")
def triton(tiny: Path, expected: tuple[list[int], list[int], str]) -> Iterator[Served]:
    served = start_serve(f"--model={tiny}", "--tensor-parallel-size=2", "--model-control=explicit",
                         *(f"--load-model={name}" for name in ENGINES))
    yield served
    served.stop()


@pytest.fixture(scope="module")
def started(triton: Served) -> dict[int, tuple[float, str]]:
    """Every process `tritium serve` started, recorded while it serves: pid -> (start time, command line)."""
    found = {}
    for process in psutil.Process(triton.process.pid).children(recursive=True):
        try:
            found[process.pid] = (process.create_time(), " ".join(process.cmdline()))
        except psutil.NoSuchProcess:
            continue
    return found


def rank_pids(triton: Served) -> set[int]:
    """The stubs' processes spawned by multiprocessing (the tensor-parallel ranks)."""
    ranks = set()
    for stub in stub_pids(triton.server_pid):
        for child in psutil.Process(stub).children():
            try:
                if "spawn_main" in " ".join(child.cmdline()):
                    ranks.add(child.pid)
            except psutil.NoSuchProcess:
                continue
    return ranks


def alive(pid: int, created: float) -> bool:
    """Whether that process (not a later one with its pid) still runs; a zombie has ended."""
    try:
        process = psutil.Process(pid)
        return process.create_time() == created and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def processes_naming(*paths: str) -> list[str]:
    """Running processes whose command line contains one of `paths` (walking /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X") and any(p in cmdline for p in paths):
            found.append(f"{entry.name}: {cmdline}")
    return found


def grpc_ids(url: str, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """One greedy request to the tritium_ids model over gRPC (tritonclient); its output ids."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, array in (("input_ids", np.array(prompt_ids, dtype=np.int32)),
                        ("max_tokens", np.array([max_tokens], dtype=np.int32)),
                        ("temperature", np.array([0.0], dtype=np.float32))):
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    ids: list[int] = []
    try:
        client.async_stream_infer(model_name="tritium_ids", inputs=inputs, enable_empty_final_response=True)
        for _ in range(max_tokens + 2):  # at most one response per token, and an empty final one
            result, error = results.get(timeout=120)
            assert error is None, error
            out = result.as_numpy("output_ids")
            if out is not None:
                ids.extend(int(t) for t in out.reshape(-1))
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return ids
    finally:
        client.stop_stream()
        client.close()
    raise AssertionError(f"no final response after {max_tokens + 2} responses: {ids}")


def test_two_ranks_answer_as_one_rank(triton: Served, expected: tuple[list[int], list[int], str],
                                      started: dict[int, tuple[float, str]]) -> None:
    assert "serving tritium with instance_group [ { count: 1, kind: KIND_MODEL } ]" in "".join(triton.output)
    assert len(rank_pids(triton)) == len(ENGINES)  # rank 1 of each engine, a child of its stub
    prompt_ids, ids, text = expected
    assert grpc_ids(triton.grpc, prompt_ids, TOKENS) == ids
    result = grpc_stream(triton.grpc, PROMPT, {"max_tokens": TOKENS, "temperature": 0, "ignore_eos": True},
                         exclude_input_in_output=True)
    assert not result.errors and result.finals == 1
    assert "".join(result.texts) == text
    log = server_log(triton.server_pid)  # the stubs' output, with their ranks' (kept while the server runs)
    assert "tritium rank 1:" in log, log[-4000:]


def test_ctrl_c_leaves_no_process(triton: Served, tiny: Path, started: dict[int, tuple[float, str]]) -> None:
    ranks = rank_pids(triton)
    assert ranks and ranks <= started.keys()
    stubs = stub_pids(triton.server_pid)
    assert set(stubs) <= started.keys() and triton.server_pid in started
    repository = next(line.split(" on ", 1)[1].split(" ...")[0] for line in triton.output
                      if line.startswith("starting tritonserver on "))
    triton.process.send_signal(signal.SIGINT)
    try:
        code = triton.process.wait(EXIT_WAIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"tritium serve did not exit within {EXIT_WAIT_S:g} s of SIGINT")
    assert code == 0, triton.stop()
    assert wait_for(lambda: not any(alive(pid, created) for pid, (created, _) in started.items()), timeout=30), [
        cmdline for pid, (created, cmdline) in started.items() if alive(pid, created)]
    assert processes_naming(repository, str(tiny), str(tiny.resolve())) == []
    assert triton.leftovers() == []
