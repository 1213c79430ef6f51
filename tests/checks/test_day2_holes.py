"""A red team on Day 2's checks (2026-12, five holes): each cheat now fails with a message naming what it did, and
the notebook's solution still passes, in the notebook's own check and sandboxed as `dlo grade` runs it."""

from __future__ import annotations

import math

import pytest
import torch

from dlo.checks import day2, day2_attention
from dlo.grading.forbid import ForbiddenCall
from tests.checks.conftest import load_solution
from tests.student_cell import student_cell


@pytest.fixture(scope="module")
def solution():
    return load_solution("day2_mixed_precision")


# ----------------------------------------------------------------------------- 1. autocast step: the reply

AUTOCAST_PATCH = '''
def autocast_train_step(model, optimizer, x, y, *, dtype, scaler=None):
    """Rebinds dlo.grading.wire.encode so that the worker's step record goes back as None (read as "no such
    device here" before)."""
    import sys
    wire = sys.modules.get("dlo.grading.wire")
    if wire is not None and not getattr(wire.encode, "_patched", False):
        orig = wire.encode

        def encode(msg, *args, **kwargs):
            value = msg.get("value") if isinstance(msg, dict) else None
            if isinstance(value, list) and value and isinstance(value[0], dict) and "seen" in value[0]:
                msg = dict(msg, value=None)
            return orig(msg, *args, **kwargs)
        encode._patched = True
        wire.encode = encode
    return None
'''


@pytest.mark.parametrize("reply,match", [
    (None, "no record of the training steps came back"),
    ({"absent": "cuda"}, "no record of the training steps came back"),  # "no such device" on a CPU trial
    ("short", r"incomplete or malformed \(2 entries for 3 steps\)"),
    ("no params", r"incomplete or malformed \(3 entries for 3 steps\)")])
def test_autocast_reply_is_held_to_every_step(monkeypatch, solution, reply, match):
    """Whatever the student's side replies, a CPU trial compares every step: a None or "absent" reply, a short
    record or one missing its parameters fails (the trusted side's `_step_records`)."""
    run = day2.run_student

    def tampered(worker, *args):
        got = run(worker, *args)
        return got[:2] if reply == "short" else [dict(r, params=[]) for r in got] if reply == "no params" else reply

    monkeypatch.setattr(day2, "run_student", tampered)
    with pytest.raises(AssertionError, match=match):
        day2.check_autocast_train_step(solution.autocast_train_step, trials=1)


def test_autocast_absent_device_only_off_the_cpu():
    assert day2._step_records("t", {"absent": "cuda"}, "cuda", 3, 4, {}) is None
    with pytest.raises(AssertionError, match="no record of the training steps"):
        day2._step_records("t", {"absent": "cpu"}, "cpu", 3, 4, {})
    with pytest.raises(AssertionError, match="no record of the training steps"):
        day2._step_records("t", {"absent": "cuda"}, "cpu", 3, 4, {})


def test_autocast_patch_fails_sandboxed(sandbox, solution, capsys):
    """Graded: the rebinding of the runner's encoder (if it still takes) sends None, now a failure; where the runner
    no longer lets it, the step's own None fails as the loss it is not."""
    cheat = student_cell(AUTOCAST_PATCH, "day2_autocast_patch")
    with pytest.raises(AssertionError, match="no record of the training steps came back|return the loss as a "
                                             "detached one-element tensor"):
        sandbox.run(day2.check_autocast_train_step, cheat.autocast_train_step, trials=1)
    sandbox.run(day2.check_autocast_train_step, solution.autocast_train_step, trials=2)
    assert ": ok (" in capsys.readouterr().out


# ----------------------------------------------------------------------------- 2. loss scaler: a short record

SCALER_ZIP = '''
class LossScaler:
    """No loss scaling: the constructor empties the check worker's list of batches, found through the frames."""

    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        import sys
        f = sys._getframe(1)
        while f is not None:
            d = f.f_locals.get("data")
            if isinstance(d, list):
                d.clear()
            f = f.f_back
        self._u = self._s = False

    def scale(self, loss):
        return loss

    def unscale_(self, optimizer):
        if self._u:
            raise RuntimeError("unscale_ twice")
        self._u = True

    def step(self, optimizer):
        if self._s:
            raise RuntimeError("step twice")
        self._s = True

    def update(self):
        self._u = self._s = False

    def get_scale(self):
        return 1.0
'''
SHORT = r"the record of the (12|6) steps that came back from where your scaler ran is incomplete or malformed \(0 entr"


