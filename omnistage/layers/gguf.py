"""A GGUF file (llama.cpp's format) as a model source: its hyperparameters as an HF config,
its tensors under HF names, its tokenizer (transformers' GGUF conversion).

Linear weights keep their stored quantization where the native kernel computes it exactly
(`keep_codes`): q4_0 -> int4 and q8_0 -> int8g, groups of 32, the codes and float16 scales as
stored, so every weight is the value llama.cpp's reference dequantization gives. Other
quantized types (k-quants, q4_1, q5_*, iq*) are dequantized by gguf-py's reference code and
re-quantized to int8g groups of 32 (error at most half of 1/127 of a block's largest weight,
well under theirs). Float types (F32, F16, BF16) come as float32, as do the embedding table,
norms and biases. Without `keep_codes` (no native kernel here, or an explicit
`quantization`), every tensor comes as float32.

The output head always comes as `lm_head.weight` (from `output.weight`, or from the token
embedding table when the file ties them), so a tied file loads untied: the head keeps its
codes while the embedding table is float32.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from omnistage.errors import CheckpointError, ModelLoadError
from omnistage.kernels.weight_pack import QuantizedCodes, WeightFormat, quantize_codes

# general.architecture -> the HF architecture our model table serves it with
ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM"}
GROUP = 32                                   # q4_0 / q8_0 block size
# GGUF tensor name parts (llama.cpp's naming) -> HF Qwen2 ones
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix.lower() == ".gguf" and Path(path).is_file()


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]          # (out, in) / (n,): outermost first (GGUF lists innermost first)
    tensor_type: int                # a gguf.GGMLQuantizationType value
    data: np.ndarray                # its bytes, memory-mapped


# GGUF value types -> (struct format, size) of the scalar ones; 8: string, 9: array
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
            6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}


class GGUFFile:
    """A GGUF file's metadata and tensors, memory-mapped. Our own reader of the layout
    (header, key/values, tensor infos, aligned data): gguf-py's GGUFReader builds a numpy view
    per field part and takes seconds per 100k-token vocabulary each time a file is opened;
    this skips arrays it is not asked for. gguf-py still gives the type sizes and the
    dequantization."""

    def __init__(self, path: str | Path):
        try:
            import gguf
        except ImportError as e:
            raise ModelLoadError(f"{path} is a GGUF file: reading it needs the gguf package "
                                 f"(pip install 'omnistage[gguf]')") from e
        self.path = Path(path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._buf = memoryview(self._map)
        try:
            self._parse(gguf.GGML_QUANT_SIZES)
        except (struct.error, ValueError, KeyError, IndexError) as e:
            raise ModelLoadError(f"{path} is not a readable GGUF file ({e!r})") from e

    def _parse(self, sizes) -> None:
        if bytes(self._buf[:4]) != b"GGUF":
            raise ValueError("no GGUF magic")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", self._buf, 4)
        if version < 2:
            raise ValueError(f"GGUF version {version} (2 or later are read)")
        self._pos = 24
        self.metadata: dict[str, object] = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(struct.unpack_from("<I", self._buf, self._pos)[0], skip=False,
                                             advance=4)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = struct.unpack_from("<I", self._buf, self._pos)
            dims = struct.unpack_from(f"<{n_dims}Q", self._buf, self._pos + 4)
            kind, offset = struct.unpack_from("<IQ", self._buf, self._pos + 4 + 8 * n_dims)
            self._pos += 4 + 8 * n_dims + 12
            infos.append((name, dims, kind, offset))
        align = int(self.metadata.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        self.tensors: list[GGUFTensor] = []
        for name, dims, kind, offset in infos:
            block, type_size = sizes[kind]
            nbytes = int(np.prod(dims)) * type_size // block
            data = self._map[start + offset:start + offset + nbytes]
            if data.size != nbytes:
                raise ValueError(f"tensor {name} runs past the end of the file")
            self.tensors.append(GGUFTensor(name, tuple(int(d) for d in reversed(dims)), kind, data))

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self._buf, self._pos)
        self._pos += 8 + n
        return bytes(self._buf[self._pos - n:self._pos]).decode("utf-8", errors="replace")

    def _value(self, kind: int, skip: bool, advance: int = 0):
        """The value of type `kind` at the cursor (after `advance` bytes); arrays are skipped
        (None): the tokenizer's lists are read by transformers, not here."""
        self._pos += advance
        if kind in _SCALARS:
            fmt, size = _SCALARS[kind]
            self._pos += size
            return None if skip else struct.unpack_from(fmt, self._buf, self._pos - size)[0]
        if kind == 8:
            return self._string()
        if kind != 9:
            raise ValueError(f"unknown GGUF value type {kind}")
        item, count = struct.unpack_from("<IQ", self._buf, self._pos)
        self._pos += 12
        if item in _SCALARS:
            self._pos += count * _SCALARS[item][1]
        else:
            for _ in range(count):
                self._value(item, skip=True)
        return None

    def field(self, key: str, default=None):
        if key in self.metadata:
            return self.metadata[key]
        if default is None:
            raise ModelLoadError(f"{self.path}: the GGUF file lacks the {key!r} entry")
        return default


