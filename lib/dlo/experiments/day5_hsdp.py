"""Day 5, section 6.9: HSDP, shard within a node and replicate across nodes, counted at the full profile's size.

`hsdp_bytes(P, nodes, gpus_per_node)` shards the comparison Llama cut to `reshard.BLOCKS` blocks with
torch's `fully_shard` inside a fake process group of nodes x gpus_per_node ranks (one process; every
collective returns at once), twice: FSDP over all N ranks (a 1-D mesh), and HSDP (a 2-D mesh
(replicate, shard): parameters sharded over the g GPUs of a node and replicated across the r nodes).
It counts every collective of a forward and backward by kind and by the size of its process group
(`dlo.measure.CommCounter`), which tells where its bytes travel: a group of the g GPUs of one node
stays on the node's links (NVLink), a group that spans nodes crosses the network (InfiniBand).

The mechanism (Zhao et al. 2023, PyTorch FSDP, "hybrid sharding"): HSDP's all-gathers and
reduce-scatters run inside a node, each rank sending (g-1)/g of the payload instead of FSDP's (N-1)/N;
what crosses nodes is one all-reduce per unit of the gradient shard, Psi/g, each rank sending
2(r-1)/r Psi/g of it. The price is memory: each GPU keeps 1/g of the model state, not 1/N.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from dlo import claims as C
from dlo import estimates as E
from dlo.experiments.day5_reshard import BLOCKS, TOKENS

ZHAO = "Zhao et al. 2023 (PyTorch FSDP, hybrid sharding)"


def _count(cfg, nodes: int, gpus: int, hybrid: bool, x, y) -> dict:
    """Collectives of the second forward + backward (the first initialises FSDP2), per (kind, group size)."""
    from torch.distributed.device_mesh import init_device_mesh

    from dlo.experiments.day5_data import lm_loss
    from dlo.experiments.day5_reshard import sharded_llama
    from dlo.measure import CommCounter, tally
    from dlo.plan import fake_world

    with fake_world(nodes * gpus):
        if hybrid:  # dim 0 replicates (across nodes), dim 1 shards (inside a node)
            mesh = init_device_mesh("cpu", (nodes, gpus), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh("cpu", (nodes * gpus,), mesh_dim_names=("shard",))
        model, _ = sharded_llama(cfg, mesh)
        lm_loss(model, x, y).backward()
        model.zero_grad()
        with CommCounter() as comm:
            lm_loss(model, x, y).backward()
        local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    return {"comm": tally(comm.records(), ("kind", "group")), "local_param_bytes": local}


def hsdp_bytes(P, nodes: int = 2, gpus_per_node: int = 4) -> list[dict]:
    """One row per layout: bytes each rank sends in one step in collectives of one node's ranks and in
    collectives whose group spans nodes (in a ring over such a group, the hops between nodes carry as
    much as every other hop: the slow link paces it), and the parameter bytes it keeps (fp32; the
    optimizer state and gradients shard alike)."""
    from dlo.experiments.day5_data import llama_config, token_batches
    from dlo.models.llama import Llama, count_parameters

    if nodes < 2 or gpus_per_node < 2:
        raise ValueError(f"need >= 2 nodes of >= 2 GPUs, got {nodes} x {gpus_per_node}")
    cfg = replace(llama_config(P, "compare_model"), n_layers=BLOCKS)
    x, y = token_batches(P, cfg, 0, "cpu", n=1)[0]
    x, y = x[:1, :TOKENS], y[:1, :TOKENS]
    with torch.device("meta"):
        psi = 4 * count_parameters(Llama(cfg))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only cost
    try:
        rows = []
        for name, hybrid in (("FSDP", False), ("HSDP", True)):
            got = _count(cfg, nodes, gpus_per_node, hybrid, x, y)
            # a group of the g GPUs of one node stays inside it (node-major rank order); any other crosses
            inside = {k: v for k, v in got["comm"].items() if k[1] == gpus_per_node}
            across = {k: v for k, v in got["comm"].items() if k[1] != gpus_per_node}
            rows.append({"layout": f"{name} {nodes} x {gpus_per_node}" if hybrid else f"{name} {nodes * gpus_per_node}",
                         "sent in one node's group": sum(v["sent"] for v in inside.values()),
                         "sent in groups spanning nodes": sum(v["sent"] for v in across.values()),
                         "collectives": {f"{k} ({g} ranks)": v["calls"] for (k, g), v in got["comm"].items()},
                         "params kept": got["local_param_bytes"], "psi": psi, "nodes": nodes,
                         "gpus": gpus_per_node})
        return rows
    finally:
        torch.set_num_threads(threads)


def claims(rows: list[dict]) -> list[C.Claim]:
    """HSDP's counts against the mechanism's formulas, FSDP's as the baseline (exact counts)."""
    fsdp, hsdp = rows
    r, g, psi = hsdp["nodes"], hsdp["gpus"], hsdp["psi"]
    n = r * g
    # the reduce-scatters' payload is Psi per step (every unit once); across nodes HSDP all-reduces Psi/g
    want_across = 2 * (r - 1) / r * psi / g
    ring = ((g - 1) / g) / ((n - 1) / n)  # HSDP's in-node collectives: the same payloads on g ranks
    return [
        C.Claim(f"HSDP sends only the gradient shard's all-reduce across nodes: 2(r-1)/r Psi/g per rank "
                f"(r={r}, g={g})", ZHAO, "Psi/g", C.approx(want_across, rel=0.01),
                E.exact(hsdp["sent in groups spanning nodes"], "bytes sent in groups spanning nodes, counted")),
        C.Claim("HSDP's all-gathers and reduce-scatters stay inside a node, on g ranks", ZHAO,
                "(g-1)/g of FSDP's (N-1)/N", C.approx(ring, rel=0.01),
                E.exact(hsdp["sent in one node's group"] / fsdp["sent in groups spanning nodes"],
                        "HSDP in-node bytes / FSDP's bytes, counted")),
        C.Claim(f"the price: each GPU keeps 1/g of the parameters, not 1/N ({n // g}x FSDP's)", ZHAO,
                f"{n // g}x", C.approx(n / g, rel=0.02),
                E.exact(hsdp["params kept"] / fsdp["params kept"], "local parameter bytes, HSDP / FSDP"))]
