"""Tool calls and reasoning per model family: the Hermes format (Qwen2.5, Qwen3), Llama 3.1's JSON calls,
Mistral's [TOOL_CALLS] list, and Qwen3's <think> block split into reasoning_content.

Parsing each format (several calls, malformed JSON left as content, piece-by-piece streaming), the reasoning
split, the format chosen from the chat template or --tool-call-parser, tools and tool messages rendered as
transformers' apply_chat_template renders them, and `flint serve`'s app in this process (FastAPI's
TestClient) on a tiny random checkpoint of each family: forced calls in the family's format, a scripted
output (a ``choice`` constraint) parsed into reasoning, content and tool_calls, streamed and not, and the
next turn's tool messages reaching the template. The family templates below are small ones written for
these tests, with the tool sections of the real ones' shape. Run: ``pytest tests/test_tool_formats.py``.
"""
from __future__ import annotations

import json

import pytest

from conftest import make_hf_model, save_hf_dir
from flint.server.reasoning import Reply, enabled, opened_by, split
from flint.server.tools import (FALLBACK, GRANITE3, HERMES, LLAMA3, MISTRAL, ToolStream, detect_format, parse,
                                render)


# Qwen2.5-like: tools as JSON lines in the system turn, calls in <tool_call> blocks, results as <tool_response>
QWEN = (
    "{% if tools %}{{ '<|im_start|>system\\n' }}{% if messages[0].role == 'system' %}{{ messages[0].content + "
    "'\\n\\n' }}{% endif %}{{ '# Tools\\n<tools>' }}{% for t in tools %}{{ '\\n' + (t | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\nTo call a function, answer <tool_call>\\n{\"name\": NAME, \"arguments\": ARGS}\\n"
    "</tool_call><|im_end|>\\n' }}"
    "{% elif messages[0].role == 'system' %}{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for m in messages %}{% if m.role == 'system' %}"
    "{% elif m.role == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{# the reasoning #}"
    "{{ m.content or '' }}{% for c in m.tool_calls or [] %}{{ '\\n<tool_call>\\n{\"name\": \"' + c.function.name + "
    "'\", \"arguments\": ' + (c.function.arguments | tojson) + '}\\n</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% elif m.role == 'tool' %}{{ '<|im_start|>user\\n<tool_response>\\n' + m.content + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Qwen3-like: the same, and the generation prompt closes an empty <think> block when enable_thinking is false
# (this test's `thinking_only` opens one instead, as the templates of thinking-only releases do)
QWEN3 = QWEN.replace(
    "{# the reasoning #}",
    "{% if m.reasoning_content %}{{ '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{% endif %}").replace(
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% elif thinking_only is defined and thinking_only %}{{ '<think>\\n' }}{% endif %}{% endif %}")
# Llama-3.1-like: tools in the system turn, a call as a bare {"name", "parameters"} object, results as ipython
LLAMA = (
    "{{ bos_token }}{% if tools %}{{ '<|start_header_id|>system<|end_header_id|>\\n\\nEnvironment: ipython\\n"
    "Answer a function call as JSON {\"name\": NAME, \"parameters\": ARGS}.\\n' }}"
    "{% for t in tools %}{{ (t | tojson) + '\\n' }}{% endfor %}{{ '<|eot_id|>' }}{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' or m.role == 'ipython' %}"
    "{{ '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"
    "{% elif m.tool_calls %}{% if m.tool_calls | length != 1 %}{{ raise_exception('one call at a time') }}{% endif %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n<|python_tag|>{\"name\": \"' + "
    "m.tool_calls[0].function.name + '\", \"parameters\": ' + (m.tool_calls[0].function.arguments | tojson) + "
    "'}<|eom_id|>' }}"
    "{% else %}{{ '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
# Mistral-v0.3-like: [AVAILABLE_TOOLS] before the last user turn, calls as one [TOOL_CALLS] list, 9-character ids
MISTRAL_T = (
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}"
    "{% endif %}{% endfor %}"
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}"
    "{% if tools and loop.index0 == ns.last %}{{ '[AVAILABLE_TOOLS] ' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{% endif %}"
    "{{ '[INST] ' + m.content + '[/INST]' }}"
    "{% elif m.role == 'assistant' and m.tool_calls %}{{ '[TOOL_CALLS] [' }}{% for c in m.tool_calls %}"
    "{% if c.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9') }}"
    "{% endif %}{{ '{\"name\": \"' + c.function.name + '\", \"arguments\": ' + (c.function.arguments | tojson) + "
    "', \"id\": \"' + c.id + '\"}' }}{% if not loop.last %}{{ ', ' }}{% endif %}{% endfor %}{{ ']' + eos_token }}"
    "{% elif m.role == 'tool' %}{% if m.tool_call_id | length != 9 %}{{ raise_exception('bad tool_call_id') }}"
    "{% endif %}{{ '[TOOL_RESULTS] {\"content\": ' + (m.content | tojson) + ', \"call_id\": \"' + m.tool_call_id + "
    "'\"}[/TOOL_RESULTS]' }}"
    "{% elif m.role == 'assistant' %}{{ m.content + eos_token }}{% endif %}{% endfor %}")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Paris"]}}, "required": ["city"],
                   "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


