#!/usr/bin/env bash
# One prepared GPU session (the `device` tool's machine or any CUDA node): the kernel and GPU tests
# compiled for the GPU in hand, the launch check, then `dlo bench` (kernels beside torch and the roofline).
#   bash bench/gpu_check.sh [dlo bench options]
#   env: OUT, TEST_TIMEOUT, LAUNCH_TIMEOUT, BENCH_TIMEOUT, DAY_TIMEOUT (s); LAUNCH=0 skips the launch check;
#   DAYS="day3_checkpointing ..." also runs those days' solution notebooks at the full profile on the GPU
#   (`dlo run`, needs papermill and ipykernel; DAY_PARAMS="-p max_steps 200" passes parameters).
# Writes its logs and the bench JSON to $OUT (default bench/results): gpu-env.txt, gpu-tests(-full).txt,
# gpu-launch.txt, gpu-bench.txt, and the executed notebooks under $OUT/days. Uses the python3 on PATH (the
# node's own torch/triton when the lock's CUDA wheels cannot be installed there; the JSON says which).
set -u
OUT=${OUT:-bench/results}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/lib${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/gpu-env.txt"
# Kernel, optimizer, AMP and quantization tests on the GPU (conftest picks cuda when TRITON_INTERPRET is unset).
timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -o addopts="" -m "not browser and not smoke and not solutions and not slurm and not compile" \
  tests/kernels tests/test_bench.py tests/optim/test_fused_adamw.py tests/test_amp.py tests/test_quant.py \
  tests/test_smoothquant.py tests/test_attention.py ${TEST_ARGS:-} \
  --maxfail=30 -rfE > "$OUT/gpu-tests-full.txt" 2>&1  # the whole log: every failure's traceback
tail -n 60 "$OUT/gpu-tests-full.txt" | tee "$OUT/gpu-tests.txt"
# `dlo.distributed.launch` with the parent's CUDA context alive (as in a notebook): NCCL ranks (one per GPU)
# and 4 gloo ranks, forked by the zygote vs one interpreter each; their sums and the CPU seconds per launch.
[ "${LAUNCH:-1}" = 0 ] || timeout ${LAUNCH_TIMEOUT:-120} python3 - <<'EOF' 2>&1 | tee "$OUT/gpu-launch.txt"
import os, resource, time
import torch
from dlo.distributed.launch import launch

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

def cpu():  # this process and its waited-for children
    return sum(r.ru_utime + r.ru_stime for r in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))

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
EOF
timeout ${BENCH_TIMEOUT:-240} python3 -c "import sys; from dlo.cli import main; sys.exit(main(['bench', '--out', '$OUT'] + sys.argv[1:]))" "$@" 2>&1 \
  | tee "$OUT/gpu-bench.txt"
# The days named in DAYS at the full profile on this GPU: the claims a CPU marks "not measurable here".
for day in ${DAYS:-}; do
  timeout ${DAY_TIMEOUT:-300} python3 -c "import sys; from dlo.cli import main; sys.exit(main(sys.argv[1:]))" \
    run "$day" --profile full ${DAY_PARAMS:-} --out "$OUT/days" --jobs 1 2>&1 | tee "$OUT/gpu-$day.txt"
done
