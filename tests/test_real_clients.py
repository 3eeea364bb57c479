"""Real clients against `flint serve`: lm-evaluation-harness's ``local-completions`` model and the OpenAI
Agents SDK, run for real (tests/test_server_compat.py sends their request shapes by hand).

- lm-eval: ``lm_eval.simple_evaluate`` with ``local-completions`` pointed at /v1/completions, on two tiny
  tasks defined in local YAML and JSONL files (no dataset hub): a multiple_choice task (loglikelihood
  requests: token-id prompts, echo, logprobs 1) whose per-choice loglikelihoods are checked against the
  reference backend, and a generate_until task (string prompts, stop strings). The tokenizer is the
  checkpoint directory's own (``tokenizer_backend=huggingface``), so nothing is fetched.
- Agents SDK: an ``Agent`` with one function tool on ``OpenAIResponsesModel`` and on
  ``OpenAIChatCompletionsModel``, ``tool_choice="required"``, one ``Runner.run``: the tool is called with
  schema-valid arguments (flint's tool grammar holds the random model to the schema), its result goes back,
  and the run ends at max_turns without a protocol error. Tracing is off (no network here).

Both packages are in the test extras (pyproject.toml), so CI runs these; each test still skips where its package
is not importable.
The servers run the tiny random llama of tests/conftest.py (byte tokenizer); the agent turns on a copy
with a longer context (its tool prompt is some hundreds of byte tokens). Run:
``pytest tests/test_real_clients.py`` (about 20 s).
"""
import json
import math

import pytest

httpx = pytest.importorskip("httpx")
from test_server import Server  # noqa: E402  (pytest puts tests/ on sys.path)
from test_server_ops import ops, reference  # noqa: E402,F401  (fixtures)

MC_DOCS = [{"q": "Once upon a", "choices": [" time", " hill", " rock"], "label": 0},
           {"q": "The cat sat on the", "choices": [" mat", " dog"], "label": 0},
           {"q": "One, two,", "choices": [" three", " four", " ten"], "label": 0}]
GEN_DOCS = [{"q": "Say hi:", "a": "hi"}, {"q": "Count: 1 2", "a": "3"}]


def write_tasks(root) -> None:
    """Two lm-eval tasks over local JSONL files: flint_mc (multiple_choice) and flint_gen (generate_until)."""
    for name, docs in (("mc", MC_DOCS), ("gen", GEN_DOCS)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {root / '{}.jsonl'}\n"
              "test_split: test\n")
    (root / "flint_mc.yaml").write_text(
        "task: flint_mc\n" + common.format("mc") + "output_type: multiple_choice\n"
        "doc_to_text: '{{q}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: label\ntarget_delimiter: ''\n"
        "metric_list:\n  - metric: acc\n")
    (root / "flint_gen.yaml").write_text(
        "task: flint_gen\n" + common.format("gen") + "output_type: generate_until\n"
        "doc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 8\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")


