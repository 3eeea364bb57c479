"""Bad input fails early and clearly: each case raises a ValueError subclass (LoadError,
ConfigError, ContextError, TokenizerError) whose message names the file, tensor or field at fault,
writes nothing, and through the CLI ends as ``flint: error: ...`` with exit code 2 and no traceback.

Cases: missing / truncated / garbage safetensors, truncated and corrupt GGUF, unsupported
architectures (gpt2, granitemoehybrid with mamba layers or MoE experts), a shard the index names
but is absent, wrong tensor shapes, prompt too long for the context, unknown token ids, and a hub
id while offline. Run: ``pytest tests/test_loading.py``.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import dir_snapshot, make_hf_model, save_hf_dir
from flint.config import ConfigError
from flint.engine import ContextError, Engine, SamplingParams
from flint.loading import LoadError, embedded_gguf_path, load_model
from flint.model import Transformer
from flint.tokenizer import TokenizerError

pytestmark = pytest.mark.usefixtures("torch_one_thread")

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def checkpoint(tiny_llama_dir, tmp_path) -> Path:
    """A private copy of the tiny llama checkpoint, free to damage."""
    return Path(shutil.copytree(tiny_llama_dir, tmp_path / "ckpt"))


def edit_config(d: Path, **fields) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(fields)
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(autouse=True)
def empty_cwd(tmp_path, monkeypatch):
    """Run each test in an empty directory and check that nothing was written there."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    yield
    assert list(cwd.iterdir()) == [], "files were written to the working directory"


def expect_load_error(spec: Path | str, *must_mention: str, error=LoadError) -> str:
    """load_model(spec) raises ``error`` (a ValueError) naming each of must_mention and leaves the
    checkpoint byte-for-byte as it was. Returns the message."""
    path = Path(spec) if os.path.exists(str(spec)) else None
    watched = None if path is None else (path if path.is_dir() else path.parent)
    before = dir_snapshot(watched) if watched else None
    with pytest.raises(error) as info:
        load_model(str(spec))
    msg = str(info.value)
    assert isinstance(info.value, ValueError)
    for needle in must_mention:
        assert needle in msg, f"error message {msg!r} does not mention {needle!r}"
    if watched:
        assert dir_snapshot(watched) == before, "a failed load wrote or changed files"
    return msg


# ------------------------------------------------------------------ safetensors directories

def test_missing_safetensors(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    expect_load_error(checkpoint, str(checkpoint), "model.safetensors")


def test_missing_config(checkpoint):
    (checkpoint / "config.json").unlink()
    expect_load_error(checkpoint, "config.json")


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_bad_config_json(checkpoint, text):
    (checkpoint / "config.json").write_text(text)
    expect_load_error(checkpoint, str(checkpoint / "config.json"))


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
@pytest.mark.parametrize("text", ["{not json", "[]"])
def test_bad_tokenizer_files(checkpoint, name, text):
    (checkpoint / name).write_text(text)
    expect_load_error(checkpoint, str(checkpoint / name))  # a TokenizerError, reported as a LoadError


@pytest.mark.parametrize("keep", [20, 0.5, 0.999])  # inside the header, in the data, at the end
def test_truncated_safetensors(checkpoint, keep):
    f = checkpoint / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: keep if isinstance(keep, int) else int(len(data) * keep)])
    msg = expect_load_error(checkpoint, str(f))
    assert "truncated" in msg


@pytest.mark.parametrize("head", [b"\x05", b"\x40\x00\x00\x00\x00\x00\x00\x00{not json",
                                  b"\xff" * 8 + b"{}"])
def test_garbage_safetensors(checkpoint, head):
    f = checkpoint / "model.safetensors"
    f.write_bytes(head)
    expect_load_error(checkpoint, str(f))


def test_absent_shard(tmp_path):
    d = save_hf_dir(make_hf_model("llama", seed=2), tmp_path / "sharded", max_shard_size="40KB",
                    tokenizer=False)
    index = d / "model.safetensors.index.json"
    shard = sorted(set(json.loads(index.read_text())["weight_map"].values()))[1]
    (d / shard).unlink()
    expect_load_error(d, str(index), shard)


def test_index_without_weight_map(checkpoint):
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    expect_load_error(checkpoint, "model.safetensors.index.json", "weight_map")


def test_config_disagrees_with_tensor_shapes(checkpoint):
    edit_config(checkpoint, intermediate_size=80)  # the tensors are 96 wide
    msg = expect_load_error(checkpoint, str(checkpoint), "w_gate")
    assert "[96, 64]" in msg and "[80, 64]" in msg, msg


