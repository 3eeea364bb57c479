"""The OpenAI request side of `flint serve`: the request schemas (pydantic, unknown fields refused,
a validation error as a 400 naming the field), and the checks that turn a validated chat or completion
request into the engine's SamplingParams, its prompt (messages through the chat template, or text,
or token ids) and its tool plan, each refusal a 400 naming the field, before any work.

Used by flint/server/app.py; tests: ``pytest tests/test_server.py tests/test_structured.py
tests/test_tools.py``.
"""
import functools
import json
from typing import TYPE_CHECKING

from .errors import APIError

if TYPE_CHECKING:
    from .queue import Options
    from .state import ServerState

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # a stop string's length: each token checks the text's end against every prefix of each
MAX_STOP_TOKENS = 64  # stop_token_ids
MAX_CHOICES = 16  # n: the choices run one after the other
MAX_MESSAGES = 2048  # messages in one chat request (each costs template tokens: the context holds few more)
# tokenizing a long text first reads this many characters per allowed token: a text of ordinary tokens
# (about 4 characters each in English) that overflows the context is known from that prefix alone
PREFIX_CHARS_PER_TOKEN = 8
CUT_TOKENS = 4  # tokens a cut inside the text may add to its prefix's count (the last word split)
PROBE_STEPS = 4  # a grammar's first steps run at admission (see _probe), trying
PROBE_BRANCH = 16  # this many of the allowed tokens at each
MAX_LOGIT_BIAS = 300  # entries, as OpenAI's limit
MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI's chat limit
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


# ------------------------------------------------------------------ validation errors

_TYPE_TAGS = {"str", "int", "float", "bool"}


def validation_error(e) -> APIError:
    """The first problem in a pydantic ValidationError, as a 400 naming the field."""
    err = e.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        why = err.get("ctx", {}).get("error", err["msg"])
        return APIError(400, f"the request body is not valid JSON ({why})", code="invalid_json")
    # a union names the branch it tried ('stop.list[str].0'); the client wants the field path
    loc = [str(x) for x in err["loc"] if not (isinstance(x, str) and ("[" in x or x in _TYPE_TAGS))]
    param = ".".join(loc) or None
    if err["type"] == "extra_forbidden":
        return APIError(400, f"{param}: this field is not supported by flint (refused rather than ignored)",
                        param=param, code="unsupported_parameter")
    return APIError(400, f"{param or 'body'}: {err['msg']}", param=param, code="invalid_value")


# ------------------------------------------------------------------ request schemas

