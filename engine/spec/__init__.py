"""MagicDec: speculative decoding whose draft reads a small compressed KV cache. One round
(`rounds`: draft gamma tokens, verify gamma + 1, accept, roll back per row), verification
(`verification`: greedy matching, lossless rejection sampling), the gamma policy and cost model
(`gamma`), the draft step and its cheap GEMMs (`draft/`), the KV compressors (`compressors/`, one file
per method), and the decoder that ties them to the core scheduler (`decoder`). Built on `engine.core`;
it knows nothing of files, reports or processes."""
