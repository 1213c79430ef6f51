"""What a rank holds in the on-ranks checks of Day 5's FSDP2 and Day 6's pipelines (issue 26), as
test_rank_parts.py and test_rank_parts_day4.py show for the others: the grader draws the case (from a
secret seed when it grades) and gives each rank its own part only - a stage rank its own stage, the
inputs only to the first stage and the targets only to the last; an FSDP2 rank the initial model and
its own slice of each step's batch - so a student's function on a rank finds nothing to rebuild the
expected result from: no seed, no other stage's weights, no whole batch, not in its arguments, not
in its callers' frames, not anywhere in its process's memory (`gc`). The grader's own drawing and
reference are sealed there, and a copy of the drawing redraws the case in a notebook only (where
the seed is the test cell's), never under the grader.

The honest submissions (the solution notebooks') pass the same checks in test_day5/6_checks.py;
here they pass again with every search run on each rank before them.
"""

from __future__ import annotations

import gc
import inspect
import random

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dlo.checks import day5, day6
from tests.checks.test_rank_parts import gpipe_from_the_whole_model, load_solution, on_the_stack, seed_on_the_stack

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.trust]  # a hostile class's evidence (issue 26): its own CI step, pytest -m trust


@pytest.fixture(scope="module")
def pipe():
    return load_solution("day6_pipeline")


def alive(kind):
    """Every object of type `kind` alive in this rank's process (after a collection)."""
    gc.unfreeze()  # a rank freezes what it inherited (dlo.distributed._worker): out of get_objects' sight till then
    gc.collect()
    return [o for o in gc.get_objects() if isinstance(o, kind)]


def send_one_for_show() -> None:
    one = torch.zeros(1, dtype=torch.float64)
    if dist.get_rank() == 0:
        dist.send(one, 1)
    elif dist.get_rank() == 1:
        dist.recv(one, 0)


# ----------------------------------------------------------------------------- Day 6, exercises 3 and 4

def refuse_what_a_stage_should_not_hold(stage, xs, ys, image: int) -> None:
    """Raise (failing the check) if this rank holds the seed, another stage's weights, the inputs
    (images of `image` pixels a side) anywhere but on the first stage or targets anywhere but on the last."""
    if seed_on_the_stack():
        raise RuntimeError("the case's seed is on the rank: it can be redrawn")
    own = {id(q) for q in stage.module.parameters()}
    others = [q for q in alive(torch.nn.Parameter) if id(q) not in own]
    if others:
        raise RuntimeError(f"{len(others)} parameters of other stages on rank {dist.get_rank()}")
    images = [t for t in alive(torch.Tensor) if t.dim() == 4 and tuple(t.shape[1:]) == (3, image, image)]
    if (xs is not None) != stage.is_first or (images and not stage.is_first):
        raise RuntimeError(f"inputs on stage {stage.index}")
    if (ys is not None) != stage.is_last:
        raise RuntimeError(f"targets on stage {stage.index}")


def searched_then(step, image: int):
    """The solution's `step`, run after this rank's searches came back empty (`image`: taken here, the
    grader's modules are sealed on a rank)."""
    def fn(stage, xs, ys, loss_fn):
        refuse_what_a_stage_should_not_hold(stage, xs, ys, image)
        return step(stage, xs, ys, loss_fn)
    return fn


@pytest.mark.parametrize(("step", "world_size"), [("gpipe_step", 2), ("one_f_one_b_step", 3)])
def test_a_stage_rank_holds_its_stage_only(pipe, ranks, step, world_size):
    check = getattr(day6, f"check_{step}")  # by name: the ranks import this module, where day6 is sealed
    check(searched_then(getattr(pipe, step), day6.IMAGE), seed=1, world_size=world_size)  # 3: a middle stage


def one_f_one_b_by_any_means(stage, xs, ys, loss_fn):
    """The grader's own drawing and reference imported, else the whole model and batch looked for in
    a caller's frame (`gpipe_from_the_whole_model`); what each attempt met, if both fail."""
    try:
        from dlo.checks.day6 import _case, _reference  # sealed on a rank
    except (ImportError, AttributeError) as e:
        sealed = str(e)
    else:
        return _reference(_case(0, dist.get_world_size(), True))[0]
    try:
        return gpipe_from_the_whole_model(stage, xs, ys, loss_fn)
    except RuntimeError as e:
        raise RuntimeError(f"{sealed}; {e}") from None


def test_one_f_one_b_finds_neither_the_graders_reference_nor_the_whole_model_on_its_rank(ranks):
    with pytest.raises(AssertionError, match="(?s)off limits.*; no whole model on the stack"):
        day6.check_one_f_one_b_step(one_f_one_b_by_any_means)


def redraw(seed: int, p: int, equal: bool, image: int) -> dict:
    """The grader's drawing of a pipeline case (`day6._case`), copied from its source (readable on disk)."""
    from dlo.models.coatnet import coatnet

    rng = random.Random(seed)
    torch.manual_seed(1000 + seed)
    model = coatnet("tiny", image_size=image).to(torch.float64).eval()
    n = len(model.blocks)
    bounds = [0] + sorted(rng.sample(range(1, n), p - 1)) + [n]
    m = rng.choice([2 * p, 3 * p]) if equal else rng.choice([p + 1, 2 * p + 1])
    b = rng.choice([1, 2]) if equal else 0
    B = m * b if equal else rng.choice([2 * m + 1, 3 * m - 1])
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, 3, image, image, generator=gen, dtype=torch.float64)
    return {"model": model, "bounds": bounds, "x": x, "y": torch.randint(0, model.cfg.num_classes, (B,), generator=gen)}


