"""Day 7, section 9.7: the collective matmul (asynchronous TP) beside one collective then one matmul.

`compare(world_size)` runs, on `world_size` gloo ranks, a sequence-parallel column linear followed by a
row-parallel one, forward and backward, twice: as `tp_comms.all_gather_linear` + `reduce_scatter_to_sp`
(one collective, then the matmul), and as `async_tp.all_gather_matmul` + `matmul_reduce_scatter` (the
ring, chunk by chunk). It returns the largest difference of outputs and gradients, the bytes each rank
handed to the backend in each (`dlo.measure.CommCounter`), and what each decomposed collective alone put
on rank 0's TCP sockets (the kernel's counters, `dlo.measure.tcp_sent`: outside our code and the counter).

What is whose (the claims): Wang et al. 2023 describe the decomposition (an all-gather becomes t - 1
permutes of one chunk each, so it sends the collective's bytes; a reduce-scatter the same), measured here on
the wire. The ratio of the two implementations' bytes over a whole step, 4 ring passes against 5
collectives, is ours: `AllGatherLinear` gathers its input again in backward (Megatron's choice, Korthikanti
et al. 2022) and the ring keeps the chunks it received; it holds by how each was written. Whether the ring
hides the transfers behind the matmuls is a GPU question: on a CPU the ranks share the cores.
"""

from __future__ import annotations

import torch

from dlo import claims as C
from dlo import estimates as E

WANG = "Wang et al. 2023 (collective matmul); seed 004 (Async Linear)"
OURS = ("this course's two implementations: async_tp keeps the chunks; tp_comms.AllGatherLinear re-gathers "
        "in backward (Korthikanti et al. 2022)")
B, T, H, OUT = 2, 16, 512, 24  # per rank OUT features of the column linear; T divisible by 2 and 4
WIRE_TOL = 0.02  # gloo's own headers: 144 B per hop against a >= 16 KiB chunk (< 1%)


def _worker() -> dict:
    import torch.distributed as dist

    from dlo.distributed.async_tp import all_gather_matmul, matmul_reduce_scatter
    from dlo.distributed.tp_comms import all_gather_linear, reduce_scatter_to_sp
    from dlo.measure import CommCounter, tcp_available, tcp_sent

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
    wire = None
    if tcp_available():  # each decomposed collective alone, forward only: bytes on this rank's sockets
        h = torch.randn(B, T, OUT, generator=g)  # the row linear's input: the whole sequence, my features
        with torch.no_grad():
            all_gather_matmul(x, w1, dim=1)  # connections up before the count
            wire = {"all_gather": tcp_sent(lambda: all_gather_matmul(x, w1, dim=1), 2)[0],
                    "reduce_scatter": tcp_sent(lambda: matmul_reduce_scatter(h, w2, dim=1), 2)[0]}
    out["wire"] = wire
    return out


def compare(world_size: int = 2) -> dict:
    """Rows per implementation (rank 0's bytes and collectives), the largest difference over ranks, and
    rank 0's TCP bytes per decomposed collective beside that collective's bytes, (t-1)/t of the whole
    tensor (the all-gather's output, the reduce-scatter's input): None where TCP cannot be read."""
    from dlo.distributed import launch

    if world_size < 2 or T % world_size:
        raise ValueError(f"world_size must be >= 2 and divide {T}, got {world_size}")
    ranks = launch(_worker, world_size, backend="gloo", timeout=120)
    naive, ring = (k for k in ranks[0] if k != "wire")
    # relative to the largest value: the ring adds the ranks' partial sums in another order (fp32)
    diff = max(float((a - b).abs().max() / a.abs().max()) for rk in ranks
               for a, b in zip([rk[naive]["y"], *rk[naive]["grads"]], [rk[ring]["y"], *rk[ring]["grads"]]))
    rows = [{"implementation": name, "bytes sent (rank 0)": ranks[0][name]["sent"],
             "ops": ", ".join(ranks[0][name]["kinds"])} for name in (naive, ring)]
    whole = B * T * H * 4  # fp32: the gathered input (B, T, H), and the row linear's output summed over ranks
    collective = (world_size - 1) / world_size * whole
    return {"rows": rows, "max_diff": diff, "world_size": world_size, "wire": ranks[0]["wire"],
            "collective_bytes": collective}


def claims(res: dict) -> list[C.Claim]:
    naive, ring = (r["bytes sent (rank 0)"] for r in res["rows"])
    t, wire, want = res["world_size"], res["wire"], res["collective_bytes"]
    rows = [C.Claim("the collective matmul computes the same output and gradients", WANG, "same result",
                    C.at_most(1e-6, "<= 1e-6"), E.exact(res["max_diff"], "largest |difference| / largest value, "
                                                        "every rank, fp32"))]
    for kind, what in (("all_gather", "an all-gather"), ("reduce_scatter", "a reduce-scatter")):
        claim = (f"decomposed, {what} sends its bytes: t - 1 hops of one chunk, (t-1)/t of the whole tensor "
                 f"per rank (t={t})")
        if wire is None:
            rows.append(C.not_measurable(claim, WANG, "(t-1)/t n", "the TCP counters need Linux (TCP_INFO)"))
            continue
        rows.append(C.Claim(claim, WANG, "(t-1)/t n", C.approx(1.0, rel=WIRE_TOL, text=f"1 +- {WIRE_TOL:g}"),
                            E.exact(wire[kind] / want, f"rank 0's TCP bytes (kernel counters), forward alone, "
                                                       f"{wire[kind]:,.0f} / (t-1)/t n = {want:,.0f}: gloo's headers "
                                                       f"< 1%")))
    rows += [C.by_construction("over a step, the ring's 4 passes send 4/5 of the one-collective version's 5 "
                               "(the ring keeps the gathered chunks, t x the memory)", OURS, "4/5",
                               "how the two were written: AllGatherLinear gathers its input again in backward, the "
                               "ring does not; not a claim of Wang et al.",
                               E.exact(ring / naive, "ring / one-collective bytes, counted (CommCounter)")),
             C.not_measurable("it hides t - 1 of the t transfers behind the matmuls", WANG, "overlap",
                              "a GPU claim (communication beside compute); here the ranks share the CPU cores")]
    return rows
