"""The child process of tests/test_loader_fuzz.py: loads one model spec per stdin line under an
address-space limit (argv[2] GiB above what its imports mapped) and answers one JSON line per load
on stdout.

Answers: {"outcome": "LoadError" | "escaped" | "loaded", "message": ..., "maxrss_mb": ...}; for a
load, "same" says whether it equals the baseline (argv[1], loaded first when given): weights bit
for bit, the tokenizer's vocabulary size and the config's shape fields, and "changed" lists the
config fields whose values differ. Run by the test, not by hand.
"""
from __future__ import annotations

import json
import resource
import sys

SHAPE_FIELDS = ("arch", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "tie_word_embeddings", "use_rope")


def summary(lm):
    import torch

    def flat(w):
        if hasattr(w, "qweight"):
            return (w.qweight, w.scales, w.mins, torch.tensor(w.group_size))
        return (w,)
    return {"cfg": lm.cfg.to_json(), "params": {k: flat(v) for k, v in lm.params.items()},
            "vocab": lm.tokenizer.vocab_size if lm.tokenizer is not None else None}


def same(a, b) -> tuple[bool, list[str]]:
    import torch

    changed = [k for k in a["cfg"] if a["cfg"][k] != b["cfg"][k]]
    ok = (a["vocab"] == b["vocab"] and a["params"].keys() == b["params"].keys()
          and not any(k in SHAPE_FIELDS for k in changed)
          and all(len(x) == len(y) and all(p.dtype == q.dtype and p.shape == q.shape and torch.equal(p, q)
                                           for p, q in zip(x, y))
                  for k in a["params"] for x, y in [(a["params"][k], b["params"][k])]))
    return ok, changed


def vm_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def main() -> None:
    from flint.loading import LoadError, load_model

    # headroom above what the imports mapped (a CUDA build of torch maps far more than a CPU one)
    limit = vm_bytes() + int(float(sys.argv[2]) * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    base = summary(load_model(sys.argv[1])) if sys.argv[1] != "-" else None
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        reply = {}
        try:
            lm = load_model(line.rstrip("\n"))
            reply["outcome"] = "loaded"
            if base is not None:
                reply["same"], reply["changed"] = same(summary(lm), base)
            del lm
        except LoadError as e:
            reply.update(outcome="LoadError", message=str(e))
        except BaseException as e:  # noqa: BLE001 - the point is to see what escapes
            reply.update(outcome="escaped", message=f"{type(e).__name__}: {e}"[:2000])
        reply["maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
