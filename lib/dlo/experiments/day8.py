"""Day 8 experiments: quantization, pruning and distillation of an MLP, repeated over seeds, and the
claims they test; plus the plan of the full profile.

Every comparison of two training procedures (QAT vs float fine-tuning + PTQ, gradual vs one-shot
pruning, a rewound lottery ticket vs a random re-initialisation, a distilled vs a labels-only
student) differs from seed to seed by about as much as the effects claimed, so `replicate` runs
the comparisons again for other seeds (model initialisation and data order; same data) and
`claims` judges each one on the paired difference over seeds through `dlo.claims`. A control
decides where a claim needs one: "distillation helps" is the distilled student against the same
student trained on the labels only, not against the teacher.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from dlo import claims as C
from dlo import estimates as E
from dlo.accounting import optimizer_bytes
from dlo.distill import train_distill
from dlo.models.small import MLP
from dlo.plan import activation_bytes, param_bytes, row
from dlo.prune import apply_masks_, gradual_sparsity, keep_masked, magnitude_masks, prunable, rewind_, sparsity_of
from dlo.quant import prepare_qat, quantize_model
from dlo.train import evaluate, make_loader, train

QAT_BITS, QAT_GRAN = 2, "channel"  # low enough for PTQ to hurt the tiny MLP
LOW_BITS = 2  # where the group-wise claim is judged: the lowest bit width of the sweep


STREAMS = {"base": 0, "qat": 1, "float_finetune": 2, "prune": 3, "lottery": 4, "distill": 5, "structured": 6,
           "sparse24": 7}


def loader(train_ds, P, seed: int, stream: str):
    """The data order of one experiment: its own seeded loader, so that a result depends on (seed,
    experiment) only, not on what ran before it (the notebook's cells and `replicate` agree)."""
    return make_loader(train_ds, P.batch_size, seed=100 * seed + STREAMS[stream])


def new_mlp(in_features: int, hidden: int, device, seed: int) -> MLP:
    """in -> hidden -> hidden -> 10, initialised from `seed`."""
    torch.manual_seed(seed)
    return MLP(in_features, hidden, 10, depth=3).to(device)


def fit(model, batches, steps: int, device, *, lr: float = 0.0, optimizer=None, log=None, name: str = "",
        progress: bool = True) -> list[float]:
    """AdamW (or `optimizer`) for `steps` steps; the curve goes to the TensorBoard run `name` when
    `log` (`Run.writer`) is given. Returns the training losses."""
    opt = optimizer or torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    writer = log(name) if log is not None else None
    try:
        hist = train(model, opt, batches, steps=steps, device=device, writer=writer, tag=name, progress=progress)
    finally:
        if writer is not None:
            writer.close()
    return hist["loss"]


def acc(model, test, device) -> float:
    return evaluate(model, test, device)[1]


def train_base(P, train_ds, device, seed: int, *, log=None, name: str = "base", progress: bool = True):
    """The model to compress, trained P.max_steps steps: (model, its initial state_dict, curve)."""
    base = new_mlp(train_ds.tensors[0][0].numel(), P.hidden, device, seed)
    init_state = copy.deepcopy(base.state_dict())  # kept for the lottery-ticket rewind
    curve = fit(base, loader(train_ds, P, seed, "base"), P.max_steps, device, lr=P.lr, log=log, name=name,
                progress=progress)
    return base, init_state, curve


def fit_report(model, train_ds, test, device) -> dict:
    """Loss and accuracy on the training images and on held-out ones: a teacher that memorised its data
    (training loss near 0, held-out loss far above) is beaten by its own students, and a distillation
    result then says more about the teacher's overfitting than about distillation."""
    (tr_loss, tr_acc), (te_loss, te_acc) = evaluate(model, train_ds, device), evaluate(model, test, device)
    return {"train loss": tr_loss, "held-out loss": te_loss, "train acc": tr_acc, "held-out acc": te_acc}


def qat_vs_float(P, base, train_ds, test, device, seed: int, *, log=None, suffix: str = "",
                 progress: bool = True) -> dict:
    """int`QAT_BITS` PTQ of `base`; the control (the same fine-tuning in float, then PTQ: separates
    "more training" from "training with the rounding"); QAT. Accuracies, the deployed QAT model, curves."""
    qat, ft = prepare_qat(base, QAT_BITS, QAT_GRAN), copy.deepcopy(base)
    curves = {"QAT": fit(qat, loader(train_ds, P, seed, "qat"), P.finetune_steps, device, lr=P.lr / 2, log=log,
                         name=f"qat{suffix}", progress=progress),
              "float fine-tune": fit(ft, loader(train_ds, P, seed, "float_finetune"), P.finetune_steps, device,
                                     lr=P.lr / 2, log=log, name=f"float_finetune{suffix}", progress=progress)}
    deployed = quantize_model(qat, QAT_BITS, QAT_GRAN)  # the real low-bit model after QAT
    return {"PTQ": acc(quantize_model(base, QAT_BITS, QAT_GRAN), test, device),
            "float ft + PTQ": acc(quantize_model(ft, QAT_BITS, QAT_GRAN), test, device),
            "QAT": acc(deployed, test, device), "model": deployed, "curves": curves}


def gradual_end(P) -> int:
    """The step at which `prune_finetune`'s gradual schedule reaches its final sparsity: 3/4 of the steps."""
    return max(1, int(0.75 * P.finetune_steps))


def prune_finetune(P, base, train_ds, target: float, gradual: bool, device, seed: int, *, log=None,
                   name: str = "", progress: bool = True, sparsity_log: list | None = None):
    """A copy of `base` pruned to `target` (global magnitude) and fine-tuned P.finetune_steps steps
    with the mask held: all at once (one-shot), or along Zhu & Gupta's cubic schedule (masks
    recomputed every 5 steps, the final sparsity reached at `gradual_end`). (model, curve).
    `sparsity_log`: gets the measured sparsity of the prunable weights after every step."""
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=P.lr / 2, weight_decay=0.01)
    weights, n = prunable(model), P.finetune_steps
    masks = magnitude_masks(weights, 0.0 if gradual else target)
    apply_masks_(model, masks)
    hooks = []
    if gradual:
        t = [0]

        def schedule(*_):  # registered first: runs before keep_masked re-applies the masks
            t[0] += 1
            if t[0] % 5 == 0:
                masks.update(magnitude_masks(weights, gradual_sparsity(t[0], target, 0, gradual_end(P))))
        hooks.append(opt.register_step_post_hook(schedule))
    hooks.append(keep_masked(model, opt, masks))
    if sparsity_log is not None:  # after keep_masked: what the weights are, not what the schedule asked
        hooks.append(opt.register_step_post_hook(lambda *_: sparsity_log.append(sparsity_of(weights))))
    curve = fit(model, loader(train_ds, P, seed, "prune"), n, device, optimizer=opt, log=log, name=name,
                progress=progress)
    for h in hooks:
        h.remove()
    return model, curve


