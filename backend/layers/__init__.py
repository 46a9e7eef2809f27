"""What models compose; each layer calls the kernels bound when the model is built (`AttentionBackend`)."""
