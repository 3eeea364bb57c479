"""`flint serve` as the clients people point at it use it: n > 1, echo with prompt logprobs (what
lm-evaluation-harness's loglikelihood tasks send), min_tokens, stop_token_ids, include_stop_str_in_output,
skip_special_tokens, chat_template_kwargs, the prompt cache in timings and usage, completions' bytes: keys,
the openai SDK's model_dump() round trip in an agent loop, /v1/responses in the OpenAI Agents SDK's request
shape, /v1/embeddings refused.

Here their requests are sent as they build them, without the packages (tests/test_real_clients.py runs
the clients themselves when they are installed): lm_eval's local-completions sends token-id prompts with
echo, logprobs 1 and max_tokens 1 for loglikelihood and string prompts with stop strings for generation;
the Agents SDK's OpenAIResponsesModel sends input items, instructions and function tools. One real server
on the tiny random llama of tests/conftest.py (byte tokenizer, context 96); the tool-using turns on the
embedded SmolLM2 (conftest's ``smol``: its tool prompt needs more than 96 tokens).
Run: ``pytest tests/test_server_compat.py`` (about a minute).
"""
import json

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
from test_server import is_openai_error  # noqa: E402  (pytest puts tests/ on sys.path)
from test_server_ops import ops, reference  # noqa: E402,F401  (fixtures)

PROMPT = "Once upon a time"
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def srv(ops):  # noqa: F811  (the imported fixture)
    return ops  # the tiny model's server of tests/test_server_ops.py, started for this module


