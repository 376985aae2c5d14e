"""Attention backends: each owns its KV cache layout and computes a step's attention.

`runner/attention.py` holds the `AttentionBackend` contract and `select_attention_backend`;
`sdpa` is the portable reference, `gather` and `cpu_sparse` the fast paths (sharing the
block-rows layout of `paged_rows`), `prefill` the multi-token chunk attention all of them use.
"""
