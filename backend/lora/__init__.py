"""Multi-LoRA: PEFT adapters (adapter.py), resident slots (manager.py), stacked device weights (weights.py)
and the shrink / expand ops (ops.py)."""