def lottery(P, base, init_state, train_ds, test, device, seed: int, *, log=None, suffix: str = "",
            progress: bool = True) -> dict:
    """Frankle & Carbin's experiment and its control: the mask of the trained `base` at sparsity
    P.sparsities[1] applied to (a) the weights `base` started from (rewind) and (b) a fresh random
    initialisation; both retrained as long as the dense model, on the same data order."""
    masks = magnitude_masks(prunable(base), P.sparsities[1])
    out, curves = {}, {}
    for name, tag in (("rewind", "lth_rewind"), ("random re-init", "lth_random")):
        m = new_mlp(train_ds.tensors[0][0].numel(), P.hidden, device, seed + 1000)
        rewind_(m, init_state if name == "rewind" else copy.deepcopy(m.state_dict()), masks)
        opt = torch.optim.AdamW(m.parameters(), lr=P.lr, weight_decay=0.01)
        keep_masked(m, opt, masks)
        curves[name] = fit(m, loader(train_ds, P, seed, "lottery"), P.max_steps, device, optimizer=opt, log=log,
                           name=f"{tag}{suffix}", progress=progress)
        out[name] = acc(m, test, device)
    return {**out, "curves": curves}


def distill_vs_labels(P, teacher, train_ds, test, device, seed: int, *, log=None, suffix: str = "",
                      progress: bool = True) -> dict:
    """The same small student (same initial weights, same data order) trained on the labels only
    (the control) and distilled from `teacher`. Accuracies, the distilled student, curves."""
    scratch = new_mlp(train_ds.tensors[0][0].numel(), P.student_hidden, device, seed + 2000)
    student = copy.deepcopy(scratch)
    curves = {"labels only": fit(scratch, loader(train_ds, P, seed, "distill"), P.max_steps, device, lr=P.lr,
                                 log=log, name=f"student_labels{suffix}", progress=progress)}
    writer = log(f"student_distilled{suffix}") if log is not None else None
    opt = torch.optim.AdamW(student.parameters(), lr=P.lr, weight_decay=0.01)
    hist = train_distill(student, teacher, opt, loader(train_ds, P, seed, "distill"), steps=P.max_steps,
                         device=device, temperature=P.temperature, lam=P.distill_lambda, writer=writer,
                         progress=progress)
    if writer is not None:
        writer.close()
    curves["distilled"] = hist["loss"]
    return {"labels only": acc(scratch, test, device), "distilled": acc(student, test, device), "student": student,
            "curves": curves}


