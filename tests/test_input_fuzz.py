"""Input fuzzing beyond the weight files (tests/test_loader_fuzz.py has the GGUF and safetensors
readers): the side files of an HF directory, the int4 formats, and the command line.

* HF side files (config.json, generation_config.json, tokenizer_config.json, the shard index):
  targeted mutants, each a field of the wrong JSON type, NaN / Infinity / an overflowing number, a
  repeated key, deep nesting, a non-UTF-8 byte, an implausible hyperparameter, a template jinja
  cannot compile, a shard outside the directory; random mutants (any value at any key, any byte).
* int4: a flint-int4 checkpoint (written by flint quantize), a GPTQ and an AWQ directory: a NaN or
  infinite scale or min, a scale dtype swapped, a group size of the wrong type or value.
* CLI: every leaf command with random values for random options (numbers out of range, NaN,
  empty, huge, non-numeric) with the commands themselves stubbed: argparse's exit 2 or the
  command's return, never another exception.

A targeted mutant must be a LoadError naming the file and the field or tensor; a random one a
LoadError naming the file or a model equal to the original; hangs and escapes are failures (the
loads run in the worker of tests/test_loader_fuzz.py). CI runs 549 cases (177 side-file mutants,
72 int4, 300 command lines; about a minute on the shared 2-core box); ``pytest -m slow
tests/test_input_fuzz.py`` adds 4,284 side-file mutants (2 min).
"""
from __future__ import annotations

import json
import math
import random
import struct
from pathlib import Path

import pytest

from flint.config import HF_FIELD_KINDS
from test_loader_fuzz import Mutant, check, run_safetensors, write_small_safetensors

# values of the wrong JSON type for each kind of field (flint.checks.KINDS); none may load
WRONG = {
    "posint": ["12", 12.0, True, -1, 0, [12], {}],
    "uint": ["1", 1.5, True, -1, [0]],
    "number": [True, False, "1e-5", [1e-5], {}],
    "bool": ["false", "true", 0, 1, [], {}],
    "ids": ["12", True, 1.5, [1, "2"], [True], {"a": 1}, -3],
    "str": [1, [], {}, True],
    "strs": ["x", [1], {}, [None]],
    "object": [[], "x", 1, True],
}
IMPLAUSIBLE = {"rms_norm_eps": [3e38, 1e300, 0.5, 1e-30], "rope_theta": [1e-300, 0.5, 1e13, 1e300]}


def _json_edit(name: str, change):
    """An edit(dir) applying change(parsed JSON of ``name``) -> new value, written back."""
    def edit(d: Path):
        p = d / name
        p.write_text(json.dumps(change(json.loads(p.read_text()) if p.exists() else {})))
    return edit


def _text_edit(name: str, text: str):
    def edit(d: Path):
        (d / name).write_text(text)
    return edit


def _set(key, value):
    def change(v):
        v[key] = value
        return v
    return change


