"""Day 5's Llama configs and token data, and the bad input refused before any process starts;
`dlo.experiments.day5` re-exports them (the notebook reads them from there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def llama_config(P, which: str = "model"):
    """The `dlo.models.llama` config of `P.model` (or `P.compare_model`), with the preset's cuts."""
    from dlo.models.llama import LlamaConfig

    cfg = LlamaConfig.from_name(getattr(P, which), **dict(P.model_overrides))
    if cfg.max_seq_len < P.seq_len:
        raise ValueError(f"seq_len={P.seq_len} is longer than {getattr(P, which)}'s max_seq_len={cfg.max_seq_len}")
    return cfg


def build(cfg, device, seed: int = 0) -> nn.Module:
    """A Llama materialised on `device` (fp32), initialised from `seed` (per parameter: the same
    values however it is sharded later)."""
    from dlo.models.llama import Llama

    with torch.device("meta"):
        model = Llama(cfg)
    model.to_empty(device=device)
    model.init_weights(seed=seed)
    return model


def n_params(cfg) -> int:
    """Parameters of a Llama of `cfg` (the tied embedding once), counted on the meta device."""
    from dlo.models.llama import Llama, count_parameters

    with torch.device("meta"):
        return count_parameters(Llama(cfg))


def token_needs(P) -> tuple[int, int, str]:
    """What `token_batches` asks of `data_dir/tokens.npy` at preset `P`: (vocabulary, fewest tokens, the
    models named): ids below the smaller vocabulary of P.model and P.compare_model (both train on the
    file), and one window of P.seq_len + 1 tokens with a start to draw."""
    cfgs = {getattr(P, which): llama_config(P, which) for which in ("model", "compare_model")}
    return min(c.vocab_size for c in cfgs.values()), P.seq_len + 2, " and ".join(cfgs)


def token_batches(P, cfg, rank: int, device, data_dir=None, n: int = 8) -> list:
    """`n` batches (x, y) of this rank: windows of `data_dir/tokens.npy` (a 1-D array of token ids,
    `dlo data tokens`) when data_dir is given (memory-mapped: only the windows are read; DataError when it
    is missing or does not fit `token_needs`), else synthetic text with a learnable rule: the next token is
    pi(token) for a fixed permutation pi, 3 times in 4 (a noisy bigram language; the loss can fall to ~1.2 nats)."""
    from dlo.data.tokens import check_tokens, open_tokens

    g = torch.Generator().manual_seed(1000 + rank)
    B, T, V = P.batch_per_rank, P.seq_len, cfg.vocab_size
    if data_dir is not None and str(data_dir) != "":
        check_tokens(data_dir, V, T + 2, model=f"a Llama of vocabulary {V}")
        tokens = open_tokens(data_dir)
        starts = torch.randint(0, len(tokens) - T - 1, (n, B), generator=g)
        seqs = [torch.stack([torch.from_numpy(tokens[s:s + T + 1].astype("int64")) for s in row.tolist()])
                for row in starts]  # (B, T+1) each
    else:
        pi = torch.randperm(V, generator=torch.Generator().manual_seed(12345))
        seqs = []
        for _ in range(n):
            seq = torch.empty(B, T + 1, dtype=torch.long)
            seq[:, 0] = torch.randint(0, V, (B,), generator=g)
            noise = torch.randint(0, V, (B, T), generator=g)
            keep = torch.rand(B, T, generator=g) < 0.75
            for t in range(T):
                seq[:, t + 1] = torch.where(keep[:, t], pi[seq[:, t]], noise[:, t])
            seqs.append(seq)
    return [(s[:, :-1].to(device), s[:, 1:].to(device)) for s in seqs]


def lm_loss(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def check_world(P, world_size: int) -> None:
    """ValueError (one line, before any process starts) when the world is larger than a weight can
    be split into: FSDP2 cuts every weight along its rows, so each rank must get at least one row."""
    for which in ("model", "compare_model"):
        cfg = llama_config(P, which)
        rows = min(cfg.n_kv_heads * cfg.head_dim, cfg.dim, cfg.ffn_dim, cfg.vocab_size)
        if world_size > rows:
            raise ValueError(f"world_size={world_size} is larger than the {rows} rows of {getattr(P, which)}'s "
                             f"smallest weight (k/v projections): some ranks would hold nothing of it; use "
                             f"world_size <= {rows}")


def check_weights(P, weights_dir: str) -> None:
    """CheckpointError (one line) when `weights_dir` is not a Llama checkpoint of `P.model`: its config
    and every tensor's presence and shape, from the headers (`dlo.models.llama_hf.check_checkpoint`)."""
    from dlo.models.llama_hf import check_checkpoint

    if not weights_dir:
        return
    check_checkpoint(weights_dir, llama_config(P), what=f"{P.model}'s config")


__all__ = ["build", "check_weights", "check_world", "lm_loss", "llama_config", "n_params", "token_batches",
           "token_needs"]
