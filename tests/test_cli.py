"""The `flint` command's handling of its input: bad values refused before a model loads, non-UTF-8
bytes in argv, prompt files and chat lines, --prompt-file / stdin, /help, --threads, help text with
defaults and --version. In-process through flint.cli.main (one subprocess for real argv bytes).

Run: ``pytest tests/test_cli.py`` (~10 s).
"""
from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flint import __version__
from flint.cli import build_parser, main
from flint.options import leaf_parsers

REPO_ROOT = Path(__file__).resolve().parents[1]
BAD = b"ab\xffcd".decode("utf-8", "surrogateescape")  # how Linux hands the bytes ab\xffcd to argv


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """main() sets torch's thread count for the process; give the other tests theirs back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def gen_args(model_dir, *extra: str) -> list[str]:
    return ["generate", "--model", str(model_dir), "--backend", "reference", "--device", "cpu",
            "--max-new-tokens", "4", *extra]


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if `flint generate` tries to load a model."""
    import flint.loading

    build_parser()  # import the subcommand modules first: they must keep the real load_model

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the arguments were checked")
    monkeypatch.setattr(flint.loading, "load_model", refuse)


@pytest.mark.parametrize("argv, needle", [
    (["--temperature", "-1"], "argument --temperature: must be a finite number >= 0, got -1"),
    (["--temperature", "nan"], "argument --temperature: must be a finite number"),
    (["--top-p", "0"], "argument --top-p: must be a finite number in (0, 1], got 0"),
    (["--top-p", "1.5"], "argument --top-p"),
    (["--top-k", "-2"], "argument --top-k: must be >= 0, got -2"),
    (["--max-new-tokens", "-1"], "argument --max-new-tokens: must be >= 0"),
    (["--max-seq-len", "0"], "argument --max-seq-len: must be >= 1, got 0"),
    (["--draft", "ngram", "--draft-k", "0"], "argument --draft-k: must be >= 1"),
    (["--draft", "smollm2-135m", "--draft-vocab", "-1"], "argument --draft-vocab: must be >= 0"),
    (["--stop", ""], "argument --stop: must not be empty"),
    (["--threads", "0"], "argument --threads: must be in [1, "),
    (["--threads", "100000"], "argument --threads: must be in [1, "),
    (["--draft", "none", "--draft-k", "3"], "--draft-k does nothing here"),
    (["--draft", "none", "--draft-vocab", "10"], "--draft-vocab does nothing here"),
    (["--model", ""], "--model: must not be empty"),
    (["--system", "be brief"], "--system does nothing without --chat"),
    (["--top-k", "5"], "--top-k does nothing here (it is read only at --temperature > 0)"),
    (["--seed", "7", "--temperature", "0"], "--seed does nothing here"),
    (["--backend", "compiled", "--dtype", "bfloat16"], "--dtype does nothing here (it is read only with --backend "
                                                       "reference)"),
    (["--backend", "reference", "--group-size", "32"], "--group-size does nothing here"),
    (["--device", "gpu0"], "--device 'gpu0': not a device"),
    (["--device", "cuda:99"], "--device 'cuda:99'"),
    (["--prompt", BAD], "argument --prompt: not valid UTF-8 at byte 2 (0xff)"),
    (["--prompt", "hi", "--chat", "--system", BAD], "argument --system: not valid UTF-8 at byte 2"),
])
def test_bad_values_are_refused_before_the_model_loads(argv, needle, no_model_load, capsys):
    if "--prompt" not in argv:
        argv = ["--prompt", "hi", *argv]
    with pytest.raises(SystemExit) as info:
        main(gen_args("unused", *argv))
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert "flint generate: error: " in err and needle in err, err


