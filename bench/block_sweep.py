"""GPU: the fixed tiles of the multi-tensor kernels and FlashAttention against their neighbours.

    python bench/block_sweep.py [--out DIR]

fused AdamW and the AMP unscale kernel launch one fixed BLOCK_SIZE / NUM_WARPS, FlashAttention one
GPU_BLOCKS tile per head dim. The compile report says they fit the targets (no spills, shared memory
within limits); this times each of them beside the other tiles that also compile, at the days' real
sizes (a 12-layer d_model 1024 transformer's 147 tensors, and one flat buffer of 2^28 elements as a
sharded optimizer holds; causal bf16 attention at T = 4096 for D = 64 and 128), so the choice is a
measurement. Each configuration gets fresh tensors (the launch tables are cached by address).
Writes DIR/<date>_<device>_block-sweep.json and prints one table per kernel."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dlo.kernels import amp_unscale, fused_adamw
from dlo.kernels import flash_attention as fa
from dlo.kernels.runtime import time_ms
from dlo.tables import format_table

ELEMENTWISE = [(block, warps) for block in (512, 1024, 2048, 4096) for warps in (4, 8)]
FLASH = {64: [(64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 32, 4, 3), (64, 32, 4, 3), (64, 64, 4, 2)],
         128: [(128, 32, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3), (128, 32, 8, 2)]}


def adamw_step(numels: list[int]):
    """One fused AdamW step over fresh fp32 tensors of these sizes (fresh addresses: fresh launch tables)."""
    params = [torch.randn(n, device="cuda") for n in numels]
    grads, m, v = [torch.randn_like(p) for p in params], [torch.randn_like(p) for p in params], \
        [torch.rand_like(p) for p in params]
    return lambda: fused_adamw.fused_adamw_(params, grads, m, v, step=2, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8,
                                            weight_decay=1e-2, check=False)


def unscale_call(numels: list[int]):
    grads = [torch.randn(n, device="cuda") for n in numels]
    found, inv = torch.zeros(1, device="cuda"), torch.ones(1, device="cuda")
    return lambda: amp_unscale.amp_unscale_(grads, found, inv)


def sweep_adamw(numels: list[int], label: str) -> list[dict]:
    rows = []
    for block, warps in ELEMENTWISE:
        fused_adamw.BLOCK_SIZE, fused_adamw.NUM_WARPS = block, warps
        ms = time_ms(adamw_step(numels))
        gbs = 28 * sum(numels) / (ms * 1e-3) / 1e9  # fp32: p, g read, p written; m, v read and written
        rows.append(dict(kernel="fused_adamw", size=label, BLOCK=block, num_warps=warps, ms=ms, **{"GB/s": gbs}))
        torch.cuda.empty_cache()
    return rows


def sweep_unscale(numels: list[int], label: str) -> list[dict]:
    rows = []
    for block, warps in ELEMENTWISE:
        amp_unscale.BLOCK_SIZE = block  # the unscale launch takes Triton's default warps (4)
        if warps != 4:
            continue
        ms = time_ms(unscale_call(numels))
        gbs = 8 * sum(numels) / (ms * 1e-3) / 1e9  # read and write each fp32 gradient
        rows.append(dict(kernel="amp_unscale", size=label, BLOCK=block, num_warps=warps, ms=ms, **{"GB/s": gbs}))
        torch.cuda.empty_cache()
    return rows


def sweep_flash(B: int = 4, H: int = 16, T: int = 4096) -> list[dict]:
    rows = []
    for D, tiles in FLASH.items():
        q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        want = fa.flash_attention_ref(q[:1, :2], k[:1, :2], v[:1, :2], causal=True)[0]
        for bm, bn, warps, stages in tiles:
            fa.GPU_BLOCKS[D] = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
            try:
                ms = time_ms(lambda q=q, k=k, v=v: fa.flash_attention(q, k, v, causal=True))
                err = (fa.flash_attention(q[:1, :2], k[:1, :2], v[:1, :2], causal=True)[0].float() - want).abs().max()
            except Exception as exc:  # noqa: BLE001 - a tile that does not fit (shared memory) is a row, not a stop
                rows.append(dict(kernel="flash_attention", size=f"B={B} H={H} T={T} D={D}", BLOCK=f"{bm}x{bn}",
                                 num_warps=warps, num_stages=stages, ms=None, error=type(exc).__name__))
                continue
            tflops = fa.attention_flops(B, H, T, D, causal=True) / (ms * 1e-3) / 1e12
            rows.append(dict(kernel="flash_attention", size=f"B={B} H={H} T={T} D={D}", BLOCK=f"{bm}x{bn}",
                             num_warps=warps, num_stages=stages, ms=ms, **{"TFLOP/s": tflops},
                             max_abs_err=float(err)))
        del q, k, v
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("block_sweep: needs a CUDA GPU")
    chosen = dict(adamw=(fused_adamw.BLOCK_SIZE, fused_adamw.NUM_WARPS), unscale=amp_unscale.BLOCK_SIZE,
                  flash={d: dict(c) for d, c in fa.GPU_BLOCKS.items()})
    model = fused_adamw.transformer_numels(1024)
    sizes = [(model, f"{sum(model) / 1e6:.0f}M in {len(model)} tensors"), ([1 << 28], "2^28 flat")]
    rows = []
    for numels, label in sizes:
        rows += sweep_adamw(numels, label) + sweep_unscale(numels, label)
    rows += sweep_flash()
    for kernel, shipped in zip(("fused_adamw", "amp_unscale", "flash_attention"), chosen.values()):
        print(f"\n{kernel} (shipped: {shipped})")
        print(format_table([r for r in rows if r["kernel"] == kernel]))
    name = torch.cuda.get_device_name().lower().replace(" ", "-")
    out = Path(args.out) / f"{time.strftime('%Y-%m-%dT%H%M', time.gmtime())}_{name}_block-sweep.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                   chosen={k: str(v) for k, v in chosen.items()}, rows=rows), indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
