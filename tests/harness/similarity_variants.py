# ruff: noqa: E501 - student code, kept as written (long signatures and plans)
"""Independent solutions of seven exercises, five each, to calibrate the similarity report's rule
(tests/harness/test_similarity_calibration.py): how far apart honest answers to the same exercise are.

Written for this purpose from the exercise's text and signature only (not from the solution or the
library), each with a structure of its own: loops against vectorized code, helpers against one
function, in place against out of place, another decomposition of the same formula. One author wrote
all of them (a class has many): they measure the spread an exercise leaves, not a real class's.
Day 1 and Day 8 ones pass their checks (test_similarity_calibration.py runs them).
"""

VARIANTS = {
    ("day1_optimizers", "adamw"): [
        '''def adamw_step(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2):
    with torch.no_grad():
        decay = 1.0 - lr * weight_decay
        param.copy_(param * decay)
        exp_avg.copy_(beta1 * exp_avg + (1 - beta1) * grad)
        exp_avg_sq.copy_(beta2 * exp_avg_sq + (1 - beta2) * grad * grad)
        c1 = 1 - beta1 ** step
        c2 = 1 - beta2 ** step
        denom = torch.sqrt(exp_avg_sq / c2) + eps
        param.copy_(param - lr * (exp_avg / c1) / denom)
''',
        '''def adamw_step(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2):
    param.data.mul_(1.0 - weight_decay * lr)
    exp_avg.data.lerp_(grad, 1.0 - beta1)
    exp_avg_sq.data.mul_(beta2).add_(grad.square(), alpha=1.0 - beta2)
    step_size = lr / (1.0 - beta1 ** step)
    root = (exp_avg_sq / (1.0 - beta2 ** step)).sqrt().add(eps)
    param.data.addcdiv_(exp_avg, root, value=-step_size)
''',
        '''def adamw_step(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2):
    t = step
    g = grad.detach()
    exp_avg.mul_(beta1)
    exp_avg.add_((1 - beta1) * g)
    exp_avg_sq.mul_(beta2)
    exp_avg_sq.add_((1 - beta2) * g.pow(2))
    bias1 = 1 - math.pow(beta1, t)
    bias2 = 1 - math.pow(beta2, t)
    update = (exp_avg / bias1) / ((exp_avg_sq / bias2).pow(0.5) + eps)
    param.detach().mul_(1 - lr * weight_decay).sub_(lr * update)
''',
        '''def adamw_step(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2):
    def ema(avg, new, beta):
        avg.mul_(beta).add_(new * (1 - beta))

    with torch.no_grad():
        param -= lr * weight_decay * param
        ema(exp_avg, grad, beta1)
        ema(exp_avg_sq, grad * grad, beta2)
        m = exp_avg / (1 - beta1 ** step)
        v = exp_avg_sq / (1 - beta2 ** step)
        param -= lr * m / (v.sqrt() + eps)
''',
        '''def adamw_step(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2):
    torch.mul(exp_avg, beta1, out=exp_avg)
    torch.add(exp_avg, grad, alpha=1 - beta1, out=exp_avg)
    torch.mul(exp_avg_sq, beta2, out=exp_avg_sq)
    torch.addcmul(exp_avg_sq, grad, grad, value=1 - beta2, out=exp_avg_sq)
    corrected_first = exp_avg.div(1 - beta1 ** step)
    corrected_second = exp_avg_sq.div(1 - beta2 ** step)
    with torch.no_grad():
        param.mul_(1 - lr * weight_decay)
        param.addcdiv_(corrected_first, corrected_second.sqrt().add_(eps), value=-lr)
''',
    ],
    ("day1_optimizers", "warmup_cosine"): [
        '''def warmup_cosine(step, *, base_lr, warmup_steps, total_steps, min_lr=0.0, start_factor=0.01):
    if warmup_steps >= total_steps:
        raise ValueError("no steps left for the cosine")
    if warmup_steps > 0 and step < warmup_steps:
        frac = step / warmup_steps
        return base_lr * start_factor + (base_lr - base_lr * start_factor) * frac
    decay_len = max(1, total_steps - warmup_steps)
    t = min(step - warmup_steps, decay_len) / decay_len
    cosine = (1 + math.cos(math.pi * t)) / 2
    return min_lr + (base_lr - min_lr) * cosine
''',
        '''def warmup_cosine(step, *, base_lr, warmup_steps, total_steps, min_lr=0.0, start_factor=0.01):
    if total_steps <= warmup_steps:
        raise ValueError(f"total_steps={total_steps} must exceed warmup_steps={warmup_steps}")
    in_warmup = step < warmup_steps
    if in_warmup:
        scale = start_factor + (1.0 - start_factor) * (step / warmup_steps)
        return scale * base_lr
    elapsed = step - warmup_steps
    length = total_steps - warmup_steps
    angle = math.pi * elapsed / length
    return min_lr + (base_lr - min_lr) * 0.5 * (1.0 + math.cos(angle))
''',
        '''def warmup_cosine(step, *, base_lr, warmup_steps, total_steps, min_lr=0.0, start_factor=0.01):
    if not warmup_steps < total_steps:
        raise ValueError("warmup must end before training does")
    def linear(s):
        return start_factor + (1 - start_factor) * s / warmup_steps

    def cosine(s):
        p = (s - warmup_steps) / (total_steps - warmup_steps)
        return (min_lr + (base_lr - min_lr) * (math.cos(p * math.pi) + 1) / 2) / base_lr

    factor = linear(step) if step < warmup_steps else cosine(step)
    return base_lr * factor
''',
        '''def warmup_cosine(step, *, base_lr, warmup_steps, total_steps, min_lr=0.0, start_factor=0.01):
    if total_steps - warmup_steps <= 0:
        raise ValueError("empty decay phase")
    lr_start = base_lr * start_factor
    if step >= warmup_steps:
        done = (step - warmup_steps) / float(total_steps - warmup_steps)
        half_wave = 0.5 * (1.0 + math.cos(math.pi * done))
        return min_lr + half_wave * (base_lr - min_lr)
    slope = (base_lr - lr_start) / warmup_steps
    return lr_start + slope * step
''',
        '''def warmup_cosine(step, *, base_lr, warmup_steps, total_steps, min_lr=0.0, start_factor=0.01):
    span_ok = total_steps > warmup_steps
    if not span_ok:
        raise ValueError("warmup_steps >= total_steps")
    phase = "warmup" if step < warmup_steps else "decay"
    if phase == "warmup":
        weight = step / warmup_steps
        return base_lr * ((1 - weight) * start_factor + weight)
    remaining = total_steps - step
    span = total_steps - warmup_steps
    c = math.cos(math.pi * (1 - remaining / span))
    return (base_lr + min_lr) / 2 + (base_lr - min_lr) / 2 * c
''',
    ],
    ("day1_optimizers", "clip_grad_norm"): [
        '''def clip_grad_norm(parameters, max_norm, norm_type=2.0):
    grads = [p.grad.detach() for p in list(parameters) if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    if math.isinf(norm_type):
        norms = [g.abs().max() for g in grads]
        total = max(norms)
    else:
        total = sum(g.abs().pow(norm_type).sum() for g in grads) ** (1.0 / norm_type)
    scale = max_norm / (total + 1e-6)
    if scale < 1:
        for g in grads:
            g.mul_(scale)
    return total
''',
        '''def clip_grad_norm(parameters, max_norm, norm_type=2.0):
    with_grad = []
    for p in parameters:
        if p.grad is not None:
            with_grad.append(p)
    if len(with_grad) == 0:
        return torch.zeros(())
    flat = torch.cat([p.grad.reshape(-1) for p in with_grad])
    total_norm = flat.abs().max() if norm_type == float("inf") else torch.linalg.vector_norm(flat, norm_type)
    factor = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    for p in with_grad:
        p.grad.mul_(factor)
    return total_norm
''',
        '''def clip_grad_norm(parameters, max_norm, norm_type=2.0):
    gs = [q.grad for q in parameters if q.grad is not None]
    if gs == []:
        return torch.tensor(0.)
    per_tensor = torch.stack([torch.linalg.vector_norm(g, ord=norm_type) for g in gs])
    total = torch.linalg.vector_norm(per_tensor, ord=norm_type)
    ratio = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in gs:
        g.mul_(ratio)
    return total
''',
        '''def clip_grad_norm(parameters, max_norm, norm_type=2.0):
    params = [p for p in parameters]
    if all(p.grad is None for p in params):
        return torch.tensor(0.0)
    total = torch.zeros(())
    if norm_type == math.inf:
        for p in params:
            if p.grad is not None:
                total = torch.maximum(total, p.grad.abs().max())
    else:
        for p in params:
            if p.grad is not None:
                total = total + (p.grad.abs() ** norm_type).sum()
        total = total ** (1 / norm_type)
    coef = max_norm / (total + 1e-6)
    if coef < 1:
        for p in params:
            if p.grad is not None:
                p.grad.detach().mul_(coef)
    return total
''',
        '''def clip_grad_norm(parameters, max_norm, norm_type=2.0):
    grads = list(filter(lambda g: g is not None, (p.grad for p in parameters)))
    if len(grads) < 1:
        return torch.as_tensor(0.0)
    norms = torch.stack([g.norm(p=norm_type) for g in grads])
    total = norms.max() if norm_type == math.inf else norms.norm(p=norm_type)
    clip = max_norm / (float(total) + 1e-6)
    if clip < 1.0:
        for g in grads:
            g.mul_(clip)
    return total
''',
    ],
    ("day8_quantization_pruning", "gradual"): [
        '''def gradual_sparsity(step, final_sparsity, begin_step, end_step, initial_sparsity=0.0):
    if step < begin_step:
        return initial_sparsity
    if step > end_step:
        return final_sparsity
    progress = (step - begin_step) / (end_step - begin_step)
    return final_sparsity + (initial_sparsity - final_sparsity) * (1 - progress) ** 3
''',
        '''def gradual_sparsity(step, final_sparsity, begin_step, end_step, initial_sparsity=0.0):
    n = end_step - begin_step
    k = max(0, min(n, step - begin_step))
    left = 1.0 - k / n
    gap = initial_sparsity - final_sparsity
    return final_sparsity + gap * left * left * left
''',
        '''def gradual_sparsity(step, final_sparsity, begin_step, end_step, initial_sparsity=0.0):
    clamped = sorted((begin_step, step, end_step))[1]
    remaining = (end_step - clamped) / (end_step - begin_step)
    return initial_sparsity * remaining ** 3 + final_sparsity * (1 - remaining ** 3)
''',
        '''def gradual_sparsity(step, final_sparsity, begin_step, end_step, initial_sparsity=0.0):
    if begin_step < step < end_step:
        done = (step - begin_step) / (end_step - begin_step)
        return final_sparsity - (final_sparsity - initial_sparsity) * math.pow(1 - done, 3)
    return initial_sparsity if step <= begin_step else final_sparsity
''',
        '''def gradual_sparsity(step, final_sparsity, begin_step, end_step, initial_sparsity=0.0):
    span = float(end_step - begin_step)
    frac = (step - begin_step) / span
    frac = 0.0 if frac < 0 else (1.0 if frac > 1 else frac)
    return float(final_sparsity + (initial_sparsity - final_sparsity) * (1.0 - frac) ** 3)
''',
    ],
    ("day8_quantization_pruning", "distill"): [
        '''def distillation_loss(student_logits, teacher_logits, targets, temperature=2.0, lam=1.0):
    t = temperature
    p_teacher = F.softmax(teacher_logits.detach() / t, dim=-1)
    log_p_student = F.log_softmax(student_logits / t, dim=-1)
    kd = F.kl_div(log_p_student, p_teacher, reduction="batchmean") * t * t
    ce = F.cross_entropy(student_logits, targets)
    return kd + lam * ce
''',
        '''def distillation_loss(student_logits, teacher_logits, targets, temperature=2.0, lam=1.0):
    with torch.no_grad():
        teacher_log = torch.log_softmax(teacher_logits / temperature, dim=1)
    student_log = torch.log_softmax(student_logits / temperature, dim=1)
    kl_per_row = (teacher_log.exp() * (teacher_log - student_log)).sum(dim=1)
    soft = kl_per_row.mean() * temperature ** 2
    hard = torch.nn.functional.nll_loss(torch.log_softmax(student_logits, dim=1), targets)
    return soft + lam * hard
''',
        '''def distillation_loss(student_logits, teacher_logits, targets, temperature=2.0, lam=1.0):
    batch = student_logits.shape[0]
    kl = torch.nn.KLDivLoss(reduction="sum", log_target=True)
    s = F.log_softmax(student_logits / temperature, dim=-1)
    tch = F.log_softmax(teacher_logits / temperature, dim=-1).detach()
    loss = kl(s, tch) / batch * temperature ** 2
    if lam:
        loss = loss + lam * torch.nn.CrossEntropyLoss()(student_logits, targets)
    return loss
''',
        '''def distillation_loss(student_logits, teacher_logits, targets, temperature=2.0, lam=1.0):
    scaled_s = student_logits / temperature
    scaled_t = teacher_logits.detach() / temperature
    log_q = scaled_s - torch.logsumexp(scaled_s, dim=-1, keepdim=True)
    log_p = scaled_t - torch.logsumexp(scaled_t, dim=-1, keepdim=True)
    kl = torch.sum(torch.exp(log_p) * (log_p - log_q)) / student_logits.size(0)
    return temperature ** 2 * kl + lam * F.cross_entropy(student_logits, targets)
''',
        '''def distillation_loss(student_logits, teacher_logits, targets, temperature=2.0, lam=1.0):
    T2 = temperature * temperature
    teacher_probs = (teacher_logits / temperature).softmax(-1).detach()
    student_logp = (student_logits / temperature).log_softmax(-1)
    cross = -(teacher_probs * student_logp).sum(-1).mean()
    entropy = -(teacher_probs * teacher_probs.clamp_min(1e-30).log()).sum(-1).mean()
    return T2 * (cross - entropy) + lam * F.cross_entropy(student_logits, targets)
''',
    ],
    ("day6_pipeline", "one_f_one_b"): [
        '''def one_f_one_b_step(stage, microbatches, targets, loss_fn):
    mb = MicroBatches(stage, microbatches, targets, loss_fn)
    count = len(stage.in_shapes)
    ahead = min(count, stage.p - stage.rank - 1)
    order = [("f", i) for i in range(ahead)]
    for k in range(count - ahead):
        order += [("f", ahead + k), ("b", k)]
    order += [("b", k) for k in range(count - ahead, count)]
    for kind, idx in order:
        (mb.forward if kind == "f" else mb.backward)(idx)
    return mb.finish()
''',
        '''def one_f_one_b_step(stage, microbatches, targets, loss_fn):
    runner = MicroBatches(stage, microbatches, targets, loss_fn)
    total = len(stage.in_shapes)
    in_flight_limit = min(stage.p - stage.rank, total)
    fwd = bwd = 0
    while bwd < total:
        if fwd < total and fwd - bwd < in_flight_limit:
            runner.forward(fwd)
            fwd += 1
        else:
            runner.backward(bwd)
            bwd += 1
    return runner.finish()
''',
        '''def one_f_one_b_step(stage, microbatches, targets, loss_fn):
    state = MicroBatches(stage, microbatches, targets, loss_fn)
    m = len(stage.in_shapes)
    depth = stage.p - stage.rank - 1
    f_list, b_list = list(range(m)), list(range(m))
    schedule = [("F", f_list.pop(0)) for _ in range(min(depth, m))]
    while f_list:
        schedule.append(("F", f_list.pop(0)))
        schedule.append(("B", b_list.pop(0)))
    schedule.extend(("B", b) for b in b_list)
    for op, i in schedule:
        if op == "F":
            state.forward(i)
        else:
            state.backward(i)
    return state.finish()
''',
        '''def one_f_one_b_step(stage, microbatches, targets, loss_fn):
    work = MicroBatches(stage, microbatches, targets, loss_fn)
    n_micro = len(stage.in_shapes)
    n_warm = max(0, min(n_micro, stage.p - stage.rank - 1))
    for i in range(n_micro + n_warm):
        if i < n_micro:
            work.forward(i)
        j = i - n_warm
        if 0 <= j < n_micro:
            work.backward(j)
    return work.finish()
''',
        '''def one_f_one_b_step(stage, microbatches, targets, loss_fn):
    pipe = MicroBatches(stage, microbatches, targets, loss_fn)
    m = len(stage.in_shapes)
    lead = min(m, stage.p - stage.rank - 1)
    forwards = iter(range(m))
    for _ in range(lead):
        pipe.forward(next(forwards))
    for b, f in itertools.zip_longest(range(m), forwards):
        if f is not None:
            pipe.forward(f)
        pipe.backward(b)
    return pipe.finish()
''',
    ],
    ("day7_tensor_parallel", "dtensor_plan"): [
        '''def apply_tp_plan(model, tp_mesh):
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    parallelize_module(model, tp_mesh, top)
    model.tie_weights()
    per_block = {
        "attention_norm": SequenceParallel(),
        "ffn_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    }
    for proj in ("wq", "wk", "wv"):
        per_block[f"attention.{proj}"] = ColwiseParallel()
    per_block["attention.wo"] = RowwiseParallel(output_layouts=Shard(1))
    for proj in ("w1", "w3"):
        per_block[f"feed_forward.{proj}"] = ColwiseParallel()
    per_block["feed_forward.w2"] = RowwiseParallel(output_layouts=Shard(1))
    for layer in model.layers.values():
        parallelize_module(layer, tp_mesh, per_block)
    return model
''',
        '''def apply_tp_plan(model, tp_mesh):
    def block_plan():
        col, row = ColwiseParallel, RowwiseParallel
        return {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            **{f"attention.{w}": col() for w in ("wq", "wk", "wv")},
            "attention.wo": row(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            **{f"feed_forward.{w}": col() for w in ("w1", "w3")},
            "feed_forward.w2": row(output_layouts=Shard(1)),
        }

    for _, block in model.layers.items():
        parallelize_module(block, tp_mesh, block_plan())
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    model.tie_weights()
    return model
''',
        '''def apply_tp_plan(model, tp_mesh):
    seq = SequenceParallel
    parallelize_module(model.tok_embeddings, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)))
    parallelize_module(model.norm, tp_mesh, seq())
    parallelize_module(model.output, tp_mesh, ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False))
    model.tie_weights()
    for blk in model.layers.values():
        attn, mlp = blk.attention, blk.feed_forward
        parallelize_module(blk.attention_norm, tp_mesh, seq())
        parallelize_module(blk.ffn_norm, tp_mesh, seq())
        parallelize_module(attn, tp_mesh, PrepareModuleInput(input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)))
        parallelize_module(mlp, tp_mesh, PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)))
        for lin in (attn.wq, attn.wk, attn.wv, mlp.w1, mlp.w3):
            parallelize_module(lin, tp_mesh, ColwiseParallel())
        for lin in (attn.wo, mlp.w2):
            parallelize_module(lin, tp_mesh, RowwiseParallel(output_layouts=Shard(1)))
    return model
''',
        '''def apply_tp_plan(model, tp_mesh):
    sharded_seq = Shard(1)
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=sharded_seq),
        "output": ColwiseParallel(input_layouts=sharded_seq, output_layouts=Shard(-1), use_local_output=False),
        "norm": SequenceParallel(),
    })
    model.tie_weights()
    colwise = ["attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"]
    rowwise = ["attention.wo", "feed_forward.w2"]
    norms = ["attention_norm", "ffn_norm"]
    for block in model.layers.values():
        plan = {name: ColwiseParallel() for name in colwise}
        plan.update({name: RowwiseParallel(output_layouts=sharded_seq) for name in rowwise})
        plan.update({name: SequenceParallel() for name in norms})
        plan["attention"] = PrepareModuleInput(input_layouts=(sharded_seq, None, None), desired_input_layouts=(Replicate(), None, None))
        plan["feed_forward"] = PrepareModuleInput(input_layouts=(sharded_seq,), desired_input_layouts=(Replicate(),))
        parallelize_module(block, tp_mesh, plan)
    return model
''',
        '''def apply_tp_plan(model, tp_mesh):
    def attention_plan():
        return {"attention": PrepareModuleInput(input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)),
                "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)), "attention_norm": SequenceParallel()}

    def mlp_plan():
        return {"feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(), "ffn_norm": SequenceParallel()}

    embed = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    head = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, tp_mesh, {"tok_embeddings": embed, "norm": SequenceParallel(), "output": head})
    model.tie_weights()
    for layer in model.layers.values():
        parallelize_module(layer, tp_mesh, {**attention_plan(), **mlp_plan()})
    return model
''',
    ],
}
