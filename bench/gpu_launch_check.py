"""`dlo.distributed.launch` on a GPU node, ranks forked by the zygote vs one interpreter each.

    PYTHONPATH=lib python3 bench/gpu_launch_check.py     (the device tool's machine or any CUDA node)

The parent touches CUDA first (as a notebook does); each mode launches NCCL ranks (one per GPU) that
all-reduce a CUDA tensor, then 4 gloo ranks on the CPU. Prints the results and the CPU seconds per launch
(this process and its waited-for children). Not a test.
"""

import os
import resource
import time

import torch


def nccl_rank():
    import torch.distributed as dist

    t = torch.ones(4, device="cuda") * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return torch.cuda.get_device_name(), t.sum().item(), torch.cuda.current_device()


def gloo_rank():
    import torch.distributed as dist

    t = torch.ones(4) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return t.sum().item(), torch.get_num_threads()


def cpu():
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def main():
    from dlo.distributed.launch import launch

    torch.ones(1, device="cuda").sum().item()  # the parent's CUDA context exists, as in a notebook
    gpus = torch.cuda.device_count()
    for mode in ("exec", "zygote", "exec", "zygote"):
        os.environ["DLO_RANK_START"] = mode
        c, t = cpu(), time.perf_counter()
        got = launch(nccl_rank, gpus, backend="nccl")
        c2, t2 = cpu(), time.perf_counter()
        cpu_ranks = launch(gloo_rank, 4, backend="gloo")
        print(f"{mode:6s} nccl x{gpus}: {got} cpu {c2 - c:.2f} s wall {t2 - t:.2f} s | gloo x4: {cpu_ranks} "
              f"cpu {cpu() - c2:.2f} s wall {time.perf_counter() - t2:.2f} s", flush=True)


if __name__ == "__main__":
    main()
