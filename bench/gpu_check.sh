#!/usr/bin/env bash
# One prepared GPU session (the `device` tool's machine or any CUDA node): the kernel and GPU tests
# compiled for the GPU in hand, then `dlo bench` (kernels beside torch and the roofline).
# Writes its logs and the bench JSON to $OUT (default bench/results). Uses the python3 on PATH
# (the node's own torch/triton when the lock's CUDA wheels cannot be installed there; the JSON says which).
set -u
OUT=${OUT:-bench/results}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/lib${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/gpu-env.txt"
# Kernel, optimizer, AMP and quantization tests on the GPU (conftest picks cuda when TRITON_INTERPRET is unset).
timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -o addopts="" -m "not browser and not smoke and not solutions and not slurm" \
  tests/kernels tests/test_bench.py tests/optim/test_fused_adamw.py tests/test_amp.py tests/test_quant.py \
  --maxfail=30 -rfE > "$OUT/gpu-tests-full.txt" 2>&1  # the whole log: every failure's traceback
tail -n 60 "$OUT/gpu-tests-full.txt" | tee "$OUT/gpu-tests.txt"
timeout ${BENCH_TIMEOUT:-240} python3 -c "import sys; from dlo.cli import main; sys.exit(main(['bench', '--out', '$OUT'] + sys.argv[1:]))" "$@" 2>&1 \
  | tee "$OUT/gpu-bench.txt"
