"""Triton loads this file; the model lives in the installed tritium package."""

from tritium.backend.serving.text_codec_models import PostprocessingModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
