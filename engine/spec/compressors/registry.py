"""The draft KV compressors by `draft.method` name (every method of `DRAFT_METHODS` but "none")."""

from __future__ import annotations

from engine.config.schema import DRAFT_METHODS
from engine.spec.compressors.base import Compressor
from engine.spec.compressors.guided import Guided
from engine.spec.compressors.pqcache import PQCache
from engine.spec.compressors.snapkv import SnapKV
from engine.spec.compressors.streamingllm import StreamingLLM

COMPRESSORS: dict[str, type[Compressor]] = {"streamingllm": StreamingLLM, "snapkv": SnapKV, "pqcache": PQCache,
                                            "guided": Guided}
assert set(COMPRESSORS) == set(DRAFT_METHODS) - {"none"}, "one compressor per draft method"