def replicate(P, train_ds, test_ds, device, seed: int, *, log=None, progress: bool = False) -> dict:
    """Every comparison the claims need, for one seed (initialisation and data order; same data):
    the keys `claims` reads. The notebook's cells give the same numbers for their seed (`loader`).
    TensorBoard runs are named "<configuration>/seed<seed>"."""
    sfx = f"/seed{seed}"
    base, init_state, _ = train_base(P, train_ds, device, seed, log=log, name=f"base{sfx}", progress=progress)
    r = {"seed": seed, "sparsity": P.sparsities[-1], "fp32": acc(base, test_ds, device)}
    for bits, gran in ((8, "channel"), (LOW_BITS, "tensor"), (LOW_BITS, "group")):
        r[f"int{bits} {gran}"] = acc(quantize_model(base, bits, gran, 32), test_ds, device)
    q = qat_vs_float(P, base, train_ds, test_ds, device, seed, log=log, suffix=sfx, progress=progress)
    r.update({k: q[k] for k in ("PTQ", "float ft + PTQ", "QAT")})
    for key, gradual, tag in (("one-shot + ft", False, "oneshot"), ("gradual", True, "gradual")):
        m, _ = prune_finetune(P, base, train_ds, r["sparsity"], gradual, device, seed, log=log,
                              name=f"prune_{tag}_{r['sparsity']}{sfx}", progress=progress)
        r[key] = acc(m, test_ds, device)
    lt = lottery(P, base, init_state, train_ds, test_ds, device, seed, log=log, suffix=sfx, progress=progress)
    d = distill_vs_labels(P, base, train_ds, test_ds, device, seed, log=log, suffix=sfx, progress=progress)
    r.update({k: lt[k] for k in ("rewind", "random re-init")} | {k: d[k] for k in ("labels only", "distilled")})
    r["student/teacher params"] = (sum(p.numel() for p in d["student"].parameters())
                                   / sum(p.numel() for p in base.parameters()))
    return r


# ----------------------------------------------------------------------------- claims

def diff(results: list[dict], a: str, b: str, n_test: int) -> E.Estimate:
    """a - b in accuracy on the same n_test images, paired over seeds (each seed's noise cancels);
    fewer than 3 seeds give no interval (dlo.estimates rule 2: not two Wilson intervals of one test set)."""
    return E.paired_difference([r[a] for r in results], [r[b] for r in results],
                               f"paired over {len(results)} seeds, {n_test} test images")


