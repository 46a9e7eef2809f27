"""What a tensor-parallel rank holds (models/sharding.py) and its layers' collectives (layers/parallel.py): the ranks'
parts of every tensor join back into the whole, KV heads are replicated when fewer than ranks, row-parallel biases
stay on rank 0, the vocabulary is padded; two ranks' sharded MLP, attention projections, embedding and logits head
(gloo, one thread per rank) give the unsharded layer's outputs."""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch
from torch._C._distributed_c10d import TCPStore

from tritium.backend.layers.attention import get_attention_backend
from tritium.backend.layers.parallel import RankGroup, VocabParallelEmbedding
from tritium.backend.layers.rotary import RotaryEmbedding
from tritium.backend.model_config import ModelConfig, ModelFolderError
from tritium.backend.models.llama import LlamaDecoderLayer
from tritium.backend.models.sharding import RankSlice, Shard, rank_slice, shard_config
from tritium.backend.worker.ranks import make_group
from tritium.backend.worker.threads import CoreBinding, choose_threads, rank_cores

T = TypeVar("T")
CPU = torch.device("cpu")


def config(**overrides: Any) -> ModelConfig:
    base: dict[str, Any] = dict(architecture="LlamaForCausalLM", vocab_size=11, hidden_size=32, intermediate_size=12,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64,
                                tie_word_embeddings=False, attention_bias=True, o_proj_bias=True, mlp_bias=True)
    return ModelConfig(**(base | overrides))


def parts(key: str, part: int | None, whole: torch.Tensor, c: ModelConfig, size: int = 2) -> list[torch.Tensor]:
    return [rank_slice(key, part, c, Shard(r, size)).of(whole, list(whole.shape)) for r in range(size)]


def test_column_and_row_parallel_parts_join_into_the_whole_tensor() -> None:
    c = config()
    q, kv = torch.randn(32, 32), torch.randn(16, 32)
    assert torch.equal(torch.cat(parts("layers.0.qkv_proj.weight", 0, q, c)), q)
    assert torch.equal(torch.cat(parts("layers.0.qkv_proj.weight", 1, kv, c)), kv)
    gate = torch.randn(12, 32)
    assert torch.equal(torch.cat(parts("layers.1.gate_up_proj.weight", 0, gate, c)), gate)
    o, down = torch.randn(32, 32), torch.randn(32, 12)
    assert torch.equal(torch.cat(parts("layers.0.o_proj.weight", None, o, c), dim=1), o)
    assert torch.equal(torch.cat(parts("layers.0.down_proj.weight", None, down, c), dim=1), down)
    norm = torch.randn(32)
    assert all(torch.equal(p, norm) for p in parts("layers.0.input_layernorm.weight", None, norm, c))


def test_a_fused_checkpoint_tensor_gives_each_rank_its_q_k_v_and_gate_up_sections() -> None:
    """Phi-3 holds q/k/v (and gate/up) in one tensor: each rank takes its rows of each section."""
    c = config()
    q, k, v = torch.randn(32, 32), torch.randn(16, 32), torch.randn(16, 32)
    rank1 = parts("layers.0.qkv_proj.weight", None, torch.cat([q, k, v]), c)[1]
    assert torch.equal(rank1, torch.cat([q[16:], k[8:], v[8:]]))
    gate, up = torch.randn(12, 32), torch.randn(12, 32)
    rank0 = parts("layers.0.gate_up_proj.weight", None, torch.cat([gate, up]), c)[0]
    assert torch.equal(rank0, torch.cat([gate[:6], up[:6]]))


def test_fewer_kv_heads_than_ranks_are_replicated() -> None:
    c = config(num_attention_heads=4, num_key_value_heads=2)
    k = torch.randn(16, 32)  # two heads of 8
    four = parts("layers.0.qkv_proj.weight", 1, k, c, size=4)
    assert [torch.equal(p, k[:8]) for p in four[:2]] == [True, True]
    assert [torch.equal(p, k[8:]) for p in four[2:]] == [True, True]
    assert shard_config(c, 4).num_key_value_heads == 1


def test_row_parallel_biases_are_rank_zeros_only_and_the_vocabulary_is_padded() -> None:
    c = config()
    bias = torch.randn(32)
    zero, one = parts("layers.0.o_proj.bias", None, bias, c)
    assert torch.equal(zero, bias) and torch.equal(one, torch.zeros(32))
    head = torch.randn(11, 32)
    first, last = parts("lm_head.weight", None, head, c)
    assert first.shape == last.shape == (6, 32)
    assert torch.equal(torch.cat([first, last])[:11], head) and torch.equal(last[5], torch.zeros(32))


def test_expert_parts_split_each_experts_intermediate_rows() -> None:
    c = config(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=6)
    w13, w2 = torch.randn(4, 12, 32), torch.randn(4, 32, 6)
    r0, r1 = parts("layers.0.moe.w13", None, w13, c)
    assert torch.equal(r0, torch.cat([w13[:, :3], w13[:, 6:9]], dim=1))
    assert torch.equal(r1, torch.cat([w13[:, 3:6], w13[:, 9:12]], dim=1))
    assert torch.equal(torch.cat(parts("layers.0.moe.w2", None, w2, c), dim=2), w2)
    one_expert_gate = torch.randn(6, 32)
    assert torch.equal(parts("layers.0.moe.w13", 0, one_expert_gate, c)[1], one_expert_gate[3:])


