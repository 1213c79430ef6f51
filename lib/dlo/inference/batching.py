"""Continuous (iteration-level) batching against static batching (Yu et al. 2022, "Orca: A Distributed
Serving System for Transformer-Based Generative Models", OSDI), under vLLM's block budget (Kwon et al. 2023).

Static batching takes up to `max_batch` requests, reserves each one's cache at the server's max length
(a contiguous cache), and runs until the longest is done: a finished sequence keeps its slot (padding
computed for nothing) and no new request starts before the whole batch ends. Orca schedules at every
iteration instead (Sec. 3.1): each step the scheduler

    1. gives every running sequence room for one more token; when the blocks run out it preempts the
       latest admitted sequence (Kwon et al. Sec. 4.5), by swapping (its blocks copied to host memory
       and back later) while the swap space lasts, else by recompute (its blocks freed, it waits at the
       queue's head and is prefilled again, prompt and generated tokens, when readmitted);
    2. swaps preempted sequences back in, then admits waiting requests (first come, first served)
       while their prompt's blocks fit and the batch has room: their prefill runs in this step and
       gives their first token;
    3. retires the sequences that are done, whose blocks go back to the free list at once.

`serve` runs a trace through a `Scheduler` with an executor: `simulate` (no model: each request ends after
its `output_len` tokens) or `ModelExecutor` (the Llama through a `PagedKVCache`, one batched decode forward
per step, each request sampling with its own generator so that its tokens do not depend on the batch).
Every step is counted: tokens computed (prefill, decode, padding), batch, blocks in use and reserved.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from dlo.errors import BadInput
from dlo.inference.kv_cache import forward_cached, sample
from dlo.inference.paged import BlockManager, PagedKVCache
from dlo.measure import sync


@dataclass(frozen=True)
class Request:
    rid: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    arrival: int = 0  # the step it arrives at
    output_len: int | None = None  # `simulate`: the tokens it generates before its end of sequence
    seed: int = 0  # its sampler's generator


@dataclass
class Sequence:
    request: Request
    generated: list[int] = field(default_factory=list)
    first_token: int | None = None  # the step that produced generated[0]
    finished: int | None = None
    preemptions: int = 0
    generator: torch.Generator | None = None

    def done(self) -> bool:
        r = self.request
        end = r.max_new_tokens if r.output_len is None else min(r.output_len, r.max_new_tokens)
        return len(self.generated) >= end


@dataclass
class Plan:
    prefill: list[Sequence]  # admitted this step: prompt (+ tokens generated before a preemption)
    decode: list[Sequence]  # running: one token each
    preempted: list[Sequence]  # by recompute: back to the queue's head, blocks freed
    padding: int = 0  # static batching: finished sequences still occupying a slot
    swap_out: list[tuple[Sequence, list[int]]] = field(default_factory=list)  # the blocks to copy out first
    swap_in: list[tuple[Sequence, list[int]]] = field(default_factory=list)  # the new blocks to copy back into


class Scheduler:
    """Admission, preemption and retirement over a `BlockManager` (`policy` "continuous" or "static").
    `swap_blocks` > 0: a preempted sequence's blocks are copied to that much host memory (vLLM's swap
    space) while it fits, and copied back before any new request is admitted; else it is recomputed."""

    def __init__(self, manager: BlockManager, max_batch: int, policy: str = "continuous", max_len: int = 0,
                 swap_blocks: int = 0):
        if policy not in ("continuous", "static"):
            raise BadInput(f"policy must be 'continuous' or 'static', got {policy!r}")
        if policy == "static" and max_len < 1:
            raise BadInput("static batching reserves max_len tokens per sequence: give max_len >= 1")
        self.manager, self.max_batch, self.policy, self.max_len = manager, max_batch, policy, max_len
        self.swap_blocks, self.swap_used = swap_blocks, 0
        self.swapped: deque[Sequence] = deque()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.batch: list[Sequence] = []  # static: the batch until its last sequence is done

    def blocks(self, tokens: int) -> int:
        return math.ceil(tokens / self.manager.block_size)

    def add(self, request: Request) -> None:
        need = len(request.prompt) + request.max_new_tokens
        if self.blocks(max(need, self.max_len)) > self.manager.allocator.num_blocks or need > (self.max_len or need):
            raise BadInput(f"request {request.rid} ({need} tokens) can never fit: "
                           f"{self.manager.allocator.num_blocks} blocks of {self.manager.block_size}, max_len "
                           f"{self.max_len or 'none'}")
        self.waiting.append(Sequence(request))

    def schedule(self, now: int) -> Plan:
        if self.policy == "static":
            return self._static(now)
        decode, plan = list(self.running), Plan([], [], [])
        while decode and not self.manager.can_append([s.request.rid for s in decode], 1):  # 1. a token each
            victim = decode.pop()  # the latest admitted
            self.running.remove(victim)
            blocks = list(self.manager.tables[victim.request.rid])
            self.manager.free(victim.request.rid)
            victim.preemptions += 1
            if self.swap_used + len(blocks) <= self.swap_blocks:
                self.swap_used += len(blocks)
                plan.swap_out.append((victim, blocks))
                self.swapped.append(victim)
            else:
                plan.preempted.append(victim)
                self.waiting.appendleft(victim)
        budget = self.manager.allocator.num_free - sum(self.manager.blocks_needed(s.request.rid, 1) for s in decode)
        while self.swapped and not plan.swap_out and len(decode) < self.max_batch:  # swapped ones first
            seq, cached = self.swapped[0], len(self.swapped[0].request.prompt) + len(self.swapped[0].generated) - 1
            if self.blocks(cached + 1) > budget:
                break
            budget -= self.blocks(cached + 1)  # its blocks and this step's token
            self.swapped.popleft()
            self.manager.add(seq.request.rid)
            self.manager.append_slots(seq.request.rid, cached)
            self.swap_used -= self.blocks(cached)
            plan.swap_in.append((seq, list(self.manager.tables[seq.request.rid])))
            decode.append(seq)
            self.running.append(seq)
        preempted, prefill = plan.preempted, plan.prefill
        while (self.waiting and not self.swapped and self.waiting[0].request.arrival <= now
               and len(decode) + len(prefill) < self.max_batch):
            seq = self.waiting[0]  # 2. admit, first come first served
            need = self.blocks(len(seq.request.prompt) + len(seq.generated))
            if need > budget or (preempted and seq in preempted):  # a victim waits one step at least
                break
            budget -= need
            prefill.append(self.waiting.popleft())
        self.running += prefill
        plan.decode = decode
        return plan

    def _static(self, now: int) -> Plan:
        if any(not s.done() for s in self.batch):
            live = [s for s in self.batch if not s.done()]
            return Plan([], live, [], padding=len(self.batch) - len(live))
        self.batch = []
        while (self.waiting and self.waiting[0].request.arrival <= now and len(self.batch) < self.max_batch
               and self.blocks(self.max_len) * (len(self.batch) + 1) <= self.manager.allocator.num_blocks):
            self.batch.append(self.waiting.popleft())
        self.running = list(self.batch)
        return Plan(list(self.batch), [], [])

    def retire(self, now: int) -> list[Sequence]:
        """3. the sequences done after this step leave; their blocks are freed (static: with the batch)."""
        done = [s for s in self.running if s.done() and s.finished is None]
        for s in done:
            s.finished = now
            if self.policy == "continuous":
                self.running.remove(s)
                self.manager.free(s.request.rid)
        if self.policy == "static" and all(s.done() for s in self.batch):
            for s in self.batch:
                self.manager.free(s.request.rid)
            self.running = []
        return done


def simulate(manager: BlockManager):
    """An executor without a model: appends each step's tokens to the block tables; every token is 0."""
    def step(plan: Plan) -> dict[int, int]:
        for seq in plan.prefill:
            manager.add(seq.request.rid)
            manager.append_slots(seq.request.rid, len(seq.request.prompt) + len(seq.generated))
        for seq in plan.decode:
            manager.append_slots(seq.request.rid, 1)
        return {s.request.rid: 0 for s in plan.prefill + plan.decode}
    return step