def test_one_tensor_with_wrong_shape(checkpoint):
    from safetensors.torch import load_file, save_file

    f = checkpoint / "model.safetensors"
    tensors = load_file(str(f))
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    save_file(tensors, str(f), metadata={"format": "pt"})
    expect_load_error(checkpoint, str(checkpoint), "layers.1.wk", "[3, 64]")


def test_unexpected_tensor(checkpoint):
    from safetensors.torch import load_file, save_file

    f = checkpoint / "model.safetensors"
    tensors = load_file(str(f))
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(tensors, str(f), metadata={"format": "pt"})
    expect_load_error(checkpoint, "model.layers.0.self_attn.q_proj.bias")


# ------------------------------------------------------------------ unsupported architectures

def test_unsupported_model_type(checkpoint):
    edit_config(checkpoint, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    expect_load_error(checkpoint, "config.json", "model_type", "gpt2")


@pytest.fixture(scope="module")
def granitemoehybrid_dir(tmp_path_factory) -> Path:
    model = make_hf_model("granitemoehybrid", seed=4)
    return save_hf_dir(model, tmp_path_factory.mktemp("gmh"), tokenizer=False)


@pytest.mark.parametrize("types,bad_index", [(["attention", "mamba"], 1),  # checkpoint spelling
                                             (["linear_attention", "full_attention"], 0)])  # transformers 5
def test_granitemoehybrid_with_mamba_layer(granitemoehybrid_dir, tmp_path, types, bad_index):
    d = Path(shutil.copytree(granitemoehybrid_dir, tmp_path / "gmh"))
    edit_config(d, layer_types=types)
    msg = expect_load_error(d, "config.json", "layer_types")
    assert f"[{bad_index}]" in msg, msg


def test_granitemoehybrid_with_experts(granitemoehybrid_dir, tmp_path):
    d = Path(shutil.copytree(granitemoehybrid_dir, tmp_path / "gmh"))
    edit_config(d, num_local_experts=4)
    expect_load_error(d, "config.json", "num_local_experts")


def test_granitemoehybrid_all_attention_loads(granitemoehybrid_dir):
    lm = load_model(str(granitemoehybrid_dir))
    assert lm.cfg.arch == "granitemoehybrid" and lm.cfg.num_layers == 2


@pytest.mark.parametrize("field,value", [
    ("num_attention_heads", 3), ("hidden_act", "gelu"), ("attention_bias", True),
    ("rope_scaling", {"rope_type": "dynamic", "factor": 4.0}),
    ("rope_parameters", {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0})])
def test_unsupported_config_fields(checkpoint, field, value):
    edit_config(checkpoint, **{field: value})
    expect_load_error(checkpoint, "config.json", field)


def test_config_error_is_a_value_error():
    from flint.config import from_hf_dict

    with pytest.raises(ConfigError, match="num_hidden_layers") as info:
        from_hf_dict({"model_type": "llama", "hidden_size": 64}, "x/config.json")
    assert isinstance(info.value, ValueError)


# ------------------------------------------------------------------ GGUF

@pytest.mark.parametrize("keep", [3, 24, 100_000, -1])
def test_truncated_gguf(tmp_path, keep):
    """Cut inside the header, inside the metadata (the vocabulary), and one byte short of the
    end (the last tensor's data incomplete: a download that stopped just short)."""
    src = embedded_gguf_path()
    n = keep if keep > 0 else src.stat().st_size + keep
    with open(src, "rb") as fh:
        head = fh.read(n)
    f = tmp_path / "truncated.gguf"
    f.write_bytes(head)
    expect_load_error(f, str(f), "truncated or corrupt")


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("after_magic", [b"", b"\x03\x00\x00\x00"])
def test_corrupt_gguf(tmp_path, seed, after_magic):
    g = torch.Generator().manual_seed(seed)
    junk = torch.randint(0, 256, (20_000,), dtype=torch.uint8, generator=g).numpy().tobytes()
    f = tmp_path / "corrupt.gguf"
    f.write_bytes(b"GGUF" + after_magic + junk)
    expect_load_error(f, str(f))


def test_non_gguf_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"not a model")
    expect_load_error(f, str(f))


def test_missing_path():
    expect_load_error("/nonexistent/flint-model-dir", "/nonexistent/flint-model-dir")


# ------------------------------------------------------------------ hub ids offline

