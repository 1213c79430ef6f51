"""Day 9's serving experiments: continuous against static batching on one request trace (Yu et al. 2022,
Orca; Kwon et al. 2023, vLLM), and speculative decoding's acceptance with a distilled and an untrained
draft (Leviathan et al. 2023).

What is counted is read from outside the code under test: the target model's forwards and the tokens
each one computes are counted by a forward hook on its output layer (`ForwardCounter`), not by the
scheduler's or the speculative loop's own bookkeeping.
"""

from __future__ import annotations

import statistics

import torch

from dlo.inference.batching import ModelExecutor, Scheduler, make_trace, serve, summary
from dlo.inference.kv_cache import generate, probabilities
from dlo.inference.paged import PagedKVCache
from dlo.inference.speculative import acceptance_rate, speculative_generate
from dlo.measure import time_fn
from dlo.progress import tqdm


class ForwardCounter:
    """Forwards of a Llama and the token positions they computed, seen by a hook on its output layer."""

    def __init__(self, model):
        self.forwards, self.tokens = 0, 0
        self.handle = model.output.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output):
        self.forwards += 1
        self.tokens += inputs[0].shape[0] * inputs[0].shape[1]  # (B, T, dim)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def trace(P, seed: int, equal_lengths: bool = False):
    """P.n_requests requests arriving together; answers of 1-48 tokens (or all 24: the control, where
    static batching wastes nothing on finished sequences)."""
    out = (24, 24) if equal_lengths else (1, 48)
    return make_trace(P.n_requests, seed=seed, prompt_lens=(4, 24), output_lens=out, max_new_tokens=48)


@torch.no_grad()
def batching(model, P, seed: int, equal_lengths: bool = False) -> dict:
    """The trace served each way through the model and a paged cache of P.num_blocks blocks (static
    batching reserves max_len = 72 tokens per sequence, prompt + answer at most, so that both fit the same
    budget). Per policy: forwards and tokens computed (hook), the steps' rows and `summary`."""
    requests = trace(P, seed, equal_lengths)
    out = {}
    for policy in ("static", "continuous"):
        cache = PagedKVCache.for_model(model, P.num_blocks, P.block_size)
        scheduler = Scheduler(cache.manager, P.max_batch, policy, max_len=72)
        with ForwardCounter(model) as counter:
            result = serve(requests, scheduler, ModelExecutor(model, cache))
        out[policy] = dict(forwards=counter.forwards, tokens_computed=counter.tokens, steps=result["steps"],
                           summary=summary(result), generated=sum(len(g) for g in result["outputs"].values()))
    return out


# ----------------------------------------------------------------------------- speculative decoding

@torch.no_grad()
def acceptance(target, draft, sequences: torch.Tensor) -> list[float]:
    """alpha = E_x[sum_v min(p(v), q(v))] per sequence (B, T): the target's and the draft's next-token
    distributions at every position of the sequence, the rate at which a draft token is accepted at T = 1
    (Leviathan et al., Definition 3.1), computed from the two models' outputs, not from a decoding run."""
    p, q = probabilities(target(sequences)), probabilities(draft(sequences))  # (B, T, vocab)
    return acceptance_rate(p, q).mean(dim=1).tolist()


@torch.no_grad()
def speculative_runs(target, draft, prompts: torch.Tensor, P, seed: int) -> list[dict]:
    """Speculative sampling (T = 1) from each prompt: tokens generated and the target's forwards (hook);
    tokens per target pass = generated / (forwards - 1), the prefill excluded."""
    device = target.output.weight.device
    runs = []
    for i in tqdm(range(prompts.shape[0]), desc="speculative"):
        gen = torch.Generator(device=device).manual_seed(seed + i)
        with ForwardCounter(target) as counter:
            tokens, _ = speculative_generate(target, draft, prompts[i:i + 1], P.spec_tokens, P.spec_k,
                                             temperature=1.0, generator=gen)
        passes = counter.forwards - (prompts.shape[1] > 1)  # the prefill of all but the last prompt token
        runs.append(dict(generated=tokens.shape[1] - prompts.shape[1], target_passes=passes,
                         tokens_per_pass=(tokens.shape[1] - prompts.shape[1]) / passes))
    return runs


def draft_cost(target, draft, prompt: torch.Tensor, reps: int) -> dict:
    """c = a draft forward's time over a target forward's, one token after `prompt` (medians), on this device."""
    device = target.output.weight.device
    times = {name: time_fn(lambda m=m: m(prompt), device=device, warmup=1, reps=reps).times_s
             for name, m in (("target", target), ("draft", draft))}
    return dict(times, c=statistics.median(times["draft"]) / statistics.median(times["target"]))


def speedups(target, draft, prompts: torch.Tensor, P, seed: int) -> list[float]:
    """Per prompt: the time of sampling P.spec_tokens tokens from the target alone over the time of
    speculative sampling with `draft` (one timing each, on this device: a GPU claim, `dlo.claims.timed`)."""
    device = target.output.weight.device
    out = []
    for i in range(prompts.shape[0]):
        prompt, gen = prompts[i:i + 1], torch.Generator(device=device)

        def plain(prompt=prompt, gen=gen, i=i):
            return generate(target, prompt, P.spec_tokens, temperature=1.0, generator=gen.manual_seed(i))

        def spec(prompt=prompt, gen=gen, i=i):
            return speculative_generate(target, draft, prompt, P.spec_tokens, P.spec_k, temperature=1.0,
                                        generator=gen.manual_seed(seed + i))

        t_plain, t_spec = (time_fn(f, device=device, warmup=1, reps=1).median_s for f in (plain, spec))
        out.append(t_plain / t_spec)
    return out