def names_args(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def streamed(text: str, think, fmt) -> list:
    """The events of ``text`` fed one character at a time."""
    r = Reply(think, fmt)
    return [e for ch in text for e in r.feed(ch)] + r.finish()


def joined(events: list, kind: str) -> str:
    return "".join(v for k, v in events if k == kind)


# ------------------------------------------------------------------ the format of each family


def test_the_format_is_read_from_the_template_or_named():
    assert detect_format(QWEN) is HERMES and detect_format(QWEN3) is HERMES
    assert detect_format(LLAMA) is LLAMA3 and detect_format(MISTRAL_T) is MISTRAL
    assert detect_format("{{ messages }}") is FALLBACK
    assert detect_format(QWEN, "llama3_json") is LLAMA3 and detect_format(LLAMA, "granite") is GRANITE3
    named = detect_format("{{ messages }}", "mistral")  # a template without tools: flint's prompt, that format
    assert named.name == "mistral" and not named.native
    with pytest.raises(ValueError, match="unknown tool-call parser 'qwen'.*hermes"):
        detect_format(QWEN, "qwen")
    assert enabled(QWEN3) and not enabled(QWEN) and not enabled(QWEN3, "none") and enabled(QWEN, "qwen3")
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        enabled(QWEN3, "r1")


def test_an_unknown_parser_is_refused_at_start():
    from flint.cli import build_parser
    from flint.server.state import ServerState

    with pytest.raises(SystemExit):  # argparse: "invalid choice", with the choices
        build_parser().parse_args(["serve", "--tool-call-parser", "nope"])
    with pytest.raises(ValueError, match="--tool-call-parser: unknown parser 'nope'"):
        ServerState("m", None, 1, tool_parser="nope")
    args = build_parser().parse_args(["serve", "--tool-call-parser", "llama3_json", "--reasoning-parser", "none"])
    assert (args.tool_call_parser, args.reasoning_parser) == ("llama3_json", "none")


HERMES_TWO = ('Checking both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


@pytest.mark.parametrize("fmt,text,content,calls", [
    (HERMES, HERMES_TWO, "Checking both.", [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>', []),
    (HERMES, '<tool_call>\n{"name": "get_time", "arguments": {}}', None, [("get_time", {})]),  # cut before the end
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", {"city": "Paris"})]),
    (LLAMA3, '<|python_tag|>{"name": "get_time", "parameters": {}}', None, [("get_time", {})]),
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "a;b"}}; {"name": "get_time", "parameters": {}}',
     None, [("get_weather", {"city": "a;b"}), ("get_time", {})]),
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris"}', '{"name": "get_weather", "parameters": '
     '{"city": "Paris"}', []),
    (LLAMA3, 'It is {"name": "x"}', 'It is {"name": "x"}', []),
    (MISTRAL, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", '
     '"arguments": {}}]', None, [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    (MISTRAL, '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}', None,
     [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    (MISTRAL, '[TOOL_CALLS]get_time[ARGS]{', '[TOOL_CALLS]get_time[ARGS]{', []),
    (MISTRAL, 'Sure. [TOOL_CALLS] [{"name": "get_time"', 'Sure. [TOOL_CALLS] [{"name": "get_time"', []),
])
def test_parse_each_format_whole_and_streamed(fmt, text, content, calls):
    got_content, got = parse(text, fmt)
    assert got_content == content and names_args(got) == calls
    events = streamed(text, None, fmt)
    assert names_args([v for k, v in events if k == "call"]) == calls
    assert joined(events, "content") == (content or "")
    if fmt is MISTRAL:
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in got)
    else:
        assert all(c["id"].startswith("call_") for c in got)


@pytest.mark.parametrize("think,text,reasoning,content,calls", [
    (False, "<think>\nThe user wants Oslo.\n</think>\n\nOslo is cold.", "The user wants Oslo.", "Oslo is cold.", []),
    (False, "No block here, and <think> later stays.", None, "No block here, and <think> later stays.", []),
    (False, "<think>\ncut short", "cut short", "", []),  # max_tokens inside the block: all reasoning
    (True, "Still thinking.\n</think>\n\nDone.", "Still thinking.", "Done.", []),  # the prompt opened it
    (True, "<think>Opened again.</think>Done.", "Opened again.", "Done.", []),
    (False, "<think>\nmaybe <tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>\n</think>\n\n"
     + HERMES_TWO, 'maybe <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "Checking both.",
     [("get_weather", {"city": "Oslo"}), ("get_time", {})]),  # calls count only after the block
    (False, "<think>\n\n</think>\n\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>", None,
     None, [("get_time", {})]),
])
def test_reasoning_split_whole_and_streamed(think, text, reasoning, content, calls):
    got = split(text, think, HERMES)
    assert got[0] == reasoning and got[1] == content and names_args(got[2]) == calls
    events = streamed(text, think, HERMES)
    assert (joined(events, "reasoning") or None) == reasoning
    assert joined(events, "content") == (content or "")  # the newlines around calls are no content
    assert names_args([v for k, v in events if k == "call"]) == calls
    kinds = [k for k, _ in events]
    assert "reasoning" not in kinds[kinds.index("content") if "content" in kinds else len(kinds):]


def test_prompt_tails_that_open_a_block():
    assert opened_by("<|im_start|>assistant\n<think>\n") and not opened_by("<think>\n\n</think>\n\n")
    assert not opened_by("<|im_start|>assistant\n")


def test_tool_stream_holds_no_call_text_back_as_content():
    s = ToolStream(MISTRAL)
    events = [e for ch in 'Hi [TOOL_CALLS] [{"name": "get_time", "arguments": {}}]' for e in s.feed(ch)] + s.finish()
    assert joined(events, "content") == "Hi" and [k for k, _ in events][-1] == "call"


# ------------------------------------------------------------------ rendering, as transformers renders


HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0123456789abcdef", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_0123456789abcdef", "content": "-3 C"},
]


def hf_history(ids=lambda i: i) -> list[dict]:
    """HISTORY as transformers' docs pass it: the call's arguments a mapping."""
    out = [dict(m) for m in HISTORY]
    call = HISTORY[2]["tool_calls"][0]
    out[2]["tool_calls"] = [{"id": ids(call["id"]), "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Oslo"}}}]
    out[3]["tool_call_id"] = ids(call["id"])
    return out


