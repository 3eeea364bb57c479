"""`flint serve`'s logprobs and operations routes: logprobs on chat and completions (streamed and not,
through the official `openai` client) checked against the reference backend's log-softmax of its own
logits, /metrics, /tokenize and /detokenize, per-request timings, HEAD /health.

One real server process on the tiny random llama of tests/conftest.py (byte tokenizer, context 96),
and the same checkpoint on the reference backend in this process for the expected values. Run:
``pytest tests/test_server_ops.py`` (about 15 s).
"""
import json
import math

import pytest
import torch

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
from test_server import Server, is_openai_error  # noqa: E402  (pytest puts tests/ on sys.path)

CONTEXT = 96
PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "hi"}]
TOL = 1e-3  # fp32 on the same backend; only the thread count differs


@pytest.fixture(scope="module")
def ops(tiny_llama_dir, tmp_path_factory):
    s = Server("ops", ["--model", str(tiny_llama_dir), "--max-seq-len", str(CONTEXT)],
               tmp_path_factory.mktemp("ops"))
    try:
        s.wait_ready({})
        s.model = str(tiny_llama_dir)
        s.client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=30)
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """ids -> the reference backend's log-softmax over the next token, from a fresh full forward."""
    from flint.model import Transformer

    model = Transformer(tiny_llama.cfg, tiny_llama.params, max_seq_len=CONTEXT)

    def logprobs(ids: list[int]) -> torch.Tensor:
        logits = model.forward(torch.tensor(ids, dtype=torch.long), 0, last_only=True)[-1]
        return torch.log_softmax(logits.float(), -1)

    return logprobs


def token_id(tok, text: str, raw: list[int] | None = None) -> int:
    """The id of a token given its text (and bytes): the byte tokenizer has one token per byte, and specials."""
    if raw is not None and len(raw) == 1:  # a byte, perhaps half a character (its text is U+FFFD)
        from flint.server.state import _byte_level_alphabet

        return tok.tk.token_to_id(next(ch for ch, b in _byte_level_alphabet().items() if b == raw[0]))
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == 1, (text, ids)
    return ids[0]


def check_against_reference(reference, prompt_ids, chosen, top_lists, k):
    """chosen: [(token id, logprob)] in order; top_lists: per token [(id, logprob)] best first."""
    assert chosen, "no logprobs came back"
    ids = list(prompt_ids)
    for (tid, lp), top in zip(chosen, top_lists, strict=True):
        ref = reference(ids)
        assert abs(lp - float(ref[tid])) < TOL, (tid, lp, float(ref[tid]))
        assert tid == int(ref.argmax()), "greedy picked another token than the reference's argmax"
        want = torch.topk(ref, k)
        assert [t for t, _ in top] == want.indices.tolist()
        assert all(abs(v - w) < TOL for (_, v), w in zip(top, want.values.tolist()))
        ids.append(tid)