def side_file_mutants(rng: random.Random, n_random: int) -> list[Mutant]:
    out = []
    for key, kind in HF_FIELD_KINDS.items():
        out.append(Mutant("config field of a wrong JSON type", [], ["config.json", key],
                          edit=_json_edit("config.json", _set(key, rng.choice(WRONG[kind])))))
    for key, values in IMPLAUSIBLE.items():
        out.append(Mutant("implausible hyperparameter", [], ["config.json", key, "plausible range"],
                          edit=_json_edit("config.json", _set(key, rng.choice(values)))))
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        field = {"config.json": "initializer_range", "generation_config.json": "temperature",
                 "tokenizer_config.json": "model_max_length"}[name]
        const = rng.choice(["NaN", "Infinity", "-Infinity", "1e400", "-2e308"])
        out.append(Mutant("NaN / Infinity / overflow", [], [name, field], edit=lambda d, n=name, f=field, c=const: (
            d / n).write_text((d / n).read_text()[:-1].rstrip() + f', "{f}": {c}}}' if (d / n).exists()
                              else f'{{"{f}": {c}}}')))
        depth = rng.choice([65, 1000, 100_000])
        out.append(Mutant("deep nesting", [], [name, "nested deeper"],
                          edit=_text_edit(name, '{"x": ' + "[" * depth + "]" * depth + "}")))
        out.append(Mutant("repeated key", [], [name, "appears twice"],
                          edit=_text_edit(name, '{"bos_token_id": 1, "bos_token_id": 2}')))
        out.append(Mutant("non-UTF-8 byte", [], [name, "UTF-8"],
                          edit=lambda d, n=name, b=rng.choice([b"\xff", b"\xc3(", b"\xed\xa0\x80"]): (d / n).write_bytes(
                              b'{"bos_token": "' + b + b'"}')))
        out.append(Mutant("side file not an object", [], [name], edit=_text_edit(name, rng.choice(["[]", "1", '"x"', "null"]))))
    for key, kind in (("eos_token_id", "ids"), ("bos_token_id", "uint")):
        out.append(Mutant("generation_config field of a wrong type", [], ["generation_config.json", key],
                          edit=_json_edit("generation_config.json", _set(key, rng.choice(WRONG[kind])))))
    for key, values in (("chat_template", [7, [1, 2], [{"name": "default"}], {"a": 1}, True]),
                        ("bos_token", [5, [], {"content": 5}, {"content": None}]),
                        ("eos_token", [5, {"content": []}]), ("add_bos_token", ["yes", 1, "false"])):
        out.append(Mutant("tokenizer_config field of a wrong type", [], ["tokenizer_config.json", key],
                          edit=_json_edit("tokenizer_config.json", _set(key, rng.choice(values)))))
    bad_templates = ["{% for m in messages %}", "{{ 1 +* 2 }}", "{% if %}", "{% endfor %}", "{{ x | nosuchfilter }}",
                     "{% generation %}no end", "{% set x = %}"]
    out.append(Mutant("chat template jinja cannot compile", [], ["tokenizer_config.json", "chat_template"],
                      edit=_json_edit("tokenizer_config.json", _set("chat_template", rng.choice(bad_templates)))))

    def index(entry):
        def edit(d: Path):
            from safetensors import safe_open

            with safe_open(str(d / "model.safetensors"), "pt") as f:
                wm = {k: "model.safetensors" for k in f.keys()}
            wm[rng.choice(sorted(wm))] = entry
            (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
        return edit
    out.append(Mutant("shard outside the directory or not a name", [], ["model.safetensors.index.json", "weight_map"],
                      edit=index(rng.choice([None, ["model.safetensors"], 3, "../x.safetensors", "/etc/hostname",
                                             "sub/model.safetensors", "..", "", {}]))))
    # random: any value at any key of any side file, or any byte of one; a LoadError or the same model
    names = ("config.json", "generation_config.json", "tokenizer_config.json")
    pool = [None, "x", "", [], {}, [1], -1, 0, 1, 1.5, True, False, 2**70, 1e300, "{{", {"content": "x"}]
    keys = sorted(HF_FIELD_KINDS) + ["eos_token", "bos_token", "chat_template", "add_bos_token", "temperature"]
    for _ in range(n_random):
        name = rng.choice(names)
        if rng.random() < 0.6:
            out.append(Mutant("random side-file value", [], [name], targeted=False,
                              edit=_json_edit(name, _set(rng.choice(keys), rng.choice(pool)))))
        else:
            def flip(d: Path, name=name, r=rng.random(), v=rng.randrange(1, 256)):
                p = d / name
                b = bytearray(p.read_bytes() if p.exists() else b"{}")
                i = int(r * len(b))
                b[i] ^= v
                p.write_bytes(bytes(b))
            out.append(Mutant("random side-file byte", [], [name], targeted=False, edit=flip))
    return out


def _tensor_spans(f: Path) -> dict:
    """name -> (dtype, absolute byte offset of its data, nbytes) in safetensors file f."""
    raw = f.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    hdr = json.loads(raw[8:8 + n])
    return {k: (v["dtype"], 8 + n + v["data_offsets"][0], v["data_offsets"][1] - v["data_offsets"][0])
            for k, v in hdr.items() if k != "__metadata__"}


def _poke(name: str, at: int, value: bytes):
    def edit(d: Path):
        with open(d / name, "r+b") as fh:
            fh.seek(at)
            fh.write(value)
    return edit


def int4_mutants(d: Path, rng: random.Random, rounds: int) -> list[Mutant]:
    """flint-int4 or GPTQ directory ``d``: non-finite scales and mins, a scale dtype swap, the
    quantization_config's group size of a wrong type or value."""
    f = d / "model.safetensors"
    spans = _tensor_spans(f)
    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    out = []
    scales = [k for k, (dt, _, _) in spans.items() if dt == "F16" and k.endswith((".scales", ".mins"))]
    for _ in range(rounds):
        k = rng.choice(scales)
        _, at, nb = spans[k]
        pos = at + 2 * rng.randrange(nb // 2)
        value = struct.pack("<e", rng.choice([math.nan, math.inf, -math.inf]))
        out.append(Mutant("non-finite int4 scale or min", [], [k.rsplit(".", 1)[0].split("model.")[-1]],
                          edit=_poke("model.safetensors", pos, value)))

        def swap(dst: Path, k=k):
            raw = (dst / "model.safetensors").read_bytes()
            n = struct.unpack("<Q", raw[:8])[0]
            hdr = json.loads(raw[8:8 + n])
            hdr[k]["dtype"] = "BF16"
            body = json.dumps(hdr).encode()
            (dst / "model.safetensors").write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n:])
        out.append(Mutant("int4 scale dtype swapped", [], [k.rsplit(".", 1)[0].split("model.")[-1]], edit=swap))
        g = rng.choice(["32", 32.0, True, 0, -32, 33, 2**40, [32]])
        out.append(Mutant("int4 group size wrong", [], [("group_size", "group size")],
                          edit=_json_edit("config.json", lambda c, g=g: {**c, "quantization_config": {
                              **qc, "group_size": g}})))
    return out


