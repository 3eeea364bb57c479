"""Does a verify launch compute what the plain step computes? Row i of one M = k launch against the M = 1 step at
the same position, on the same cache (GPU).

Greedy speculative decoding is identical to plain greedy only where the verify's argmax at every kept position is
the plain step's. The megakernel runs each M in its own object; this tool measures, per M, how many rows are the
M = 1 logits bit for bit, the largest difference, and how many rows change their argmax. A variant whose verify
rows are not bitwise the M = 1 ones can change greedy text wherever two logits are within that difference.

    FLINT_KERNEL_DIR=build/kernels python3 lab/mk_verify_rows.py --model synthetic:smollm2-135m --m 2,4,8
    (a variant: run the copy in build/var/NAME/lab/, from that folder)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from flint.backend import make_backend  # noqa: E402
from flint.bench import load_bench_model  # noqa: E402
from flint.kernels.build import source_hash  # noqa: E402


def compare(backend, tokens: torch.Tensor, start: int, m: int) -> dict:
    """Steps at positions start..start+m-1 one by one, then the same positions as one launch of m tokens (the cache
    rows rewritten): bitwise-equal rows, the largest |difference| and the argmax changes."""
    rows = []
    for i in range(m):
        rows.append(backend.forward(tokens[start + i:start + i + 1], start + i)[0].float().clone())
    one = torch.stack(rows)
    wide = backend.forward(tokens[start:start + m], start).float().clone()
    same = [bool(torch.equal(one[i], wide[i])) for i in range(m)]
    return dict(equal_rows=sum(same), rows=m, max_abs=float((one - wide).abs().max()),
                argmax_changes=int((one.argmax(-1) != wide.argmax(-1)).sum()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="synthetic:smollm2-135m", help="a synthetic: name or a model file")
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--m", default="2,3,4,8", help="launch widths to compare with M = 1")
    ap.add_argument("--starts", type=int, default=16, help="launch positions per width")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    lm = load_bench_model(a.model, a.group, dev)
    backend = make_backend("megakernel", lm, max_seq_len=1024, device="cuda", group_size=a.group)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, lm.cfg.vocab_size, (1024,), generator=gen)
    for p in range(0, 64, backend.max_chunk):  # a prompt in the cache first
        backend.forward(tokens[p:p + backend.max_chunk], p)
    out = dict(library=source_hash(), model=a.model, widths={})
    for m in (int(x) for x in a.m.split(",")):
        if m > backend.max_chunk:
            raise SystemExit(f"mk_verify_rows: M = {m} is over the backend's widest launch ({backend.max_chunk})")
        res = [compare(backend, tokens, 64 + 37 * s, m) for s in range(a.starts)]
        agg = dict(equal_rows=sum(r["equal_rows"] for r in res), rows=sum(r["rows"] for r in res),
                   max_abs=max(r["max_abs"] for r in res), argmax_changes=sum(r["argmax_changes"] for r in res))
        out["widths"][m] = agg
        print(f"M = {m}: {agg['equal_rows']}/{agg['rows']} rows bitwise the M = 1 step's, max |diff| "
              f"{agg['max_abs']:.3g}, argmax changed in {agg['argmax_changes']}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