@pytest.mark.parametrize("template", ["QWEN", "QWEN3", "LLAMA", "MISTRAL_T"])
def test_rendered_as_transformers_renders(tmp_path, template):
    """flint's render of OpenAI messages through a family template gives transformers' apply_chat_template
    text for the same conversation (tools as given, arguments as a mapping); Mistral's ids shortened to 9."""
    from transformers import AutoTokenizer

    from flint.loading import load_model
    from flint.server.tools import _short_id

    text = globals()[template]
    d = save_hf_dir(make_hf_model("qwen2", seed=3), tmp_path / "m")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps(dict(cfg, chat_template=text)))
    tok = load_model(str(d)).tokenizer
    hf = AutoTokenizer.from_pretrained(str(d))
    fmt = detect_format(text)
    msgs, tools = render(HISTORY, [WEATHER, TIME], fmt)
    want_msgs = hf_history(_short_id if fmt.short_ids else (lambda i: i))
    for gen in (True, False):
        mine = tok.apply_chat_template(msgs, gen, tools)
        theirs = hf.apply_chat_template(want_msgs, tools=[WEATHER, TIME], tokenize=False, add_generation_prompt=gen)
        assert mine == theirs
    assert ("get_time" in mine) and (fmt.name != "llama3_json" or "ipython" in mine)
    if fmt is HERMES:
        assert "<tool_response>\n-3 C\n</tool_response>" in mine


