"""Triton loads this file; the model lives in the installed tritium package."""

from tritium.backend.serving.embed_model import TritonPythonModel

__all__ = ["TritonPythonModel"]