def test_chat_logprobs_match_the_reference(ops, tiny_llama, reference):
    tok = tiny_llama.tokenizer
    r = ops.client.chat.completions.create(model=ops.model, messages=MESSAGES, max_tokens=6, temperature=0,
                                           logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    ids = [token_id(tok, c.token) for c in content]
    assert "".join(c.token for c in content) == r.choices[0].message.content
    assert all(bytes(c.bytes) == c.token.encode() for c in content)
    check_against_reference(reference, tok.encode_chat(MESSAGES), [(i, c.logprob) for i, c in zip(ids, content)],
                            [[(token_id(tok, t.token), t.logprob) for t in c.top_logprobs]
                             for c in content], 3)


def test_chat_logprobs_streamed_equal_the_whole_response(ops):
    kw = dict(model=ops.model, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
              extra_body={"ignore_eos": True})
    whole = ops.client.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = []
    for ch in ops.client.chat.completions.create(stream=True, **kw):
        if ch.choices and ch.choices[0].logprobs is not None:
            streamed += ch.choices[0].logprobs.content
    def flat(content):  # the second call reuses the cached prompt prefix: values equal up to rounding
        return ([(c.token, c.bytes, [t.token for t in c.top_logprobs]) for c in content],
                [v for c in content for v in (c.logprob, *(t.logprob for t in c.top_logprobs))])

    assert flat(streamed)[0] == flat(whole)[0] and flat(streamed)[1] == pytest.approx(flat(whole)[1], abs=TOL)
    # logprobs without top_logprobs: the chosen token's only
    r = ops.client.chat.completions.create(**{**kw, "top_logprobs": None})
    assert all(c.top_logprobs == [] for c in r.choices[0].logprobs.content)


def test_completion_logprobs_match_the_reference(ops, tiny_llama, reference):
    tok = tiny_llama.tokenizer
    kw = dict(model=ops.model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=4,
              extra_body={"ignore_eos": True})
    r = ops.client.completions.create(**kw)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.tokens) == 5
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    ids = [token_id(tok, t) for t in lp.tokens]
    tops = [sorted(((token_id(tok, t), v) for t, v in d.items()), key=lambda x: -x[1])
            for d in lp.top_logprobs]
    check_against_reference(reference, tok.encode(PROMPT), list(zip(ids, lp.token_logprobs)), tops, 4)
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for ch in ops.client.completions.create(stream=True, **kw):
        if ch.choices and ch.choices[0].logprobs is not None:
            for key in streamed:
                streamed[key] += getattr(ch.choices[0].logprobs, key)
    # the second call reuses the cached prompt prefix: the same values up to rounding
    assert streamed["tokens"] == lp.tokens and streamed["text_offset"] == lp.text_offset
    assert streamed["token_logprobs"] == pytest.approx(lp.token_logprobs, abs=TOL)


def test_sampled_logprobs_are_the_model_distribution(ops, tiny_llama, reference):
    # temperature and top_p change the draw, not the reported values (OpenAI's convention)
    tok = tiny_llama.tokenizer
    r = ops.client.chat.completions.create(model=ops.model, messages=MESSAGES, max_tokens=6, temperature=1.5,
                                           top_p=0.9, seed=5, logprobs=True, extra_body={"ignore_eos": True})
    ids = tok.encode_chat(MESSAGES)
    for c in r.choices[0].logprobs.content:
        tid = token_id(tok, c.token, c.bytes)
        assert abs(c.logprob - float(reference(ids)[tid])) < TOL
        ids.append(tid)
    assert len(ids) == len(tok.encode_chat(MESSAGES)) + 6


@pytest.mark.parametrize("path,kw,param", [
    ("/v1/chat/completions", dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("/v1/chat/completions", dict(logprobs=True, top_logprobs=-1), "top_logprobs"),
    ("/v1/chat/completions", dict(logprobs=False, top_logprobs=2), "top_logprobs"),
    ("/v1/chat/completions", dict(logprobs=2), "logprobs"),
    ("/v1/completions", dict(logprobs=21), "logprobs"),
    ("/v1/completions", dict(logprobs=True), "logprobs"),
])
def test_bad_logprobs_fields_are_400s(ops, path, kw, param):
    body = {"model": ops.model, "max_tokens": 2, **kw}
    body.update({"messages": MESSAGES} if "chat" in path else {"prompt": PROMPT})
    r = httpx.post(ops.url + path, json=body, timeout=30)
    assert r.status_code == 400 and is_openai_error(r.json()), r.text
    assert r.json()["error"]["param"] == param


# ------------------------------------------------------------------ operations routes

def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30)


