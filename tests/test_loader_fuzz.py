"""Loader fuzzing: seeded mutants of GGUF and safetensors checkpoints, each loaded in a worker
process under a time and memory limit (tests/loader_fuzz_worker.py).

Targets: a small GGUF written here with gguf.GGUFWriter in the embedded SmolLM2's layout (the same
metadata keys, a BPE vocabulary with merges, a Q8_0 embedding, Q4_1 matrices, F32 norms, a tied
head), a handful of mutants of the embedded GGUF itself, and a small HF safetensors checkpoint.

Two classes of mutant:

* targeted, invalid by construction (the kind says what was broken: NaN / infinite / zero /
  negative norm epsilon or rope base, a token id outside the vocabulary, a block count off by one
  or huge, array counts and string lengths past the end of the file, non-UTF-8 strings, tensor
  data misaligned / overlapping / past the end, a tensor type or shape that no longer matches its
  bytes, field types that do not suit the field, integer dtypes for float weights, ...): the load
  must raise LoadError naming the file and the field or tensor;
* random (a byte, a structural integer or a header byte changed at random): the load must raise
  LoadError naming the file, or give a model whose weights, vocabulary size and shape fields equal
  the original's (a changed value that is still valid, such as a name or a slightly different
  rope base, is a model the file legitimately describes).

Targeted kinds include broken weights with valid bytes: a NaN or infinite value, block scale or
min in each tensor type, and an F16 tensor relabelled BF16 (the load must name the tensor).
tests/test_input_fuzz.py does the same for HF side files, the int4 formats and the CLI.

Either way a load that outlives its time limit is a hang, any other exception an escape, and a
targeted mutant that loads a silent accept: all three must be zero. CI runs about 800 mutants
(~15 s on 2 cores); ``pytest -m slow tests/test_loader_fuzz.py`` runs about 24,000 (~3 min).
"""
from __future__ import annotations

import collections
import json
import math
import os
import random
import select
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import pytest

from conftest import SPECIALS, byte_tokenizer_json

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("loader_fuzz_worker.py")
QT = gguf.GGMLQuantizationType
VT = gguf.GGUFValueType
ARCH = "llama"
H, FF, HEADS, KV_HEADS, LAYERS = 64, 96, 4, 2, 2
HEAD_DIM = H // HEADS
MERGED = ["Ġt", "he", "Ġthe"]  # extra tokens, so the vocabulary has merges to read
MERGES = ["Ġ t", "h e", "Ġt he"]
GGUF_TIMEOUT_S = 20.0
MEMORY_GIB = 2.0  # the worker's address-space headroom; a load that needs more is an escape


# ------------------------------------------------------------------ the targets