@functools.cache
def schemas():
    """The request models (built on first use so importing this module stays cheap)."""
    from typing import Literal

    from pydantic import BaseModel, ConfigDict, Field

    class _Base(BaseModel):
        # a field flint does not know is refused (400), not ignored; NaN and infinity are no numbers
        model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    class TextPart(_Base):
        type: Literal["text"]
        text: str

    class CallFunction(_Base):
        name: str
        arguments: str  # JSON text, as OpenAI sends it

    class ToolCall(_Base):
        id: str
        type: Literal["function"]
        function: CallFunction

    class ChatMessage(_Base):
        role: str
        content: str | list[TextPart] | None = None
        name: str | None = None  # a participant's name: given to the chat template with the message
        tool_call_id: str | None = None  # goes to the chat template with the message
        tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
        reasoning_content: str | None = None  # an assistant's earlier reasoning: to the template (Qwen3's reads it)
        # what an answer's message.model_dump() sends back: accepted when empty (null; annotations [])
        refusal: None = None
        audio: None = None
        function_call: None = None
        annotations: list[dict] | None = Field(None, max_length=0)

    class FunctionDef(_Base):
        name: str
        description: str | None = None
        parameters: dict | None = None  # a JSON schema of the arguments
        strict: bool | None = None  # true: the output is constrained under tool_choice auto too (forced calls always are)

    class Tool(_Base):
        type: Literal["function"]
        function: FunctionDef

    class ChoiceFunction(_Base):
        name: str

    class NamedToolChoice(_Base):
        type: Literal["function"]
        function: ChoiceFunction

    class JsonSchemaSpec(_Base):
        model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)
        name: str
        description: str | None = None
        schema_: dict | None = Field(None, alias="schema")
        strict: bool | None = None

    class ResponseFormat(_Base):
        type: Literal["text", "json_object", "json_schema"]
        json_schema: JsonSchemaSpec | None = None

    class StructuredOutputs(_Base):  # vLLM's extension: one of these
        model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)
        json_: dict | None = Field(None, alias="json")
        regex: str | None = None
        choice: list[str] | None = None
        grammar: str | None = None  # Lark (llguidance's dialect)

    class StreamOptions(_Base):
        include_usage: bool = False

    class Common(_Base):
        model: str
        max_tokens: int | None = Field(None, ge=1)
        temperature: float | None = Field(None, ge=0, le=2)  # OpenAI's default is 1
        top_p: float | None = Field(None, gt=0, le=1)
        seed: int | None = Field(None, ge=-(2**63), lt=2**63)  # int64, as OpenAI's
        stop: str | list[str] | None = None
        n: int | None = None
        stream: bool | None = None
        stream_options: StreamOptions | None = None
        presence_penalty: float | None = Field(None, ge=-2, le=2)
        frequency_penalty: float | None = Field(None, ge=-2, le=2)
        logit_bias: dict[str, float] | None = None  # token id (a JSON key, so a string) -> bias
        user: str | None = None  # an end-user label: changes no output
        # extensions (vLLM spells them the same way)
        top_k: int | None = Field(None, ge=0)
        min_p: float | None = Field(None, ge=0, le=1)
        repetition_penalty: float | None = Field(None, gt=0, le=10)
        ignore_eos: bool = False
        structured_outputs: StructuredOutputs | None = None  # vLLM's spelling
        grammar: str | None = None  # llama.cpp's: a GBNF grammar
        min_tokens: int | None = Field(None, ge=0)  # vLLM: no end of sequence or stop before this many tokens
        stop_token_ids: list[int] | None = None  # vLLM: more tokens that end the output
        include_stop_str_in_output: bool = False  # vLLM: the stop string that matched ends the text
        skip_special_tokens: bool | None = None  # vLLM: special tokens' text in the output (default: left out)
        cache_prompt: bool | None = None  # llama.cpp's: flint always reuses the cached prompt prefix

    class ChatRequest(Common):
        messages: list[ChatMessage] = Field(min_length=1)
        max_completion_tokens: int | None = Field(None, ge=1)
        logprobs: bool | None = None
        top_logprobs: int | None = None
        metadata: dict[str, str] | None = None  # labels: change no output
        response_format: ResponseFormat | None = None
        tools: list[Tool] | None = None
        tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
        parallel_tool_calls: bool | None = None
        chat_template_kwargs: dict | None = None  # vLLM's: more variables for the chat template
        # the deprecated function-calling fields: refused (see refuse_unsupported), tools replace them
        functions: list | None = None
        function_call: str | dict | None = None

    class CompletionRequest(Common):
        prompt: str | list[str] | list[int] | list[list[int]]
        max_tokens: int | None = Field(None, ge=0)  # 0 with echo: the prompt's logprobs alone
        echo: bool | None = None
        logprobs: int | None = None
        best_of: int | None = None
        suffix: str | None = None

    class TokenizeRequest(_Base):
        # vLLM spells the text prompt and add_special_tokens, llama.cpp content and add_special
        model: str | None = None
        prompt: str | None = None
        content: str | None = None
        messages: list[ChatMessage] | None = Field(None, min_length=1)
        add_special_tokens: bool | None = None
        add_special: bool | None = None
        add_generation_prompt: bool = True
        with_pieces: bool = False  # llama.cpp: each token as {"id", "piece"}

    class DetokenizeRequest(_Base):
        model: str | None = None
        tokens: list[int]

    class ResponsesRequest(_Base):  # OpenAI's Responses API: text and function tools (flint.server.responses)
        model: str
        input: str | list[dict]
        instructions: str | None = None
        tools: list[dict] | None = None
        tool_choice: Literal["none", "auto", "required"] | dict | None = None
        parallel_tool_calls: bool | None = None
        temperature: float | None = Field(None, ge=0, le=2)
        top_p: float | None = Field(None, gt=0, le=1)
        max_output_tokens: int | None = Field(None, ge=1)
        text: dict | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
        metadata: dict[str, str] | None = None
        user: str | None = None
        # refused unless neutral (flint.server.responses.chat_body says why)
        stream: bool | None = None
        store: bool | None = None
        previous_response_id: str | None = None
        include: list[str] | None = None
        reasoning: dict | None = None
        truncation: str | None = None

    return ChatRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest, ResponsesRequest