def test_hub_id_offline_fails_fast(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    t0 = time.perf_counter()
    msg = expect_load_error("flint-test-org/no-such-model", "flint-test-org/no-such-model", "--model")
    assert time.perf_counter() - t0 < 10, "offline hub lookup should fail at once"
    assert "HF_HUB_OFFLINE" in msg


# ------------------------------------------------------------------ runtime input

class CountingBackend:
    """Wraps a backend and counts forward calls, to show errors come before any work."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0
        self.cfg, self.device, self.max_seq_len = inner.cfg, inner.device, inner.max_seq_len

    def forward(self, tokens, start_pos, return_hidden=False):
        self.calls += 1
        return self.inner.forward(tokens, start_pos, return_hidden)


def test_prompt_too_long(tiny_llama):
    backend = CountingBackend(Transformer(tiny_llama.cfg, tiny_llama.params, max_seq_len=32))
    engine = Engine(backend, tiny_llama.tokenizer)
    engine.check_fits(28, 4)  # exactly fills the context: fine
    with pytest.raises(ContextError, match="28 tokens.*max_new_tokens \\(5\\).*32") as info:
        engine.check_fits(28, 5)
    assert isinstance(info.value, ValueError)
    with pytest.raises(ContextError):
        engine.generate(list(range(10, 40)), SamplingParams(max_new_tokens=8))
    with pytest.raises(ContextError, match="empty"):
        engine.generate([], SamplingParams(max_new_tokens=8))
    assert backend.calls == 0, "the engine ran the model before refusing the prompt"


def test_positions_beyond_cache(tiny_llama):
    model = Transformer(tiny_llama.cfg, tiny_llama.params, max_seq_len=16)
    with pytest.raises(ValueError, match="max_seq_len 16"):
        model.forward(torch.arange(4), 14)


def test_unknown_token_id(tiny_llama):
    vocab = tiny_llama.cfg.vocab_size
    model = Transformer(tiny_llama.cfg, tiny_llama.params, max_seq_len=16)
    for bad in (vocab, vocab + 100, -1):
        with pytest.raises(ValueError, match=f"token id {bad}"):
            model.forward(torch.tensor([5, bad, 7]), 0)
    backend = CountingBackend(model)
    with pytest.raises(ValueError, match=f"token id {vocab}"):
        Engine(backend, tiny_llama.tokenizer).generate([5, vocab], SamplingParams(max_new_tokens=2))
    assert backend.calls == 0
    with pytest.raises(TokenizerError, match=f"token id {vocab + 3}") as info:
        tiny_llama.tokenizer.decode([65, vocab + 3])
    assert isinstance(info.value, ValueError)
    with pytest.raises(TokenizerError):
        tiny_llama.tokenizer.stream().feed(-2)


# ------------------------------------------------------------------ through the CLI

def run_cli(*args: str, env_extra: dict | None = None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), **(env_extra or {}))
    env.pop("FLINT_DEBUG", None)
    # cwd: the test's empty directory (the empty_cwd fixture checks that it stays empty)
    return subprocess.Popen([sys.executable, "-m", "flint", *args], cwd=os.getcwd(), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_cli_reports_bad_input_without_traceback(tmp_path, tiny_llama_dir):
    truncated = tmp_path / "truncated.gguf"
    with open(embedded_gguf_path(), "rb") as fh:
        truncated.write_bytes(fh.read(100_000))
    gpt2 = Path(shutil.copytree(tiny_llama_dir, tmp_path / "gpt2"))
    edit_config(gpt2, model_type="gpt2")
    hf_home = str(tmp_path / "hf-home")
    cases = {  # name -> (argv, text the error must contain, extra env)
        "missing": (["--model", str(tmp_path / "nope")], str(tmp_path / "nope"), {}),
        "truncated-gguf": (["--model", str(truncated)], str(truncated), {}),
        "gpt2": (["--model", str(gpt2)], "model_type", {}),
        "hub-offline": (["--model", "flint-test-org/no-such-model"], "--model",
                        {"HF_HUB_OFFLINE": "1", "HF_HOME": hf_home}),
        "too-long": (["--model", str(tiny_llama_dir), "--max-seq-len", "16", "--max-new-tokens", "4"],
                     "exceeds the context", {}),
    }
    procs = {}
    for name, (argv, _, env) in cases.items():
        prompt = "a long prompt " * 4 if name == "too-long" else "hi"
        procs[name] = run_cli("generate", "--backend", "reference", "--device", "cpu", *argv,
                              "--prompt", prompt, env_extra=env)
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        needle = cases[name][1]
        assert proc.returncode == 2, f"{name}: exit code {proc.returncode}\n{err}"
        assert "Traceback" not in err, f"{name}: traceback on stderr:\n{err}"
        assert "flint: error:" in err and needle in err, f"{name}: stderr {err!r} lacks {needle!r}"
        assert out.strip() == "", f"{name}: wrote to stdout: {out!r}"
