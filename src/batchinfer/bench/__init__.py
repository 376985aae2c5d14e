"""`batchinfer bench`: a load generator that speaks only HTTP, so it measures any
OpenAI-compatible server, with `vllm bench serve`'s metric definitions.

Modules (nothing here imports the engine, the runner, the models or torch):
- `workload`: prompts (synthetic, shared-prefix, JSONL) and length distributions;
- `arrival`: send times (Poisson / gamma with burstiness);
- `mix`: priority classes (`--mix`), each sent as `service_tier`, with its own lengths;
- `client`, `transport`: one streamed request timed chunk by chunk, pre-run checks;
- `loadgen`: warm-up, arrival schedule, concurrency limit -> `BenchResult`;
- `metrics`: TTFT / TPOT / ITL / E2EL percentiles, throughput, goodput;
- `scrape`: the server's `/metrics` (running, waiting, KV usage, sequences per step);
- `report`, `plots`, `serve`: tables, JSON, PNGs, and `bench_serve(BenchConfig)`;
- `sweep`: start a server per batching configuration and compare them (`run_sweep`).
"""