# ------------------------------------------------------------------ the tests

@pytest.fixture(scope="module")
def side_target(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("fuzz-side") / "ckpt"
    write_small_safetensors(d, tokenizer=True)
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return d


@pytest.fixture(scope="module")
def flint_int4_target(tmp_path_factory) -> Path:
    """flint quantize of a small random model (every K a multiple of the group size 32)."""
    from flint.quant.quantize import quantize_checkpoint
    from test_quantize_safety import TINY

    d = tmp_path_factory.mktemp("fuzz-int4")
    (d / "tiny.json").write_text(json.dumps(TINY))
    return quantize_checkpoint(f"synthetic:{d / 'tiny.json'}", d / "q", 32, log=lambda *a, **k: None)


def _hfquant_target(tmp_path_factory, method: str) -> Path:
    from test_hfquant import quantized_dir

    return quantized_dir(tmp_path_factory.mktemp(f"fuzz-{method}"), "llama", method, 32, False, seed=3,
                         num_hidden_layers=1)[0]


@pytest.fixture(scope="module")
def gptq_target(tmp_path_factory) -> Path:
    return _hfquant_target(tmp_path_factory, "gptq")


@pytest.fixture(scope="module")
def awq_target(tmp_path_factory) -> Path:
    return _hfquant_target(tmp_path_factory, "awq")


def test_side_file_fuzz(side_target, tmp_path):
    check(run_safetensors(side_target, side_file_mutants(random.Random(0), n_random=120), tmp_path))


@pytest.mark.parametrize("target", ["flint_int4_target", "gptq_target", "awq_target"])
def test_int4_fuzz(target, tmp_path, request):
    src = request.getfixturevalue(target)
    check(run_safetensors(src, int4_mutants(src, random.Random(0), rounds=8), tmp_path))


@pytest.mark.slow
@pytest.mark.usefixtures("slow_run")
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_side_file_fuzz_many(side_target, tmp_path, seed):
    rng = random.Random(seed)
    mutants = [m for _ in range(4) for m in side_file_mutants(rng, n_random=300)]
    check(run_safetensors(side_target, mutants, tmp_path))


# ------------------------------------------------------------------ the command line

NASTY = ["0", "-1", "1", "-0", "1e9", "99999999999999999999", "nan", "inf", "-inf", "", "x", "1.5", "0x10",
         "\u0661", " 3", "1_000", "--", "-5e-324"]


def cli_cases(rng: random.Random, n: int) -> list[list[str]]:
    from flint.cli import build_parser
    from flint.options import leaf_parsers

    leaves = []
    for p in leaf_parsers(build_parser()):
        opts = [a for a in p._actions if a.option_strings and a.nargs != 0 and a.dest not in ("help", "version")]
        words = p.prog.split()[1:]
        leaves.append((words, opts, [a for a in p._actions if not a.option_strings and a.dest != "help"]))
    cases = []
    for _ in range(n):
        words, opts, positional = rng.choice(leaves)
        argv = list(words) + ["x"] * len(positional)
        for a in rng.sample(opts, min(len(opts), rng.randint(1, 3))):
            argv += [a.option_strings[-1], str(rng.choice(NASTY + list(a.choices or [])))]
        cases.append(argv)
    return cases


def run_cli(argv, monkeypatch) -> str:
    """'argparse' (exit 2), 'error' (a clear error, exit 2), 'ran' (the checks passed: the stubbed
    command ran); anything else raises."""
    import argparse

    import flint.cli
    import flint.options

    ran = []
    real = flint.cli.build_parser

    def stubbed():
        ap = real()
        for p in flint.options.leaf_parsers(ap):
            p.set_defaults(func=lambda args: ran.append(args) or 0)
        return ap
    monkeypatch.setattr(flint.cli, "build_parser", stubbed)
    try:
        rc = flint.cli.main(argv)
    except SystemExit as e:
        assert e.code == 2, (argv, e.code)
        return "argparse"
    except argparse.ArgumentError:
        return "argparse"
    assert rc in (0, 2), (argv, rc)
    return "ran" if ran else "error"


def test_cli_fuzz(monkeypatch, capsys):
    """Random options with bad values on every leaf command: argparse refuses them or the
    pre-load checks do (exit 2, no traceback); never another exception."""
    import collections

    import torch

    threads = torch.get_num_threads()
    seen = collections.Counter()
    try:
        for argv in cli_cases(random.Random(0), 300):
            seen[run_cli(argv, monkeypatch)] += 1
            err = capsys.readouterr().err
            assert "Traceback" not in err, (argv, err)
    finally:
        torch.set_num_threads(threads)
    print(dict(seen))
    assert seen["argparse"] > 100 and sum(seen.values()) == 300, seen