# ------------------------------------------------------------------ turning requests into jobs

def _requested_max_tokens(req) -> int | None:
    if getattr(req, "max_tokens", None) is not None:
        return req.max_tokens
    return getattr(req, "max_completion_tokens", None)


def refuse_unsupported(req, state: "ServerState") -> None:
    """400s for fields whose value flint cannot honour (before any work). Fields at their neutral
    value (tools [], response_format {"type": "text"}) change nothing and pass."""
    def refuse(param: str, message: str, code: str = "unsupported_parameter"):
        raise APIError(400, message, param=param, code=code)

    if req.stream_options is not None and not req.stream:
        refuse("stream_options", "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
               "invalid_value")
    if req.n is not None and not 1 <= req.n <= MAX_CHOICES:
        refuse("n", f"n must be in 1..{MAX_CHOICES}, got {req.n}", "invalid_value")
    if req.cache_prompt is False:
        refuse("cache_prompt", "cache_prompt: false cannot be honoured: flint always reuses the cached prompt "
                               "prefix (the output is the same either way)", "unsupported_value")
    if req.min_tokens:
        want = _requested_max_tokens(req)
        if want is not None and req.min_tokens > want:
            refuse("min_tokens", f"min_tokens ({req.min_tokens}) is over max_tokens ({want})", "invalid_value")
        if req.ignore_eos:
            refuse("min_tokens", "min_tokens: not with ignore_eos (nothing ends the output early)", "invalid_value")
        _refuse_on_draft(state, "min_tokens", "min_tokens (a ban on the ending tokens)")
    vocab = state.lm.cfg.vocab_size
    if len(req.stop_token_ids or ()) > MAX_STOP_TOKENS:
        refuse("stop_token_ids", f"stop_token_ids: at most {MAX_STOP_TOKENS}", "invalid_value")
    bad = next((t for t in req.stop_token_ids or () if not 0 <= t < vocab), None)
    if bad is not None:
        refuse("stop_token_ids", f"stop_token_ids: {bad} is not a token id of this model (0..{vocab - 1})",
               "invalid_value")
    limit = state.max_tokens_limit
    for name in ("max_tokens", "max_completion_tokens"):
        v = getattr(req, name, None)
        if v is not None and v > limit:
            refuse(name, f"{name}={v} is over this server's limit of {limit} (--max-tokens-limit)", "invalid_value")
    if len(req.logit_bias or {}) > MAX_LOGIT_BIAS:
        refuse("logit_bias", f"logit_bias: at most {MAX_LOGIT_BIAS} entries", "invalid_value")
    if hasattr(req, "messages"):
        if req.top_logprobs is not None:
            if not req.logprobs:
                refuse("top_logprobs", "top_logprobs requires logprobs: true", "invalid_value")
            if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
                refuse("top_logprobs", f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {req.top_logprobs}",
                       "invalid_value")
        for name in ("functions", "function_call"):
            if getattr(req, name) is not None:
                refuse(name, f"{name}: the deprecated function-calling field is not supported; use tools and "
                             "tool_choice")
        if req.tool_choice not in (None, "none") and not req.tools:
            refuse("tool_choice", "tool_choice needs tools", "invalid_value")
        rf = req.response_format
        if rf is not None and rf.type == "json_schema" and (rf.json_schema is None or rf.json_schema.schema_ is None):
            refuse("response_format.json_schema.schema", "response_format: type json_schema needs "
                   "json_schema.schema", "invalid_value")
    else:
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
            refuse("logprobs", f"logprobs must be in 0..{MAX_TOP_LOGPROBS} (alternatives per token), got "
                               f"{req.logprobs}", "invalid_value")
        for field, bad in (("best_of", req.best_of not in (None, 1)), ("suffix", req.suffix)):
            if bad:
                refuse(field, f"{field} is not supported", "unsupported_value")
        if req.max_tokens == 0 and not req.echo:
            refuse("max_tokens", "max_tokens: 0 only with echo (the prompt and its logprobs alone)", "invalid_value")
        if req.echo and req.logprobs is not None:
            _refuse_on_draft(state, "echo", "the prompt's logprobs")


