"""Serving a trained Llama: what Day 9 builds on `dlo.models.llama`.

- `kv_cache`: prefill and decode with a contiguous key/value cache, its bytes per token, `generate`.
- `paged`: vLLM's block allocator, block tables and copy-on-write (Kwon et al. 2023), a paged cache.
- `batching`: iteration-level (continuous) batching against static batching (Yu et al. 2022, Orca).
- `speculative`: speculative decoding with a draft model (Leviathan et al. 2023; Chen et al. 2023).
- `w4a16`: a Llama's projections as Day 8's int4 weights in the decode loop (the split-K kernel at decode).

The paged-attention decode kernel is `dlo.kernels.paged_attention` (Triton, with its torch reference).
Nothing is imported here: each module is imported by its own name.
"""
