"""The draft step: a lean fused forward for Llama-family drafts on CPU or transformers' own forward
(`forward`), on lower-precision copies of the linear weights when that is cheaper (`gemms`). Only the
draft uses these; the target's modules are never changed."""