def _too_long(param: str, n_prompt: int, max_tokens: int | None, context: int, at_least: bool = False) -> APIError:
    room = f" + max_tokens ({max_tokens})" if max_tokens is not None else ""
    size = f"at least {n_prompt} tokens" if at_least else f"{n_prompt} tokens"
    return APIError(400, f"{param}: the prompt ({size}){room} does not fit the context of {context} tokens",
                    param=param, code="context_length_exceeded")


def _check_length(n_chars: int, req, state: "ServerState", param: str, n_messages: int = 0) -> None:
    """Refuse, before tokenizing, a prompt too long to fit: n characters are at least
    n / max_token_chars tokens, and each chat message adds the template's tokens around it. This
    bounds what tokenizing costs."""
    least = -(-n_chars // state.lm.tokenizer.max_token_chars) + n_messages * state.message_tokens
    want = _requested_max_tokens(req)
    if least + (want or 1) > state.engine.max_seq_len:
        raise _too_long(param, least, want, state.engine.max_seq_len, at_least=True)


def check_fits(n_tokens: int, req, state: "ServerState", param: str) -> None:
    want = _requested_max_tokens(req)
    if n_tokens + (want or 1) > state.engine.max_seq_len:
        raise _too_long(param, n_tokens, want, state.engine.max_seq_len)


def check_message_count(n: int) -> None:
    if n > MAX_MESSAGES:
        raise APIError(400, f"messages: {n} messages; at most {MAX_MESSAGES} in one request", param="messages",
                       code="invalid_value")


def encode_text(text: str, req, state: "ServerState", param: str, add_special: bool = True) -> list[int]:
    """A text's token ids, refused (400) when they cannot fit the context with max_tokens; the time is
    bounded: the character pre-check first, then, for a long text, a prefix of it decides."""
    _check_length(len(text), req, state, param)
    encode = state.lm.tokenizer.encode
    room = state.engine.max_seq_len - (_requested_max_tokens(req) or 1)
    window = (room + 1) * PREFIX_CHARS_PER_TOKEN
    if len(text) > window:
        head = len(encode(text[:window], add_special_tokens=add_special)) - CUT_TOKENS
        if head > room:
            raise _too_long(param, head, _requested_max_tokens(req), state.engine.max_seq_len, at_least=True)
    ids = encode(text, add_special_tokens=add_special)
    check_fits(len(ids), req, state, param)
    return ids


def _logprobs_wanted(req) -> int | None:
    """Alternatives per token the request wants with its logprobs (None: no logprobs)."""
    if hasattr(req, "messages"):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


class ToolPlan:
    """How one chat request uses tools: the format its template speaks, the tools shown to the model, whether
    the output is parsed for calls, and the grammar that forces a call (tool_choice required or named); and
    whether its output is split into reasoning and content (``think``, set once the prompt is known: see
    plan_reasoning)."""

    def __init__(self, fmt, tools: list[dict] | None, parse: bool, force=None, keep_special: bool = False,
                 param: str = "tool_choice"):
        self.fmt, self.tools, self.parse, self.force, self.keep_special = fmt, tools, parse, force, keep_special
        self.param = param  # the field the grammar comes from: tool_choice (a forced call), tools (strict, auto)
        self.think: bool | None = None  # None: no reasoning split; True: the prompt opened the block


def plan_reasoning(plan: ToolPlan, state: "ServerState", prompt_ids: list[int], sp) -> None:
    """Turn the reasoning split on for a chat request whose model has one; ``think`` says whether the rendered
    prompt already opened the block. Under a grammar the output is what it shapes from its first token, and a
    block counts only where the output itself opens it (the tools' grammars allow one before the calls)."""
    from .reasoning import opened_by

    if state.reasoning:
        tail = state.lm.tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False)
        plan.think = sp.constraint is None and opened_by(tail)


