"""Triton kernels. Each module: the kernel(s), a launcher, `<op>_ref` in torch, and a GPU `bench()`
that `dlo bench <module name>` discovers. Tests run them on CPU with TRITON_INTERPRET=1."""

from dlo.kernels.fused_adamw import fused_adamw_, fused_adamw_ref

__all__ = ["fused_adamw_", "fused_adamw_ref"]
