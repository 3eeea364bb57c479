"""`flint bench` on a CPU with a tiny synthetic model: the JSON schema, bytes per token, MBU, the
table, the plot, and clear errors for bad arguments. Run: ``pytest tests/test_bench.py`` (~10 s).
"""
from __future__ import annotations

import json

import pytest

from flint.backend import BackendError
from flint.bench import BenchError, main, markdown_table, plot, run_bench

TINY = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
            tie_word_embeddings=True, max_position_embeddings=64)


@pytest.fixture(scope="module")
def tiny_spec(tmp_path_factory):
    p = tmp_path_factory.mktemp("bench") / "config.json"
    p.write_text(json.dumps(TINY))
    return f"synthetic:{p}"


def _quiet(*a, **k):
    pass


@pytest.fixture(scope="module")
def cpu_run(tiny_spec, tmp_path_factory):
    path = tmp_path_factory.mktemp("out") / "bench.json"
    doc = run_bench([tiny_spec], ["reference", "compiled", "compiled-bf16"], [8, 24], n_tokens=3, repeats=2,
                    prompt_len=5, device="cpu", group_size=32, json_path=str(path), bw_bytes=32 << 20, log=_quiet)
    return doc, json.loads(path.read_text())


def test_json_schema(cpu_run, tiny_spec):
    doc, on_disk = cpu_run
    assert on_disk == doc
    assert set(doc) == {"device", "hbm_read_GBps", "results", "ttft"}
    assert isinstance(doc["device"], str) and doc["device"].startswith("CPU")
    assert isinstance(doc["hbm_read_GBps"], float) and doc["hbm_read_GBps"] > 0
    assert len(doc["results"]) == 6
    types = {"model": str, "backend": str, "ctx": int, "loop": str, "tok_s": float, "ms_per_token": float,
             "bytes_per_token": int, "mbu": float}
    for r in doc["results"]:
        assert set(r) == set(types)
        # compiled* have greedy_run (argmax fed back on the device); the reference loops on the host
        assert r["loop"] == ("host" if r["backend"] == "reference" else "device"), r
        for k, t in types.items():
            assert isinstance(r[k], t), (k, r[k])
        assert r["model"] == tiny_spec and r["tok_s"] > 0
        assert r["ms_per_token"] == pytest.approx(1e3 / r["tok_s"], rel=1e-2)
        assert r["mbu"] == pytest.approx(r["bytes_per_token"] * r["tok_s"] / (doc["hbm_read_GBps"] * 1e9),
                                         rel=1e-2, abs=1e-4)
    assert [(r["backend"], r["ctx"]) for r in doc["results"]] == [
        (b, c) for b in ("reference", "compiled", "compiled-bf16") for c in (8, 24)]
    assert {r["backend"] for r in doc["ttft"]} == {"reference", "compiled", "compiled-bf16"}
    assert all(r["prompt_len"] == 5 and r["ttft_ms"] > 0 for r in doc["ttft"])


def test_bytes_per_token(cpu_run):
    """Weights as each backend holds them, plus K and V at ctx (counted here independently)."""
    doc, _ = cpu_run
    c = TINY
    h, i, v, L = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    linear = [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]  # fused q|k|v and gate|up
    n_weights = L * sum(n * k for n, k in linear) + v * h
    norms = (2 * L + 1) * h

    def kv_bytes(ctx, el):
        return 2 * L * kv * ctx * el

    by = {(r["backend"], r["ctx"]): r["bytes_per_token"] for r in doc["results"]}
    # reference on CPU: fp32 weights, the tied head read whole, one embedding row
    assert by["reference", 8] == 4 * (n_weights + norms + h) + kv_bytes(8, 4)
    # compiled-bf16: bf16
    assert by["compiled-bf16", 24] == 2 * (n_weights + norms + h) + kv_bytes(24, 2)
    # compiled on CPU: int4 codes (K/2 bytes a row) + fp32 scale and zero per group of 32, fp32 rest
    groups = n_weights // 32
    assert by["compiled", 8] == n_weights // 2 + 8 * groups + 4 * (norms + h) + kv_bytes(8, 4)
    assert by["compiled", 24] - by["compiled", 8] == kv_bytes(16, 4)