# ------------------------------------------------------------------ the server, on a tiny model of each family

FAMILIES = {"qwen2": QWEN, "qwen3": QWEN3, "llama": LLAMA, "mistral": MISTRAL_T}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """family -> a TestClient on `flint serve`'s app with a tiny random checkpoint of that family."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from flint.cli import build_parser
    from flint.server.app import create_app
    from flint.server.state import ServerState

    out = {}
    for i, (family, template) in enumerate(FAMILIES.items()):
        d = save_hf_dir(make_hf_model(family, seed=10 + i, max_position_embeddings=1024),
                        tmp_path_factory.mktemp(family))
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        (d / "tokenizer_config.json").write_text(json.dumps(dict(cfg, chat_template=template)))
        args = build_parser().parse_args(["serve", "--model", str(d), "--backend", "reference", "--device", "cpu",
                                          "--max-seq-len", "1024"])
        state = ServerState("m", None, 4, allow_hosts=["testserver"])
        state.load(args)
        out[family] = TestClient(create_app(state))
    yield out
    for client in out.values():
        client.close()
    

def chat(client, **body) -> dict:
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": ASK, "max_tokens": 200, **body})
    assert r.status_code == 200, r.text
    return r.json()


def stream_chat(client, **body) -> tuple[dict, str | None]:
    """The streamed deltas added up: {"content", "reasoning_content", "tool_calls"} and the finish reason."""
    got = {"content": "", "reasoning_content": "", "tool_calls": {}}
    finish = None
    with client.stream("POST", "/v1/chat/completions", json={"model": "m", "messages": ASK, "max_tokens": 200,
                                                              "stream": True, **body}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            ch = json.loads(line[6:])["choices"][0]
            d = ch["delta"]
            got["content"] += d.get("content") or ""
            got["reasoning_content"] += d.get("reasoning_content") or ""
            for tc in d.get("tool_calls") or []:
                c = got["tool_calls"].setdefault(tc["index"], {"id": tc["id"], "name": "", "arguments": ""})
                c["name"] += tc["function"]["name"]
                c["arguments"] += tc["function"]["arguments"]
            finish = ch["finish_reason"] or finish
    return got, finish


@pytest.mark.parametrize("family", list(FAMILIES))
def test_forced_calls_come_in_the_family_format(servers, family):
    client = servers[family]
    extra = {}
    if family == "qwen3":  # the grammar allows a <think> block first, which a random model never closes: "<to"
        # rather than "<th" (where "h" is the only token allowed, as in "get_weather", it is still taken)
        h = client.post("/tokenize", json={"model": "m", "prompt": "h", "add_special_tokens": False}).json()["tokens"]
        extra = {"logit_bias": {str(h[0]): -100}}
    r = chat(client, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}},
             temperature=0, **extra)
    choice = r["choices"][0]
    m = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and m["content"] is None, m
    assert [c["function"]["name"] for c in m["tool_calls"]] == ["get_weather"]
    assert json.loads(m["tool_calls"][0]["function"]["arguments"])["city"] in ("Oslo", "Paris")
    got, finish = stream_chat(client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                              temperature=0, **extra)
    assert finish == "tool_calls" and got["content"] == "" and len(got["tool_calls"]) == 1, got
    # the next turn: the call and its result back through the family's template (Mistral's 9-character ids)
    history = ASK + [m, {"role": "tool", "tool_call_id": m["tool_calls"][0]["id"], "content": "Cold"}]
    r = client.post("/tokenize", json={"model": "m", "messages": history})
    assert r.status_code == 200, r.text
    text = client.post("/detokenize", json={"model": "m", "tokens": r.json()["tokens"]}).json()["prompt"]
    assert {"qwen2": "<tool_response>\nCold", "qwen3": "<tool_response>\nCold", "llama": "ipython<|end_header_id|>",
            "mistral": '[TOOL_RESULTS] {"content": "Cold"'}[family] in text


SCRIPTS = {  # family -> (an output the model is made to write, its reasoning, content and calls)
    "qwen2": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
              None, "Let me check.", [("get_weather", {"city": "Oslo"})]),
    "qwen3": ('<think>\nOslo, so call it.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
              '{"city": "Oslo"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
              "Oslo, so call it.", None, [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    "llama": ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, None,
              [("get_weather", {"city": "Paris"})]),
    "mistral": ('[TOOL_CALLS] [{"name": "get_time", "arguments": {}}]', None, None, [("get_time", {})]),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_model_output_parsed_streamed_and_not(servers, family):
    client = servers[family]
    script, reasoning, content, calls = SCRIPTS[family]
    body = dict(tools=[WEATHER, TIME], structured_outputs={"choice": [script]}, temperature=0)
    r = chat(client, **body)
    m, finish = r["choices"][0]["message"], r["choices"][0]["finish_reason"]
    assert finish == "tool_calls" and m["content"] == content and names_args(m["tool_calls"]) == calls, m
    assert m.get("reasoning_content") == reasoning and ("reasoning_content" in m) == (family == "qwen3")
    got, finish = stream_chat(client, **body)
    assert finish == "tool_calls" and got["content"] == (content or "")
    assert got["reasoning_content"] == (reasoning or "")
    assert [(c["name"], json.loads(c["arguments"])) for c in got["tool_calls"].values()] == calls
    # malformed: the text stays content, as it is
    broken = script.replace('"name"', '"name" "')
    r = chat(client, **dict(body, structured_outputs={"choice": [broken]}))
    m = r["choices"][0]["message"]
    assert r["choices"][0]["finish_reason"] == "stop" and "tool_calls" not in m
    assert m["content"] == (broken if reasoning is None else broken.split("</think>\n\n", 1)[1])


def test_thinking_switches_reach_the_template(servers):
    client = servers["qwen3"]
    off = chat(client, max_tokens=6, chat_template_kwargs={"enable_thinking": False}, temperature=0)
    m = off["choices"][0]["message"]
    assert m["reasoning_content"] is None and len(m["content"]) > 0
    on = chat(client, max_tokens=6, chat_template_kwargs={"thinking_only": True}, temperature=0)
    m = on["choices"][0]["message"]  # the prompt opened the block, the output never closes it: all reasoning
    assert m["content"] == "" and m["reasoning_content"], m
    got, _ = stream_chat(client, max_tokens=6, chat_template_kwargs={"thinking_only": True}, temperature=0)
    assert got["content"] == "" and got["reasoning_content"] == m["reasoning_content"]
    # an earlier turn's reasoning goes back to the template
    history = ASK + [{"role": "assistant", "content": "Cold.", "reasoning_content": "Recall Oslo."},
                     {"role": "user", "content": "Thanks"}]
    ids = client.post("/tokenize", json={"model": "m", "messages": history}).json()["tokens"]
    text = client.post("/detokenize", json={"model": "m", "tokens": ids}).json()["prompt"]
    assert "<think>\nRecall Oslo.\n</think>\n\nCold." in text
    r = client.post("/v1/chat/completions", json={"model": "m", "max_tokens": 2, "messages": [
        {"role": "user", "content": "x", "reasoning_content": "no"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.reasoning_content"


def test_a_thinking_model_may_reason_before_a_forced_or_strict_call(tiny_llama):
    """With the reasoning split on, the tools' grammars allow one <think> block the output opens before the
    calls (or, under strict auto, the text), and nothing else new."""
    from flint.grammar import Grammars
    from flint.server.tools import auto_grammar, call_grammar

    tok = tiny_llama.tokenizer
    g = Grammars(tok, tiny_llama.cfg.vocab_size, tok.eos_token_ids[0])
    strict = {"type": "function", "function": dict(WEATHER["function"], strict=True)}

    def accepts(constraint, text: str) -> bool:
        m = constraint.matcher()
        return all(m.m.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) and m.accepting

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    forced, auto = call_grammar(g, HERMES, [strict], True, think=True), auto_grammar(g, HERMES, [strict], True,
                                                                                        think=True)
    for c in (forced, auto):
        assert accepts(c, call) and accepts(c, "<think>\nOslo.\n</think>\n\n" + call)
        assert not accepts(c, "<think>a</think>b</think>" + call)  # one block
        assert not accepts(c, "<think>a</think>\n\n" + call.replace("Oslo", "Rome"))  # the schema still holds
    assert accepts(auto, "<think>a</think>\n\nJust text.") and not accepts(forced, "<think>a</think>\n\nJust text.")
    assert not accepts(auto, "<think>a</think>\n\ntext then " + call)
    assert not accepts(call_grammar(g, HERMES, [strict], True), "<think>a</think>" + call)  # no split, no block
