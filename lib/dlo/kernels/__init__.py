"""Triton kernels. Each module: the kernel(s), a launcher, `<op>_ref` in torch, a GPU `bench()` that
`dlo bench <module name>` discovers, and `compile_cases()`: what a GPU launch compiles, which
dlo.kernels.aot compiles for sm_80/90/100 without a GPU (tests/kernels/test_compile.py, `dlo bench
--compile-report`). Tests run the kernels on CPU with TRITON_INTERPRET=1."""

from dlo.kernels.fused_adamw import fused_adamw_, fused_adamw_ref

__all__ = ["fused_adamw_", "fused_adamw_ref"]