@pytest.mark.parametrize("argv, needle", [
    (["serve", "--port", "70000"], "flint serve: error: argument --port: must be in [0, 65535], got 70000"),
    (["draft", "harvest", "--out", "unused", "--temperature", "-1"],
     "flint draft harvest: error: argument --temperature: must be a finite number >= 0"),
    (["bench", "--device", "cuda:99"], "flint bench: error: --device 'cuda:99'"),
    (["bench", "--bw-gib", "-1"], "flint bench: error: argument --bw-gib: must be a finite number in (0, 64]"),
    (["bench", "--bw-gib", "100000"], "argument --bw-gib: must be a finite number in (0, 64]"),
    (["eval", "--stride", "0"], "flint eval: error: argument --stride: must be >= 1, got 0"),
    (["eval", "--max-tokens", "-1"], "flint eval: error: argument --max-tokens: must be >= 1"),
    *[(["draft", "train", "--data", "d", "--out", "o", f"--{o}", "0"], f"argument --{o}: must be >= 1, got 0")
      for o in ("batch-size", "k", "depth", "eval-every", "ckpt-every", "steps", "layers", "intermediate-size")],
    (["draft", "train", "--data", "d", "--out", "o", "--lr", "nan"], "argument --lr: must be a finite number > 0"),
    (["draft", "train", "--data", "d", "--out", "o", "--attention-heads", "-1"], "argument --attention-heads"),
    (["draft", "eval", "--draft", "d", "--prompts-per-kind", "0"], "argument --prompts-per-kind: must be >= 1"),
    (["draft", "eval", "--draft", "d", "--max-seq-len", "0"], "argument --max-seq-len: must be >= 1"),
    (["draft", "eval", "--draft", "d", "--k", "2,0"], "argument --k: must be >= 1, got 0"),
    (["draft", "eval", "--draft", "d", "--top-p", "2"], "argument --top-p: must be a finite number in (0, 1]"),
    (["draft", "eval", "--draft", "d", "--time-budget", "-5"], "argument --time-budget"),
    (["draft", "harvest", "--out", "o", "--batch-size", "0"], "argument --batch-size: must be >= 1"),
    (["draft", "vocab", "--draft", "d", "--size", "-1"], "argument --size: must be >= 0"),
])
def test_other_subcommands_refuse_out_of_range_values_at_parse_time(argv, needle, monkeypatch, capsys):
    import flint.bench
    import flint.speculative.cli
    import flint.server.serve

    def ran(args):
        raise AssertionError(f"flint {args.command} ran with a bad value")
    import flint.evaluate

    draft = flint.speculative.cli
    for mod, fn in ((flint.server.serve, "cmd_serve"), (draft, "cmd_harvest"), (flint.bench, "_run"),
                    (draft, "cmd_train"), (draft, "cmd_eval"), (draft, "cmd_vocab"), (flint.evaluate, "_run")):
        monkeypatch.setattr(mod, fn, ran)  # register() reads these names when main() builds the parser
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert needle in capsys.readouterr().err


def test_every_numeric_option_has_a_range():
    """No subcommand option parses as a bare int or float (any value, 0 or -1 or 1e9, accepted):
    each has a range (flint.options.OPTION_RANGES) or a list of choices. flint serve's are checked by
    flint.server.serve before it starts."""
    bare = [f"{p.prog} --{a.dest}" for p in leaf_parsers(build_parser()) for a in p._actions
            if a.type in (int, float) and not a.choices and not p.prog.endswith(" serve")]
    assert bare == []


def test_non_utf8_argv_from_a_real_command_line_is_refused_without_traceback(tiny_llama_dir):
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    env.pop("FLINT_DEBUG", None)
    argv = [sys.executable.encode(), b"-m", b"flint", *(a.encode() for a in gen_args(tiny_llama_dir)),
            b"--prompt", b"caf\xe9"]  # Latin-1, not UTF-8
    r = subprocess.run(argv, env=env, capture_output=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert b"Traceback" not in r.stderr
    assert b"argument --prompt: not valid UTF-8 at byte 3 (0xe9)" in r.stderr
    assert r.stdout == b""


def test_ctrl_c_while_starting_exits_130_without_a_traceback(tmp_path):
    """Ctrl-C while `python -m flint` imports torch and builds its parser (the first second): exit
    130, no traceback. (Earlier than ~0.15 s the interpreter itself is still importing its site
    packages, which no program can catch.)"""
    import signal
    import time

    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    env.pop("FLINT_DEBUG", None)
    codes = []
    for delay in (0.6, 1.0, 1.5, 2.5):
        p = subprocess.Popen([sys.executable, "-m", "flint", "quantize", "synthetic:smollm2-135m", str(tmp_path / "q")],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=tmp_path)
        time.sleep(delay)
        if p.poll() is not None:  # (a fast machine quantized the small model already: no Ctrl-C to test there)
            p.communicate()
            continue
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
        # -SIGINT: the signal came before the interpreter installed its handler (a loaded machine starts slowly)
        assert p.returncode in (130, -signal.SIGINT) and b"Traceback" not in err, (delay, p.returncode, err[-2000:])
        codes.append(p.returncode)
    assert 130 in codes, codes


def test_prompt_file_and_stdin_give_the_prompt(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    prompt = "héllo wörld"
    assert main(gen_args(tiny_llama_dir, "--prompt", prompt)) == 0
    want = capsys.readouterr().out
    assert want.strip()
    f = tmp_path / "prompt.txt"
    f.write_text(prompt, encoding="utf-8")
    assert main(gen_args(tiny_llama_dir, "--prompt-file", str(f))) == 0
    assert capsys.readouterr().out == want
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(prompt.encode()), encoding="utf-8"))
    assert main(gen_args(tiny_llama_dir, "--prompt-file", "-")) == 0
    assert capsys.readouterr().out == want


def test_prompt_file_not_utf8_names_file_and_byte(tmp_path, no_model_load, capsys):
    f = tmp_path / "latin1.txt"
    f.write_bytes("naïve".encode("latin-1"))
    assert main(gen_args("unused", "--prompt-file", str(f))) == 2
    assert f"flint: error: {f}: not valid UTF-8 at byte 2 (0xef)" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one prompt source, not two
        main(gen_args("unused", "--prompt", "x", "--prompt-file", str(f)))
    assert "not allowed with argument" in capsys.readouterr().err


