"""Multi-LoRA (docs/lora.md; design: docs/architecture.md#lora)."""
