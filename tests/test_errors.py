"""flint's error classes derive from one base, flint.errors.FlintError, and keep the builtin base they had (callers
that catch ValueError or RuntimeError still catch them). CPU only: ``pytest tests/test_errors.py``."""
from __future__ import annotations

import importlib

import pytest

from flint.errors import FlintError

ERRORS = [("backend_api", "BackendError", ValueError), ("bench", "BenchError", ValueError),
          ("bench_head", "HeadOptionError", ValueError), ("config", "ConfigError", ValueError),
          ("engine", "ContextError", ValueError), ("engine", "Cancelled", Exception),
          ("engine", "NonFiniteLogits", RuntimeError),
          ("evaluate", "EvalError", ValueError), ("grammar", "GrammarError", ValueError),
          ("kernels.build", "BuildError", RuntimeError), ("megakernel", "MegakernelError", RuntimeError),
          ("params", "LoadError", ValueError), ("quant.quantize", "QuantizeError", ValueError),
          ("tokenizer", "TokenizerError", ValueError), ("server.errors", "APIError", Exception),
          ("server.queue", "QueueFull", Exception),
          ("speculative.draft_head", "DraftError", ValueError)]


@pytest.mark.parametrize("module,name,builtin", ERRORS)
def test_error_derives_from_flint_error(module, name, builtin):
    cls = getattr(importlib.import_module(f"flint.{module}"), name)
    assert issubclass(cls, FlintError) and issubclass(cls, builtin)