def test_chat_survives_a_non_utf8_line_and_has_help(tiny_llama_dir, monkeypatch, capsys):
    lines = b"ab\xffcd\n/help\nhi\n"  # a strict UTF-8 stdin, as on a UTF-8 terminal
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(lines), encoding="utf-8"))
    argv = ["chat", "--model", str(tiny_llama_dir), "--backend", "reference", "--device", "cpu",
            "--max-new-tokens", "3"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "not valid UTF-8 at byte 2 (0xff); nothing was sent" in err
    assert "/help" in out.splitlines()[0]  # the banner names it
    for cmd in ("/reset", "/stats", "/exit"):
        assert f"  {cmd} " in out, out
    assert out.count("⚡ 3 tokens") == 1  # "hi" got its answer; the bad line got none


def test_chat_reports_a_template_that_refuses_a_message_and_goes_on(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    """A template's raise_exception (or a render error) on one message: reported, nothing sent, the
    session goes on; transformers' {% generation %} tag compiles."""
    import json
    import shutil

    d = Path(shutil.copytree(tiny_llama_dir, tmp_path / "m"))
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc["chat_template"] = ("{% for m in messages %}{% if m.content == 'bad' %}{{ raise_exception('no bad') }}"
                           "{% endif %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}")
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"bad\nhi\n"), encoding="utf-8"))
    assert main(["chat", "--model", str(d), "--backend", "reference", "--device", "cpu", "--max-new-tokens", "3"]) == 0
    out, err = capsys.readouterr()
    assert "(chat template: no bad; nothing was sent)" in err
    assert out.count("⚡ 3 tokens") == 1  # "hi" got its answer


def test_nan_logits_end_generate_with_a_clear_error(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    """A model whose output is NaN (weights that passed the load checks, a runaway activation):
    `flint generate` says so and exits 1, at any temperature; no IndexError, no empty answer."""
    import flint.model

    real = flint.model.Transformer.forward

    def nan_forward(self, *a, **k):
        out = real(self, *a, **k)
        if isinstance(out, tuple):
            return (torch.full_like(out[0], float("nan")), *out[1:])
        return torch.full_like(out, float("nan"))
    monkeypatch.setattr(flint.model.Transformer, "forward", nan_forward)
    for t in ("0", "0.8"):
        assert main(gen_args(tiny_llama_dir, "--prompt", "hi", "--temperature", t)) == 1
        out, err = capsys.readouterr()
        assert "flint: error: the model's logits are NaN or infinite" in err and "Traceback" not in err
        assert out == ""


def test_every_subcommand_takes_threads_and_help_shows_defaults():
    from flint.options import leaf_parsers

    ap = build_parser()
    leaves = list(leaf_parsers(ap))
    names = {p.prog for p in leaves}
    for cmd in ("chat", "generate", "quantize", "bench", "eval", "serve", "draft harvest", "draft train"):
        assert f"flint {cmd}" in names, names
    for p in leaves:
        assert "--threads" in p._option_string_actions, p.prog
    text = " ".join(next(p for p in leaves if p.prog == "flint generate").format_help().split())
    assert "tokens to generate at most (default: 256)" in text
    assert "0 = greedy (default: 0.0)" in text
    assert "--seed SEED sampling seed (default: random)" in text  # a default the help names is not repeated


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"flint {__version__}"


def test_threads_flag_and_small_machine_default(tiny_llama_dir, monkeypatch, capsys):
    import flint.options

    torch.set_num_threads(2)
    assert main(gen_args(tiny_llama_dir, "--prompt", "hi", "--threads", "1")) == 0
    assert torch.get_num_threads() == 1
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for cores, want in ((2, 1), (64, 2)):  # small machine: 1 thread; a large one keeps torch's
        monkeypatch.setattr(flint.options, "available_cores", lambda: cores)
        torch.set_num_threads(2)
        assert main(gen_args(tiny_llama_dir, "--prompt", "hi")) == 0
        assert torch.get_num_threads() == want, cores
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's own setting wins over the default
    monkeypatch.setattr(flint.options, "available_cores", lambda: 2)
    torch.set_num_threads(2)
    assert main(gen_args(tiny_llama_dir, "--prompt", "hi")) == 0
    assert torch.get_num_threads() == 2


def test_settle_heap_freezes_what_is_alive_and_collects_older_cycles_at_the_next_engine():
    """load_engine's settle_heap: objects alive when an engine is built leave the cyclic collector's walks (a full
    walk of torch's objects mid-decode is a stall); a cycle that died since is collected when the next engine is built."""
    import gc
    import weakref

    from flint.assemble import settle_heap

    class Node:
        pass

    a = Node()
    a.me = a
    ref = weakref.ref(a)
    try:
        settle_heap()
        assert gc.get_freeze_count() > 0
        del a
        gc.collect()
        assert ref() is not None  # frozen: the collector does not walk it
        settle_heap()
        assert ref() is None
    finally:
        gc.unfreeze()