def write_small_gguf(path: Path, seed: int = 0, edit=None) -> None:
    """A 2-layer llama GGUF with the embedded SmolLM2's metadata keys and tensor types;
    ``edit(name, values, kind)``, when given, returns the [(name, values, kind)] written instead."""
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_str(byte_tokenizer_json()).get_vocab()
    tokens = sorted(vocab, key=vocab.get) + MERGED
    w = gguf.GGUFWriter(str(path), ARCH)
    w.add_type("model")
    w.add_name("fuzz target")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(3)
    w.add_vocab_size(len(tokens))
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_add_space_prefix(False)
    w.add_add_bos_token(False)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    w.add_quantization_version(2)
    rng = np.random.default_rng(seed)

    def add(name, shape, kind):
        x = (rng.standard_normal(shape) * 0.1 + (1.0 if len(shape) == 1 else 0.0)).astype(np.float32)
        for n, y, k in edit(name, x, kind) if edit else [(name, x, kind)]:
            w.add_tensor(n, gguf.quants.quantize(y, k), raw_dtype=k)

    add("token_embd.weight", (len(tokens), H), QT.Q8_0)
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", (H,), QT.F32)
        add(f"blk.{i}.ffn_down.weight", (H, FF), QT.Q4_1)
        add(f"blk.{i}.ffn_gate.weight", (FF, H), QT.Q4_1)
        add(f"blk.{i}.ffn_up.weight", (FF, H), QT.Q4_1)
        add(f"blk.{i}.ffn_norm.weight", (H,), QT.F32)
        add(f"blk.{i}.attn_k.weight", (KV_HEADS * HEAD_DIM, H), QT.Q4_1)
        add(f"blk.{i}.attn_output.weight", (H, H), QT.F16 if i == 1 else QT.Q4_1)  # an F16 to swap
        add(f"blk.{i}.attn_q.weight", (H, H), QT.Q4_1)
        add(f"blk.{i}.attn_v.weight", (KV_HEADS * HEAD_DIM, H), QT.Q4_1)
    add("output_norm.weight", (H,), QT.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


SAFETENSORS_CONFIG = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
                          bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def write_small_safetensors(d: Path, seed: int = 0, tokenizer: bool = False) -> None:
    """An HF llama directory (config.json, model.safetensors) with random weights; with
    ``tokenizer``, the byte tokenizer and a ChatML template too (and its vocabulary size)."""
    import torch
    from safetensors.torch import save_file

    from conftest import BYTE_VOCAB, CHATML

    c = dict(SAFETENSORS_CONFIG, vocab_size=BYTE_VOCAB) if tokenizer else SAFETENSORS_CONFIG
    h, i, hd = c["hidden_size"], c["intermediate_size"], c["hidden_size"] // c["num_attention_heads"]
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(shape, generator=g) * 0.1

    t = {"model.embed_tokens.weight": r(c["vocab_size"], h), "model.norm.weight": 1 + r(h),
         "lm_head.weight": r(c["vocab_size"], h)}
    for li in range(c["num_hidden_layers"]):
        p = f"model.layers.{li}."
        t.update({p + "input_layernorm.weight": 1 + r(h), p + "post_attention_layernorm.weight": 1 + r(h),
                  p + "self_attn.q_proj.weight": r(4 * hd, h), p + "self_attn.k_proj.weight": r(2 * hd, h),
                  p + "self_attn.v_proj.weight": r(2 * hd, h), p + "self_attn.o_proj.weight": r(h, 4 * hd),
                  p + "mlp.gate_proj.weight": r(i, h), p + "mlp.up_proj.weight": r(i, h),
                  p + "mlp.down_proj.weight": r(h, i)})
    d.mkdir(parents=True, exist_ok=True)
    save_file(t, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(c))
    if tokenizer:
        (d / "tokenizer.json").write_text(byte_tokenizer_json())
        (d / "tokenizer_config.json").write_text(json.dumps(
            {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False, "chat_template": CHATML}))


# ------------------------------------------------------------------ where things are in a GGUF

@dataclass
class KV:
    key_pos: int  # the key's length prefix
    type_pos: int
    vtype: VT
    value_pos: int  # scalar value, string length prefix, or array item type


@dataclass
class Info:
    name_pos: int
    ndims_pos: int
    dims_pos: int
    n_dims: int
    dims: tuple
    type_pos: int
    kind: QT
    offset_pos: int
    offset: int


@dataclass
class Layout:
    kvs: dict
    infos: dict
    data_start: int
    structural: list  # (pos, size) of every length, count, type, dimension and offset
    strings: list  # (pos, length, key) of string bytes


def _u(buf, pos, fmt):
    return struct.unpack_from(fmt, buf, pos)[0]


def locate(buf: bytes, keys, tensor_names) -> Layout:
    """Positions of the known keys and tensor infos, found by their length-prefixed names (a
    locator independent of both GGUF readers)."""
    kvs, infos, structural, strings = {}, {}, [(8, 8), (16, 8)], []

    def find(name: str) -> int:
        b = name.encode()
        pos = buf.find(struct.pack("<Q", len(b)) + b)
        assert pos > 0, name
        return pos

    for k in keys:
        p = find(k)
        tp = p + 8 + len(k.encode())
        kv = KV(p, tp, VT(_u(buf, tp, "<I")), tp + 4)
        kvs[k] = kv
        structural += [(p, 8), (tp, 4)]
        strings.append((p + 8, len(k.encode()), "key:" + k))
        if kv.vtype == VT.STRING:
            structural.append((kv.value_pos, 8))
            strings.append((kv.value_pos + 8, _u(buf, kv.value_pos, "<Q"), k))
        elif kv.vtype == VT.ARRAY:
            structural += [(kv.value_pos, 4), (kv.value_pos + 4, 8)]
            if VT(_u(buf, kv.value_pos, "<I")) == VT.STRING:
                q = kv.value_pos + 12
                for _ in range(_u(buf, kv.value_pos + 4, "<Q")):
                    n = _u(buf, q, "<Q")
                    structural.append((q, 8))
                    strings.append((q + 8, n, k))
                    q += 8 + n
    end = 0
    for name in tensor_names:
        p = find(name)
        nd_pos = p + 8 + len(name)
        n_dims = _u(buf, nd_pos, "<I")
        dims = tuple(_u(buf, nd_pos + 4 + 8 * j, "<Q") for j in range(n_dims))
        tp = nd_pos + 4 + 8 * n_dims
        infos[name] = Info(p, nd_pos, nd_pos + 4, n_dims, dims, tp, QT(_u(buf, tp, "<I")), tp + 4,
                           _u(buf, tp + 4, "<Q"))
        structural += [(p, 8), (nd_pos, 4), (tp, 4), (tp + 4, 8)] + [(nd_pos + 4 + 8 * j, 8) for j in range(n_dims)]
        strings.append((p + 8, len(name), name))
        end = max(end, tp + 12)
    return Layout(kvs, infos, (end + 31) // 32 * 32, structural, strings)


def gguf_layout(path: Path) -> tuple[bytes, Layout]:
    """The file's bytes up to the tensor data, and where its fields are (the file must be valid:
    its keys and tensor names are listed by walking it)."""
    with open(path, "rb") as fh:
        head = fh.read(4 << 20)
    n_kv = _u(head, 16, "<Q")
    n_t = _u(head, 8, "<Q")
    keys, names, pos = [], [], 24
    for _ in range(n_kv):  # keys in file order: key, type, value (walked for the valid file only)
        n = _u(head, pos, "<Q")
        keys.append(head[pos + 8:pos + 8 + n].decode())
        pos = _skip_value(head, pos + 8 + n)
    for _ in range(n_t):
        n = _u(head, pos, "<Q")
        names.append(head[pos + 8:pos + 8 + n].decode())
        pos += 8 + n
        pos += 4 + 8 * _u(head, pos, "<I") + 4 + 8
    lay = locate(head, keys, names)
    return head[:lay.data_start], lay


def _skip_value(buf, tp):
    vt = VT(_u(buf, tp, "<I"))
    p = tp + 4
    if vt == VT.ARRAY:
        it = VT(_u(buf, p, "<I"))
        n = _u(buf, p + 4, "<Q")
        p += 12
        if it == VT.STRING:
            for _ in range(n):
                p += 8 + _u(buf, p, "<Q")
            return p
        return p + n * struct.calcsize(SCALAR_FMT[it])
    if vt == VT.STRING:
        return p + 8 + _u(buf, p, "<Q")
    return p + struct.calcsize(SCALAR_FMT[vt])


SCALAR_FMT = {VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h", VT.UINT32: "<I",
              VT.INT32: "<i", VT.FLOAT32: "<f", VT.BOOL: "<B", VT.UINT64: "<Q", VT.INT64: "<q",
              VT.FLOAT64: "<d"}


# ------------------------------------------------------------------ mutants

@dataclass
class Mutant:
    kind: str
    patches: list  # (pos, bytes) applied to the file
    expect: list = field(default_factory=list)  # substrings the LoadError must contain (besides the path)
    targeted: bool = True
    edit: object = None  # safetensors: a function(dir) that damages a copy


def _nbytes(dims, kind) -> int:
    block, size = gguf.GGML_QUANT_SIZES[kind]
    return math.prod(dims) // block * size if dims[0] % block == 0 else -1


FLINT_TYPES = {QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q4_K, QT.Q5_K, QT.Q6_K}


def gguf_targeted(head: bytes, lay: Layout, rng: random.Random) -> list[Mutant]:
    """One mutant of every targeted kind, values drawn from rng."""
    a = f"{ARCH}."
    kv, infos = lay.kvs, lay.infos
    vocab = len(_string_items(head, kv["tokenizer.ggml.tokens"]))
    out = []

    def scalar(kind, key, fmt, value, *expect):
        out.append(Mutant(kind, [(kv[key].value_pos, struct.pack(fmt, value))], [key, *expect]))

    eps, rope = a + "attention.layer_norm_rms_epsilon", a + "rope.freq_base"
    bad_float = [math.nan, math.inf, -math.inf, 0.0, -rng.uniform(1e-9, 1e3), -0.0]
    scalar("norm epsilon not finite or <= 0", eps, "<f", rng.choice(bad_float))
    scalar("rope base not finite or <= 0", rope, "<f", rng.choice(bad_float))
    scalar("implausible norm epsilon", eps, "<f", rng.choice([3e38, 1.0, 0.2, 1e-30]), "plausible range")
    scalar("implausible rope base", rope, "<f", rng.choice([1e-30, 0.5, 1e13, 3e38]), "plausible range")
    for key in ("eos", "bos", "unknown", "padding"):
        scalar("token id outside the vocabulary", f"tokenizer.ggml.{key}_token_id", "<I",
               rng.choice([vocab, vocab + 1, rng.randrange(vocab, 2**32)]))
    n_layers = _u(head, kv[a + "block_count"].value_pos, "<I")
    scalar("block count != layers present", a + "block_count", "<I",
           rng.choice([n_layers - 1, n_layers + 1, 0, 2**31, 2**32 - 1, rng.randrange(n_layers + 1, 2**32)]))
    scalar("context length 0 or > 2^31-1", a + "context_length", "<I", rng.choice([0, 2**31, 2**32 - 1]))
    for key in ("attention.head_count", "attention.head_count_kv", "embedding_length", "feed_forward_length",
                "rope.dimension_count", "vocab_size"):
        orig = _u(head, kv[a + key].value_pos, "<I")
        new = rng.choice([0, orig + 1, orig * 2, orig // 2 or 3, 2**32 - 1, rng.randrange(2**32)])
        out.append(Mutant("shape field changed", [(kv[a + key].value_pos, struct.pack("<I", new))],
                          [(a + key, "tensor")]))  # the field, or a tensor whose shape it contradicts
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                "general.languages"):
        if key in kv:
            rest = len(head) * 4  # more items than the whole file could hold
            out.append(Mutant("array count past the end", [(kv[key].value_pos + 4, struct.pack(
                "<Q", rng.choice([2**62, 2**64 - 1, 2**63, rng.randrange(rest, 2**64)])))], [key]))
    for key in ("general.name", "tokenizer.chat_template", "tokenizer.ggml.model"):
        out.append(Mutant("string length past the end", [(kv[key].value_pos, struct.pack(
            "<Q", rng.choice([2**62, 2**64 - 1, rng.randrange(len(head) * 4, 2**64)])))], [key]))
    k = rng.choice(list(kv))
    out.append(Mutant("key length past the end", [(kv[k].key_pos, struct.pack("<Q", 2**64 - 1 - rng.randrange(99)))],
                      ["metadata key"]))
    for pos in (8, 16):
        out.append(Mutant("header count past the end", [(pos, struct.pack("<Q", rng.choice([2**62, 2**64 - 1])))],
                          ["tensor infos"]))
    # non-UTF-8: 0xFF is never valid in UTF-8
    strs = [s for s in lay.strings if s[1] > 0]
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "general.name", "tokenizer.chat_template"):
        pos, n, _ = rng.choice([s for s in strs if s[2] == key])
        out.append(Mutant("non-UTF-8 string", [(pos + rng.randrange(n), b"\xff")], [key]))
    pos, n, name = rng.choice([s for s in strs if s[2] in infos])
    out.append(Mutant("non-UTF-8 tensor name", [(pos + rng.randrange(n), b"\xfe")], ["tensor info #"]))
    # field types that do not suit the field (same width, so the rest of the file parses)
    key, new = rng.choice([(eps, VT.UINT32), (rope, VT.INT32), (a + "block_count", VT.FLOAT32),
                           ("tokenizer.ggml.eos_token_id", VT.FLOAT32), (a + "context_length", VT.FLOAT32),
                           ("tokenizer.ggml.add_bos_token", VT.UINT8), ("tokenizer.ggml.add_bos_token", VT.INT8)])
    out.append(Mutant("field type unsuitable", [(kv[key].type_pos, struct.pack("<I", new))], [key]))
    out.append(Mutant("unknown value type", [(kv[rng.choice(list(kv))].type_pos,
                                              struct.pack("<I", rng.randrange(13, 2**32)))], ["field '"]))
    out.append(Mutant("boolean not 0 or 1", [(kv["tokenizer.ggml.add_bos_token"].value_pos,
                                               bytes([rng.randrange(2, 256)]))], ["tokenizer.ggml.add_bos_token"]))
    model = kv["tokenizer.ggml.model"].value_pos + 8
    out.append(Mutant("tokenizer model not gpt2", [(model, b"gpt3")], ["tokenizer.ggml.model"]))
    # tensor infos
    names = list(infos)
    for kind in ("misaligned offset", "overlapping offset", "offset past the end", "type change",
                 "shape change", "dimension count"):
        name = rng.choice(names)
        t = infos[name]
        if kind == "misaligned offset":
            p = [(t.offset_pos, struct.pack("<Q", t.offset + rng.randrange(1, 32)))]
        elif kind == "overlapping offset":
            other = rng.choice([infos[n].offset for n in names if infos[n].offset != t.offset] +
                               ([t.offset - 32] if t.offset >= 32 else []))
            p = [(t.offset_pos, struct.pack("<Q", other))]
        elif kind == "offset past the end":
            p = [(t.offset_pos, struct.pack("<Q", rng.randrange(1 << 40, 1 << 63) // 32 * 32))]
        elif kind == "type change":
            new = rng.choice([q for q in QT if q != t.kind and (
                q not in gguf.GGML_QUANT_SIZES or q not in FLINT_TYPES or _nbytes(t.dims, q) != _nbytes(t.dims, t.kind))]
                + [rng.randrange(40, 2**32)])
            p = [(t.type_pos, struct.pack("<I", int(new)))]
        elif kind == "shape change":
            j = rng.randrange(t.n_dims)
            dims = list(t.dims)
            dims[j] = rng.choice([0, dims[j] + 32, dims[j] * 2, max(dims[j] - 32, 1), 2**63, rng.randrange(2**64)])
            if t.n_dims == 2 and dims == list(t.dims):
                dims = dims[::-1]
            p = [(t.dims_pos + 8 * j, struct.pack("<Q", dims[j]))]
        else:
            p = [(t.ndims_pos, struct.pack("<I", rng.choice([0, 5, 6, 2**32 - 1])))]
        out.append(Mutant(kind, p, ["tensor"]))
    t = infos[rng.choice([n for n in names if infos[n].n_dims == 2 and infos[n].dims[0] != infos[n].dims[1]])]
    out.append(Mutant("shape transposed", [(t.dims_pos, struct.pack("<Q", t.dims[1])),
                                           (t.dims_pos + 8, struct.pack("<Q", t.dims[0]))], ["tensor"]))
    out += gguf_broken_weights(lay, rng)
    return out


# a non-finite value per tensor type, at the first block: (byte offset in the block, bytes)
_NAN_F16, _INF_F16 = struct.pack("<e", math.nan), struct.pack("<e", math.inf)
_BROKEN = {QT.F32: [(0, struct.pack("<f", math.nan)), (0, struct.pack("<f", -math.inf))],
           QT.F16: [(0, _NAN_F16), (0, _INF_F16)],
           QT.Q8_0: [(0, _NAN_F16), (0, _INF_F16)],  # the block's scale
           QT.Q4_1: [(0, _NAN_F16), (2, _INF_F16), (2, _NAN_F16)],  # its scale, its min
           QT.Q4_0: [(0, _NAN_F16)]}


def gguf_broken_weights(lay: Layout, rng: random.Random) -> list[Mutant]:
    """Weights whose bytes are valid but whose values are not: a NaN or infinite value, scale or
    min (the load must name the tensor), and a same-width type swap, F16 <-> BF16 (the magnitudes
    give it away). Patches land in the tensor data, past the header."""
    out = []
    for kind in sorted({t.kind for t in lay.infos.values()} & set(_BROKEN)):
        name = rng.choice([n for n, t in lay.infos.items() if t.kind == kind])
        block = gguf.GGML_QUANT_SIZES[kind][1]
        at, value = rng.choice(_BROKEN[kind])
        pos = lay.data_start + lay.infos[name].offset + block * rng.randrange(4) + at
        out.append(Mutant(f"non-finite {kind.name} weight", [(pos, value)], [name, "NaN or infinite"]))
    for name, t in lay.infos.items():
        if t.kind in (QT.F16, QT.BF16) and t.n_dims == 2:
            swap = QT.BF16 if t.kind == QT.F16 else QT.F16
            out.append(Mutant("F16 <-> BF16 swap", [(t.type_pos, struct.pack("<I", swap))], [name, "likely wrong"]))
    return out


def _string_items(buf, kv: KV) -> list:
    q, items = kv.value_pos + 12, []
    for _ in range(_u(buf, kv.value_pos + 4, "<Q")):
        n = _u(buf, q, "<Q")
        items.append(buf[q + 8:q + 8 + n])
        q += 8 + n
    return items


def gguf_random(head: bytes, lay: Layout, rng: random.Random) -> Mutant:
    r = rng.random()
    if r < 0.4:
        pos = rng.randrange(len(head))
        return Mutant("random byte", [(pos, bytes([head[pos] ^ rng.randrange(1, 256)]))], targeted=False)
    if r < 0.75:
        pos, size = rng.choice(lay.structural)
        old = int.from_bytes(head[pos:pos + size], "little")
        new = rng.choice([old + 1, old - 1, old ^ (1 << rng.randrange(8 * size)), rng.randrange(2 ** (8 * size)),
                          2 ** (8 * size - 1), 0]) % 2 ** (8 * size)
        return Mutant("random structural integer", [(pos, new.to_bytes(size, "little"))], targeted=False)
    pos, n, _ = rng.choice([s for s in lay.strings if s[1] > 0])
    p = pos + rng.randrange(n)
    return Mutant("random string byte", [(p, bytes([rng.randrange(256)]))], targeted=False)


# ------------------------------------------------------------------ safetensors mutants

def st_mutants(d: Path, rng: random.Random, n_random: int) -> list[Mutant]:
    f = d / "model.safetensors"
    raw = f.read_bytes()
    n = _u(raw, 0, "<Q")
    hdr = json.loads(raw[8:8 + n])
    names = [k for k in hdr if k != "__metadata__"]
    data_size = len(raw) - 8 - n
    out = []

    def header(kind, change, *expect):
        h = json.loads(raw[8:8 + n])
        change(h)
        body = json.dumps(h).encode()

        def edit(dst: Path, body=body):
            (dst / "model.safetensors").write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n:])
        out.append(Mutant(kind, [], ["model.safetensors", *expect], edit=edit))

    def cfg(kind, key, value, expect):
        def edit(dst: Path):
            c = json.loads((dst / "config.json").read_text())
            c[key] = value
            (dst / "config.json").write_text(json.dumps(c))
        out.append(Mutant(kind, [], expect, edit=edit))

    for _ in range(3):
        k = rng.choice(names)
        same_width = {"F32": ["I32", "U32"], "F16": ["I16", "U16"], "BF16": ["I16", "U16"]}[hdr[k]["dtype"]]
        header("integer dtype for a float weight", lambda h, k=k, v=rng.choice(same_width): h[k].update(dtype=v), k)
        header("dtype of another width or kind", lambda h, k=k, v=rng.choice(
            ["F64", "F16", "BF16", "I8", "U8", "I64", "BOOL", "F8_E4M3", "F8_E5M2", "Q4", "", 7]): h[k].update(dtype=v), k)
        sh = list(hdr[k]["shape"])
        j = rng.randrange(len(sh))
        bad = sh[:j] + [rng.choice([sh[j] + 1, max(sh[j] - 1, 0), 0, 2**40, -1])] + sh[j + 1:]
        header("shape changed", lambda h, k=k, s=bad: h[k].update(shape=s), k)
        header("shape reordered", lambda h, k=k, s=sh[::-1] if len(sh) == 2 and sh[0] != sh[1] else sh + [1]:
               h[k].update(shape=s), "tensor")
        b, e = hdr[k]["data_offsets"]
        shift = rng.choice([1, 2, 4, -4, 64, 2**40])
        header("data offsets shifted", lambda h, k=k, o=[b + shift, e + shift] if b + shift >= 0 else [b, e + 4]:
               h[k].update(data_offsets=o), k)
        other = rng.choice([x for x in names if x != k])
        header("data offsets overlap", lambda h, k=k, o=other: h[k].update(
            data_offsets=[h[o]["data_offsets"][0], h[o]["data_offsets"][0] + e - b]), k)
        header("data offsets past the end", lambda h, k=k: h[k].update(
            data_offsets=[data_size, data_size + e - b]), k)
        header("entry malformed", lambda h, k=k, v=rng.choice(
            [{}, [], "x", {"dtype": "F32"}, {"dtype": "F32", "shape": "4", "data_offsets": [0, 4]}]): h.update({k: v}), k)
        header("tensor missing", lambda h, k=k: h.pop(k), ("missing", "belong to no tensor"))
        header("tensor renamed", lambda h, k=k, v=rng.choice(
            ["model.layers.2.mlp.up_proj.weight", "model.extra.weight", "lm_head.bias", k + "x"]): h.update({v: h.pop(k)}), "tensor")
    header("metadata not strings", lambda h: h.update(__metadata__={"format": 1}), "__metadata__")
    for key, values in (("rms_norm_eps", [math.nan, math.inf, 0.0, -1e-5]), ("rope_theta", [0.0, -1.0, math.nan]),
                        ("eos_token_id", [64, 65, 2**31]), ("bos_token_id", [64, 10**9]),
                        ("num_hidden_layers", [1, 3, 2**31]), ("max_position_embeddings", [0, 2**40])):
        cfg("config value out of range", key, rng.choice(values), ["config.json", key])
    for key, values in (("vocab_size", [63, 65]), ("hidden_size", [16, 2**40]), ("intermediate_size", [47, 2**40])):
        cfg("config shape contradicts a tensor", key, rng.choice(values), ["tensor"])

    def length(v):
        def edit(dst: Path):
            b = bytearray(raw)
            b[:8] = struct.pack("<Q", v)
            (dst / "model.safetensors").write_bytes(bytes(b))
        return edit
    for v in (n + 1, n - 1, n + rng.randrange(2, 64), 2**64 - 1, 0):
        out.append(Mutant("header length wrong", [], ["model.safetensors"], edit=length(v)))
    # any config value replaced by a value of another type or range; tie_word_embeddings is left
    # out: true with an lm_head present ties it, as transformers does (a valid, different model)
    keys = [k for k in SAFETENSORS_CONFIG if k != "tie_word_embeddings"]
    for _ in range(n_random // 4):
        key, value = rng.choice(keys), rng.choice([None, "x", [], {}, [1], -1, 0, 1, 1.5, True, False, 2**70, math.nan])

        def edit(dst: Path, key=key, value=value):
            c = json.loads((dst / "config.json").read_text())
            c[key] = value
            (dst / "config.json").write_text(json.dumps(c))
        out.append(Mutant("random config value", [], ["config.json"], targeted=False, edit=edit))
    for _ in range(n_random):
        pos = 8 + rng.randrange(n)
        new = bytes([raw[pos] ^ rng.randrange(1, 256)])

        def edit(dst: Path, pos=pos, new=new):
            b = bytearray(raw)
            b[pos:pos + 1] = new
            (dst / "model.safetensors").write_bytes(bytes(b))
        out.append(Mutant("random header byte", [], ["model.safetensors"], targeted=False, edit=edit))
    return out


# ------------------------------------------------------------------ running them

class Worker:
    """A child process that loads one spec per request with a time limit (a timeout is a hang,
    the child is then replaced) under an address-space limit."""

    def __init__(self, baseline: str | None, tmp: Path):
        self.baseline, self.tmp = baseline or "-", tmp
        self.proc = None

    def start(self):
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", TQDM_DISABLE="1")
        self.err = open(self.tmp / "worker.stderr", "ab")
        self.proc = subprocess.Popen([sys.executable, str(WORKER), self.baseline, str(MEMORY_GIB)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err,
                                     cwd=str(self.tmp), env=env, text=True)
        ready = self._read(120.0)
        assert ready and ready.get("ready"), f"fuzz worker did not start: {(self.tmp / 'worker.stderr').read_text()[-2000:]}"

    def _read(self, timeout):
        r, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not r:
            return None
        line = self.proc.stdout.readline()
        return json.loads(line) if line else {"outcome": "crashed", "message": f"worker exited ({self.proc.poll()})"}

    def load(self, spec: str, timeout: float) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        self.proc.stdin.write(spec + "\n")
        self.proc.stdin.flush()
        reply = self._read(timeout)
        if reply is None:
            self.stop()
            return {"outcome": "hang", "message": f"no answer in {timeout:.0f} s"}
        if reply["outcome"] == "crashed":
            self.stop()
        return reply

    def stop(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc.stdin.close()
            self.proc.stdout.close()
            self.err.close()
            self.proc = None


@dataclass
class Tally:
    rows: collections.Counter = field(default_factory=collections.Counter)  # (kind, verdict)
    failures: list = field(default_factory=list)
    peak_mb: float = 0.0

    def add(self, m: Mutant, reply: dict, spec: str) -> None:
        out, msg = reply["outcome"], reply.get("message", "")
        self.peak_mb = max(self.peak_mb, reply.get("maxrss_mb", 0.0))
        if out == "LoadError":
            need = [spec, *m.expect] if m.targeted else [spec]
            missing = [s for s in need if not any(x in msg for x in ((s,) if isinstance(s, str) else s))]
            verdict = "unnamed" if missing else "LoadError"
        elif out == "loaded":
            verdict = "silent accept" if m.targeted or not reply.get("same", False) else "valid value"
        else:
            verdict = out  # hang, escaped, crashed
        self.rows[(m.kind, verdict)] += 1
        if verdict not in ("LoadError", "valid value"):
            self.failures.append(f"{m.kind} {m.patches[:2]}: {verdict}: {msg[:300]} {reply.get('changed', '')}")

    def report(self) -> str:
        kinds = sorted({k for k, _ in self.rows})
        total = collections.Counter()
        for (k, v), n in self.rows.items():
            total[v] += n
        lines = [f"{sum(total.values())} mutants, {len(kinds)} kinds: " + ", ".join(f"{v} {n}" for v, n in total.most_common())
                 + f"; worker peak RSS {self.peak_mb:.0f} MB"]
        lines += [f"  {k}: " + ", ".join(f"{v} {n}" for (kk, v), n in sorted(self.rows.items()) if kk == k) for k in kinds]
        return "\n".join(lines)


def run_gguf(src: Path, mutants: list[Mutant], tmp: Path, baseline: bool) -> Tally:
    """Patch a copy of src in place for each mutant, load it, put the bytes back."""
    work = tmp / "mutant.gguf"
    shutil.copyfile(src, work)
    worker, tally = Worker(str(src) if baseline else None, tmp), Tally()
    try:
        with open(work, "r+b") as fh:
            for m in mutants:
                saved = []
                for pos, b in m.patches:
                    fh.seek(pos)
                    saved.append((pos, fh.read(len(b))))
                    fh.seek(pos)
                    fh.write(b)
                fh.flush()
                tally.add(m, worker.load(str(work), GGUF_TIMEOUT_S), str(work))
                for pos, b in reversed(saved):
                    fh.seek(pos)
                    fh.write(b)
                fh.flush()
    finally:
        worker.stop()
    return tally


def run_safetensors(src: Path, mutants: list[Mutant], tmp: Path) -> Tally:
    worker, tally = Worker(str(src), tmp), Tally()
    try:
        for i, m in enumerate(mutants):
            d = tmp / f"m{i}"
            shutil.copytree(src, d)
            m.edit(d)
            tally.add(m, worker.load(str(d), GGUF_TIMEOUT_S), str(d))
            shutil.rmtree(d)
    finally:
        worker.stop()
    return tally


def check(tally: Tally) -> None:
    report = tally.report()
    print("\n" + report)
    assert not tally.failures, report + "\nfailures:\n" + "\n".join(tally.failures[:40])


# ------------------------------------------------------------------ the tests

@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("fuzz-gguf") / "small.gguf"
    write_small_gguf(p)
    return p


@pytest.fixture(scope="module")
def small_st(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("fuzz-st") / "ckpt"
    write_small_safetensors(d)
    return d


def gguf_mutants(path: Path, seed: int, rounds: int, n_random: int) -> list[Mutant]:
    head, lay = gguf_layout(path)
    rng = random.Random(seed)
    out = [m for _ in range(rounds) for m in gguf_targeted(head, lay, rng)]
    return out + [gguf_random(head, lay, rng) for _ in range(n_random)]


def test_small_gguf_loads_like_the_embedded_layout(small_gguf):
    """The target itself loads, with the embedded model's tensor types (so mutants start valid)."""
    from flint.loading import load_model
    from flint.quant.int4 import Int4Weight

    lm = load_model(str(small_gguf))
    assert lm.cfg.num_layers == LAYERS and lm.cfg.tie_word_embeddings
    assert isinstance(lm.params["layers.1.wq"], Int4Weight)  # Q4_1 kept as codes
    assert lm.params["lm_head"] is lm.params["embed"]  # Q8_0, dequantized, tied
    assert lm.tokenizer.encode(" the") == [lm.tokenizer.tk.token_to_id("Ġthe")]  # the merges were read


@pytest.mark.parametrize("which", ["small", pytest.param("embedded", marks=pytest.mark.slow)])
def test_reader_agrees_with_gguf_package(small_gguf, which, request):
    """flint.gguf_file reads what gguf.GGUFReader reads: every field's value and type, every
    tensor's name, shape, type, offset and bytes. (The embedded file takes GGUFReader ~6 s: a slow
    run; tests/test_gguf.py checks its weights and tokens against transformers in CI.)"""
    if which == "embedded":
        request.getfixturevalue("slow_run")
    from flint import gguf_file
    from flint.loading import LoadError, embedded_gguf_path

    if which == "small":
        path = small_gguf
    else:
        try:
            path = embedded_gguf_path()
        except LoadError as e:
            pytest.skip(str(e))
    ours, theirs = gguf_file.read(path), gguf.GGUFReader(str(path))
    fields = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(fields)
    for k, f in fields.items():
        assert ours.fields[k].type == f.types[0], k
        assert ours.fields[k].value == f.contents(), k
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.shape, a.tensor_type, a.nbytes) == (tuple(int(x) for x in b.shape), b.tensor_type, b.n_bytes), a.name
        assert a.offset + (theirs.data_offset) == b.data_offset, a.name
        assert np.array_equal(a.data, np.asarray(b.data).reshape(-1).view(np.uint8)), a.name


def test_gguf_fuzz(small_gguf, tmp_path):
    mutants = gguf_mutants(small_gguf, seed=0, rounds=6, n_random=300)
    tally = run_gguf(small_gguf, mutants, tmp_path, baseline=True)
    check(tally)


def test_embedded_gguf_fuzz(tmp_path):
    """The issue's cases on the real file: one targeted mutant of each kind."""
    from flint.loading import LoadError, embedded_gguf_path

    try:
        src = embedded_gguf_path()
    except LoadError as e:
        pytest.skip(str(e))
    kinds = {"norm epsilon not finite or <= 0", "rope base not finite or <= 0", "token id outside the vocabulary",
             "block count != layers present", "array count past the end", "non-UTF-8 string",
             "misaligned offset", "overlapping offset", "type change", "field type unsuitable",
             "non-finite Q4_1 weight", "non-finite Q8_0 weight", "non-finite F32 weight"}
    head, lay = gguf_layout(src)
    chosen, seen = [], set()
    for m in gguf_targeted(head, lay, random.Random(1)):
        if m.kind in kinds and m.kind not in seen:
            seen.add(m.kind)
            chosen.append(m)
    tally = run_gguf(src, chosen, tmp_path, baseline=False)
    check(tally)
    assert seen == kinds


def test_safetensors_fuzz(small_st, tmp_path):
    rng = random.Random(0)
    mutants = st_mutants(small_st, rng, n_random=150) + st_mutants(small_st, rng, n_random=0)
    check(run_safetensors(small_st, mutants, tmp_path))


@pytest.mark.slow
@pytest.mark.usefixtures("slow_run")
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_gguf_fuzz_many(small_gguf, tmp_path, seed):
    check(run_gguf(small_gguf, gguf_mutants(small_gguf, seed, rounds=30, n_random=3000), tmp_path, baseline=True))


@pytest.mark.slow
@pytest.mark.usefixtures("slow_run")
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_safetensors_fuzz_many(small_st, tmp_path, seed):
    rng = random.Random(seed)
    mutants = [m for _ in range(6) for m in st_mutants(small_st, rng, n_random=300)]
    check(run_safetensors(small_st, mutants, tmp_path))
