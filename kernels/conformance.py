"""Static conformance of the two ops modules to the kernel interface, checked by mypy (`make lint`).

A module assigned to a name of Protocol type is checked against the Protocol member by member: each op of
`KernelOps` must exist in the module with compatible parameters (order, kinds, types, a default wherever the
Protocol has one) and return type, as for a class implementing it; an implementation may add optional
parameters after the declared ones (`tiles`, `num_splits`). mypy does not compare the names of positional
parameters (it never does outside `__call__`): tests/kernels/test_kernel_interface.py checks those, and the
defaults, by inspection. At run time these are plain assignments.
"""

from __future__ import annotations

from tritium.kernels import reference, triton_ops
from tritium.kernels.interface import KernelOps

REFERENCE_OPS: KernelOps = reference
TRITON_OPS: KernelOps = triton_ops
