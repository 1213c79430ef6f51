"""dlo.checkpoint: exact resume, atomic saves under SIGKILL, rotation, corrupt files, bad input, sharding."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dlo import checkpoint as ck
from dlo.config import seed_everything


def _setup(seed=0, init_seed=0):
    torch.manual_seed(init_seed)
    model = nn.Sequential(nn.Linear(7, 13), nn.ReLU(), nn.Dropout(0.3), nn.Linear(13, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1)
    gen = torch.Generator().manual_seed(seed)
    data = (torch.randn(45, 7, generator=gen), torch.randint(0, 3, (45,), generator=gen))
    loader = ck.ResumableBatches(data, batch_size=8, seed=seed)
    return model, opt, sched, scaler, loader


def _step(model, opt, sched, scaler, loader) -> float:
    x, y = next(loader)
    x = x + 0.1 * torch.from_numpy(np.random.randn(*x.shape)).float()  # numpy RNG matters
    if random.random() < 0.5:  # python RNG matters
        x = -x
    loss = F.cross_entropy(model(x), y)  # dropout: torch RNG matters
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    sched.step()
    return loss.item()


def test_interrupted_run_gives_bit_identical_losses(tmp_path):
    steps, cut = 14, 6  # 45 // 8 = 5 batches per epoch: the cut and the end fall in other epochs
    seed_everything(0)
    objs = _setup()
    want = [_step(*objs) for _ in range(steps)]
    scale_want = objs[3].get_scale()

    seed_everything(0)
    objs = _setup()
    got = [_step(*objs) for _ in range(cut)]
    ck.save_atomic(ck.training_state(*objs, step=cut), tmp_path / "s.pt")
    del objs
    seed_everything(123)  # the "new job" starts from another RNG state and other initial weights
    objs = _setup(init_seed=5)
    step = ck.restore_training_state(torch.load(tmp_path / "s.pt", weights_only=False), *objs)
    assert step == cut
    got += [_step(*objs) for _ in range(steps - cut)]
    assert got == want  # exact equality, not allclose
    assert objs[3].get_scale() == scale_want


def test_resume_without_rng_is_not_identical(tmp_path):
    """The exact-resume test can fail: skip restoring the RNGs and the losses differ."""
    seed_everything(0)
    objs = _setup()
    want = [_step(*objs) for _ in range(8)]
    seed_everything(0)
    objs = _setup()
    got = [_step(*objs) for _ in range(4)]
    state = ck.training_state(*objs, step=4)
    seed_everything(9)
    objs = _setup(init_seed=5)
    state["rng"] = ck.rng_state()  # "forgot" the RNGs
    ck.restore_training_state(state, *objs)
    got += [_step(*objs) for _ in range(4)]
    assert got[:4] == want[:4] and got != want


def test_mismatching_model_names_keys_and_loads_nothing():
    model, opt, *_ = _setup()
    state = ck.training_state(model, opt)
    other = nn.Sequential(nn.Linear(7, 11), nn.ReLU(), nn.Dropout(0.3), nn.Linear(11, 3), nn.Linear(3, 3))
    other_opt = torch.optim.AdamW(other.parameters())
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError, match=r"unexpected keys|missing keys") as err:
        ck.restore_training_state(state, other, other_opt)
    msg = str(err.value)
    assert "'4.weight'" in msg and "0.weight: checkpoint (13, 7) vs model (11, 7)" in msg
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())
    assert other_opt.state_dict()["state"] == {}


def test_manager_rotation_ignores_temp_files(tmp_path):
    mgr = ck.CheckpointManager(tmp_path, keep_last=2)
    (tmp_path / ".ckpt-00000009.pt.abc.tmp").write_bytes(b"half a file")
    for s in (1, 2, 3):
        mgr.save({"step": s}, s)
    assert [s for s, _ in mgr.checkpoints()] == [2, 3]
    state, path = mgr.load_latest()
    assert state["step"] == 3 and path.name == "ckpt-00000003.pt"
    assert ck.CheckpointManager(tmp_path / "none").load_latest() == (None, None)
    with pytest.raises(ValueError, match="keep_last"):
        ck.CheckpointManager(tmp_path, keep_last=0)


def test_corrupt_latest_is_skipped_with_warning(tmp_path):
    mgr = ck.CheckpointManager(tmp_path, keep_last=3)
    mgr.save({"w": torch.arange(1000.0)}, 1)
    good = (tmp_path / "ckpt-00000001.pt").read_bytes()
    (tmp_path / "ckpt-00000002.pt").write_bytes(good[: len(good) // 2])  # truncated copy
    with pytest.warns(RuntimeWarning, match=r"skipping unreadable checkpoint .*ckpt-00000002\.pt"):
        state, path = mgr.load_latest()
    assert path.name == "ckpt-00000001.pt" and torch.equal(state["w"], torch.arange(1000.0))


WRITER = textwrap.dedent("""
    import sys, torch
    from dlo.checkpoint import CheckpointManager
    mgr = CheckpointManager(sys.argv[1], keep_last=2)
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    step = 0
    while True:
        step += 1
        with torch.no_grad():
            model.weight.add_(1.0)
        # a big payload whose every value is the step: a mixed or truncated file cannot pass for good
        mgr.save({"step": step, "model": model.state_dict(), "big": torch.full((2_000_000,), float(step))}, step)
