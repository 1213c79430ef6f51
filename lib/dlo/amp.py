"""Mixed precision: a dynamic loss scaler, an autocast training step and the measurements of Day 2.

Mixed-precision training (Micikevicius et al. 2018) runs matmuls and convolutions in a 16-bit format
and keeps master weights, optimizer state and reductions in fp32. fp16 (5 exponent bits) needs loss
scaling so that small gradients do not flush to zero; bf16 (8 exponent bits, the fp32 range; Kalamkar
et al. 2019) trains without it. `DynamicLossScaler` is the scaler of the paper's Sec. 3.2, with the
interface and update rule of torch.amp.GradScaler, and unscales through the multi-tensor Triton kernel
of dlo.kernels.amp_unscale where that kernel can run.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dlo.kernels.amp_unscale import amp_unscale_, amp_unscale_ref
from dlo.kernels.runtime import kernel_available
from dlo.measure import saved_bytes

FP16_MAX = 65504.0  # largest finite fp16: (2 - 2^-10) * 2^15
FP16_MIN_NORMAL = 2.0 ** -14  # below this fp16 loses precision (subnormals) ...
FP16_MIN_SUBNORMAL = 2.0 ** -24  # ... and below this everything rounds to zero
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
MODES = ("fp32", "tf32", "bf16", "fp16")


def float_formats() -> list[dict]:
    """One row per training float format: bit layout, range and precision, read from torch.finfo."""
    rows = []
    for name, dtype, exp_bits, man_bits in (("fp32", torch.float32, 8, 23), ("tf32", torch.float32, 8, 10),
                                            ("fp16", torch.float16, 5, 10), ("bf16", torch.bfloat16, 8, 7)):
        fi = torch.finfo(dtype)
        eps = 2.0 ** -man_bits  # tf32 is fp32 storage with a 10-bit mantissa inside the tensor cores
        rows.append({"format": name, "sign": 1, "exponent": exp_bits, "mantissa": man_bits, "max": float(fi.max),
                     "min normal": float(fi.tiny), "eps": eps, "decimal digits": man_bits * 0.301})
    return rows


# ----------------------------------------------------------------------------- dynamic loss scaling

class DynamicLossScaler:
    """Dynamic loss scaling, GradScaler's interface and arithmetic (Micikevicius et al. 2018, Sec. 3.2).

    Each iteration: `scale(loss).backward()`; optionally `unscale_(opt)` (to clip true gradients);
    `step(opt)` unscales if needed and skips `opt.step()` when a gradient is inf or nan; `update()`
    multiplies the scale by `backoff_factor` after an overflow, by `growth_factor` after
    `growth_interval` overflow-free steps in a row. Scale, growth counter and overflow flag live on the
    device as tensors, so the only host sync is step()'s decision to step or skip.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True, use_kernel: bool | None = None):
        if not (growth_factor > 1.0 and 0.0 < backoff_factor < 1.0 and growth_interval >= 1 and init_scale > 0):
            raise ValueError(f"need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1; "
                             f"got {init_scale}, {growth_factor}, {backoff_factor}, {growth_interval}")
        self.init_scale, self.growth_factor, self.backoff_factor = init_scale, growth_factor, backoff_factor
        self.growth_interval, self.enabled, self.use_kernel = growth_interval, enabled, use_kernel
        self._scale: Tensor | None = None  # () fp32, created on the loss's device by the first scale()
        self._growth_tracker: Tensor | None = None  # () int32: overflow-free steps since the last change
        self._found_inf: dict[int, Tensor] = {}  # id(optimizer) -> () fp32 flag, set by unscale_
        self._stepped: set[int] = set()
        self.last_step_skipped = False

    def scale(self, loss: Tensor) -> Tensor:
        """loss * S. The product keeps the loss's dtype (S is a 0-dim tensor)."""
        if not self.enabled:
            return loss
        if self._scale is None:
            self._scale = torch.full((), self.init_scale, dtype=torch.float32, device=loss.device)
            self._growth_tracker = torch.zeros((), dtype=torch.int32, device=loss.device)
        return loss * self._scale.to(loss.device)

    def _unscale_grads(self, grads: list[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
        use_kernel = self.use_kernel
        if use_kernel is None:
            use_kernel = kernel_available(found_inf.device) and all(map(Tensor.is_contiguous, grads))
        (amp_unscale_ if use_kernel else amp_unscale_ref)(grads, found_inf.view(1), inv_scale.view(1))

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by S in place and record whether any is inf or nan."""
        if not self.enabled:
            return
        if self._scale is None:
            raise RuntimeError("unscale_() before any scale(): there is no scale yet")
        key = id(optimizer)
        if key in self._stepped:
            raise RuntimeError("unscale_() is being called after step(); call update() first")
        if key in self._found_inf:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update()")
        inv_scale = self._scale.double().reciprocal().float()  # 1/S rounded once, as GradScaler does
        found_inf = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        self._unscale_grads(grads, found_inf, inv_scale)
        self._found_inf[key] = found_inf

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        """Unscale (unless already done) and call optimizer.step() only if all gradients are finite."""
        if not self.enabled:
            return optimizer.step(*args, **kwargs)
        key = id(optimizer)
        if key in self._stepped:
            raise RuntimeError("step() has already been called since the last update()")
        if key not in self._found_inf:
            self.unscale_(optimizer)
        self._stepped.add(key)
        self.last_step_skipped = bool(self._found_inf[key].item())  # the one host sync per iteration
        return None if self.last_step_skipped else optimizer.step(*args, **kwargs)

    def update(self) -> None:
        """Back off after an overflow, grow after `growth_interval` clean steps (torch._amp_update_scale_)."""
        if not self.enabled:
            return
        if not self._found_inf:
            raise RuntimeError("update() without any unscale_() or step() since the last update()")
        found = torch.stack(list(self._found_inf.values())).sum() > 0
        tracker = torch.where(found, torch.zeros_like(self._growth_tracker), self._growth_tracker + 1)
        grow = tracker == self.growth_interval
        grown = self._scale * self.growth_factor
        grown = torch.where(torch.isfinite(grown), grown, self._scale)  # never grow into inf
        self._scale = torch.where(found, self._scale * self.backoff_factor, torch.where(grow, grown, self._scale))
        self._growth_tracker = torch.where(grow, torch.zeros_like(tracker), tracker)
        self._found_inf.clear()
        self._stepped.clear()

    def get_scale(self) -> float:
        """The current scale S as a float (init_scale before the first scale(); 1.0 when disabled)."""
        if not self.enabled:
            return 1.0
        return self.init_scale if self._scale is None else float(self._scale.item())


# ----------------------------------------------------------------------------- training step

def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: Tensor, y: Tensor, *,
               dtype: torch.dtype | None = None, scaler=None, loss_weight: float = 1.0) -> Tensor:
    """One step of cross-entropy training; the forward runs under autocast(dtype) unless dtype is None
    (plain fp32). Parameters, gradients and optimizer state stay fp32 (master weights). With a scaler
    (fp16) the loss is scaled and the step may be skipped. The loss that is backpropagated is
    `loss_weight` times the cross-entropy (a weighted term; a mean over very many samples). Returns
    the detached fp32 cross-entropy (unweighted)."""
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None):
        logits = model(x)  # (B, classes) in `dtype`
        loss = F.cross_entropy(logits, y)  # autocast runs the softmax and the mean in fp32
    weighted = loss * loss_weight if loss_weight != 1.0 else loss
    if scaler is None:
        weighted.backward()
        optimizer.step()
    else:
        scaler.scale(weighted).backward()  # backward outside autocast: ops reuse the forward's dtypes
        scaler.step(optimizer)
        scaler.update()
    return loss.detach().float()


def zero_grad_fraction(parameters) -> float:
    """Fraction of gradient entries that are exactly 0 (fp16 underflow shows up here, next to the
    zeros a ReLU produces anyway: compare with an fp32 run)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    total = sum(g.numel() for g in grads)
    return sum(int((g == 0).sum()) for g in grads) / total if total else 0.0


def amp_step(dtype: torch.dtype | None = None, scaler=None, loss_weight: float = 1.0):
    """`train_step` as a step function of `dlo.train.train`: metrics "loss", "scale" (after update),
    "skipped" (1.0 when the scaler skipped the step: update() lowered the scale, which reads the
    same for torch.amp.GradScaler, which has no skipped flag, as for DynamicLossScaler) and
    "zero_grads" (`zero_grad_fraction` of the step's gradients, before any unscaling skip)."""
    def step(model: nn.Module, optimizer: torch.optim.Optimizer, batch) -> dict:
        before = scaler.get_scale() if scaler is not None else 1.0
        loss = train_step(model, optimizer, batch[0], batch[1], dtype=dtype, scaler=scaler, loss_weight=loss_weight)
        scale = scaler.get_scale() if scaler is not None else 1.0
        return {"loss": loss, "scale": scale, "skipped": float(scale < before),
                "zero_grads": zero_grad_fraction(model.parameters())}
    return step


def train_amp(model: nn.Module, optimizer: torch.optim.Optimizer, batches, *, steps: int, device,
              dtype: torch.dtype | None = None, scaler=None, progress: bool = True, writer=None,
              loss_weight: float = 1.0, eval_data=None) -> dict:
    """`dlo.train.train` with `amp_step(dtype, scaler, loss_weight)`; history["skipped"] is the number
    of skipped steps, history["skipped_at"] their indices. With `eval_data`, "eval_loss"/"eval_acc" are
    measured under the same autocast."""
    from dlo.train import evaluate, train

    hist = train(model, optimizer, batches, steps=steps, device=device, step_fn=amp_step(dtype, scaler, loss_weight),
                 writer=writer, tag=str(dtype or "fp32").removeprefix("torch."), progress=progress)
    hist["skipped_at"] = [i for i, skipped in enumerate(hist["skipped"]) if skipped]
    hist["skipped"] = len(hist["skipped_at"])
    if eval_data is not None:
        with torch.autocast(torch.device(device).type, dtype=dtype, enabled=dtype is not None):
            hist["eval_loss"], hist["eval_acc"] = evaluate(model, eval_data, device)
        if writer is not None:
            writer.add_scalar("eval_acc", hist["eval_acc"], steps)
            writer.add_scalar("eval_loss", hist["eval_loss"], steps)
    return hist


def underflow_fraction(model: nn.Module, x: Tensor, y: Tensor, *, dtype: torch.dtype = torch.float16,
                       loss_weight: float = 1.0, scale: float = 1.0) -> float:
    """Measured underflow: the fraction of gradient entries that are non-zero in an fp32 backward of
    `loss_weight * cross_entropy` but exactly zero in an autocast(dtype) backward of the same weights
    and batch with the loss multiplied by `scale` (a loss scale). The model's .grad are left at None."""
    grads = []
    for dt, s in ((None, 1.0), (dtype, scale)):
        model.zero_grad(set_to_none=True)
        with torch.autocast(x.device.type, dtype=dt, enabled=dt is not None):
            loss = F.cross_entropy(model(x), y)
        (loss * (loss_weight * s)).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    model.zero_grad(set_to_none=True)
    ref, low = grads
    alive = ref != 0
    return float(((low == 0) & alive).sum()) / max(1, int(alive.sum()))


def grad_log2_magnitudes(parameters) -> Tensor:
    """log2|g| of every non-zero gradient element, one fp32 vector, for histograms of exponents."""
    mags = [p.grad.detach().float().abs().flatten() for p in parameters if p.grad is not None]
    g = torch.cat(mags) if mags else torch.zeros(0)
    return torch.log2(g[g > 0]).cpu()


# ----------------------------------------------------------------------------- measurement

def saved_activation_bytes(model: nn.Module, *inputs: Tensor, dtype: torch.dtype | None = None) -> dict:
    """Bytes autograd keeps for the backward pass of one forward of `model`, optionally under autocast.

    Counted by dlo.measure.saved_bytes (saved_tensors_hooks), so exact and device-independent: every
    saved tensor's storage once (views of one buffer count once), leaving out the model's own
    parameters and buffers, which exist anyway. Autocast's low-precision weight copies are counted:
    they are held until backward too. Returns {"total", "tensors", "by_dtype": {dtype name: bytes}}.
    """
    device_type = inputs[0].device.type if inputs else "cpu"

    def forward():
        with torch.autocast(device_type, dtype=dtype, enabled=dtype is not None):
            return model(*inputs)

    r = saved_bytes(forward, exclude=(*model.parameters(), *model.buffers()), backward=False)
    return {"total": r["saved_bytes"], "tensors": r["saved_tensors"], "by_dtype": r["by_dtype"]}


@contextlib.contextmanager
def precision_mode(mode: str):
    """Yield the autocast dtype (None for fp32/tf32) of `mode`; "tf32" switches tf32 matmuls and
    convolutions on for the duration, "fp32" switches them off, and the old flags come back after."""
    if mode not in MODES:
        raise ValueError(f"unknown precision mode {mode!r}; choose from {MODES}")
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = mode == "tf32"
    try:
        yield AUTOCAST_DTYPES.get(mode)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def precision_step(make_model, batch: tuple[Tensor, Tensor], *, mode: str, device, compile: bool = False,
                   channels_last: bool = False, lr: float = 1e-3):
    """A closure running one AdamW training step of a fresh `make_model()` in precision `mode`, for
    `dlo.measure.measure_step` (time and peak memory). fp16 gets a DynamicLossScaler; `compile`
    wraps the model in torch.compile, `channels_last` puts model and images in NHWC."""
    device = torch.device(device)
    model = make_model().to(device)
    x, y = (t.to(device) for t in batch)
    if channels_last:
        model, x = model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    fwd = torch.compile(model) if compile else model
    scaler = DynamicLossScaler() if mode == "fp16" else None

    def step() -> Tensor:
        with precision_mode(mode) as dtype:
            return train_step(fwd, optimizer, x, y, dtype=dtype, scaler=scaler)
    return step
