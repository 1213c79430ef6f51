"""A check's worker on N ranks (`api.on_ranks`), from both ends: what the checking process sends
(`worker_ref`: the worker by name; `rank_payload`: its arguments pickled apart; `write_shards`: each
rank's own part of the case in a file of its own) and what each rank does with it (`run_on_rank`:
take its shard, block the forbidden names, seal the grader's modules, refuse new threads, and only
then unpickle the student's objects, `load_captures`, and run the worker).

Used by the direct backend (`api.DirectSession.on_ranks`), the sandboxed runner's session (through
it) and the tests' rank pool alike; it runs where student code runs, so the seal leaves it open.
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile

from dlo.grading.forbid import forbidden, no_threads, plan, protected
from dlo.grading.frames import as_grader_error
from dlo.grading.meter import END, MARK, hand_over
from dlo.grading.seal import sealed
from dlo.measure.held import live_bytes
from dlo.measure.process import steady_malloc


def worker_ref(worker):
    """A module-level worker as (module, qualname), resolved on the rank (where the grader's modules are
    sealed by the time anything could look them up); any other callable as itself."""
    module, qualname = getattr(worker, "__module__", None), getattr(worker, "__qualname__", "<>")
    importable = module not in (None, "__main__") and "<" not in qualname and module in sys.modules
    return (module, qualname) if importable else worker


def rank_payload(args, kwargs) -> bytes:
    """The worker's arguments (the student's objects among them), pickled apart from the worker: a rank
    unpickles them only once it has blocked the forbidden names and sealed the grader's modules, since
    unpickling a student's object may run the student's code (`__reduce__`, `__init_subclass__`)."""
    from dlo.pickling import dumps

    return dumps((args, kwargs))  # the student's functions keep their cells' names and lines


def write_shards(per_rank, world_size: int) -> str | None:
    """Each rank's own part of a check's case (`on_ranks(..., per_rank=[...])`) in a file of its own,
    in a new private folder (None when there is no per-rank part)."""
    if per_rank is None:
        return None
    import cloudpickle

    if len(per_rank) != world_size:
        raise ValueError(f"per_rank has {len(per_rank)} parts for {world_size} ranks")
    folder = tempfile.mkdtemp(prefix="dlo-shards-")
    for r, part in enumerate(per_rank):
        with open(os.path.join(folder, f"rank-{r}.pkl"), "wb") as f:
            f.write(cloudpickle.dumps(part))
    return folder


def take_shard(folder: str):
    """On a rank: its own part, read and deleted, then a barrier - every rank has taken its part (and
    deleted it) before any student code runs, so no rank's code can read another's."""
    import pickle

    import torch.distributed as dist

    path = os.path.join(folder, f"rank-{dist.get_rank()}.pkl")
    with open(path, "rb") as f:
        data = f.read()
    os.unlink(path)
    dist.barrier()
    return pickle.loads(data)


def run_on_rank(worker, forbid, name, hint, payload: bytes, shards: str | None = None, meter: str | None = None,
                for_good: bool = False):
    """On each rank of `on_ranks` (and of the tests' rank pool): the worker resolved and this rank's
    own part of the case taken (`per_rank`: the worker's first argument), its TCP sockets handed to the
    launcher's byte meter (`meter`: `dlo.grading.meter`), then the check's forbidden references blocked
    (`for_good` on a rank that ends with the check, as a launch's), the grader's modules sealed and new
    threads refused, then the student's objects unpickled and the worker run with them (and, for a worker
    with `measures_growth`, the rank's live tensor bytes before they were: `live_before=`). A worker with a
    `counted_prelude` has it run first, with this rank's part only (trusted code: the reference on the
    case whose memory the launcher counts), then a `MARK` sent to the meter, and is called with
    `counted=True` (unless the prelude returned False: nothing counted in this case); where there is no meter
    (the tests' reused ranks) neither runs."""
    if isinstance(worker, tuple):
        module, qualname = worker
        worker = importlib.import_module(module)
        for part in qualname.split("."):
            worker = getattr(worker, part)
    mine = (take_shard(shards),) if shards is not None else ()
    counted = meter is not None and getattr(worker, "counted_prelude", None) is not None
    if meter is not None:
        import torch.distributed as dist

        hand_over(meter, dist.get_rank())
    if counted:  # trusted code only, before any student object exists: its peak is what the student's is held to
        steady_malloc()  # freed large blocks leave the rank's resident memory (`dlo.measure.process`)
        plan(forbid, name, hint)  # what blocking imports and finds (a check's modules: megabytes) is the grader's,
        protected()  # made before the prelude: in both the prelude's peak and the mark, not in the student's step
        try:
            counted = worker.counted_prelude(*mine) is not False  # False: nothing counted in this case
        except Exception as exc:  # the course's reference failing is the grader's fault: say so (`on_ranks`)
            raise as_grader_error(exc, name) or exc from None
        if counted:
            protected()  # again, should the prelude have imported a module (cached: nothing to do otherwise)
            hand_over(meter, dist.get_rank(), MARK)
    # a worker that measures what the student's code keeps (`measures_growth`) counts it from here, before the
    # student's objects exist: what a class body or a module-level line allocates at unpickling counts too
    given = {"live_before": live_bytes()} if getattr(worker, "measures_growth", False) else {}
    if counted:
        given["counted"] = True  # the launcher reads the rank's memory: run the counted phase
    try:
        with forbidden(forbid, name, hint, for_good), sealed() as sealing, no_threads(name):
            args, kwargs = load_captures(sealing.loads(payload))
            result = worker(*mine, *args, **kwargs, **given)
    except Exception as exc:
        own = as_grader_error(exc, name)  # the worker's own bug, not the student's: say so (`on_ranks`)
        if own is None:
            raise
        raise own from None
    if meter is not None:
        hand_over(meter, dist.get_rank(), END)
    return result


def load_captures(obj, loaded: dict | None = None, depth: int = 0):
    """`obj` with each captured student object (`wire_request.Ref("cap", path)`, as the sandboxed runner
    forwards them) unpickled here, on the rank, under the seal: the runner's process never loads
    them for an on-ranks check, since unpickling may run the student's code (`__reduce__`) and that
    process has seen every rank's part of the case."""
    from dlo.grading.wire_request import Ref  # OPEN: importable while sealed

    loaded = {} if loaded is None else loaded
    if isinstance(obj, Ref) and obj.kind == "cap":
        if obj.key not in loaded:
            import pickle

            with open(obj.key, "rb") as f:
                loaded[obj.key] = pickle.load(f)  # plain unpickling: the grader's names meet the seal
        return loaded[obj.key]
    if depth < 64 and type(obj) in (list, tuple):
        return type(obj)(load_captures(x, loaded, depth + 1) for x in obj)
    if depth < 64 and type(obj) is dict:
        return {k: load_captures(v, loaded, depth + 1) for k, v in obj.items()}
    return obj