""")


def test_sigkill_during_save_leaves_a_loadable_checkpoint(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)])
    mgr = ck.CheckpointManager(tmp_path, keep_last=2)
    deadline = time.monotonic() + 60
    while len(mgr.checkpoints()) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(random.Random().uniform(0.0, 0.3))  # land anywhere, most likely inside a save
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # atomic writes: the newest file must be whole
        state, path = mgr.load_latest()
    assert state is not None and path.name == f"ckpt-{state['step']:08d}.pt"
    assert torch.equal(state["big"], torch.full((2_000_000,), float(state["step"])))
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    ck.check_compatible(model, state["model"])
    expected = model.weight.detach().clone()
    for _ in range(state["step"]):  # the same float additions as the writer made
        expected += 1.0
    model.load_state_dict(state["model"])
    assert torch.equal(model.weight.detach(), expected)


def _sharded_rank(folder):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = {"w": torch.arange(35.0).view(7, 5), "b": torch.arange(3.0)}  # 7 rows: uneven shards
    state = {"model": {"w": distribute_tensor(full["w"], mesh, [Shard(0)]), "b": full["b"].clone()}, "step": 11}
    ck.save_sharded(state, folder)
    fresh = {"model": {"w": distribute_tensor(torch.zeros(7, 5), mesh, [Shard(0)]), "b": torch.zeros(3)}, "step": 0}
    ck.load_sharded(fresh, folder)
    return fresh["model"]["w"].full_tensor(), fresh["model"]["b"], fresh["step"]


def test_sharded_saved_at_2_loads_at_2_and_1(tmp_path):
    from dlo.distributed import launch

    folder = tmp_path / "sharded"
    results = launch(_sharded_rank, 2, str(folder), backend="gloo", timeout=120)
    for w, b, step in results:
        assert torch.equal(w, torch.arange(35.0).view(7, 5)) and torch.equal(b, torch.arange(3.0)) and step == 11
    assert not (tmp_path / "sharded.partial").exists()
    single = {"model": {"w": torch.zeros(7, 5), "b": torch.zeros(3)}, "step": 0}  # world size 1, plain tensors
    ck.load_sharded(single, folder)
    assert torch.equal(single["model"]["w"], torch.arange(35.0).view(7, 5)) and single["step"] == 11
    with pytest.raises(FileNotFoundError, match="no .metadata"):
        ck.load_sharded(single, tmp_path)


def test_sharded_kill_between_renames_loads_the_previous_one(tmp_path):
    folder = tmp_path / "sharded"
    ck.save_sharded({"w": torch.arange(6.0), "step": 1}, folder)
    ck.save_sharded({"w": torch.arange(6.0) * 2, "step": 2}, folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sharded"]  # no .partial, no .old left behind
    # A kill between save_sharded's two renames: step 2 was moved aside, step 3 is still .partial.
    os.replace(folder, tmp_path / "sharded.old")
    ck.save_sharded({"w": torch.arange(6.0) * 3, "step": 3}, tmp_path / "sharded.partial.src")
    os.replace(tmp_path / "sharded.partial.src", tmp_path / "sharded.partial")
    got = {"w": torch.zeros(6), "step": 0}
    ck.load_sharded(got, folder)
    assert torch.equal(got["w"], torch.arange(6.0) * 2) and got["step"] == 2
    ck.save_sharded({"w": torch.arange(6.0) * 4, "step": 4}, folder)  # the next save swaps in and cleans up
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sharded"]
    ck.load_sharded(got, folder)
    assert torch.equal(got["w"], torch.arange(6.0) * 4) and got["step"] == 4


def test_failed_save_leaves_no_temp_file_and_keeps_the_old_one(tmp_path):
    path = ck.save_atomic({"step": 1}, tmp_path / "state.pt")
    with pytest.raises(TypeError, match="pickle"):
        ck.save_atomic({"lock": threading.Lock()}, path)  # a lock cannot be pickled
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.pt"]
    assert torch.load(path)["step"] == 1


def test_rng_state_restores_from_a_checkpoint_mapped_to_the_device(tmp_path, device):
    """map_location moves the saved RNG byte tensors to the device; restoring must still work (on a GPU
    it raised "RNG state must be a torch.ByteTensor") and give the same draws."""
    seed_everything(3)
    torch.save({"rng": ck.rng_state()}, tmp_path / "rng.pt")
    want = (random.random(), np.random.rand(), torch.rand(3))
    state = torch.load(tmp_path / "rng.pt", map_location=device, weights_only=False)
    assert state["rng"]["torch"].device.type == device.type
    ck.set_rng_state(state["rng"])
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[:2] == want[:2] and torch.equal(got[2], want[2])
