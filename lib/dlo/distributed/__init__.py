"""Multi-process training helpers: `launch(fn, n)` runs fn on n ranks from a notebook cell, or on
this rank under torchrun/srun; `rank()`, `world_size()`, `is_main()` and `rank_device()` (the
device this rank computes on) work with or without a process group."""

from dlo.distributed.current import heartbeat, init_from_env, is_main, rank, rank_device, world_size
from dlo.distributed.launch import RankError, launch

__all__ = ["launch", "RankError", "heartbeat", "init_from_env", "rank", "rank_device", "world_size", "is_main"]
