"""The building blocks models compose: attention over the paged cache, norms, rotary, activations, linears.
Each calls the engine's kernel implementation (`AttentionBackend`), bound when the model is built."""
