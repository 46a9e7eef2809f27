"""What the kernel tests share about Triton's interpreter (TRITON_INTERPRET=1, tests/conftest.py): the tolerance of
a kernel against its torch reference per dtype, and a fix for the interpreter's bf16 dot."""

from __future__ import annotations

import pytest
import torch

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def upcast_bf16_dot(monkeypatch: pytest.MonkeyPatch) -> None:
    """Until `monkeypatch` undoes it, the interpreter's `tl.dot` upcasts bf16 operands to fp32: it holds bf16 as
    raw bits and its dot on them is garbage (all other bf16 math in the kernels is done after an explicit cast to
    fp32, which the interpreter converts correctly)."""
    import numpy as np
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # type: ignore[no-untyped-def]
        def up(x):  # type: ignore[no-untyped-def]
            if x.dtype.scalar == interpreter.tl.bfloat16:
                data = interpreter._convert_float(x.data, x.dtype.scalar, interpreter.tl.float32, None)
                return interpreter.TensorHandle(data.view(np.float32), interpreter.tl.float32)
            return x
        return original(self, up(a), up(b), d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
