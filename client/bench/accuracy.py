"""Accuracy of a quantized model against the unquantized one: greedy agreement and perplexity.

- Greedy agreement: PROMPTS, `max_tokens` greedy tokens each (ignore_eos) through the engine, in both
  configurations; per prompt the matching prefix (tokens equal from the start) and the first divergence (the
  index of the first differing token, None when all match).
- Perplexity: exp(mean next-token negative log-likelihood) of TEXT, teacher-forced in one prefill of the model
  as loaded (`perplexity`), so it measures exactly the weights and kernels the engine runs.

`python -m tritium.client.bench.accuracy [--model DIR] [--quantization int8|int4] [--group-size G] [--head S]`
prints both (JSON); `--group-size` (int4: 32, the default, 64, 128 or 256) and `--head` (the logits head's scheme:
int8 or int4) measure other choices than the engine's (measurement knobs, not engine settings:
quantization.QuantizationOptions): the greedy tokens of both models then come from the models alone, one prefill
per token, instead of the engine.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tritium.backend.layers.attention import AttentionMetadata
from tritium.backend.models.base import CausalLM
from tritium.backend.models.loader import load_model
from tritium.backend.models.quantization import QuantizationOptions
from tritium.backend.tokenizer import Tokenizer

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "Photosynthesis is the process by which",
    "The largest planet in our solar system is",
    "In 1969, the first humans",
)

TEXT = (
    "The history of the bicycle begins in the early nineteenth century, when inventors in Europe built "
    "two-wheeled machines that riders pushed along with their feet. These early designs had no pedals and "
    "were heavy, but they showed that a person could balance on two wheels in a line. Over the following "
    "decades, makers added cranks and pedals to the front wheel, and later moved the drive to the rear wheel "
    "with a chain. Pneumatic tyres, invented for comfort, made riding smoother and faster. By the end of the "
    "century, the safety bicycle, with two wheels of equal size, had become popular across the world. It "
    "gave workers a cheap way to travel to their jobs, and it gave many people, women in particular, a new "
    "kind of freedom. Today, bicycles are used for transport, sport and leisure, and many cities build "
    "separate lanes so that cyclists can ride safely beside cars and buses."
)


@dataclass
class Agreement:
    """Greedy agreement of `test` with `ref` over the prompts (`tokens` generated per prompt)."""

    tokens: int
    matching_prefix: list[int]
    first_divergence: list[int | None]

    @property
    def mean_matching_prefix(self) -> float:
        return sum(self.matching_prefix) / len(self.matching_prefix)

    @property
    def earliest_divergence(self) -> int | None:
        points = [d for d in self.first_divergence if d is not None]
        return min(points) if points else None

    @property
    def exact(self) -> int:
        """How many prompts matched over all their tokens."""
        return sum(d is None for d in self.first_divergence)


def agreement(ref: list[list[int]], test: list[list[int]]) -> Agreement:
    prefixes: list[int] = []
    firsts: list[int | None] = []
    for a, b in zip(ref, test, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        prefixes.append(n)
        firsts.append(None if n == len(a) == len(b) else n)
    return Agreement(max(len(a) for a in ref), prefixes, firsts)


def greedy_tokens(llm: object, max_tokens: int = 32, prompts: tuple[str, ...] = PROMPTS) -> list[list[int]]:
    """Greedy token ids for every prompt through `llm` (an LLM), EOS ignored so every prompt gets max_tokens."""
    from tritium.backend import LLM, SamplingParams

    assert isinstance(llm, LLM)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [list(out.token_ids) for out in llm.generate(list(prompts), params)]


@torch.inference_mode()
def sequence_logits(model: CausalLM, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """fp32 logits `[len(token_ids), vocab]` of one sequence in one prefill (torch reference kernels, CPU)."""
    config = model.config
    device = model.embed_tokens.weight.device
    dtype = model.embed_tokens.weight.dtype
    n = len(token_ids)
    num_blocks = (n + block_size - 1) // block_size
    shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    caches = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
              for _ in range(config.num_hidden_layers)]
    def i32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    meta = AttentionMetadata(
        slot_mapping=i32(list(range(n))), num_decode_tokens=0,
        decode_block_tables=i32([]).reshape(0, num_blocks), decode_seq_lens=i32([]),
        prefill_block_tables=i32(list(range(num_blocks))).reshape(1, num_blocks), prefill_cu_seqlens_q=i32([0, n]),
        prefill_seq_lens=i32([n]), prefill_max_query_len=n,
    )
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    hidden = model(ids, torch.arange(n, device=device), caches, meta)
    return model.compute_logits(hidden).float()


def perplexity(model: CausalLM, token_ids: list[int]) -> float:
    """exp(mean negative log-likelihood of token i+1 given tokens 0..i) over the sequence."""
    logits = sequence_logits(model, token_ids)[:-1]
    targets = torch.tensor(token_ids[1:], dtype=torch.long, device=logits.device)
    nll = torch.nn.functional.cross_entropy(logits, targets)
    return math.exp(float(nll))


def text_perplexity(folder: str | Path, quantization: str | None, text: str = TEXT,
                    options: QuantizationOptions | None = None) -> float:
    """Perplexity of `text` under the model of `folder` (fp32 weights on the CPU, optionally quantized with
    `options`, None the defaults)."""
    ids = Tokenizer(Path(folder)).encode(text)
    model = load_model(folder, torch.float32, torch.device("cpu"), max_positions=len(ids) + 1,
                       quantization=quantization, quantization_options=options)
    return perplexity(model, ids)


def model_greedy_tokens(model: CausalLM, folder: str | Path, max_tokens: int = 32,
                        prompts: tuple[str, ...] = PROMPTS) -> list[list[int]]:
    """Greedy token ids for every prompt from `model` alone, one prefill per token (no engine, no EOS)."""
    tokenizer = Tokenizer(Path(folder))
    runs = []
    for prompt in prompts:
        ids, generated = tokenizer.encode(prompt), []
        for _ in range(max_tokens):
            generated.append(int(sequence_logits(model, ids + generated)[-1].argmax()))
        runs.append(generated)
    return runs


def main(argv: list[str] | None = None) -> None:
    from tritium.backend import LLM
    from tritium.backend.models.registry import resolve_model

    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--model", default=None, help="model folder (default: the embedded default model)")
    p.add_argument("--quantization", default="int8")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--group-size", type=int, default=None, help="int4's group size (default: 32)")
    p.add_argument("--head", default=None, help="the logits head's scheme (default: int8 for int8 and int4)")
    args = p.parse_args(argv)
    folder = resolve_model(args.model)
    options = QuantizationOptions(group_size=args.group_size, head=args.head)
    ppl_ref = text_perplexity(folder, None)
    ppl = text_perplexity(folder, args.quantization, options=options)
    runs = []
    for q in (None, args.quantization):
        if options == QuantizationOptions():
            llm = LLM(model=str(folder), quantization=q, max_num_seqs=len(PROMPTS), max_num_batched_tokens=256)
            runs.append(greedy_tokens(llm, args.max_tokens))
        else:
            model = load_model(folder, torch.float32, torch.device("cpu"), quantization=q, quantization_options=options)
            runs.append(model_greedy_tokens(model, folder, args.max_tokens))
    agree = agreement(runs[0], runs[1])
    print(json.dumps({
        "quantization": args.quantization, "group_size": args.group_size, "head": args.head,
        "perplexity_fp32": ppl_ref, "perplexity": ppl,
        "perplexity_rel_change": ppl / ppl_ref - 1, **asdict(agree),
        "mean_matching_prefix": agree.mean_matching_prefix, "earliest_divergence": agree.earliest_divergence,
        "exact_prompts": agree.exact,
    }, indent=2))


if __name__ == "__main__":
    main()