class ModelExecutor:
    """The Llama through a PagedKVCache: each admitted sequence's prefill alone, then one batched decode
    forward over every running sequence (Orca's selective batching: attention per sequence, the
    projections on the whole batch). Tokens at `temperature` from each request's own generator."""

    def __init__(self, model, cache: PagedKVCache, temperature: float = 0.0):
        self.model, self.cache, self.temperature = model, cache, temperature
        self.swapped: dict[int, tuple] = {}  # rid -> its blocks' K and V in host memory

    @torch.no_grad()
    def __call__(self, plan: Plan) -> dict[int, int]:
        device = self.cache.k.device
        out = {}
        for seq, blocks in plan.swap_out:  # before anything this step writes into the freed blocks
            self.swapped[seq.request.rid] = self.cache.copy_blocks_out(blocks)
        for seq, blocks in plan.swap_in:
            self.cache.copy_blocks_in(blocks, self.swapped.pop(seq.request.rid))
        for seq in plan.prefill:
            if seq.generator is None:
                seq.generator = torch.Generator(device=device).manual_seed(seq.request.seed)
            self.cache.add(seq.request.rid)
            tokens = torch.tensor([list(seq.request.prompt) + seq.generated], device=device)
            logits = forward_cached(self.model, tokens, self.cache, [seq.request.rid])[0, -1]
            out[seq.request.rid] = self._next(logits, seq)
        if plan.decode:
            rows = [s.request.rid for s in plan.decode]
            last = torch.tensor([[s.generated[-1]] for s in plan.decode], device=device)
            logits = forward_cached(self.model, last, self.cache, rows)[:, 0]
            out.update({s.request.rid: self._next(logits[i], s) for i, s in enumerate(plan.decode)})
        return out

    def _next(self, logits, seq: Sequence) -> int:
        return int(sample(logits[None], self.temperature, seq.generator)[0])