def _tool_plan(req, state: "ServerState") -> ToolPlan:
    from ..grammar import GrammarError
    from .reasoning import CLOSE, OPEN
    from .tools import auto_grammar, call_grammar, check_tools

    fmt = state.tool_format
    tok = state.lm.tokenizer
    specials = {t.content for t in tok.tk.get_added_tokens_decoder().values() if t.special}
    think_special = state.reasoning and bool({OPEN, CLOSE} & specials)  # the split needs the markers' text
    if not req.tools or req.tool_choice == "none":  # "none": the tools are not shown, the output is text
        return ToolPlan(fmt, None, False, keep_special=think_special)
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    force, param = None, "tool_choice"
    try:
        check_tools(tools)
        choice = req.tool_choice
        if choice == "required" or not isinstance(choice, (str, type(None))):
            chosen = tools
            if choice != "required":
                chosen = [t for t in tools if t["function"]["name"] == choice.function.name]
                if not chosen:
                    raise GrammarError(f"tool_choice: no tool is named {choice.function.name[:80]!r}",
                                       "tool_choice.function.name")
            # a named function is called once; "required" allows several when parallel_tool_calls permits
            parallel = choice == "required" and req.parallel_tool_calls is not False
            _refuse_on_draft(state, "tool_choice", "forcing a tool call")
            force = call_grammar(state.grammars, fmt, chosen, parallel, think=state.reasoning)
        elif any(t["function"].get("strict") for t in tools):  # auto, strict: text, or calls valid for their schemas
            _refuse_on_draft(state, "tools", "strict function schemas")
            force = auto_grammar(state.grammars, fmt, tools, req.parallel_tool_calls is not False, think=state.reasoning)
            param = "tools"
        else:  # auto: the schemas must still be ones the engine could force
            for i, t in enumerate(tools):
                if "parameters" in t["function"]:
                    state.grammars.json_schema(t["function"]["parameters"], f"tools.{i}.function.parameters")
    except GrammarError as e:
        raise APIError(400, str(e), param=e.param or "tools", code="invalid_value") from None
    keep = think_special or bool({fmt.begin, fmt.end} & specials)
    return ToolPlan(fmt, tools, True, force, keep_special=keep, param=param)


def _refuse_on_draft(state: "ServerState", param: str, what: str) -> None:
    """A 400 naming ``param`` when the engine cannot apply a grammar (speculative decoding: no token mask)."""
    from ..engine import SamplingParams

    if state.engine.unsupported(SamplingParams(constraint=object())):
        raise APIError(400, f"{param}: {what} needs grammar-constrained decoding, which speculative decoding "
                            "(this server runs --draft) does not apply", param=param, code="unsupported_parameter")


