"""One rank spawned by `dlo.distributed.launch`: `python -m dlo.distributed._worker WORKDIR`.

RANK, WORLD_SIZE, MASTER_ADDR/PORT come from the environment. Files in WORKDIR:
payload.pkl (in), ready-<rank> (written once the process group is up), result-<rank>.pkl (out:
("ok", value) or ("error", traceback text, time of failure)).
"""

import os
import pickle
import sys
import time
import traceback


def _write(workdir, r, record):
    tmp = os.path.join(workdir, f"result-{r}.tmp")
    with open(tmp, "wb") as f:
        f.write(record)
    os.replace(tmp, os.path.join(workdir, f"result-{r}.pkl"))  # atomic: the parent never sees half


def main(workdir):
    r = int(os.environ["RANK"])
    with open(os.path.join(workdir, "payload.pkl"), "rb") as f:
        parent_path, backend, blob = pickle.load(f)
    sys.path[:] = parent_path + [p for p in sys.path if p not in parent_path]
    try:
        import cloudpickle
        import torch.distributed as dist

        from dlo.distributed.launch import dumps, init_from_env

        fn, args, kwargs = cloudpickle.loads(blob)
        device = init_from_env(backend)
        open(os.path.join(workdir, f"ready-{r}"), "w").close()
        record = dumps(("ok", fn(*args, **kwargs)))
    except Exception:
        _write(workdir, r, pickle.dumps(("error", traceback.format_exc(), time.time())))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # no cleanup: a process group with dead peers may block in destroy
    _write(workdir, r, record)
    # Stay until every rank is done: rank 0 hosts the TCP store the others still talk to.
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])  # NCCL: name the GPU, or it guesses and warns
    else:
        dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip C++ static destructors: live gloo threads there can abort a finished rank


if __name__ == "__main__":
    main(sys.argv[1])