def _mean_ratio(results: list[dict], a: str, b: str, n_test: int) -> E.Estimate:
    return E.paired_ratio([r[a] for r in results], [r[b] for r in results],
                          f"t over {len(results)} seeds, {n_test} test images")


def claims(results: list[dict], n_test: int, gpu: dict | None = None) -> list[C.Claim]:
    """Day 8's claims table from `replicate`'s per-seed results. `gpu`: the best measured kernel
    speed-ups {"int8": .., "sparse24": .., "w4 decode": ..} (None on a CPU: not measurable here), each
    repeated do_bench speed-ups or an Estimate; a single number gets no verdict (`speedup_estimate`)."""
    d = lambda a, b: diff(results, a, b, n_test)  # noqa: E731
    share = results[0]["student/teacher params"]
    rows = _gpu_claims(gpu)
    rows += [
        C.Claim("int8 per-channel weights are nearly free (PTQ)", "Gholami et al. 2021 (seed 003)",
                "<= 1 point lost", C.at_least(-0.01, ">= -0.01"), d("int8 channel", "fp32")),
        C.Claim(f"sub-channel (group) scales keep what per-tensor loses at low bits (int{LOW_BITS}, groups of "
                "32 inputs of a row)", "seed 003 ('sub-channel wise ... best accuracy'); the groups of GPTQ and "
                "AWQ, not Q-BERT's (section 1)", "group > tensor", C.at_least(0.0, "> 0"),
                d(f"int{LOW_BITS} group", f"int{LOW_BITS} tensor")),
        C.Claim(f"QAT recovers what PTQ loses (int{QAT_BITS}; control: float fine-tune + PTQ)", "seed 003",
                "QAT > control", C.at_least(0.0, "> 0"), d("QAT", "float ft + PTQ")),
        C.Claim(f"gradual pruning beats one-shot + fine-tune at {results[0]['sparsity']:.0%}, same steps",
                "Zhu & Gupta 2017 (seed 000)", "gradual > one-shot", C.at_least(0.0, "> 0"),
                d("gradual", "one-shot + ft")),
        C.Claim("lottery ticket: rewinding to the initial weights beats a random re-init of the same mask",
                "Frankle & Carbin 2019 (seed 000)", "rewind > random", C.at_least(0.0, "> 0"),
                d("rewind", "random re-init")),
        C.Claim("lottery ticket: the rewound sparse net matches the dense one", "Frankle & Carbin 2019 (seed 000)",
                "comparable (>= -2 points)", C.at_least(-0.02, ">= -0.02"), d("rewind", "fp32")),
        C.Claim(f"distillation beats the same student on labels only ({share:.0%} of the teacher's size)",
                "Hinton et al. 2015; seed 000", "distilled > labels only", C.at_least(0.0, "> 0"),
                d("distilled", "labels only")),
        C.Claim(f"DistilBERT: the student keeps 97% of the teacher ({share:.0%} of its size here, 60% there; "
                "control, which must fail: the same student on labels only)", "Sanh et al. 2019 (seed 000)",
                ">= 0.97 of the teacher",
                C.at_least(0.97, ">= 0.97"), _mean_ratio(results, "distilled", "fp32", n_test),
                control=_mean_ratio(results, "labels only", "fp32", n_test)),
    ]
    return rows


def speedup_estimate(v) -> E.Estimate | None:
    """A measured speed-up with its interval: an Estimate as given; repeated speed-ups (one per
    do_bench run of the same shape) as their median with its order-statistics interval; None for
    a single number. One do_bench median already averages many calls, but the run-to-run spread
    (clocks, other tenants, L2 state) is what decides a x1.5 claim, and one run does not show it."""
    if isinstance(v, E.Estimate):
        return v
    if isinstance(v, (list, tuple)) and len(v) > 1:
        return E.median_interval(v, f"median of {len(v)} do_bench runs")
    return None