def _constraint(req, state: "ServerState", plan: ToolPlan | None):
    """The grammar constraint a request asks for (at most one source), compiled; None without one."""
    from ..grammar import GrammarError

    g = state.grammars
    asked = []  # (param, build)
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type == "json_object":
        asked.append(("response_format", lambda: g.json_object("response_format")))
    elif rf is not None and rf.type == "json_schema":
        asked.append(("response_format", lambda: g.json_schema(rf.json_schema.schema_,
                                                               "response_format.json_schema.schema")))
    so = req.structured_outputs
    if so is not None:
        given = [(n, v) for n, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                     ("grammar", so.grammar)) if v is not None]
        if len(given) != 1:
            raise APIError(400, "structured_outputs: give exactly one of json, regex, choice, grammar",
                           param="structured_outputs", code="invalid_value")
        (name, v), = given
        where = f"structured_outputs.{name}"
        compile_ = {"json": g.json_schema, "regex": g.regex, "choice": g.choice, "grammar": g.lark}[name]
        asked.append(("structured_outputs", lambda: compile_(v, where)))
    if req.grammar is not None:
        asked.append(("grammar", lambda: g.gbnf(req.grammar, "grammar")))
    if plan is not None and plan.force is not None:
        asked.append((plan.param, lambda: plan.force))
    if not asked:
        return None
    if len(asked) > 1:
        raise APIError(400, f"{asked[1][0]}: only one output constraint per request ({asked[0][0]} is given too)",
                       param=asked[1][0], code="invalid_value")
    param, build = asked[0]
    if req.ignore_eos:
        raise APIError(400, f"ignore_eos cannot be combined with {param} (the grammar ends the output)",
                       param="ignore_eos", code="invalid_value")
    _refuse_on_draft(state, param, "this output constraint")
    try:
        constraint = build()
    except GrammarError as e:
        raise APIError(400, str(e), param=e.param or param, code="invalid_value") from None
    _probe(constraint, param)
    return constraint


def _probe(constraint, param: str) -> None:
    """Run the grammar's first steps now: a grammar that compiles can still fail when its parser meets the
    first tokens (llguidance's row limit: a schema of 1000 optional properties fails at its opening brace),
    and that is a 400 naming the field before any work, not an error mid-answer. At each of PROBE_STEPS
    steps the first PROBE_BRANCH allowed tokens are each tried, and the walk goes on with the first."""
    import torch

    from ..grammar import mask_words

    m = constraint.matcher()
    words = mask_words(constraint.grammars.vocab)
    bits = torch.arange(32, dtype=torch.int32)
    try:
        for _ in range(PROBE_STEPS):
            mask = m.fill(torch.zeros(words, dtype=torch.int32))
            allowed = ((mask.view(-1, 1) >> bits) & 1).flatten().nonzero().flatten().tolist()
            allowed = [t for t in allowed if t != constraint.grammars.eos][:PROBE_BRANCH]
            if m.done or not allowed:
                return
            for t in allowed[1:]:
                branch = m.m.deep_copy()
                if not branch.consume_token(t) or branch.is_error():
                    raise RuntimeError(f"grammar: token {t} was not allowed ({branch.get_error()})")
            m.consume(allowed[0])
    except RuntimeError as e:
        param = constraint.param or param
        raise APIError(400, f"{param}: the engine cannot run this {constraint.kind} ({first_line(e)})",
                       param=param, code="invalid_value") from None


def first_line(e: Exception, limit: int = 300) -> str:
    """An engine message's first line, at most ``limit`` characters (llguidance appends its whole grammar)."""
    line = str(e).split("\n", 1)[0]
    return line if len(line) <= limit else line[:limit] + "..."


