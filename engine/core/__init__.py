"""The hot path: the engine-owned KV cache (`kv_cache`), attention over it registered with transformers
(`attention`, with the fused C++ CPU kernels of `csrc/` built by `kernels`), a model bound to its cache
(`runner`), prefill with prefix reuse (`prefill`, `prefix_store`), a row's tokens and stop rules
(`sequence`), sampling, counters (`stats`) and continuous batching (`scheduler`).

It is not MagicDec: how rows advance after prefill is a `Decoder` handed to the scheduler (see
`engine.spec`). It knows nothing of files, reports, terminals or DeepSpeed (tensor parallelism reaches
it as `sync` / `agree` callables), and raises no job-level errors."""