def _gpu_claims(gpu: dict | None) -> list[C.Claim]:
    """The GPU speed-ups of `claims`: a value per key (a float, repeats, or an Estimate; None on a CPU)."""
    a100 = "seed 000 (NVIDIA A100 table)"
    spec = [("int8", "INT8 tensor cores: 624 TOPS vs 312 bf16 TFLOPS on A100", a100, "x2", C.at_least(1.5, ">= 1.5")),
            ("sparse24", "2:4 sparsity: x2 in theory, less in practice", "seed 000 (A100 supports 2:4); NVIDIA",
             "1 < x < 2", C.between(1.0, 2.0)),
            ("w4 decode", "weight-only int4 speeds up memory-bound decoding (M <= 16)",
             "Frantar et al. 2023 (GPTQ), Lin et al. 2024 (AWQ, TinyChat): abstracts", "> 1", C.at_least(1.0, "> 1"))]
    out = []
    for key, text, source, claimed, region in spec:
        v = (gpu or {}).get(key)
        if v is None:
            out.append(C.not_measurable(text, source, claimed, "needs a CUDA GPU (int8 / sparse tensor cores)", region))
            continue
        est, why = speedup_estimate(v), ""
        if est is None:  # one number: shown, but no verdict without its noise
            one = v[0] if isinstance(v, (list, tuple)) else v
            why = f"x{float(one):.2f} from one do_bench run: no run-to-run interval (pass repeated speed-ups)"
        est = est and C.timed(est, device="cuda", gpu_claim=True)
        out.append(C.Claim(text, source, claimed, region, est, why))
    return out


def plan(P, *, gpus: int, gpu_mem_gb: float) -> list[dict]:
    """Rows: base MLP training (AdamW, fp32), distillation (student trained, teacher held, frozen),
    static PTQ calibration (the percentile observer keeps every input value it sees, in host memory),
    and the MLP block in bf16 dense / W8A16 / W4A16 (weights, and the block's activations at
    P.llama_tokens tokens, inference only). Single process: `gpus` does not change the rows."""
    d_in = 3 * P.image_size ** 2
    with torch.device("meta"):
        base, student = MLP(d_in, P.hidden, 10, depth=3), MLP(d_in, P.student_hidden, 10, depth=3)
        x, y = torch.randn(P.batch_size, d_in), torch.randint(0, 10, (P.batch_size,))
    rows = []
    for name, model, extra in (("base MLP training", base, 0), ("distillation", student, param_bytes(base))):
        n = param_bytes(model)
        acts = activation_bytes(lambda model=model: F.cross_entropy(model(x), y), exclude=list(model.parameters()))
        rows.append(row(name, 1, params=n + extra, grads=n, optimizer=optimizer_bytes("adamw", n),
                        activations=acts, gpu_mem_gb=gpu_mem_gb, main=name == "base MLP training",
                        note=f"{d_in} -> {model.net[1].out_features} x 2 -> 10, batch {P.batch_size}, AdamW"
                        + ("; the teacher's weights in params" if extra else "")))
    calib = P.calib_batches * P.batch_size * (d_in + 2 * P.hidden) * 4  # every Linear's input, fp32
    rows.append(row("PTQ calibration (percentile)", 1, params=param_bytes(base), grads=0, optimizer=0,
                    activations=calib, gpu_mem_gb=gpu_mem_gb,
                    note=f"{P.calib_batches} batches of inputs kept by the observers (host memory)"))
    d, h, t = P.llama_d_model, P.llama_hidden, P.llama_tokens
    weights = 3 * d * h  # gate, up (h, d) and down (d, h)
    block_acts = t * (d + 3 * h) * 2  # x, gate(x), up(x), their product: bf16, no graph (inference)
    for name, nbytes in (("bf16 dense", 2 * weights), ("W8A16 group 128", weights + 4 * weights // 128),
                         ("W4A16 group 128", weights // 2 + 4 * weights // 128)):
        rows.append(row(f"MLP block {name}", 1, params=nbytes, grads=0, optimizer=0, activations=block_acts,
                        gpu_mem_gb=gpu_mem_gb, note=f"d={d}, hidden={h}, {t} tokens; scales in fp32"))
    return rows
