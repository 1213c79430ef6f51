"""Day 7, section 9.7: the collective matmul (asynchronous TP) beside one collective then one matmul.

`compare(world_size)` runs, on `world_size` gloo ranks, a sequence-parallel column linear followed by a
row-parallel one, forward and backward, twice: as `tp_comms.all_gather_linear` + `reduce_scatter_to_sp`
(one collective, then the matmul), and as `async_tp.all_gather_matmul` + `matmul_reduce_scatter` (the
ring, chunk by chunk). It returns the largest difference of outputs and gradients and the bytes each
rank sent in each, counted (`dlo.measure.CommCounter`). Whether the ring hides the transfers behind
the matmuls is a GPU question: on a CPU the ranks share the cores ("not measurable here").
"""

from __future__ import annotations

import torch

from dlo import claims as C
from dlo import estimates as E

WANG = "Wang et al. 2023 (collective matmul); seed 004 (Async Linear)"
B, T, H, OUT = 2, 16, 32, 24  # per rank OUT features of the column linear; T divisible by 2 and 4


def _worker() -> dict:
    import torch.distributed as dist

    from dlo.distributed.async_tp import all_gather_matmul, matmul_reduce_scatter
    from dlo.distributed.tp_comms import all_gather_linear, reduce_scatter_to_sp
    from dlo.measure import CommCounter

    r, t = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, H, generator=g).chunk(t, 1)[r]  # this rank's sequence chunk
    w1 = torch.randn(OUT * t, H, generator=g).chunk(t, 0)[r]  # column-parallel rows
    w2 = torch.randn(H, OUT * t, generator=g).chunk(t, 1)[r]  # row-parallel columns
    dy = torch.randn(B, T, H, generator=g).chunk(t, 1)[r]
    out = {}
    for name, col, row in (("one collective, then the matmul", lambda a, w: all_gather_linear(a, w, dim=1),
                            lambda h, w: reduce_scatter_to_sp(h @ w.T, dim=1)),
                           ("collective matmul (ring)", lambda a, w: all_gather_matmul(a, w, dim=1),
                            lambda h, w: matmul_reduce_scatter(h, w, dim=1))):
        leaves = [v.clone().requires_grad_() for v in (x, w1, w2)]
        with CommCounter() as comm:
            y = row(col(leaves[0], leaves[1]), leaves[2])
            y.backward(dy)
        out[name] = {"y": y.detach(), "grads": [v.grad for v in leaves], "sent": comm.sent(),
                     "kinds": sorted(comm.by_kind())}
    return out


def compare(world_size: int = 2) -> dict:
    """Rows per implementation (rank 0's bytes and collectives) and the largest difference over ranks."""
    from dlo.distributed import launch

    if world_size < 2 or T % world_size:
        raise ValueError(f"world_size must be >= 2 and divide {T}, got {world_size}")
    ranks = launch(_worker, world_size, backend="gloo", timeout=120)
    naive, ring = list(ranks[0])
    # relative to the largest value: the ring adds the ranks' partial sums in another order (fp32)
    diff = max(float((a - b).abs().max() / a.abs().max()) for rk in ranks
               for a, b in zip([rk[naive]["y"], *rk[naive]["grads"]], [rk[ring]["y"], *rk[ring]["grads"]]))
    rows = [{"implementation": name, "bytes sent (rank 0)": ranks[0][name]["sent"],
             "ops": ", ".join(ranks[0][name]["kinds"])} for name in (naive, ring)]
    return {"rows": rows, "max_diff": diff, "world_size": world_size}


def claims(res: dict) -> list[C.Claim]:
    naive, ring = (r["bytes sent (rank 0)"] for r in res["rows"])
    return [C.Claim("the collective matmul computes the same output and gradients", WANG, "same result",
                    C.at_most(1e-6, "<= 1e-6"), E.exact(res["max_diff"], "largest |difference| / largest value, "
                                                        "every rank, fp32")),
            C.Claim("... and moves the same bytes per pass: 4 ring passes against 5 collectives (AllGatherLinear "
                    "gathers its input again in backward; the ring keeps it, t x the memory)", WANG, "4/5",
                    C.approx(0.8, rel=1e-6), E.exact(ring / naive, "ring / one-collective bytes sent, counted")),
            C.not_measurable("it hides t - 1 of the t transfers behind the matmuls", WANG, "overlap",
                             "a GPU claim (communication beside compute); here the ranks share the CPU cores")]
