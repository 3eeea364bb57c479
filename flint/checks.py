"""Checks the loaders share (flint.config, flint.loading, flint.tokenizer): JSON side files read
strictly, their fields typed, hyperparameters in plausible ranges, and weights finite and
plausibly labelled. Every check raises the caller's error class (ConfigError, LoadError,
TokenizerError) with a message naming the file and the field or tensor.

* ``read_json``: UTF-8 (an undecodable byte is named by offset), no NaN / Infinity / overflowing
  number (1e400 parses to inf in Python), no key given twice (Python keeps the last silently),
  nesting bounded (Python's parser recurses; 100,000 brackets would be a RecursionError).
* ``typed``: a field's value only from the JSON type that means it, as the GGUF getter does
  (flint.loading._gguf_getter): a boolean only from true / false (``"false"`` is not false), an
  id or size only from an integer (``"12"`` or 12.0 is not 12), a number from an integer or a
  float but never a boolean.
* ``PLAUSIBLE``: the ranges ModelConfig.validate holds hyperparameters to. Wider than any
  released checkpoint's (norm epsilon 1e-12 .. 1e-1, RoPE base 1 .. 1e12, Granite's multipliers
  1e-6 .. 1e6); outside them the arithmetic runs and the output is garbage (rope base 1e-300:
  NaN logits), so a value there is a misread file, not a model.
* ``check_weight``: every value of a float weight, and every int4 scale and min, finite; a 2-D
  float weight or int4 scale whose magnitudes say its bytes are another type (``SUSPECT``).
  Cost (lab/studies/load_checks_cost.py, one thread, the shared 2-core CPU box, 2026-12-07,
  `load_checks_cost_cpu_2026-12-07.txt`): the checks alone 73 ms of the embedded SmolLM2's 0.79 s load;
  3.4 GiB/s of bf16 weights (a 3B model's 6 GB: ~2 s).

Tests: ``pytest tests/test_checks.py tests/test_loader_fuzz.py``.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

# JSON nesting deeper than this is refused (HF configs nest 3 or 4 levels; tokenizer.json ~6)
MAX_JSON_DEPTH = 64

# (low, high) inclusive: outside it a value is refused naming the field
PLAUSIBLE = {
    "rms_norm_eps": (1e-12, 1e-1),
    "rope_theta": (1.0, 1e12),
    "embedding_multiplier": (1e-6, 1e6),
    "attention_multiplier": (1e-6, 1e6),
    "residual_multiplier": (1e-6, 1e6),
    "logits_scaling": (1e-6, 1e6),
}


def plausible_range_error(field: str, value) -> str | None:
    """None if ``value`` is inside PLAUSIBLE[field], else why not (for the caller's message)."""
    lo, hi = PLAUSIBLE[field]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        return f"must be a number in [{lo:g}, {hi:g}] (the plausible range flint accepts), got {value!r}"
    return None


def _depth(text: str) -> int:
    """The deepest bracket nesting of a JSON text (brackets inside strings skipped)."""
    depth = top = 0
    in_str = esc = False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > top:
                top = depth
                if top > MAX_JSON_DEPTH:
                    return top
        elif ch in "]}":
            depth -= 1
    return top


def parse_json(raw: bytes, source: str, err=ValueError, max_depth: int = MAX_JSON_DEPTH):
    """The value of JSON ``raw``, read strictly (see the module doc); ``err`` naming ``source``."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise err(f"{source}: not valid UTF-8 at byte {e.start} (0x{raw[e.start]:02x})") from None
    if max_depth and ("[" * (max_depth + 1) in text or "{" * (max_depth + 1) in text
                      or _depth(text) > max_depth):
        raise err(f"{source}: JSON nested deeper than {max_depth} levels")

    def where(value: str) -> str:
        """' (field NAME)' for the first field holding the literal ``value``, if one can be found."""
        m = re.search(r'"((?:[^"\\]|\\.){0,200})"\s*:\s*' + re.escape(value) + r"\b", text)
        return f" (field {m.group(1)!r})" if m else ""

    def constant(name):
        raise err(f"{source}: {name}{where(name)} is not a JSON number (NaN and Infinity are refused)")

    def number(s):
        v = float(s)
        if not math.isfinite(v):
            raise err(f"{source}: the number {s[:40]}{where(s)} is beyond a float's range")
        return v

    def pairs(items):
        d = {}
        for k, v in items:
            if k in d:
                raise err(f"{source}: key {k!r} appears twice in one object")
            d[k] = v
        return d
    try:
        return json.loads(text, parse_constant=constant, parse_float=number, object_pairs_hook=pairs)
    except json.JSONDecodeError as e:
        raise err(f"{source}: not valid JSON ({e})") from None
    except (RecursionError, MemoryError) as e:
        raise err(f"{source}: cannot be read as JSON ({type(e).__name__})") from None


def read_json(path: str | Path, err=ValueError, required: bool = True, max_depth: int = MAX_JSON_DEPTH):
    """parse_json of file ``path``; None for an absent file unless ``required``."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        if required:
            raise err(f"{p}: file not found") from None
        return None
    except OSError as e:
        raise err(f"{p}: cannot be read ({e.strerror or e})") from None
    return parse_json(raw, str(p), err, max_depth)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# kind -> (test, what it must be)
KINDS = {
    "int": (_is_int, "an integer"),
    "uint": (lambda v: _is_int(v) and v >= 0, "a non-negative integer"),
    "posint": (lambda v: _is_int(v) and v > 0, "a positive integer"),
    "number": (_is_number, "a finite number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "strs": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
    "ids": (lambda v: (_is_int(v) and v >= 0) or (isinstance(v, list) and all(_is_int(x) and x >= 0 for x in v)),
            "a non-negative integer or a list of them"),
    "object": (lambda v: isinstance(v, dict), "an object"),
    "token": (lambda v: isinstance(v, str) or isinstance(v, dict) and isinstance(v.get("content"), str),
              "a string or an object with a string 'content'"),
}


def check_types(d: dict, kinds: dict, source: str, err=ValueError, prefix: str = "") -> None:
    """Every field of ``d`` named in ``kinds`` (field -> kind of KINDS) that is present and not
    null holds a value of that kind, else ``err`` naming the field and what it holds."""
    for key, kind in kinds.items():
        v = d.get(key)
        if v is None:
            continue
        test, what = KINDS[kind]
        if not test(v):
            shown = json.dumps(v)[:80] if isinstance(v, (dict, list, str)) else repr(v)
            raise err(f"{source}: field {prefix + key!r} must be {what}, got {shown}")


def typed(d: dict, key: str, kind: str, source: str, err=ValueError, default=None):
    """d[key] if present, not null and of ``kind``; ``default`` if absent or null."""
    check_types(d, {key: kind}, source, err)
    v = d.get(key)
    return default if v is None else v


# ------------------------------------------------------------------ weights

SAMPLE = 1 << 12  # values sampled per tensor for the magnitude test (a strided sample)
# a 2-D float weight is suspect when, of its sampled nonzero values, at least this share
SUSPECT = 0.99
# ... lies in [0.5, 2): BF16 bytes read as F16 (a bf16 value's top 5 exponent bits are fp16's
# exponent, 0b01110 or 0b01111 for any |w| in [2^-15, 2): every value lands near 1) ...
BF16_AS_F16 = (0.5, 2.0)
# ... or below this: F16 bytes read as BF16 (fp16's 0.02 = 0x251F reads as 1.4e-16)
F16_AS_BF16 = 1e-8
# ... or the spread of its magnitudes, the 90th percentile over the 10th, exceeds this (random
# exponent bits: bytes of another quantized type read as scales; a Gaussian's ratio is 13)
MAX_SPREAD = 1e5


def magnitude_problem(t) -> str | None:
    """None if the values of 2-D float tensor ``t`` look like trained weights, else what they
    look like instead (see SUSPECT)."""
    import torch

    flat = t.detach().reshape(-1)
    if flat.numel() > SAMPLE:
        flat = flat[:: flat.numel() // SAMPLE][:SAMPLE]
    a = flat.float().abs()
    a = a[a > 0]
    if a.numel() < 64:
        return None
    near_one = float(((a >= BF16_AS_F16[0]) & (a < BF16_AS_F16[1])).float().mean())
    if near_one >= SUSPECT:
        return (f"{near_one:.1%} of its values have magnitudes in [0.5, 2), as bfloat16 bytes read "
                "as float16 do")
    tiny = float((a < F16_AS_BF16).float().mean())
    if tiny >= SUSPECT:
        return f"{tiny:.1%} of its values are below {F16_AS_BF16:g}, as float16 bytes read as bfloat16 are"
    n = a.numel()
    q10, q90 = (float(torch.kthvalue(a, max(1, round(q * n))).values) for q in (0.1, 0.9))  # no full sort
    if q90 > MAX_SPREAD * q10:
        return (f"its magnitudes spread over {math.log10(q90 / q10):.0f} decades (10th percentile {q10:.3g}, "
                f"90th {q90:.3g}), as bytes of another type read as this one do")
    return None


def nonfinite(t) -> str | None:
    """None if every value of tensor ``t`` is finite, else how many are not and the first."""
    import torch

    if t.numel() == 0:
        return None
    # aminmax propagates NaN and shows an infinity at either end: one pass, no mask (15x faster
    # than isfinite().all() on CPU); the mask is built only to report a failure
    lo, hi = torch.aminmax(t)
    if math.isfinite(float(lo)) and math.isfinite(float(hi)):
        return None
    ok = torch.isfinite(t)
    bad = (~ok).nonzero()
    first = tuple(bad[0].tolist())
    return f"{bad.shape[0]} values are NaN or infinite (the first at {list(first)}: {float(t[first])})"


def check_weight(name: str, w, source: str, err=ValueError) -> None:
    """``w`` (a float tensor or an int4 weight with scales and mins) finite, and a 2-D float one of
    plausible magnitudes; else ``err`` naming ``source`` and tensor ``name``."""
    parts = [("scales", w.scales), ("mins", w.mins)] if hasattr(w, "qweight") else [("", w)]
    for part, t in parts:
        what = f"tensor {name!r}" + (f" ({part})" if part else "")
        bad = nonfinite(t)
        if bad:
            raise err(f"{source}: {what}: {bad}; the weights are broken, or the file's type for them is wrong")
        if t.dim() == 2 and t.is_floating_point() and part != "mins":  # the scales tell a swap already
            odd = magnitude_problem(t)
            if odd:
                raise err(f"{source}: {what}: {odd}; the file's type for it is likely wrong")