def serve(requests: list[Request], scheduler: Scheduler, executor, max_steps: int = 100_000) -> dict:
    """Run the trace to its end: {"outputs": rid -> generated tokens, "steps": one dict per step,
    "requests": rid -> arrival, first token, finish (steps) and preemptions}."""
    pending = deque(sorted(requests, key=lambda r: r.arrival))
    seqs, steps = {}, []
    for now in range(max_steps):
        while pending and pending[0].arrival <= now:
            scheduler.add(pending.popleft())
            seqs[scheduler.waiting[-1].request.rid] = scheduler.waiting[-1]
        if not (pending or scheduler.waiting or scheduler.running or scheduler.swapped):
            break
        plan = scheduler.schedule(now)
        row = dict(step=now, prefill_tokens=sum(len(s.request.prompt) + len(s.generated) for s in plan.prefill),
                   decode_tokens=len(plan.decode), padding=plan.padding, batch=len(plan.prefill) + len(plan.decode),
                   waiting=len(scheduler.waiting), preempted=len(plan.preempted), swapped_out=len(plan.swap_out))
        start = time.perf_counter()
        tokens = executor(plan)
        sync()  # the device's work of the step, in its wall time
        row["ms"] = 1e3 * (time.perf_counter() - start)
        for rid, token in tokens.items():
            seqs[rid].generated.append(token)
        for seq in plan.prefill:
            seq.first_token = now if seq.first_token is None else seq.first_token
        row["blocks_used"] = scheduler.manager.usage()["blocks_used"]  # before retiring: the step's peak
        row["blocks_reserved"] = (len(scheduler.batch) * scheduler.blocks(scheduler.max_len)
                                  if scheduler.policy == "static" else row["blocks_used"])
        scheduler.retire(now)
        steps.append(row)
    else:
        raise RuntimeError(f"the trace did not finish in {max_steps} steps")
    return dict(outputs={rid: s.generated for rid, s in seqs.items()}, steps=steps,
                requests={rid: dict(arrival=s.request.arrival, first_token=s.first_token, finished=s.finished,
                                    tokens=len(s.generated), preemptions=s.preemptions) for rid, s in seqs.items()})


def summary(result: dict, step_ms: float | None = None, token_ms: float = 0.0) -> dict:
    """Steps, generated tokens, tokens per step; throughput, time to first token and time per output token
    (medians over requests, in ms; every request's in `ttft_ms`, `tpot_ms` for intervals), on the steps'
    measured wall times (step_ms None: the executor's, e.g. the model's on a GPU) or under the cost model
    time(step) = step_ms + token_ms x tokens computed (prefill, decode and padding)."""
    steps, reqs = result["steps"], list(result["requests"].values())
    clock, t = [], 0.0
    for s in steps:
        computed = s["prefill_tokens"] + s["decode_tokens"] + s["padding"]
        t += s["ms"] if step_ms is None else step_ms + token_ms * computed
        clock.append(t)
    generated = sum(r["tokens"] for r in reqs)
    ttft = sorted(clock[r["first_token"]] - (clock[r["arrival"] - 1] if r["arrival"] else 0.0) for r in reqs)
    tpot = sorted((clock[r["finished"]] - clock[r["first_token"]]) / (r["tokens"] - 1)
                  for r in reqs if r["tokens"] > 1)
    return dict(steps=len(steps), tokens=generated, tokens_per_step=generated / len(steps),
                tokens_per_s=generated / (clock[-1] / 1e3), median_ttft_ms=ttft[len(ttft) // 2],
                median_tpot_ms=tpot[len(tpot) // 2] if tpot else None, ttft_ms=ttft, tpot_ms=tpot,
                peak_blocks_used=max(s["blocks_used"] for s in steps), preemptions=sum(r["preemptions"] for r in reqs))


def make_trace(n: int, *, seed: int = 0, prompt_lens: tuple[int, int] = (4, 24),
               output_lens: tuple[int, int] = (1, 48), max_new_tokens: int = 48, arrivals_per_step: float = 0.0,
               vocab: int = 256) -> list[Request]:
    """n requests with uniform prompt and output lengths; all at step 0, or a Poisson stream of
    `arrivals_per_step` requests per step (exponential gaps)."""
    rng, t = random.Random(seed), 0.0
    trace = []
    for rid in range(n):
        if arrivals_per_step:
            t += rng.expovariate(arrivals_per_step)
        prompt = tuple(rng.randrange(vocab) for _ in range(rng.randint(*prompt_lens)))
        trace.append(Request(rid, prompt, max_new_tokens, int(t), min(rng.randint(*output_lens), max_new_tokens), rid))
    return trace


__all__ = ["ModelExecutor", "Plan", "Request", "Scheduler", "Sequence", "make_trace", "serve", "simulate", "summary"]
