"""Per-token host cost of three grammar engines (llguidance, xgrammar, outlines-core) on CPU.

    python3 lab/studies/grammar_engines.py [--engines llguidance,xgrammar,outlines-core] [--reps 3]

For each vocabulary (the embedded SmolLM2's, 49152 tokens, and a Granite-size one of 100352: SmolLM2's
plus 51200 merges of two of its tokens, a proxy, as no Granite tokenizer ships in a package) and a JSON
schema with nested objects, arrays, enums, numbers and strings, it compiles the schema, then walks a valid
instance token by token: at each step it fills the vocabulary bitmask (ceil(V / 32) int32 words, the
layout the backends' set_token_mask takes) and advances with the instance's next token. It reports the
compile time and the per-token times (fill + advance: the host work of a constrained decode step), and
checks each mask allows the token the instance takes next. flint uses llguidance (flint/grammar.py);
the other two are measured here only (pip install xgrammar outlines-core to run them).
Results: bench/results/grammar_engines_2026-12-02.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "scores": {"type": "array", "items": {"type": "number"}},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                      "zip": {"type": "string"}},
                    "required": ["street", "city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "object", "properties": {"key": {"type": "string"},
                                                                           "value": {"type": "string"}},
                                            "required": ["key", "value"], "additionalProperties": False}},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "role", "scores", "address", "tags", "active"],
    "additionalProperties": False,
}


def bounded(schema):
    """The schema with maxLength 40 on every string (bounded strings cost llguidance far more: see the results)."""
    if isinstance(schema, dict):
        out = {k: bounded(v) for k, v in schema.items()}
        if out.get("type") == "string" and "enum" not in out:
            out["maxLength"] = 40
        return out
    return schema


SCHEMAS = {"unbounded strings": SCHEMA, "maxLength 40 strings": bounded(SCHEMA)}
INSTANCE = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "role": "admin",
            "scores": [98.5, 87.25, 100], "address": {"street": "12 St James's Square", "city": "London",
                                                      "zip": "SW1Y 4JH"},
            "tags": [{"key": "field", "value": "mathematics"}, {"key": "era", "value": "19th century"}],
            "active": True}


def vocabularies():
    """(name, tokenizer.json text, vocab size, eos id, the instance's token ids) for both vocabularies."""
    from flint.bench import proxy_tokenizer
    from flint.loading import load_model

    base = load_model("embedded:smollm2").tokenizer
    ids = base.encode(json.dumps(INSTANCE), add_special_tokens=False)
    eos = base.eos_token_ids[0]
    big = proxy_tokenizer(100352)
    assert big.vocab_size == 100352, big.vocab_size
    return [("SmolLM2 (49152)", base.tk.to_str(), base.vocab_size, eos, ids),
            ("Granite-size proxy (100352)", big.tk.to_str(), 100352, eos, ids)]


def byte_level_vocab(tok_json: str, size: int) -> list[bytes]:
    from flint.server.state import _byte_level_alphabet

    table = _byte_level_alphabet()
    vocab = json.loads(tok_json)["model"]["vocab"]
    out = [b""] * size
    for t, i in vocab.items():
        out[i] = bytes(table[c] for c in t) if all(c in table for c in t) else t.encode()
    return out


def check(mask: torch.Tensor, tok: int, engine: str, step: int) -> None:
    if not (int(mask[tok >> 5]) >> (tok & 31)) & 1:
        raise AssertionError(f"{engine}: step {step}: the mask forbids the instance's token {tok}")


def run_llguidance(tok_json, size, eos, ids, schema):
    import llguidance
    import llguidance.torch as llt

    t0 = time.perf_counter()
    lt = llguidance.LLTokenizer(tok_json, n_vocab=size, eos_token=eos)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    m = llguidance.LLMatcher(lt, grammar)
    if m.is_error():
        raise RuntimeError(m.get_error())
    t_compile = time.perf_counter() - t0
    mask = llt.allocate_token_bitmask(1, size)
    times = []
    for step, t in enumerate(ids + [eos]):
        s = time.perf_counter()
        llt.fill_next_token_bitmask(m, mask, 0)
        ok = m.consume_token(t)
        times.append(time.perf_counter() - s)
        check(mask[0], t, "llguidance", step)
        assert ok, m.get_error()
    return t_tok, t_compile, times


def run_xgrammar(tok_json, size, eos, ids, schema):
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(byte_level_vocab(tok_json, size), xgr.VocabType.RAW, vocab_size=size,
                             stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    cg = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
    m = xgr.GrammarMatcher(cg)
    t_compile = time.perf_counter() - t0
    mask = xgr.allocate_token_bitmask(1, size)
    times = []
    for step, t in enumerate(ids + [eos]):
        s = time.perf_counter()
        m.fill_next_token_bitmask(mask, 0)
        ok = m.accept_token(t)
        times.append(time.perf_counter() - s)
        check(mask[0], t, "xgrammar", step)
        assert ok, step
    return t_tok, t_compile, times


def run_outlines_core(tok_json, size, eos, ids, schema):
    import outlines_core as oc
    from outlines_core.json_schema import build_regex_from_schema

    t0 = time.perf_counter()
    by_bytes: dict[bytes, list[int]] = {}
    for i, b in enumerate(byte_level_vocab(tok_json, size)):
        if i != eos and b:
            by_bytes.setdefault(b, []).append(i)
    vocab = oc.Vocabulary(eos, by_bytes)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    index = oc.Index(build_regex_from_schema(json.dumps(schema), r"[ ]?"), vocab)
    guide = oc.Guide(index)
    t_compile = time.perf_counter() - t0
    mask = torch.zeros(1, (size + 31) // 32, dtype=torch.int32)
    times = []
    for step, t in enumerate(ids + [eos]):
        s = time.perf_counter()
        guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
        if step < len(ids):
            guide.advance(t)
        times.append(time.perf_counter() - s)
        check(mask[0], t, "outlines-core", step)
    return t_tok, t_compile, times


ENGINES = {"llguidance": run_llguidance, "xgrammar": run_xgrammar, "outlines-core": run_outlines_core}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--reps", type=int, default=3, help="walks of the instance per engine (fresh matcher each)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for name, tok_json, size, eos, ids in vocabularies():
        for sname, schema in SCHEMAS.items():
            print(f"## {name}, {sname}: instance of {len(ids)} tokens (+ eos), {len(json.dumps(INSTANCE))} characters")
            print("| engine | tokenizer setup s | schema compile s | per token mean us | p50 us | p99 us | max us |")
            print("|---|---|---|---|---|---|---|")
            for eng in args.engines.split(","):
                try:
                    runs = [ENGINES[eng](tok_json, size, eos, ids, schema) for _ in range(args.reps)]
                except ImportError as e:
                    print(f"| {eng} | not installed ({e}) |")
                    continue
                times = sorted(t for r in runs for t in r[2][1:])  # the first step of a walk includes lazy setup
                first = statistics.median(r[2][0] for r in runs)
                us = [t * 1e6 for t in times]
                print(f"| {eng} | {statistics.median(r[0] for r in runs):.2f} | "
                      f"{statistics.median(r[1] for r in runs):.3f} | {statistics.fmean(us):.0f} | {us[len(us) // 2]:.0f} "
                      f"| {us[int(len(us) * 0.99)]:.0f} | {us[-1]:.0f} |  (first step {first * 1e6:.0f} us)")
            print()

if __name__ == "__main__":
    main()