def test_table_and_plot(cpu_run, tmp_path):
    doc, _ = cpu_run
    table = markdown_table(doc)
    assert "| model | backend | ctx | loop | tok/s | ms/token | GB/token | MBU | chain µs/layer |" in table
    assert table.count("| compiled-bf16 |") == 2 + 1 + 2  # two decode rows, one TTFT row, two ratio rows
    assert "| model | ctx | backend | tok/s | × compiled |" in table  # every other backend against compiled
    assert table.count("× |") == 2 * 2  # reference and compiled-bf16, two contexts each
    png = tmp_path / "bench.png"
    plot(doc, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_host_loop_is_chosen_on_request(tiny_spec):
    doc = run_bench([tiny_spec], ["compiled"], [8], n_tokens=2, repeats=1, device="cpu", group_size=32,
                    bw_bytes=32 << 20, log=_quiet, loop="host")
    assert [r["loop"] for r in doc["results"]] == ["host"]
    with pytest.raises(BenchError, match="--loop must be 'device' or 'host', got 'gpu'"):
        run_bench([tiny_spec], ["compiled"], [8], device="cpu", log=_quiet, loop="gpu")


def test_bad_arguments_are_clear_errors(tiny_spec, capsys):
    with pytest.raises(BackendError, match="unknown backend 'turbo'"):
        run_bench([tiny_spec], ["reference", "turbo"], [8], device="cpu", log=_quiet)
    with pytest.raises(BenchError, match="needs 67 positions; model .* has a context of 64"):
        run_bench([tiny_spec], ["reference"], [60], n_tokens=7, device="cpu", log=_quiet)
    assert main(["--model", tiny_spec, "--backend", "reference", "--ctx", "100", "--device", "cpu"]) == 2
    assert "flint: error: --ctx 100 + --tokens 32" in capsys.readouterr().err
    assert main(["--model", tiny_spec, "--ctx", "8,x", "--device", "cpu"]) == 2
    assert "not a comma-separated list of integers" in capsys.readouterr().err
    # top-p / top-k sample the --draft bench only, at a temperature, in range; refused before any model is loaded
    assert main(["--model", tiny_spec, "--top-p", "0.9", "--device", "cpu"]) == 2
    assert "--top-p / --top-k shape the sampling of --draft PATH" in capsys.readouterr().err
    assert main(["--model", "no-such-model.gguf", "--draft", "smollm2-135m", "--top-k", "5", "--device", "cpu"]) == 2
    assert "they need --temperature > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:  # argparse's range check
        main(["--model", "no-such-model.gguf", "--draft", "smollm2-135m", "--temperature", "0.7", "--top-p", "1.5",
              "--device", "cpu"])
    assert info.value.code == 2
    assert "argument --top-p: must be a finite number in (0, 1], got 1.5" in capsys.readouterr().err
    # an option the chosen mode does not read is refused, naming it
    assert main(["--model", tiny_spec, "--oracle-accept", "2", "--device", "cpu"]) == 2
    assert "--oracle-accept does nothing here (it is read only with --draft oracle)" in capsys.readouterr().err
    assert main(["--model", "no-such-model.gguf", "--draft", "smollm2-135m", "--bw-gib", "1", "--device", "cpu"]) == 2
    assert "--bw-gib does nothing here" in capsys.readouterr().err
    for opt, bad in (("--ctx", "8,0"), ("--verify", "-1"), ("--draft-k", "0"), ("--oracle-accept", "nan")):
        draft = ["--draft", "oracle"] if opt in ("--draft-k", "--oracle-accept") else []
        assert main(["--model", "synthetic:smollm2-135m", *draft, opt, bad, "--device", "cpu"]) == 2
        assert f"flint: error: {opt}: " in capsys.readouterr().err
    for bad in ("-1", "100000", "nan"):
        with pytest.raises(SystemExit):
            main(["--model", tiny_spec, "--bw-gib", bad, "--device", "cpu"])
        assert "argument --bw-gib: must be a finite number in (0, 64]" in capsys.readouterr().err


def test_cli_writes_json_and_table(tiny_spec, tmp_path, capsys):
    out = tmp_path / "b.json"
    rc = main(["--model", tiny_spec, "--backend", "compiled", "--ctx", "4", "--tokens", "2", "--repeats", "1",
               "--device", "cpu", "--group-size", "32", "--bw-gib", "0.03", "--json", str(out)])
    assert rc == 0
    assert "| compiled | 4 |" in capsys.readouterr().out
    assert json.loads(out.read_text())["results"][0]["backend"] == "compiled"


def test_bench_draft_reports_acceptance_beside_plain():
    """`flint bench --draft`: speculative and plain decoding on the same held-out prompts, greedy
    outputs identical on the fp32 reference, the draft's tokens accepted; two rounds, each kept."""
    from flint.bench import draft_table, run_draft_bench

    doc = run_draft_bench(None, ["reference"], "smollm2-135m", 3, per_kind=1, max_new_tokens=8,
                          device="cpu", rounds=2, log=lambda *a, **k: None)
    assert doc["rounds"] == 2
    rows = {r["kind"]: r for r in doc["speculative"]}
    assert all(len(r["spec_tok_s_rounds"]) == len(r["x_plain_rounds"]) == 2 for r in rows.values())
    assert set(rows) >= {"code", "all"}
    allrow = rows["all"]
    # the shipped draft gets tokens accepted (a broken draft or verify gives 1.0; it measured 1.87 here)
    assert allrow["tokens_per_step"] > 1.2
    assert allrow["identical_to_plain"] == f"{allrow['prompts']}/{allrow['prompts']}"
    assert allrow["spec_tok_s"] > 0 and allrow["plain_tok_s"] > 0
    assert "tokens_per_step" in draft_table(doc)


def test_bench_draft_rounds_report_medians(capsys):
    """`flint bench --draft PATH --repeats N`: N rounds over the prompt set, tok/s the rounds' medians with every
    round's kept; acceptance from the first round; --draft oracle refuses rounds (it takes --draft-prompts)."""
    from flint.bench import _median_rounds

    t = [{"all": {"prompts": 2, "tokens_per_step": 1.8, "spec_tok_s": v, "plain_tok_s": w, "identical_to_plain": "2/2"}}
         for v, w in ((100.0, 90.0), (120.0, 80.0), (110.0, 100.0))]
    row = _median_rounds(t)["all"]
    assert (row["spec_tok_s"], row["plain_tok_s"], row["tokens_per_step"]) == (110.0, 90.0, 1.8)
    assert row["spec_tok_s_rounds"] == [100.0, 120.0, 110.0] and row["x_plain_rounds"] == [1.1111, 1.5, 1.1]
    assert main(["--model", "synthetic:smollm2-135m", "--draft", "oracle", "--repeats", "2", "--device", "cpu"]) == 2
    assert "--draft oracle runs one pass" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["--model", "no-such-model.gguf", "--draft", "smollm2-135m", "--repeats", "0", "--device", "cpu"])
    assert info.value.code == 2 and "argument --repeats: must be >= 1" in capsys.readouterr().err