def gpipe_from_a_redrawn_case(image: int):
    """A GPipe step that tries the test cells' seeds: the one whose model has this stage's weights
    gives the whole model and batch, hence one process's loss and this stage's gradients; one message
    for show."""
    def fn(stage, xs, ys, loss_fn):
        return from_a_redrawn_case(stage, image)
    return fn


def from_a_redrawn_case(stage, image: int):
    from dlo.distributed.pipeline import make_stage_modules

    mine = list(stage.module.parameters())
    for seed in range(3):
        c = redraw(seed, dist.get_world_size(), False, image)
        drawn = list(make_stage_modules(list(c["model"].blocks), c["bounds"])[stage.index].parameters())
        if len(drawn) == len(mine) and all(torch.equal(a, b) for a, b in zip(drawn, mine)):
            loss = F.cross_entropy(c["model"](c["x"]), c["y"])
            loss.backward()
            for q, d in zip(mine, drawn):
                q.grad = d.grad.clone()
            send_one_for_show()
            return loss.item()
    raise RuntimeError("the case could not be redrawn")


@pytest.mark.slow  # ~10 CPU s: the grader's sandbox and a launch of its own ranks
def test_a_graded_pipeline_case_cannot_be_redrawn(tmp_path, ranks):
    """In a notebook the case comes from the test cell's seed, and the copied drawing rebuilds it: the loss
    and gradients pass there, and only there (the check then reads the schedule from the messages: one for
    show fails); the grader draws it from a secret seed."""
    from dlo.grading.trusted import LocalSandbox  # here: the ranks import this module (sealed) for its functions

    cheat = gpipe_from_a_redrawn_case(day6.IMAGE)
    with pytest.raises(AssertionError, match=r"in 1 message\(s\), expected 3"):  # compared after the gradients
        day6.check_gpipe_step(cheat, seed=2)
    with LocalSandbox(tmp_path) as sandbox, pytest.raises(AssertionError, match="the case could not be redrawn"):
        sandbox.run(day6.check_gpipe_step, cheat, seed=2)


# ----------------------------------------------------------------------------- Day 5, exercise 5

def parallelize_from_the_whole_batch(model, mesh, **kwargs):
    """The global batch looked for anywhere in this rank's memory: world_size times the rows of this
    rank's slice (the case's sizes are on the rank: the exercise needs them)."""
    sizes = on_the_stack(lambda v: isinstance(v, dict) and {"per_rank", "T", "lr"} <= v.keys())
    if sizes is None:
        raise RuntimeError("no sizes on the stack")
    if seed_on_the_stack():
        raise RuntimeError("the case's seed is on the rank: the global batch can be redrawn")
    rows = dist.get_world_size() * sizes["per_rank"]
    if not [t for t in alive(torch.Tensor) if t.dtype == torch.int64 and t.dim() == 2 and t.shape[0] == rows]:
        raise RuntimeError("no whole batch on the rank")
    raise RuntimeError("the whole batch is on the rank")  # not reached since the case is split


def test_fsdp2_finds_no_whole_batch_on_its_rank(ranks):
    with pytest.raises(AssertionError, match="no whole batch on the rank"):
        day5.check_fsdp2(parallelize_from_the_whole_batch, seed=2)


# ----------------------------------------------------------------------------- Day 6, exercise 5
# last, and on ranks of their own: torch.distributed.pipelining, once imported on a pool's rank,
# would fail the step checks above (they refuse a step that imported it)

def torch_pipeline_searched_then(step):
    """The solution's `step`, run after this rank's searches came back empty: no seed, no parameter
    but those of the stages this rank holds (for each schedule's case), the batch only with stage 0
    and the targets only with the last stage."""
    def fn(stage_modules, stage_ids, n_stages, x, y, loss_fn, n_microbatches, schedule):
        if seed_on_the_stack():
            raise RuntimeError("the case's seed is on the rank: it can be redrawn")
        parts = next(f.frame.f_locals["mine"] for f in inspect.stack() if "mine" in f.frame.f_locals)
        own = {id(q) for part in parts.values() for mod in part["mods"] for q in mod.parameters()}
        if any(id(q) not in own for q in alive(torch.nn.Parameter)):
            raise RuntimeError(f"parameters of another rank's stages on rank {dist.get_rank()}")
        if (x is not None) != (0 in stage_ids) or (y is not None) != (n_stages - 1 in stage_ids):
            raise RuntimeError(f"inputs or targets on a rank holding stages {stage_ids}")
        return step(stage_modules, stage_ids, n_stages, x, y, loss_fn, n_microbatches, schedule)
    return fn


def test_torch_pipeline_rank_holds_its_stages_only(pipe):
    # interleaved: two stages a rank, the batch with stages 0 and 2 on rank 0, the targets with 1 and 3 on rank 1
    day6.check_torch_pipeline(torch_pipeline_searched_then(pipe.torch_pipeline_step), seed=1,
                              schedules=("Interleaved1F1B",))


def torch_pipeline_from_the_whole_model(stage_modules, stage_ids, n_stages, x, y, loss_fn, n_microbatches,
                                        schedule):
    """One process's losses and gradients from the whole model and batch, if a caller's frame had them."""
    case = on_the_stack(lambda v: isinstance(v, dict) and "model" in v and "x" in v and "y" in v)
    if case is None:
        raise RuntimeError("no whole model on the stack")
    loss = F.cross_entropy(case["model"](case["x"]), case["y"])
    loss.backward()
    return [loss.item()] * n_microbatches


def test_torch_pipeline_finds_no_whole_model_on_its_rank():
    with pytest.raises(AssertionError, match="no whole model on the stack"):
        day6.check_torch_pipeline(torch_pipeline_from_the_whole_model, schedules=("GPipe",))