@pytest.mark.parametrize(("overrides", "size", "message"), [
    ({"num_attention_heads": 6, "num_key_value_heads": 6}, 4, "does not divide num_attention_heads 6"),
    ({"num_attention_heads": 6, "num_key_value_heads": 3}, 2, "num_key_value_heads 3: one must divide the other"),
    ({"intermediate_size": 13}, 2, "does not divide intermediate_size 13"),
    ({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 5}, 2,
     "does not divide the experts' intermediate size 5"),
])
def test_sizes_that_do_not_divide_are_refused_naming_the_numbers(overrides: dict[str, Any], size: int,
                                                                 message: str) -> None:
    with pytest.raises(ModelFolderError, match=message):
        shard_config(config(**overrides), size)


def test_a_slice_read_from_safetensors_is_the_slice_of_the_tensor(tmp_path: Any) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    whole = torch.randn(6, 10)
    save_file({"w": whole}, str(tmp_path / "w.safetensors"))
    cut = RankSlice(1, ((2, 5), (7, 9)))
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as st:
        piece = st.get_slice("w")
        assert torch.equal(cut.of(piece, piece.get_shape()), cut.of(whole, list(whole.shape)))


def test_tensor_parallel_ranks_share_the_usable_cores_each_on_its_own() -> None:
    assert choose_threads(8, ranks=2).count == 4
    assert choose_threads(2, ranks=4).count == 1
    assert choose_threads(8, override=3, ranks=2).count == 3
    affinity = {0, 2, 4, 6, 8, 10}
    assert [rank_cores(affinity, 6, r, 3) for r in range(3)] == [{0, 2}, {4, 6}, {8, 10}]
    assert rank_cores(affinity, 4, 1, 2) == {4, 6}  # a cgroup quota of 4 CPUs: the first 4
    assert rank_cores({0, 1}, 2, 0, 4) is None and rank_cores({0, 1}, 2, 0, 1) is None


def test_rank_zero_gives_the_thread_that_built_it_its_cores_back() -> None:
    import os

    before = os.sched_getaffinity(0)
    binding = CoreBinding.of_this_thread()
    os.sched_setaffinity(0, {min(before)})
    other = threading.Thread(target=binding.restore)  # on another thread: nothing to give back there
    other.start()
    other.join()
    assert os.sched_getaffinity(0) == {min(before)}
    binding.restore()
    assert os.sched_getaffinity(0) == before


def on_two_ranks(work: Callable[[RankGroup], T]) -> list[T]:
    """`work(group)` on ranks 0 and 1 of a gloo group, one thread each; their results in rank order."""
    store = TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    results: dict[int, Any] = {}

    def rank(r: int) -> None:
        client = store if r == 0 else TCPStore("127.0.0.1", store.port, 2, False,
                                                timeout=datetime.timedelta(seconds=30))
        try:
            results[r] = work(make_group(client, r, 2, CPU))
        except BaseException as exc:  # re-raised on the test's thread
            results[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for r in range(2):
        if isinstance(results.get(r), BaseException):
            raise results[r]
    return [results[0], results[1]]


def sharded_layer(whole: LlamaDecoderLayer, c: ModelConfig, group: RankGroup) -> LlamaDecoderLayer:
    backend = get_attention_backend("torch", CPU).on_ranks(group)
    rotary = RotaryEmbedding(c.head_dim, c.rope_theta, None, c.max_position_embeddings, backend)
    layer = LlamaDecoderLayer(shard_config(c, group.size), 0, rotary, backend)
    q_size, kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    sections = {0: (0, q_size), 1: (q_size, q_size + kv_size), 2: (q_size + kv_size, q_size + 2 * kv_size)}
    state = {}
    for key, tensor in whole.state_dict().items():
        shard = Shard(group.rank, group.size)
        if key.startswith("qkv_proj"):
            pieces = [rank_slice(key, part, c, shard).of(tensor[a:b], list(tensor[a:b].shape))
                      for part, (a, b) in sections.items()]
            state[key] = torch.cat(pieces)
        else:
            state[key] = rank_slice(key, None, c, shard).of(tensor, list(tensor.shape))
    layer.load_state_dict(state)
    return layer


def test_two_ranks_sharded_layers_give_the_whole_layers_outputs() -> None:
    """The MLP and the attention projections (row-parallel biases once), the embedding and the logits head."""
    torch.manual_seed(0)
    c = config()
    backend = get_attention_backend("torch", CPU)
    whole = LlamaDecoderLayer(c, 0, RotaryEmbedding(c.head_dim, c.rope_theta, None, 64, backend), backend)
    for p in whole.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(5, c.hidden_size)
    embed, ids = torch.randn(c.vocab_size, c.hidden_size), torch.tensor([0, 5, 6, 10])
    with torch.inference_mode():
        expected_mlp = whole.mlp(x, None)
        expected_o = whole.o_proj(x)

    def run(group: RankGroup) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        layer = sharded_layer(whole, c, group)
        table = VocabParallelEmbedding(c.vocab_size, c.hidden_size, group)
        table.load_state_dict({"weight": rank_slice("embed_tokens.weight", None, c,
                                                    Shard(group.rank, 2)).of(embed, list(embed.shape))})
        with torch.inference_mode():
            cols = slice(group.rank * 16, (group.rank + 1) * 16)  # o_proj's input: this rank's heads
            o = group.all_reduce(layer.o_proj(x[:, cols].contiguous()))
            logits = group.gather_columns(x[:4] @ table.weight.T, c.vocab_size)
            return layer.mlp(x, None), o, table(ids), logits

    (mlp0, o0, embedded0, logits0), (mlp1, o1, embedded1, _) = on_two_ranks(run)
    for mlp, o, embedded in ((mlp0, o0, embedded0), (mlp1, o1, embedded1)):
        torch.testing.assert_close(mlp, expected_mlp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(o, expected_o, rtol=1e-5, atol=1e-5)
        assert torch.equal(embedded, embed[ids])
    torch.testing.assert_close(logits0, x[:4] @ embed.T, rtol=1e-5, atol=1e-5)  # rank 0: the whole vocabulary