def post(s, path: str, **body) -> dict:
    r = httpx.post(s.url + path, json={"model": s.model, **body}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def complete(s, **kw) -> dict:
    return post(s, "/v1/completions", **{"prompt": PROMPT, "max_tokens": 8, "temperature": 0, **kw})


def test_n_choices_run_one_after_the_other(srv):
    one = complete(srv, temperature=1.0, seed=7)
    three = complete(srv, temperature=1.0, seed=7, n=3)
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    assert three["choices"][0]["text"] == one["choices"][0]["text"]  # choice i samples with seed + i
    assert len({c["text"] for c in three["choices"]}) > 1
    assert three["usage"]["completion_tokens"] == 3 * 8
    assert three["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=30, json={
            "model": srv.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2,
            "ignore_eos": True,  # (an unseeded draw may end a choice early: the usage below counts 2 x 4)
            "stream": True, "stream_options": {"include_usage": True}}) as r:
        chunks = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    finished = [c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finished == [0, 1] and chunks[-1]["usage"]["completion_tokens"] == 8


def test_echo_with_prompt_logprobs_is_lm_eval_loglikelihood(srv, tiny_llama, reference):  # noqa: F811
    # lm_eval local-completions, loglikelihood: the context and continuation as token ids, echo, logprobs 1
    ids = tiny_llama.tokenizer.encode(PROMPT, add_special_tokens=False)
    got = post(srv, "/v1/completions", prompt=[ids], echo=True, logprobs=1, max_tokens=1, temperature=0)
    lp = got["choices"][0]["logprobs"]
    assert got["choices"][0]["text"].startswith(PROMPT)
    assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i in range(1, len(ids)):  # each prompt token under the tokens before it
        want = reference(ids[:i])
        assert abs(lp["token_logprobs"][i] - want[ids[i]].item()) < 1e-3
        (best, v), = lp["top_logprobs"][i].items()
        assert abs(v - want.max().item()) < 1e-3
    assert lp["text_offset"][:3] == [0, 1, 2]
    only = post(srv, "/v1/completions", prompt=PROMPT, echo=True, logprobs=0, max_tokens=0)
    assert only["choices"][0]["text"] == PROMPT and only["usage"]["completion_tokens"] == 0
    assert only["choices"][0]["logprobs"]["token_logprobs"][1:] == lp["token_logprobs"][1:len(ids)]
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=30, json={
            "model": srv.model, "prompt": PROMPT, "echo": True, "logprobs": 0, "max_tokens": 3, "stream": True}) as r:
        chunks = [json.loads(ln[6:])["choices"][0] for ln in r.iter_lines() if ln.startswith("data: {")]
    assert chunks[0]["text"] == PROMPT and chunks[0]["logprobs"]["token_logprobs"][0] is None
    streamed = [v for c in chunks if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
    assert len(streamed) == len(ids) + 3


def test_lm_eval_generation_request(srv):
    # lm_eval local-completions, generate_until: a string prompt, stop strings ("until"), max_tokens, seed
    r = post(srv, "/v1/completions", prompt=PROMPT, max_tokens=16, temperature=0, stop=["\n\n"], seed=1234)
    assert r["choices"][0]["finish_reason"] in ("stop", "length") and "\n\n" not in r["choices"][0]["text"]


def test_stop_token_ids_min_tokens_and_include_stop_str(srv, tiny_llama):
    base = complete(srv, max_tokens=12)
    text = base["choices"][0]["text"]
    first = tiny_llama.tokenizer.encode(text, add_special_tokens=False)[0]
    r = complete(srv, max_tokens=12, stop_token_ids=[first])
    assert (r["choices"][0]["text"], r["choices"][0]["finish_reason"]) == ("", "stop")
    assert r["usage"]["completion_tokens"] == 1
    r = complete(srv, max_tokens=12, stop_token_ids=[first], min_tokens=3)
    assert r["usage"]["completion_tokens"] >= 3
    r = complete(srv, max_tokens=5, min_tokens=5, stop_token_ids=[first])  # never past max_tokens
    assert r["usage"]["completion_tokens"] == 5 and r["choices"][0]["finish_reason"] == "length"
    stop = text[3:5]
    cut = text.index(stop)
    r = complete(srv, max_tokens=12, stop=[stop])
    assert r["choices"][0]["text"] == text[:cut] and r["choices"][0]["finish_reason"] == "stop"
    r = complete(srv, max_tokens=12, stop=[stop], include_stop_str_in_output=True)
    assert r["choices"][0]["text"] == text[:cut] + stop


def test_skip_special_tokens_and_special_logprobs(srv):
    forced = {"1": 100}  # <|im_start|>, a special token, made the only likely one
    kept = complete(srv, max_tokens=2, logit_bias=forced, skip_special_tokens=False, logprobs=1)
    assert kept["choices"][0]["text"] == "<|im_start|>" * 2
    skipped = complete(srv, max_tokens=2, logit_bias=forced, logprobs=1)
    assert skipped["choices"][0]["text"] == ""
    assert skipped["choices"][0]["logprobs"]["tokens"] == ["", ""]  # as the text: left out
    assert skipped["choices"][0]["logprobs"]["text_offset"] == [0, 0]


def test_partial_characters_are_keyed_by_bytes(srv):
    r = post(srv, "/v1/completions", prompt="é!", echo=True, logprobs=2, max_tokens=0)
    lp = r["choices"][0]["logprobs"]
    assert lp["tokens"] == ["bytes:\\xc3", "bytes:\\xa9", "!"]
    assert lp["text_offset"] == [0, 0, 1]  # the character starts at 0, "!" after it
    keys = [k for top in lp["top_logprobs"][1:] for k in top]
    assert len(keys) == 4 and all(isinstance(k, str) for k in keys)


def test_timings_count_processed_and_cached_prompt_tokens(srv):
    body = {"prompt": "A prompt that is sent twice", "max_tokens": 2}
    first, again = complete(srv, **body), complete(srv, **body)
    n = first["usage"]["prompt_tokens"]
    assert again["timings"]["cache_n"] == n - 1 and again["timings"]["prompt_n"] == 1
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1
    assert first["timings"]["prompt_n"] + first["timings"]["cache_n"] == n


def test_chat_template_kwargs_reach_the_template(tiny_llama):
    from flint.tokenizer import Tokenizer

    tok = tiny_llama.tokenizer
    t = Tokenizer(tok.tk, "{% if shout %}LOUD {% endif %}{{ messages[0]['content'] }}", None, None, [2])
    assert t.apply_chat_template([{"role": "user", "content": "x"}], template_kwargs={"shout": True}) == "LOUD x"
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == "x"


def test_openai_model_dump_round_trip_in_an_agent_loop(smol):
    srv = smol
    messages = [{"role": "user", "content": "Weather in Paris?", "name": "alice"}]
    for _ in range(2):
        r = srv.client.chat.completions.create(model=srv.model, messages=messages, tools=TOOLS, max_tokens=40,
                                               tool_choice="required", temperature=0)
        msg = r.choices[0].message
        assert msg.tool_calls, msg
        messages.append(msg.model_dump())  # null refusal, audio, function_call, annotations included
        messages += [{"role": "tool", "tool_call_id": c.id, "content": "Sunny"} for c in msg.tool_calls]
    assert {"refusal", "audio", "function_call", "annotations"} <= set(messages[1])
    final = srv.client.chat.completions.create(model=srv.model, messages=messages, tools=TOOLS, max_tokens=4)
    assert final.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_responses_in_the_agents_sdk_shape(smol):
    srv = smol
    # what OpenAIResponsesModel sends: instructions, input items, function tools, tool_choice
    tools = [{"type": "function", "name": "weather", "description": "the weather", "strict": True,
              "parameters": TOOLS[0]["function"]["parameters"]}]
    body = {"instructions": "You are terse.", "input": [{"role": "user", "content": "Weather in Oslo?"}],
            "tools": tools, "tool_choice": "required", "parallel_tool_calls": False, "max_output_tokens": 60,
            "temperature": 0}
    r = srv.client.responses.create(model=srv.model, **body)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and calls and calls[0].name == "weather"
    assert json.loads(calls[0].arguments)["city"] in ("Paris", "Oslo")
    # the next turn: the call and its output go back as input items
    body["input"] += [calls[0].model_dump(exclude_none=True),
                      {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Cold"}]
    body["tool_choice"] = "none"
    r = srv.client.responses.create(model=srv.model, **{**body, "max_output_tokens": 4})
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    assert r.status == "incomplete" and r.usage.output_tokens == 4
    # streamed: the Responses API's events, the call whole in one arguments delta
    body.update(tool_choice="required", input=body["input"][:1])
    events = list(srv.client.responses.create(model=srv.model, stream=True, **body))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.done" in kinds and [e.sequence_number for e in events] == list(
        range(len(events)))
    done = events[-1].response
    assert [o.type for o in done.output] == ["function_call"] and done.output[0].name == "weather"
    for field, kw in (("store", dict(store=True)),
                      ("input.0.type", dict(input=[{"type": "reasoning", "summary": []}])),
                      ("tools.0.type", dict(tools=[{"type": "web_search"}]))):
        bad = httpx.post(srv.url + "/v1/responses", json={"model": srv.model, "input": "hi", **kw}, timeout=30)
        assert bad.status_code == 400 and is_openai_error(bad.json()), bad.text
        assert bad.json()["error"]["param"] == field, bad.text


def test_responses_streamed_text(srv):
    events = list(srv.client.responses.create(model=srv.model, input="hi", max_output_tokens=6, temperature=0,
                                              stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    whole = srv.client.responses.create(model=srv.model, input="hi", max_output_tokens=6, temperature=0)
    assert text == whole.output[0].content[0].text == events[-1].response.output[0].content[0].text
    assert events[-1].response.usage.output_tokens == 6


def test_embeddings_are_refused_with_a_reason(srv):
    with pytest.raises(openai.BadRequestError) as e:
        srv.client.embeddings.create(model=srv.model, input="hello")
    assert "defines no embedding" in str(e.value)


def test_bench_serve_reports_client_and_engine_speed(tiny_llama_dir, tmp_path, capsys):
    from flint.cli import main

    out = tmp_path / "serve.json"
    assert main(["bench", "--serve", "--model", str(tiny_llama_dir), "--backend", "reference", "--device", "cpu",
                 "--tokens", "16", "--repeats", "2", "--json", str(out)]) == 0
    row, = json.loads(out.read_text())["results"]
    assert row["tokens"] == 16 and row["ttft_ms"] > 0 and row["client_tok_s"] > 0 and row["engine_tok_s"] > 0
    assert row["ratio"] == pytest.approx(row["client_tok_s"] / row["engine_tok_s"])
    assert "client / engine" in capsys.readouterr().out


def test_bench_serve_runs_a_synthetic_shape(tmp_path, capsys):
    """`flint serve` gives a synthetic model the byte-level tokenizer of its vocabulary, so `bench --serve` times a
    shape with no tokenizer of its own; every id the model emits decodes, text encodes byte by byte."""
    from flint.cli import main
    from flint.synthetic import synthetic_config, synthetic_tokenizer

    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(dict(model_type="llama", vocab_size=400, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=256, eos_token_id=399)))
    tok = synthetic_tokenizer(synthetic_config(str(cfg_path)))
    assert tok.vocab_size == 400 and tok.eos_token_ids == [399]
    assert tok.tk.decode(tok.tk.encode("héllo").ids) == "héllo" and len(tok.tk.encode("héllo").ids) == 6
    assert tok.tk.decode([300, 399]) == " w300 w399"
    assert "<|im_start|>assistant" in tok.apply_chat_template([{"role": "user", "content": "hi"}])
    out = tmp_path / "serve.json"
    assert main(["bench", "--serve", "--model", f"synthetic:{cfg_path}", "--backend", "reference", "--device", "cpu",
                 "--tokens", "8", "--repeats", "1", "--json", str(out)]) == 0
    row, = json.loads(out.read_text())["results"]
    assert row["tokens"] == 8 and row["client_tok_s"] > 0 and row["engine_tok_s"] > 0