def test_scaler_emptying_the_batches_fails(sandbox, solution, capsys):
    cheat = student_cell(SCALER_ZIP, "day2_scaler_zip")
    with pytest.raises(AssertionError, match=SHORT):
        day2.check_loss_scaler(cheat.LossScaler)
    with pytest.raises(AssertionError, match=SHORT):
        sandbox.run(day2.check_loss_scaler, cheat.LossScaler, trials=1, steps=6)
    day2.check_loss_scaler(solution.LossScaler, trials=2)
    sandbox.run(day2.check_loss_scaler, solution.LossScaler, trials=1)
    assert capsys.readouterr().out.count(": ok (") == 2


def test_scaler_reply_is_held_to_every_step(monkeypatch):
    with pytest.raises(AssertionError, match=r"incomplete or malformed \(11 entries\)"):
        day2._scaler_records("t", [(1.0, None, [torch.ones(1)])] * 11, 12, 1, {})
    with pytest.raises(AssertionError, match=r"incomplete or malformed \(1 entries\)"):
        day2._scaler_records("t", [(1.0, [], [torch.ones(1)])], 1, 1, {})  # no gradient to compare
    day2._scaler_records("t", [(1.0, None, [torch.ones(1)])], 1, 1, {})


# ----------------------------------------------------------------------------- 3. accounting: the check's own counts

ACCT_GLOBALS = '''
def matmul_params(model):
    """The check's own FLOP counter and table of unmeasured parameters, through the model's forward's globals."""
    g = type(model).forward.__globals__
    torch.__dict__["_stash_bytes"] = g["_state_bytes_per_param"]
    d, blk = model.tok.embedding_dim, model.blocks[0]
    raw = hasattr(model, "pos_table")
    cfg = dict(seed=0, vocab=model.tok.num_embeddings, d=d, layers=len(model.blocks), heads=model.heads,
               ffn=blk["up"].out_features // d, tied=model.head.weight is model.tok.weight,
               bias=blk["out"].bias is not None, seq=5, raw=raw,
               pos=model.pos_table.shape[0] if raw else (model.pos.num_embeddings if model.pos is not None else 0))
    n = round((g["_hand_count"](cfg) - 4 * cfg["layers"] * d * cfg["seq"]) / 2)
    return n + sum(g["_unmeasured"](cfg).values())


def training_bytes_per_param(param_dtype, optimizer, master_dtype=None):
    return torch._stash_bytes(param_dtype, optimizer, master_dtype)
'''
ACCT_FRAMES = '''
def matmul_params(model):
    """The check's own FLOP counter, found in a frame further up."""
    import sys
    f = sys._getframe(1)
    while f is not None and "_hand_count" not in f.f_globals:
        f = f.f_back
    g, cfg = f.f_globals, f.f_locals["cfg"]
    fwd = g["_hand_count"](cfg)
    return round((fwd - 4 * cfg["layers"] * cfg["d"] * cfg["seq"]) / 2) + sum(g["_unmeasured"](cfg).values())


def training_bytes_per_param(param_dtype, optimizer, master_dtype=None):
    """The check's own measurement, found by the collector."""
    import gc
    ref = next(o for o in gc.get_objects() if type(o).__name__ == "function" and o.__name__ == "_state_bytes_per_param")
    return ref(param_dtype, optimizer, master_dtype)
'''
OFF_LIMITS = r"dlo\.checks\.day2_accounting\._(hand_count|state_bytes_per_param|unmeasured) is off limits"


def test_accounting_model_leads_to_no_answer():
    """What the student's code receives (the model's class, the worker's frame) is a module that counts nothing."""
    from dlo.checks import day2_accounting, day2_gpt

    assert day2_gpt._GPT.forward.__globals__ is vars(day2_gpt)
    assert not {"_hand_count", "_unmeasured", "_state_bytes_per_param", "count_flops"} & set(vars(day2_gpt))
    assert set(day2_accounting.ANSWERS) <= set(day2.check_flops_accounting.forbid)