def test_tokenize_and_detokenize_in_vllm_and_llama_cpp_spellings(ops, tiny_llama):
    tok = tiny_llama.tokenizer
    r = post(ops, "/tokenize", {"model": ops.model, "prompt": PROMPT}).json()
    assert r == {"tokens": tok.encode(PROMPT), "count": len(tok.encode(PROMPT)), "max_model_len": CONTEXT}
    r = post(ops, "/tokenize", {"content": PROMPT, "add_special": False, "with_pieces": True}).json()
    assert [t["id"] for t in r["tokens"]] == tok.encode(PROMPT, add_special_tokens=False)
    assert "".join(t["piece"] for t in r["tokens"]) == PROMPT
    chat = post(ops, "/tokenize", {"messages": MESSAGES}).json()["tokens"]
    assert chat == tok.encode_chat(MESSAGES)
    bare = post(ops, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()["tokens"]
    assert bare == tok.encode_chat(MESSAGES, add_generation_prompt=False) and len(bare) < len(chat)
    back = post(ops, "/detokenize", {"tokens": chat}).json()
    assert back == {"prompt": tok.decode(chat, skip_special_tokens=False), "content": back["prompt"]}
    assert "<|im_start|>" in back["prompt"]
    for path, body, status, param in (
            ("/tokenize", {"prompt": "a", "content": "a"}, 400, "content"),
            ("/tokenize", {}, 400, "prompt"),
            ("/tokenize", {"prompt": "a", "add_special": True, "add_special_tokens": True}, 400, "add_special"),
            ("/tokenize", {"prompt": "x" * 4096}, 400, "prompt"),  # over the context: refused before tokenizing
            ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
            ("/tokenize", {"prompt": "a", "text": "a"}, 400, "text"),
            ("/detokenize", {"tokens": [1, 10**6]}, 400, "tokens")):
        r = post(ops, path, body)
        assert r.status_code == status and is_openai_error(r.json()), (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.text)


def test_tokenizer_info_is_vllms(ops, tiny_llama):
    # what lm-evaluation-harness's RemoteTokenizer reads (with /tokenize and /detokenize)
    tok = tiny_llama.tokenizer
    r = httpx.get(ops.url + "/tokenizer_info", timeout=30)
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["eos_token"] == "<|im_end|>" and info["bos_token"] == "<|im_start|>" and info["pad_token"] is None
    assert info["chat_template"] == tok.chat_template and info["model_max_length"] == CONTEXT
    ids = post(ops, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert ids == [2]  # lm_eval takes the first id of the eos text as the eos id


def test_timings_in_responses(ops):
    body = {"model": ops.model, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    r = post(ops, "/v1/completions", body).json()
    t, u = r["timings"], r["usage"]
    assert t["prompt_n"] == u["prompt_tokens"] and t["predicted_n"] == u["completion_tokens"] - 1 == 4
    assert t["prompt_ms"] > 0 and t["predicted_ms"] > 0 and t["queue_ms"] >= 0
    assert t["predicted_per_second"] == pytest.approx(4 / (t["predicted_ms"] / 1e3))
    with httpx.stream("POST", ops.url + "/v1/completions", json={**body, "stream": True}, timeout=30) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert [c["choices"][0]["finish_reason"] for c in chunks if "timings" in c] == ["length"]


def test_head_health(ops):
    r = httpx.head(ops.url + "/health", timeout=10)
    assert r.status_code == 200 and r.content == b""


def scrape(server) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(server.url + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def test_metrics_count_requests_tokens_and_times(ops):
    ok = ("flint_http_requests_total", (("route", "/v1/completions"), ("status", "200")))
    bad = ("flint_http_requests_total", (("route", "/v1/completions"), ("status", "400")))
    before = scrape(ops)
    r = post(ops, "/v1/completions", {"model": ops.model, "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True})
    post(ops, "/v1/completions", {"model": ops.model, "prompt": PROMPT, "max_tokens": 0})
    after = scrape(ops)

    def grew(key) -> float:
        return after.get(key, 0) - before.get(key, 0)

    assert grew(ok) == 1 and grew(bad) == 1
    assert grew(("flint_generation_tokens_total", ())) == r.json()["usage"]["completion_tokens"] == 5
    assert grew(("flint_prompt_tokens_total", ())) == r.json()["usage"]["prompt_tokens"]
    assert grew(("flint_generations_total", (("reason", "length"),))) == 1
    for h in ("flint_time_to_first_token_seconds", "flint_decode_seconds", "flint_queue_wait_seconds",
              "flint_time_per_output_token_seconds"):
        assert grew((h + "_count", ())) == 1, h
    assert after[("flint_queue_waiting", ())] == 0 and after[("flint_queue_running", ())] == 0
    steps = grew(("flint_spec_verify_steps_total", ()))  # the default --draft auto: its steps, each by a drafter
    assert steps >= 1 and steps == sum(grew(("flint_spec_drafter_steps_total", (("drafter", d),)))
                                       for d in ("suffix", "head", "none"))
    spec = r.json()["timings"]["speculative"]
    assert spec["verify_steps"] >= 1 and 1 <= spec["tokens_per_step"] and abs(sum(spec["drafters"].values()) - 1) < 0.01
    assert after[("flint_spec_tokens_per_verify_step", ())] >= 1


def test_logprobs_end_at_the_stop(ops, tiny_llama):
    base = dict(model=ops.model, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True)
    plain = ops.client.chat.completions.create(**base, extra_body={"ignore_eos": True}).choices[0].message.content
    assert len(plain) == 8  # the byte tokenizer: one character a token on this model's printable ASCII
    stop = plain[3:5]
    cut = plain.find(stop)
    r = ops.client.chat.completions.create(**base, stop=[stop], extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    # the text ends before the stop string; its tokens are in the logprobs, up to the one completing it
    assert r.choices[0].message.content == plain[:cut] and "".join(c.token for c in content) == plain[:cut + 2]
    eos = tiny_llama.cfg.eos_token_ids[0]
    r = ops.client.chat.completions.create(**base, logit_bias={str(eos): 100})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1
    assert r.choices[0].logprobs.content == []  # the end-of-sequence token is no part of the text


def test_engine_logprobs_leave_the_greedy_shortcut(tiny_llama, reference):
    from flint.engine import Engine, SamplingParams
    from flint.model import Transformer

    class OnDeviceGreedy(Transformer):  # a backend with the shortcuts that return no logits
        def greedy_next(self, token, pos):
            raise AssertionError("greedy_next taken with logprobs asked for")

        greedy_run = greedy_next

    engine = Engine(OnDeviceGreedy(tiny_llama.cfg, tiny_llama.params, max_seq_len=CONTEXT), tiny_llama.tokenizer)
    ids = tiny_llama.tokenizer.encode(PROMPT)
    r = engine.generate(ids, SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=2,
                                            logit_bias={7: 3.0}))
    assert [e.token_id for e in r.logprobs] == r.token_ids and all(len(e.top) == 2 for e in r.logprobs)
    ctx = list(ids)
    for e in r.logprobs:  # the bias is part of the distribution reported
        biased = reference(ctx).exp()
        biased[7] *= math.exp(3.0)
        assert abs(e.logprob - math.log(biased[e.token_id] / biased.sum())) < TOL
        ctx.append(e.token_id)


def test_token_bytes_of_byte_level_and_sentencepiece_vocabularies(tiny_llama):
    from types import SimpleNamespace

    from tokenizers import Tokenizer as HFTokenizer, decoders, models

    from flint.server.state import ServerState
    from flint.tokenizer import Tokenizer

    def state_for(tok) -> ServerState:
        s = ServerState("m", None, 1)
        s.lm = SimpleNamespace(tokenizer=tok)
        return s

    byte_level = state_for(tiny_llama.tokenizer)
    e_acute = "é".encode()
    first, second = (token_id(tiny_llama.tokenizer, "", [b]) for b in e_acute)
    assert byte_level.token_text(first) == ("\ufffd", [e_acute[0]]) and byte_level.token_text(second)[1] == [e_acute[1]]
    assert byte_level.token_text(token_id(tiny_llama.tokenizer, " ", [32])) == (" ", [32])
    # a Llama-2-style vocabulary: word marks, byte fallback, and a decoder that strips the first space
    vocab = {"<unk>": 0, "<0xC3>": 1, "<0xA9>": 2, "\u2581Paris": 3, "is": 4}
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    spm = state_for(Tokenizer(tk, None, None, None, []))
    assert spm.token_text(3) == (" Paris", list(b" Paris"))
    assert spm.token_text(1) == ("\ufffd", [0xC3]) and spm.token_text(4) == ("is", list(b"is"))
