"""The @triton.jit kernel bodies, one module per host module of tritium.kernels (mypy skips them)."""
