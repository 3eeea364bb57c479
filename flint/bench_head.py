"""`flint bench --head-group-size 32,64,128`: the same body with the LM head at other int4 group sizes.

Each listed group size G gives one pass over the backends with the model's head replaced by the
round-to-nearest int4 fit of its values at G (flint.quant.int4.quantize_int4; the body is untouched), so
one run prints the bytes per token and tok/s of every head variant side by side. Rows are named
``MODEL · head int4 gG`` and carry ``"head": "int4 gG"`` in the JSON. A searched or GPTQ head has
the bytes (and the kernel work) of an RTN head at its group size: it needs no row of its own.

What the int4 backends can stream, and so what is refused here (BenchError) rather than ignored:

* a head group size other than the body's: yes. The megakernel repacks every matrix with its own
  descriptor (group size included, flint/megakernel.py ``repack``), and the compiled backend
  prepares the head as its own tinygemm weight at the head's group size.
* a float or 8-bit head: no. The megakernel takes only an int4 head (``_validate``) and the compiled
  backend quantizes a float head to int4 at load; ``reference`` and ``compiled-bf16`` hold every
  weight in float, so a head group size means nothing to their bytes: they are refused too.
* a G that does not divide the head's K (hidden size): SmolLM2's 576 takes 32 and 64, not 128. That
  variant is recorded as an error of the run and the others go on.

Test: ``pytest tests/test_bench_head.py``.
"""
from __future__ import annotations

import dataclasses

import torch

from .errors import FlintError
from .quant.int4 import GROUP_SIZES, Int4Weight, quantize_int4

INT4_BACKENDS = ("compiled", "megakernel")


class HeadOptionError(FlintError, ValueError):
    pass


def parse_head_groups(s: str) -> list[int]:
    """``--head-group-size`` "32,64,128" -> [32, 64, 128]; anything but int4 group sizes is refused."""
    items = [x.strip() for x in s.split(",") if x.strip()]
    if not items:
        raise HeadOptionError("--head-group-size: empty list")
    out = []
    for x in items:
        if not x.isdigit() or int(x) not in GROUP_SIZES:
            raise HeadOptionError(
                f"--head-group-size: {x!r} is not an int4 group size ({', '.join(map(str, GROUP_SIZES))}); "
                "no int4 backend streams a float or 8-bit head (the megakernel takes an int4 head only, "
                "compiled quantizes a float head to int4 at load)")
        if int(x) not in out:
            out.append(int(x))
    return out


def check_head_backends(backends: list[str]) -> None:
    other = [b for b in backends if b not in INT4_BACKENDS]
    if other:
        raise HeadOptionError(f"--head-group-size: backend {other[0]!r} holds the LM head in float, so its "
                              f"bytes do not depend on an int4 group size; the option is for "
                              f"{' and '.join(INT4_BACKENDS)}")


def head_variants(lm, name: str, groups: list[int] | None):
    """(row name, head label or None, the model with that head, or a HeadOptionError) per variant;
    with no ``groups`` the model as it is, once."""
    if not groups:
        yield name, None, lm
        return
    head = lm.params["lm_head"]
    dense = head.dequantize(torch.float32) if isinstance(head, Int4Weight) else head.float()
    k = dense.shape[1]
    for g in groups:
        label = f"int4 g{g}"
        if k % g:
            yield f"{name} · head {label}", label, HeadOptionError(
                f"--head-group-size {g}: the LM head's K={k} (hidden size) is not a multiple of {g}")
            continue
        params = dict(lm.params, lm_head=quantize_int4(dense, g, name="lm_head"))
        yield f"{name} · head {label}", label, dataclasses.replace(lm, params=params)


def int4_bytes(n: int, k: int, g: int) -> int:
    """Bytes of an [n, k] int4 matrix (a head) at group size g in flint-int4-v1, as the megakernel
    streams it: one nibble a weight, an fp16 scale and min a group."""
    return n * k // 2 + 4 * n * (k // g)
