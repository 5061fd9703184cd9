"""The GGUF blocks behind a converted model's float32 weights, for the few-row kernel to read.

A GGUF model is converted once into float32 safetensors (`engine.models.gguf`), and a decode step
then reads 4 bytes a weight. The file's Q4_1 and Q8_0 blocks hold the same weights in 0.625 and 1.06
bytes, and the few-row kernel (`engine.core.linear`) multiplies them with the same bits as the
float32 copy. This module finds, for each of the model's linear layers, the GGUF tensor it came
from (llama.cpp's names; q/k rows in llama.cpp's RoPE order are put back in transformers' order).
It keeps only the layers whose blocks de-quantise, in float32 as gguf-py does (Q4_1: d * q, then
+ m; Q8_0: d * q), to exactly the loaded weight. It saves them once beside the converted copy
(`gguf_blocks.safetensors`) and attaches them to their modules as `module.packed`.

`to_panels` regroups Q4_1 and Q8_0 blocks by 16 outputs, the layout the AVX-512 kernel reads them in.
Not here: the conversion, the kernel, and other block formats (those layers stay float32).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.cache_dir import file_lock
from engine.steps import step, waiting

BLOCK_WEIGHTS = 32  # weights per block, along K
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}  # Q4_1: fp16 d, fp16 m, 16 bytes of nibbles; Q8_0: fp16 d, 32 int8
BLOCKS_FILE = "gguf_blocks.safetensors"
# A layer's linears: llama.cpp's name (under blk.<i>.) -> transformers' (under model.layers.<i>.)
LAYER_LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}
ROPE_PERMUTED = ("attn_q", "attn_k")  # llama.cpp interleaves each head's two RoPE halves in these rows
PLAIN_LINEARS = ("Linear", "EngineLinear")  # torch's, and the engine's subclass of it (engine.core.linear)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackedWeight:
    """The GGUF blocks a float32 weight [N, K] was de-quantised from: blocks uint8 [N, K / 32, bytes],
    or for "q4_1_panels" / "q8_0_panels" the same blocks as panels [N / 16, K / 32, 320 / 544]
    (`to_panels`)."""

    format: str  # a key of BLOCK_BYTES, or its panels' (PANEL_FORMATS)
    blocks: torch.Tensor


def dequantise(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """blocks uint8 [N, K / 32, bytes] -> float32 [N, K], rounding as gguf-py does."""
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [N, K / 32, 1]
    if fmt == "q4_1":
        m = blocks[..., 2:4].contiguous().view(torch.float16).float()
        nibbles = blocks[..., 4:]  # [N, K / 32, 16]: weight j < 16 is byte j's low nibble, j >= 16 byte j - 16's high
        q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).float()  # [N, K / 32, 32]
        weights = d * q  # two roundings, as gguf-py: the product, then the sum
        weights = weights + m
    else:
        weights = d * blocks[..., 2:].contiguous().view(torch.int8).float()
    return weights.reshape(blocks.shape[0], -1)


PANEL_OUTPUTS = 16  # outputs per panel


SCALE_BYTES = {"q4_1": 4, "q8_0": 2}  # a block's fp16 scales before its weight bytes: Q4_1 d and m, Q8_0 d
PANEL_FORMATS = {"q4_1": "q4_1_panels", "q8_0": "q8_0_panels"}  # block format -> its panels' format
BLOCKS_OF_PANELS = {panels: fmt for fmt, panels in PANEL_FORMATS.items()}


def to_panels(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """Blocks uint8 [N, K / 32, bytes] of `fmt` (N a multiple of 16) -> the same bytes as panels uint8
    [N / 16, K / 32, 16 x bytes], the AVX-512 kernel's layout (engine/core/csrc/cpu_linear.cpp): per 16
    outputs and block, each fp16 scale of the 16 outputs side by side (Q4_1: d, then m; Q8_0: d), then
    for each weight byte j of a block sixteen bytes, byte i being output i's byte j (Q4_1: j < 16 holds
    weight j low and weight j + 16 high; Q8_0: j < 32 holds weight j)."""
    rows, per_row, size = blocks.shape
    fields = SCALE_BYTES[fmt] // 2
    g = blocks.view(rows // PANEL_OUTPUTS, PANEL_OUTPUTS, per_row, size)  # [G, 16, KB, bytes]
    scales = g[..., : 2 * fields].reshape(*g.shape[:3], fields, 2).permute(0, 2, 3, 1, 4)  # [G, KB, fields, 16, 2]
    weights = g[..., 2 * fields:].permute(0, 2, 3, 1)  # [G, KB, weight bytes, 16]
    return torch.cat([scales.flatten(2), weights.flatten(2)], dim=-1).contiguous()  # [G, KB, 16 x bytes]


def from_panels(panels: torch.Tensor, fmt: str) -> torch.Tensor:
    """`to_panels`'s inverse: panels uint8 [N / 16, K / 32, 16 x bytes] -> blocks uint8 [N, K / 32, bytes]."""
    groups, per_row, _ = panels.shape
    fields, size = SCALE_BYTES[fmt] // 2, BLOCK_BYTES[fmt]
    head = 2 * fields * PANEL_OUTPUTS
    scales = panels[..., :head].reshape(groups, per_row, fields, PANEL_OUTPUTS, 2).permute(0, 1, 3, 2, 4)
    weights = panels[..., head:].reshape(groups, per_row, -1, PANEL_OUTPUTS).transpose(2, 3)  # [G, KB, 16, bytes]
    blocks = torch.cat([scales.flatten(3), weights], dim=-1)  # [G, KB, 16, bytes]
    return blocks.permute(0, 2, 1, 3).reshape(groups * PANEL_OUTPUTS, per_row, size).contiguous()