def gguf_config(path: str | Path) -> dict:
    """The HF config.json content of a GGUF model (its llama.cpp hyperparameter keys)."""
    r = GGUFFile(path)
    arch = r.field("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} is not served; GGUF files of "
                             f"{', '.join(ARCHITECTURES)} are (other models: HF safetensors folders)")
    embd = next((t for t in r.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise CheckpointError(f"{path} has no token_embd.weight tensor")
    heads = int(r.field(f"{arch}.attention.head_count"))
    cfg = {
        "architectures": [ARCHITECTURES[arch]], "model_type": arch,
        "vocab_size": embd.shape[0], "hidden_size": int(r.field(f"{arch}.embedding_length")),
        "intermediate_size": int(r.field(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(r.field(f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(r.field(f"{arch}.attention.head_count_kv", heads)),
        "max_position_embeddings": int(r.field(f"{arch}.context_length")),
        "rms_norm_eps": float(r.field(f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(r.field(f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": False,        # the head always loads as lm_head.weight
    }
    key_length = r.field(f"{arch}.attention.key_length", 0)
    if key_length:
        cfg["head_dim"] = int(key_length)
    if r.field(f"{arch}.rope.scaling.type", "none") not in ("none", "linear") or \
            float(r.field(f"{arch}.rope.scaling.factor", 1.0)) != 1.0:
        cfg["rope_scaling"] = {"rope_type": str(r.field(f"{arch}.rope.scaling.type"))}
    return cfg


def gguf_weights(path: str | Path, keep_codes: bool
                 ) -> Iterator[tuple[str, torch.Tensor | QuantizedCodes]]:
    """(HF name, tensor) of every tensor of the file; linear weights as QuantizedCodes when
    `keep_codes` and they are quantized (see the module doc)."""
    r = GGUFFile(path)
    names = {t.name for t in r.tensors}
    for t in r.tensors:
        if t.name == "token_embd.weight":
            yield "model.embed_tokens.weight", _float(t)
            if "output.weight" not in names:
                yield "lm_head.weight", _weight(t, keep_codes)
        elif t.name == "output.weight":
            yield "lm_head.weight", _weight(t, keep_codes)
        elif t.name == "output_norm.weight":
            yield "model.norm.weight", _float(t)
        else:
            yield _layer_name(t.name), (_weight(t, keep_codes) if len(t.shape) == 2 else _float(t))


def _layer_name(name: str) -> str:
    parts = name.split(".", 2)
    if parts[0] != "blk" or len(parts) < 3 or parts[2] not in LAYER_NAMES:
        return f"gguf.{name}"                # not ours: the model reports it as unused
    return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}"


def _float(t: GGUFTensor) -> torch.Tensor:
    """A tensor's values as float32 (out, in) / (n,), dequantized when stored quantized."""
    import gguf

    values = gguf.quants.dequantize(_rows(t), gguf.GGMLQuantizationType(t.tensor_type))
    # A copy: the file's pages are read-only (and the tensor outlives nothing but its load).
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(t.shape))


def _rows(t: GGUFTensor) -> np.ndarray:
    """The bytes of a tensor as gguf-py's dequantize takes them: one row of bytes per
    outermost index, in the element type for float types."""
    import gguf

    kind = gguf.GGMLQuantizationType(t.tensor_type)
    if kind in (kind.F32, kind.F16):
        return t.data.view(np.float32 if kind == kind.F32 else np.float16)
    return t.data.reshape(t.shape[0] if len(t.shape) > 1 else 1, -1)


def _weight(t: GGUFTensor, keep_codes: bool) -> torch.Tensor | QuantizedCodes:
    import gguf

    kind = gguf.GGMLQuantizationType
    if not keep_codes or t.tensor_type in (kind.F32, kind.F16, kind.BF16, kind.F64):
        return _float(t)
    if t.tensor_type in (kind.Q4_0, kind.Q8_0):
        return _codes(t, t.tensor_type == kind.Q4_0)
    return quantize_codes(_float(t), WeightFormat("int8g", GROUP))


def _codes(t: GGUFTensor, int4: bool) -> QuantizedCodes:
    """q4_0 / q8_0 blocks of 32 -> codes and scales. A q4_0 block: float16 d, then 16 bytes
    whose low nibbles are elements 0..15 and high nibbles 16..31, w = (u - 8) d; a q8_0 block:
    float16 d, then 32 int8, w = q d."""
    out, k = t.shape
    blocks = t.data.reshape(out, k // GROUP, -1)                        # (out, blocks, bytes)
    scales = np.ascontiguousarray(blocks[:, :, :2]).view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[:, :, 2:]
    if int4:
        codes = np.concatenate([qs & 15, qs >> 4], axis=-1)             # (out, blocks, 32)
    else:
        codes = np.ascontiguousarray(qs).view(np.int8)
    return QuantizedCodes("int4" if int4 else "int8g",
                          torch.from_numpy(np.ascontiguousarray(codes).reshape(out, k)),
                          torch.from_numpy(scales), GROUP)


def load_gguf_tokenizer(path: str | Path):
    """The file's tokenizer, converted by transformers (its GGUF support)."""
    from transformers import AutoTokenizer

    p = Path(path)
    try:
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"cannot build a tokenizer from {path} ({e})") from e