def sampling(req, state: "ServerState", n_prompt: int, prompt_param: str, plan: ToolPlan | None = None):
    """SamplingParams for a validated request, with the context checked (400 before any work)."""
    from ..engine import ContextError, SamplingParams

    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_CHARS for s in stop):
        raise APIError(400, f"stop: at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} "
                            "characters", param="stop", code="invalid_value")
    max_tokens = _requested_max_tokens(req)
    engine = state.engine
    try:
        if max_tokens is None:  # the server's default, or what the context leaves when that is less
            engine.check_fits(n_prompt, 1)
            max_tokens = min(state.default_max_tokens, engine.max_seq_len - n_prompt)
        else:
            engine.check_fits(n_prompt, max_tokens)
    except ContextError:
        if n_prompt == 0:
            raise APIError(400, f"{prompt_param}: the prompt is empty", param=prompt_param,
                           code="invalid_value") from None
        raise _too_long(prompt_param, n_prompt, _requested_max_tokens(req), engine.max_seq_len) from None
    bias = {}
    vocab = state.lm.cfg.vocab_size
    for key, b in (req.logit_bias or {}).items():
        try:
            t = int(key)
        except ValueError:
            t = -1
        if not 0 <= t < vocab:
            raise APIError(400, f"logit_bias: {key!r} is not a token id of this model (0..{vocab - 1})",
                           param="logit_bias", code="invalid_value")
        bias[t] = b
    sp = SamplingParams(max_new_tokens=max_tokens,
                        temperature=1.0 if req.temperature is None else req.temperature,
                        top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
                        seed=req.seed, stop=stop, ignore_eos=req.ignore_eos, min_p=req.min_p or 0.0,
                        presence_penalty=req.presence_penalty or 0.0,
                        frequency_penalty=req.frequency_penalty or 0.0,
                        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                        logit_bias=bias, logprobs=_logprobs_wanted(req), constraint=_constraint(req, state, plan),
                        skip_special=_skip_special(req, plan))
    try:
        sp.validate()
    except ValueError as e:
        field = str(e).split(" ")[0].rstrip(":")
        raise APIError(400, str(e), param=field if field in type(req).model_fields else None,
                       code="invalid_value") from None
    if getattr(req, "min_tokens", None) and sp.constraint is not None:
        raise APIError(400, "min_tokens: not with an output constraint (its grammar decides where the output ends)",
                       param="min_tokens", code="invalid_value")
    bad = engine.unsupported(sp)
    if bad:
        raise APIError(400, f"{bad[0]} is not supported with speculative decoding (this server runs --draft)",
                       param=bad[0], code="unsupported_parameter")
    return sp


def _skip_special(req, plan: ToolPlan | None) -> bool:
    """Whether special tokens' text is left out of the output: yes by default, no where the tool-call markers
    are special tokens (the parser needs them)."""
    keep = plan is not None and plan.keep_special
    if req.skip_special_tokens and keep:
        raise APIError(400, "skip_special_tokens: true would remove this model's tool-call or reasoning markers "
                            "(special tokens) that the output is parsed by", param="skip_special_tokens",
                       code="invalid_value")
    return not keep if req.skip_special_tokens is None else req.skip_special_tokens


def options(req, sp) -> "Options":
    """The queue's Options of a validated request: what it asks beyond SamplingParams."""
    from .queue import Options

    return Options(n=req.n or 1, min_tokens=req.min_tokens or 0, stop_ids=frozenset(req.stop_token_ids or ()),
                   include_stop=req.include_stop_str_in_output,
                   prompt_logprobs=sp.logprobs if getattr(req, "echo", None) else None)