def test_ratio_rows_take_the_median_of_interleaved_runs():
    from flint.bench import ratio_rows
    doc = {"results": [{"model": "m", "ctx": 512, "backend": b, "tok_s": v} for b, v in
                       [("compiled", 429.0), ("megakernel", 864.0), ("compiled", 446.0), ("megakernel", 832.0),
                        ("compiled", 446.0), ("megakernel", 864.0)]]
           + [{"model": "m", "ctx": 2048, "backend": "megakernel", "tok_s": 700.0}]}  # no baseline at 2048: no row
    (r,) = ratio_rows(doc)
    assert (r["model"], r["ctx"], r["backend"], r["tok_s"]) == ("m", 512, "megakernel", 864.0)
    assert abs(r["x_compiled"] - 864.0 / 446.0) < 1e-12


def test_verify_curve_rows_and_table(tiny_spec):
    from flint.bench import verify_table

    doc = run_bench([tiny_spec], ["reference"], [8, 16], n_tokens=2, repeats=1, device="cpu", log=_quiet,
                    verify=[4, 1, 2])
    rows = doc["verify"]
    assert [(r["ctx"], r["m"]) for r in rows] == [(8, 1), (8, 2), (8, 4), (16, 1), (16, 2), (16, 4)]
    assert all(r["us_per_step"] > 0 and r["backend"] == "reference" for r in rows)
    assert [r["x_m1"] for r in rows if r["m"] == 1] == [1.0, 1.0]
    t = verify_table(doc)
    assert "| M = 1 | M = 2 | M = 4 |" in t and t.count("\n| ") == 2  # two (model, backend, ctx) rows
    with pytest.raises(BenchError, match="--verify"):
        run_bench([tiny_spec], ["reference"], [8], device="cpu", log=_quiet, verify=[0])
    with pytest.raises(BenchError, match="positions"):  # ctx + the widest verify must fit the context
        run_bench([tiny_spec], ["reference"], [60], n_tokens=1, device="cpu", log=_quiet, verify=[8])
