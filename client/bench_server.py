"""In-process engine throughput vs the same workload streamed through tritonserver over gRPC.

Workload: N prompts of spread lengths (random token text, fixed seed), `output_len` tokens each, greedy,
ignore_eos; the server run sends all N at once on one gRPC stream (concurrency N). Prints tok/s of both
and the server's loss; writes `server_vs_local.json`.
"""

from __future__ import annotations

import json
import queue
import time
from pathlib import Path

from tqdm import tqdm

from tritium.backend import LLM, SamplingParams
from tritium.backend.models.registry import resolve_model
from tritium.backend.tokenizer import Tokenizer
from tritium.client.bench_offline import make_prompts
from tritium.client.remote import grpc_inputs


def prompts_as_text(n: int) -> list[str]:
    tokenizer = Tokenizer(resolve_model(None))
    return [tokenizer.decode(p) for p in make_prompts(n, 32, 256, vocab=49152, first_normal_id=17)]


def run_local(prompts: list[str], output_len: int) -> tuple[int, float]:
    llm = LLM(None, max_num_seqs=64, max_num_batched_tokens=2048)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    return sum(len(o.token_ids) for o in outs), time.perf_counter() - t0


def run_server(prompts: list[str], output_len: int, grpc_url: str) -> tuple[int, float]:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(grpc_url)
    done: queue.Queue[tuple[object, object]] = queue.Queue()
    client.start_stream(callback=lambda result, error: done.put((result, error)))
    sampling = json.dumps({"max_tokens": output_len, "temperature": 0, "ignore_eos": True})

    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        inputs = grpc_inputs({"text_input": prompt, "sampling_parameters": sampling, "stream": True,
                              "return_num_output_tokens": True})
        client.async_stream_infer("tritium", inputs, request_id=str(i), enable_empty_final_response=True)
    tokens, finished = 0, 0
    with tqdm(total=len(prompts), desc="server", unit="req") as bar:
        while finished < len(prompts):
            result, error = done.get(timeout=600)
            if error is not None:
                raise RuntimeError(f"request failed: {error}")
            response = result.get_response()  # type: ignore[attr-defined]
            if response.parameters["triton_final_response"].bool_param:
                finished += 1
                tokens += int(result.as_numpy("num_output_tokens")[0])  # type: ignore[attr-defined]
                bar.update(1)
    seconds = time.perf_counter() - t0
    client.stop_stream()
    client.close()
    return tokens, seconds


def run_server_benchmark(num_requests: int = 32, output_len: int = 128, out_dir: str = "bench_results") -> dict:
    from tritium.client.triton_server import ServerOptions, TritonServer

    prompts = prompts_as_text(num_requests)
    local_tokens, local_s = run_local(prompts, output_len)
    options = ServerOptions(http_port=18100, grpc_port=18101, metrics_port=18102, model_control="explicit",
                            load_models=["tritium"])
    with TritonServer(options) as server:
        run_server(prompts[:2], 4, server.grpc_url)  # warm-up
        server_tokens, server_s = run_server(prompts, output_len, server.grpc_url)
    local_tps, server_tps = local_tokens / local_s, server_tokens / server_s
    print(f"\n{num_requests} requests x {output_len} tokens, greedy, ignore_eos")
    print(f"in-process : {local_tokens} tokens in {local_s:.1f} s = {local_tps:.1f} tok/s")
    print(f"gRPC x{num_requests:<3}: {server_tokens} tokens in {server_s:.1f} s = {server_tps:.1f} tok/s")
    print(f"server path keeps {100 * server_tps / local_tps:.1f}% of the in-process throughput")
    report = {"num_requests": num_requests, "output_len": output_len, "local_tokens_per_s": local_tps,
              "server_tokens_per_s": server_tps, "server_fraction": server_tps / local_tps}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "server_vs_local.json").write_text(json.dumps(report, indent=2))
    return report
