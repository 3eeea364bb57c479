"""Greedy speculative output vs plain greedy on one device and precision (is a mismatch numerics or a bug?).

    python lab/studies/spec_identity.py --model PATH.gguf --device cuda --dtype float32 [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flint.backend import make_backend  # noqa: E402
from flint.speculative.draft_head import load_draft  # noqa: E402
from flint.engine import Engine, SamplingParams  # noqa: E402
from flint.loading import load_model  # noqa: E402
from flint.speculative.verify import SpeculativeEngine  # noqa: E402

PROMPTS = ["Write a Python function that merges two sorted lists.",
           "Explain how a refrigerator keeps food cold.",
           "What is the boiling point of water at sea level?",
           "Tell me about your favourite season and why."]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", action="append", default=None)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=5)
    a = ap.parse_args()
    lm = load_model(a.model)
    for dtype in a.dtype or ["float32"]:
        be = make_backend("reference", lm, 1024, device=a.device, dtype=dtype)
        draft = load_draft("smollm2-135m", lm.cfg, lm.params, device=be.device)
        same = 0
        for p in PROMPTS:
            ids = lm.tokenizer.encode_chat([{"role": "user", "content": p}])
            sp = SamplingParams(max_new_tokens=a.tokens)
            plain = Engine(be, lm.tokenizer).generate(ids, sp).token_ids
            spec_engine = SpeculativeEngine(be, lm.tokenizer, draft, k=a.k)
            spec = spec_engine.generate(ids, sp).token_ids
            n = next((i for i, (x, y) in enumerate(zip(plain, spec)) if x != y), min(len(plain), len(spec)))
            same += plain == spec
            print(f"{dtype} {a.device}: identical={plain == spec} first_diff={n} "
                  f"tokens/step={spec_engine.acceptance():.2f} :: {p[:40]}")
        print(f"{dtype} {a.device}: {same}/{len(PROMPTS)} identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