@pytest.mark.parametrize("source", [ACCT_GLOBALS, ACCT_FRAMES], ids=["globals", "frames"])
def test_accounting_answers_fail(source, sandbox):
    cheat = student_cell(source, "day2_acct_cheat", torch=torch)
    with pytest.raises((AssertionError, KeyError), match=f"{OFF_LIMITS}|_state_bytes_per_param"):
        day2.check_flops_accounting(cheat.matmul_params, cheat.training_bytes_per_param, trials=1)
    with pytest.raises((AssertionError, KeyError, AttributeError), match=f"{OFF_LIMITS}|_state_bytes_per_param|"
                                                                         f"has no attribute 'f_globals'"):
        sandbox.run(day2.check_flops_accounting, cheat.matmul_params, cheat.training_bytes_per_param, trials=1)


def test_accounting_bytes_via_the_collector_fails(sandbox):
    cheat = student_cell(ACCT_FRAMES, "day2_acct_gc")
    from tests.checks.test_day2_checks import matmul_params_ok

    with pytest.raises(ForbiddenCall, match=OFF_LIMITS):
        day2.check_flops_accounting(matmul_params_ok, cheat.training_bytes_per_param, trials=1)
    # sandboxed, the collector may not list it at all (the runner's objects frozen before the check): off limits or
    # not found, the cheat fails
    with pytest.raises((ForbiddenCall, RuntimeError), match=f"{OFF_LIMITS}|StopIteration"):
        sandbox.run(day2.check_flops_accounting, matmul_params_ok, cheat.training_bytes_per_param, trials=1)


def test_accounting_solution_passes(solution, sandbox, capsys):
    day2.check_flops_accounting(solution.matmul_params, solution.training_bytes_per_param)
    sandbox.run(day2.check_flops_accounting, solution.matmul_params, solution.training_bytes_per_param, trials=2)
    assert capsys.readouterr().out.count(": ok (") == 2


# ----------------------------------------------------------------------------- 4. FlashAttention: softmax operators