@pytest.mark.parametrize("tokenizer", ["local", "remote"])
def test_lm_eval_local_completions(ops, tiny_llama, reference, tmp_path, tokenizer):  # noqa: F811  (fixtures)
    lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install lm-eval)")
    pytest.importorskip("tenacity", reason="lm-eval's API models need lm-eval[api] (tenacity)")
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    write_tasks(tmp_path)
    # local: the checkpoint directory's tokenizer; remote: lm_eval's default "auto" finds the server's
    # /tokenizer_info and /tokenize and tokenizes through them (no tokenizer files on the client)
    lm = get_model("local-completions")(
        model=ops.model, base_url=ops.url + "/v1/completions", max_length=96, num_concurrent=1, max_retries=1,
        **({"tokenizer": ops.model, "tokenizer_backend": "huggingface"} if tokenizer == "local"
           else {"tokenizer_backend": "auto"}))
    assert lm.tokenizer_backend == ("huggingface" if tokenizer == "local" else "remote")
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=["flint_mc", "flint_gen"], task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True, bootstrap_iters=0)
    res = out["results"]
    print("lm-eval results:", json.dumps({t: {k: v for k, v in r.items() if "," in k} for t, r in res.items()}))
    acc, em = res["flint_mc"]["acc,none"], res["flint_gen"]["exact_match,none"]
    assert 0.0 <= acc <= 1.0 and 0.0 <= em <= 1.0, res
    # each choice's loglikelihood is the sum of the reference backend's log-probs of its tokens
    tok = tiny_llama.tokenizer
    samples = out["samples"]["flint_mc"]
    assert len(samples) == len(MC_DOCS)
    for s in samples:
        ctx = tok.encode(s["doc"]["q"], add_special_tokens=False)
        for choice, resp in zip(s["doc"]["choices"], s["resps"]):
            ll, _greedy = resp[0]
            cont = tok.encode(choice, add_special_tokens=False)
            ids = ctx + cont
            want = sum(reference(ids[:i])[ids[i]].item() for i in range(len(ctx), len(ids)))
            assert math.isfinite(ll) and abs(ll - want) < 1e-3, (s["doc"], choice, ll, want)
    gens = out["samples"]["flint_gen"]
    assert len(gens) == len(GEN_DOCS) and all(isinstance(g["resps"][0][0], str) for g in gens)
    assert all("\n" not in g["resps"][0][0] for g in gens)


@pytest.fixture(scope="module")
def long_srv(tmp_path_factory):
    """`flint serve` on the tiny random llama with a 2048-token context: the Agents SDK's tool prompt fits."""
    pytest.importorskip("agents", reason="the OpenAI Agents SDK is not installed (pip install openai-agents)")
    from conftest import make_hf_model, prefer_printable_ascii, save_hf_dir

    model = make_hf_model("llama", seed=1, rope_theta=5000.0, max_position_embeddings=2048)
    prefer_printable_ascii(model)
    path = save_hf_dir(model, tmp_path_factory.mktemp("tiny-llama-2k"))
    s = Server("agents", ["--model", str(path), "--max-seq-len", "2048"], tmp_path_factory.mktemp("agents"))
    try:
        s.wait_ready({})
        s.model = str(path)
        yield s
    finally:
        s.stop()


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_agents_sdk_one_tool_turn(long_srv, api):
    agents = pytest.importorskip("agents", reason="the OpenAI Agents SDK is not installed (pip install openai-agents)")
    import asyncio
    from typing import Literal

    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Cold in {city}"

    client = AsyncOpenAI(base_url=long_srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
    model = (agents.OpenAIResponsesModel if api == "responses" else agents.OpenAIChatCompletionsModel)(
        model=long_srv.model, openai_client=client)
    settings = agents.ModelSettings(tool_choice="required", max_tokens=200, temperature=0)

    async def run(stream=False, **kw):
        agent = agents.Agent(name="weather", instructions="Answer with the weather tool.", tools=[weather],
                             model=model, model_settings=settings, **kw)
        if not stream:
            return await agents.Runner.run(agent, "Weather in Oslo?", max_turns=2)
        streamed = agents.Runner.run_streamed(agent, "Weather in Oslo?", max_turns=2)
        events = [e.type async for e in streamed.stream_events()]
        assert "raw_response_event" in events and "run_item_stream_event" in events, events
        return streamed

    async def both():
        # the call, its output back to the model in the next request, and a second forced call: max_turns
        # ends it (with the choice left "auto" the random model's text would run to max_tokens, which the
        # SDK treats as a failed response: status "incomplete")
        with pytest.raises(agents.MaxTurnsExceeded):
            await run(reset_tool_choice=False)
        assert len(calls) == 2 and set(calls) <= {"Paris", "Oslo"}  # the tool ran twice, arguments valid
        # runs that complete on the tool's output, then streamed (SSE)
        return [await run(stream=stream, tool_use_behavior="stop_on_first_tool") for stream in (False, True)]

    for i, result in enumerate(asyncio.run(both())):
        assert [item.type for item in result.new_items] == ["tool_call_item", "tool_call_output_item"]
        assert result.final_output == f"Cold in {calls[2 + i]}"
    assert len(calls) == 4