def chat_messages(req, state: "ServerState") -> list[dict]:
    """The messages as the chat template takes them, roles checked, their length against the context."""
    check_message_count(len(req.messages))
    messages = []
    open_calls: set[str] = set()  # the ids of the last assistant message's calls not answered yet
    for i, m in enumerate(req.messages):
        role = ROLES.get(m.role)
        if role is None:
            raise APIError(400, f"messages.{i}.role: {m.role[:40]!r} is not a role; use one of "
                                f"{', '.join(ROLES)}", param=f"messages.{i}.role", code="invalid_value")
        c = m.content
        if isinstance(c, list):
            c = "".join(p.text for p in c)
        msg = {"role": role, "content": c or ""}
        if m.name is not None:
            msg["name"] = m.name
        if role == "tool":  # as OpenAI: the answer to a call of the assistant message before it
            if m.tool_call_id not in open_calls:
                why = ("needs tool_call_id" if m.tool_call_id is None else
                       f"tool_call_id {m.tool_call_id[:64]!r} answers no call of the assistant message before it")
                raise APIError(400, f"messages.{i}: a tool message {why} (a tool message answers one of the "
                                    "preceding assistant message's tool_calls)",
                               param=f"messages.{i}.tool_call_id", code="invalid_value")
            open_calls.discard(m.tool_call_id)
        elif open_calls:
            _unanswered(open_calls, i)
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            if role != "assistant":
                raise APIError(400, f"messages.{i}.reasoning_content: only assistant messages have reasoning",
                               param=f"messages.{i}.reasoning_content", code="invalid_value")
            msg["reasoning_content"] = m.reasoning_content
        if m.tool_calls:
            if role != "assistant":
                raise APIError(400, f"messages.{i}.tool_calls: only assistant messages have tool calls",
                               param=f"messages.{i}.tool_calls", code="invalid_value")
            for j, tc in enumerate(m.tool_calls):
                try:
                    json.loads(tc.function.arguments)
                except ValueError:
                    raise APIError(400, f"messages.{i}.tool_calls.{j}.function.arguments: not valid JSON",
                                   param=f"messages.{i}.tool_calls.{j}.function.arguments",
                                   code="invalid_value") from None
            msg["tool_calls"] = [tc.model_dump() for tc in m.tool_calls]
            open_calls = {tc.id for tc in m.tool_calls}
        messages.append(msg)
    if open_calls and messages[-1]["role"] == "tool":  # some calls of the last assistant message unanswered
        _unanswered(open_calls, len(messages))
    extra = sum(len(json.dumps(t.model_dump(exclude_none=True))) for t in (getattr(req, "tools", None) or []))
    extra += sum(len(json.dumps(m["tool_calls"])) for m in messages if "tool_calls" in m)
    extra += sum(len(m.get("reasoning_content", "")) for m in messages)
    _check_length(sum(len(m["content"]) for m in messages) + extra, req, state, "messages", len(messages))
    return messages


def _unanswered(ids: set[str], i: int) -> None:
    raise APIError(400, f"messages.{i}: an assistant message with tool_calls must be followed by a tool message "
                        f"for each call; no answer to {', '.join(sorted(ids))[:200]}", param=f"messages.{i}",
                   code="invalid_value")


RESERVED_TEMPLATE_NAMES = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}


def encode_chat(messages: list[dict], state: "ServerState", add_generation_prompt: bool = True,
                 plan: ToolPlan | None = None, template_kwargs: dict | None = None) -> list[int]:
    from .tools import render

    clash = sorted(RESERVED_TEMPLATE_NAMES & set(template_kwargs or ()))
    if clash:
        raise APIError(400, f"chat_template_kwargs: {', '.join(clash)} are set by the request itself",
                       param="chat_template_kwargs", code="invalid_value")
    fmt = plan.fmt if plan is not None else state.tool_format
    messages, tools = render(messages, plan.tools if plan is not None else None, fmt)
    try:
        return state.lm.tokenizer.encode_chat(messages, add_generation_prompt, tools, template_kwargs)
    except ValueError as e:  # no chat template, or the template rejects the conversation
        raise APIError(400, str(e), param="messages", code="invalid_value") from None
    except Exception as e:  # a template error (jinja) on unusual input
        raise APIError(400, f"the chat template failed on these messages ({type(e).__name__}: {e})",
                       param="messages", code="invalid_value") from None


def completion_input(req, state: "ServerState") -> str | list[int]:
    """The prompt: a string (for encode_text) or checked token ids."""
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise APIError(400, f"prompt: {len(p)} prompts given; flint serves one per request",
                           param="prompt", code="unsupported_value")
        p = p[0]
    if isinstance(p, str):
        return p
    want = _requested_max_tokens(req)
    if len(p) + (want or 1) > state.engine.max_seq_len:  # before looking at each id
        raise _too_long("prompt", len(p), want, state.engine.max_seq_len)
    vocab = state.lm.cfg.vocab_size
    for t in p:
        if not 0 <= t < vocab:
            raise APIError(400, f"prompt: token id {t} is outside the vocabulary (size {vocab})",
                           param="prompt", code="invalid_value")
    return list(p)