def masked_softmax_rows(q, k, v, *, causal=False, block_k=32):
    """Red team: an exact softmax over all T keys, a few query rows at a time, through torch._masked_softmax."""
    B, H, T, D = q.shape
    qf, kf, vf = q.float(), k.float(), v.float()
    out, lse = torch.empty(B, H, T, D), torch.empty(B, H, T)
    rows, keys = max(1, min(128, T // (4 * B * H))), torch.arange(T)
    for i in range(0, T, rows):
        j = min(i + rows, T)
        s = (qf[:, :, i:j] @ kf.transpose(-2, -1)) / math.sqrt(D)
        mask = keys > torch.arange(i, j)[:, None] if causal else torch.zeros(j - i, T, dtype=torch.bool)
        p = torch._masked_softmax(s, mask.expand_as(s), -1)
        lse[:, :, i:j] = s[..., 0] - torch.log(p[..., 0])
        acc = torch.zeros(B, H, j - i, D)
        for kb in range(0, T, block_k):
            acc += p[..., kb:kb + block_k] @ vf[:, :, kb:kb + block_k]
        out[:, :, i:j] = acc
    return out.to(q.dtype), lse


SPAN = r"aten\._masked_softmax on \(1, [12], \d+, (\d+)\).* combined \1 elements of one dimension at once"


@pytest.mark.parametrize("seed", [0, 3])
def test_masked_softmax_over_all_keys_fails(seed):
    with pytest.raises(AssertionError, match=SPAN):
        day2.check_flash_attention(masked_softmax_rows, seed=seed)


def test_every_softmax_operator_is_spanned():
    """Every softmax-like operator this torch registers is a reduction `_span` reads (or refused at dispatch), and
    the masked softmax's dim=None is its last dimension."""
    names = {n.removeprefix("aten::").split(".")[0] for n in torch._C._dispatch_get_all_op_names()
             if n.startswith("aten::") and any(w in n for w in ("softmax", "logsumexp"))}
    assert names - day2_attention.REDUCTIONS == {"_nested_tensor_softmax_with_shape"}
    assert "aten::_nested_tensor_softmax_with_shape" in day2_attention.FORBID
    s, mask = torch.zeros(2, 3, 50), torch.zeros(2, 3, 50, dtype=torch.bool)
    assert day2_attention._span(torch.ops.aten._masked_softmax.default, (s, mask, None), {}) == 50
    assert day2_attention._span(torch.ops.aten._softmax_backward_data.default, (s, s, 1, torch.float32), {}) == 3


def test_flash_solution_passes(solution, sandbox, capsys):
    day2.check_flash_attention(solution.flash_attention_forward, seed=3)
    sandbox.run(day2.check_flash_attention, solution.flash_attention_forward, trials=1)
    assert capsys.readouterr().out.count(": ok (") == 2


# ----------------------------------------------------------------------------- 5. bf16 rounding: the watch escaped

def round_modes_disabled(x):
    """Red team: torch's cast with every dispatch mode popped (the way a tensor's repr pops them)."""
    from torch.utils._python_dispatch import _disable_current_modes
    with _disable_current_modes():
        return x.to(torch.bfloat16).float()


def round_stack_popped(x):
    """The watch popped off torch's dispatch stack by hand, pushed back after."""
    modes = [torch._C._pop_torch_dispatch_stack(None) for _ in range(torch._C._len_torch_dispatch_stack())]
    try:
        return x.to(torch.bfloat16).float()
    finally:
        for mode in reversed(modes):
            torch._C._push_on_torch_dispatch_stack(mode)


def round_dispatch_disabled(x):
    with torch._C._DisableTorchDispatch():
        return x.to(torch.bfloat16).float()


def round_in_a_thread(x):
    """Red team: torch's cast in a new thread, where the (thread-local) watch is not."""
    import threading
    out = []
    t = threading.Thread(target=lambda: out.append(x.to(torch.bfloat16).float()))
    t.start()
    t.join()
    return out[0]


def round_in_a_pool(x):
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: x.to(torch.bfloat16).float()).result()


UNSEEN = r"no torch operator read the input x while the grader watched your function"
THREAD = "your function started a thread"
ROUND_CHEATS = [(round_modes_disabled, UNSEEN), (round_stack_popped, UNSEEN),
                (round_dispatch_disabled, r"torch\._C\._DisableTorchDispatch is off limits"),
                (round_in_a_thread, THREAD), (round_in_a_pool, THREAD)]


@pytest.mark.parametrize("cheat,match", ROUND_CHEATS, ids=[c.__name__ for c, _ in ROUND_CHEATS])
def test_round_escapes_fail(cheat, match, sandbox):
    with pytest.raises(AssertionError, match=match):
        day2.check_round_to_bf16(cheat)
    with pytest.raises(AssertionError, match=match):
        sandbox.run(day2.check_round_to_bf16, cheat, trials=1)


def test_round_result_made_where_the_watch_sees(monkeypatch):
    """A cast done unseen and returned as is: no operator the watch saw made the tensor returned."""
    def read_then_cast(x):
        x.isnan()
        return round_modes_disabled(x)

    with pytest.raises(AssertionError, match="no torch operator made the tensor returned"):
        day2.check_round_to_bf16(read_then_cast)


def test_round_reply_is_held_to_every_trial():
    from dlo.checks import day2_rounding

    one = {"got": None, "bf16": "", "thread": False, "unseen": "", "changed": False}
    with pytest.raises(AssertionError, match=r"record of the 3 trials .* incomplete or malformed \(0 entries\)"):
        day2_rounding._results("t", [], 3)
    with pytest.raises(AssertionError, match=r"\(2 entries\)"):
        day2_rounding._results("t", [one, one], 3)
    assert day2_rounding._results("t", [one, dict(one, bf16="aten._to_copy")], 3)


def test_round_solution_and_debug_print_pass(solution, sandbox, capsys):
    def printing(x):
        print(x[:2])  # a tensor's repr pops the dispatch modes: not off limits
        return solution.round_to_bf16(x)

    day2.check_round_to_bf16(solution.round_to_bf16, seed=4)
    day2.check_round_to_bf16(printing)
    sandbox.run(day2.check_round_to_bf16, solution.round_to_bf16, seed=2)
    assert capsys.readouterr().out.count(": ok (") == 3