def unpermute_rope_rows(blocks: torch.Tensor, head_dim: int) -> torch.Tensor:
    """llama.cpp's q/k row order -> transformers': its row h * D + 2a + b is transformers' h * D + D/2 * b + a."""
    rows = blocks.shape[0]
    return blocks.view(rows // head_dim, head_dim // 2, 2, *blocks.shape[1:]).transpose(1, 2).reshape(blocks.shape)


def attach_gguf_blocks(model: torch.nn.Module, gguf: Path, folder: Path) -> int:
    """Give the model's linears converted from `gguf` their blocks (`module.packed`); returns how many.

    folder: the converted copy's folder, where the blocks are saved the first time (checked there).
    The blocks only make decode faster: if they cannot be written or read (a full disk, a damaged
    file), that is logged and the model keeps its float32 weights alone."""
    path = folder / BLOCKS_FILE
    try:
        if not path.is_file():
            with file_lock(folder.with_name(folder.name + ".blocks.lock"),
                           on_wait=waiting(f"for {path} to be written")):
                if not path.is_file():
                    with step(f"keeping {gguf.name}'s blocks for decode steps in {path} (once)",
                              f"kept {gguf.name}'s blocks"):
                        _save_blocks(model, gguf, path)
        found = _read_blocks(model, path) if path.is_file() else {}
    except Exception as exc:  # noqa: BLE001 - any failure leaves the float32 weights, which are correct
        log.warning("GGUF blocks of %s not used (%s): decode steps read the float32 weights", gguf.name,
                    str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__)
        return 0
    for module, packed in found.items():
        module.packed = packed
    return len(found)


def _read_blocks(model: torch.nn.Module, path: Path) -> dict[torch.nn.Module, PackedWeight]:
    """The saved blocks whose shape fits their module's weight, by module."""
    from safetensors import safe_open

    found = {}
    with safe_open(str(path), framework="pt") as handle:
        formats = handle.metadata() or {}
        for name in handle.keys():
            module = model.get_submodule(name)
            blocks = handle.get_tensor(name)
            N, K = module.weight.shape
            if formats.get(name) in BLOCK_BYTES and blocks.shape == (N, K // BLOCK_WEIGHTS, BLOCK_BYTES[formats[name]]):
                found[module] = PackedWeight(formats[name], blocks)
    return found


def _save_blocks(model: torch.nn.Module, gguf_path: Path, path: Path) -> None:
    """Write the blocks of every linear whose GGUF tensor de-quantises to exactly its loaded weight;
    nothing if a GGUF linear's module is not a float32 `nn.Linear` of its shape (a sharded model)."""
    import gguf
    import numpy as np
    from safetensors.torch import save_file

    types = {gguf.GGMLQuantizationType.Q4_1: "q4_1", gguf.GGMLQuantizationType.Q8_0: "q8_0"}
    tensors = {t.name: t for t in gguf.GGUFReader(gguf_path).tensors}
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kept, formats = {}, {}
    for name, tensor in tensors.items():
        module_name, proj = _module_for(name, has_output="output.weight" in tensors)
        fmt = types.get(tensor.tensor_type)
        if module_name is None or fmt is None:
            continue
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            continue
        weight = getattr(module, "weight", None)
        blocks = torch.from_numpy(np.ascontiguousarray(np.asarray(tensor.data)).copy())
        if type(module).__name__ not in PLAIN_LINEARS or weight is None or weight.dtype != torch.float32 \
                or weight.shape[1] % BLOCK_WEIGHTS or blocks.numel() != weight.numel() // BLOCK_WEIGHTS * BLOCK_BYTES[fmt]:
            return  # not the plain float32 model the file was converted into (e.g. sharded): keep nothing
        blocks = blocks.reshape(weight.shape[0], -1, BLOCK_BYTES[fmt])
        candidates = [blocks]
        if proj in ROPE_PERMUTED and weight.shape[0] % head_dim == 0:
            candidates.append(unpermute_rope_rows(blocks, head_dim).contiguous())
        for candidate in candidates:
            if torch.equal(dequantise(candidate, fmt), weight):
                kept[module_name], formats[module_name] = candidate, fmt
                break
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        save_file(kept, str(tmp), metadata=formats)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _module_for(gguf_name: str, *, has_output: bool) -> tuple[str | None, str | None]:
    """The transformers module a GGUF weight belongs to (llama.cpp names), and its llama.cpp projection name."""
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in LAYER_LINEARS:
        return f"model.layers.{parts[1]}.{LAYER_LINEARS[parts[2]]}", parts[2]
    if gguf_name == "output.weight" or (gguf_name == "token_embd.weight" and not has_output):
        return "lm_head", None  # a tied lm_head is the embedding's weight
    return None, None
