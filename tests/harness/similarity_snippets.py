# ruff: noqa: E501 - student code, kept as written (long signatures)
"""Fixed snippets for the similarity report's calibration (tests/harness/test_similarity.py).

HONEST: exercise cells written independently (by a second author, from the exercise text only, not
the library or the solution): correct, the same API, their own structure. COPIES: the library's
references as a student hides a copy (`disguised`): comments and docstrings dropped, independent
lines reordered, and (`padded`) a dead line after each line.
"""

import random
import re

HONEST = {
    ('day6_pipeline', 'one_f_one_b'): '''def one_f_one_b_step(stage, microbatches, targets, loss_fn):
    mb = MicroBatches(stage, microbatches, targets, loss_fn)
    total = len(stage.in_shapes)
    n_warm = min(stage.p - 1 - stage.rank, total)
    fwd, bwd = 0, 0
    while fwd < n_warm:
        mb.forward(fwd)
        fwd += 1
    while fwd < total:
        mb.forward(fwd)
        fwd += 1
        mb.backward(bwd)
        bwd += 1
    while bwd < total:
        mb.backward(bwd)
        bwd += 1
    return mb.finish()
''',
    ('day8_quantization_pruning', 'gradual'): '''def gradual_sparsity(step, final_sparsity, begin_step, end_step, initial_sparsity=0.0):
    if step <= begin_step:
        return initial_sparsity
    if step >= end_step:
        return final_sparsity
    remaining = 1.0 - (step - begin_step) / (end_step - begin_step)
    return final_sparsity - (final_sparsity - initial_sparsity) * remaining ** 3
''',
    ('day8_quantization_pruning', 'distill'): '''def distillation_loss(student_logits, teacher_logits, targets, temperature=2.0, lam=1.0):
    soft_targets = torch.softmax(teacher_logits.detach() / temperature, dim=-1)
    log_student = torch.log_softmax(student_logits / temperature, dim=-1)
    kl = (soft_targets * (torch.log(soft_targets + 1e-12) - log_student)).sum(dim=-1).mean()
    hard = F.cross_entropy(student_logits, targets)
    return kl * temperature ** 2 + lam * hard
''',
    ('day1_optimizers', 'sgd_momentum'): '''def sgd_momentum_step(param, grad, buf, *, lr, momentum=0.9, weight_decay=0.0, dampening=0.0, nesterov=False):
    g = grad.clone()
    if weight_decay != 0:
        g = g.add(param, alpha=weight_decay)
    if buf is not None:
        buf.mul_(momentum)
        buf.add_((1 - dampening) * g)
    else:
        buf = torch.clone(g).detach()
    step_dir = g.add(buf, alpha=momentum) if nesterov else buf
    param.add_(step_dir, alpha=-lr)
    return buf
''',
    ('day5_fsdp', 'accountant'): '''def memory_per_rank(n_params, world, stage, *, param_dtype=torch.bfloat16, optimizer="adamw"):
    width = torch.tensor([], dtype=param_dtype).element_size()
    n_states = {"sgd": 0, "sgd_momentum": 1, "adamw": 2}[optimizer]
    if width < 4:
        per_param_opt = 4 * (1 + n_states)
    else:
        per_param_opt = width * n_states
    local = math.ceil(n_params / world)
    result = {}
    result["params"] = width * local if stage == 3 else width * n_params
    result["grads"] = width * local if stage >= 2 else width * n_params
    result["optimizer"] = per_param_opt * local if stage >= 1 else per_param_opt * n_params
    result["total"] = result["params"] + result["grads"] + result["optimizer"]
    return result
''',
    ('day4_ddp', 'ring'): '''def ring_all_reduce(tensor):
    world, me = dist.get_world_size(), dist.get_rank()
    right, left = (me + 1) % world, (me - 1 + world) % world
    data = tensor.flatten().clone()
    size = (data.numel() + world - 1) // world
    data = F.pad(data, (0, size * world - data.numel()))
    parts = list(data.split(size))
    recv = torch.zeros(size, dtype=data.dtype)
    for step in range(world - 1):
        send_idx, recv_idx = (me - step) % world, (me - step - 1) % world
        req = dist.isend(parts[send_idx].clone(), right)
        dist.recv(recv, left)
        req.wait()
        parts[recv_idx] = parts[recv_idx] + recv
    for step in range(world - 1):
        send_idx, recv_idx = (me + 1 - step) % world, (me - step) % world
        req = dist.isend(parts[send_idx].clone(), right)
        dist.recv(recv, left)
        req.wait()
        parts[recv_idx] = recv.clone()
    tensor.copy_(torch.cat(parts)[:tensor.numel()].view_as(tensor))
    return tensor
''',
}

# (day, cell, the library reference a student copies, whether the padded copy still reaches the
# threshold); the copy is made from the reference's current source (`disguised`), so that it follows
# the library when the library changes
COPIES = [
    ("day5_fsdp", "accountant", "dlo.accounting.model_state_bytes", True),
    ("day8_quantization_pruning", "distill", "dlo.distill.distillation_loss", True),
    ("day8_quantization_pruning", "gradual", "dlo.prune.gradual_sparsity", True),
    ("day4_ddp", "ring", "dlo.distributed.collectives.ring_all_reduce", True),
]


def disguised(source: str) -> str:
    """A copy as a student hides it: docstrings and comments dropped, every name changed (the report
    compares names as one symbol: `rename` in test_similarity.py shows that), and each run of simple
    assignments at one indent shuffled (a fixed shuffle)."""
    rng = random.Random(0)
    source = re.sub(r'(?s)""".*?"""', '""', source)
    lines = [line for line in source.splitlines() if line.strip() and not line.strip().startswith("#")]
    out, i = [], 0
    while i < len(lines):
        indent, j = len(lines[i]) - len(lines[i].lstrip()), i
        while j < len(lines) and re.match(r"\s*[\w.\[\], ]+\s*=[^=]", lines[j]) \
                and not lines[j].rstrip().endswith((":", "(", "[", ",", "\\")) \
                and len(lines[j]) - len(lines[j].lstrip()) == indent:
            j += 1
        block = lines[i:max(j, i + 1)]
        rng.shuffle(block)
        out += block
        i = max(j, i + 1)
    return "\n".join(out) + "\n"


def padded(source: str) -> str:
    """`source` with a dead statement after every statement inside a block."""
    out = []
    for line in source.splitlines():
        out.append(line)
        indent = len(line) - len(line.lstrip())
        if indent and not line.rstrip().endswith((":", "(", ",", "[")):
            out.append(" " * indent + "_unused = None")
    return "\n".join(out) + "\n"
