"""The Triton implementations of the kernel interface (docs/architecture.md), as one module the `triton`
attention backend binds to. Same names and signatures as `tritium.kernels.reference`."""

from tritium.kernels.decode_attention import decode_attention
from tritium.kernels.elementwise import gelu_tanh_and_mul, rms_norm, rotary_embedding, silu_and_mul, store_kv
from tritium.kernels.fused_moe import fused_moe
from tritium.kernels.int8_gemm import int8_gemm
from tritium.kernels.lora import lora_expand, lora_expand_rows, lora_shrink, lora_shrink_rows
from tritium.kernels.prefill_attention import prefill_attention
from tritium.kernels.token_bitmask import apply_token_bitmask

__all__ = ["apply_token_bitmask", "decode_attention", "fused_moe", "gelu_tanh_and_mul", "int8_gemm", "lora_expand",
           "lora_expand_rows", "lora_shrink", "lora_shrink_rows", "prefill_attention", "rms_norm", "rotary_embedding",
           "silu_and_mul", "store_kv"]
