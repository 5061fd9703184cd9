"""Draft KV compressors: which `budget` cached positions a draft reads, per row, layer and KV head.
`base` (the shared life cycle and view assembly), one module per method (`streamingllm`, `snapkv`,
`pqcache`, `guided`), the draft's own compact bf16 store of a fixed view (`compact`), and the `registry` by
method name. They choose positions; they never own the target's K/V."""
