"""Peak memory of loading: a GGUF or an HF directory loads tensor by tensor, so the process's peak
resident memory during ``load_model`` stays within 1.15x the weights it ends up holding.

Each case runs the load in a fresh Python process (the modules it needs imported first), resets
the kernel's high-water mark (/proc/self/clear_refs) and reads VmHWM after the load, against the
bytes of the distinct tensors in the loaded params. The model is a 12-layer tiny-vocabulary Llama
(about 145 MB of float32 weights: the allocator's few MB of slack stay well inside the 15%), written
by save_pretrained and as F32 and F16 GGUFs. An HF directory's tensors are mapped from the file and
read when first used, so its load peaks far below the weights.
Run: ``pytest tests/test_load_memory.py`` (Linux only: it reads /proc).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")

ROOT = Path(__file__).resolve().parents[1]
PROBE = r"""
import json, sys
import numpy, torch
import flint.gguf_file, flint.loading, flint.tokenizer, safetensors, tqdm  # imports are not the load's

# nor is torch's lazy set-up of its first operators (about 5 MB): one small op of each kind first
torch.randn(64, 4)[torch.arange(64).view(4, 8, 2).transpose(1, 2).reshape(-1)].contiguous()
torch.from_numpy(numpy.zeros((4, 4), numpy.float32).copy())

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

open("/proc/self/clear_refs", "w").write("5")  # resets VmHWM to the current resident size
before = status("VmRSS")
lm = flint.loading.load_model(sys.argv[1])
peak = status("VmHWM") - before
seen, held = set(), 0
for w in lm.params.values():
    for t in ([w.qweight, w.scales, w.mins] if hasattr(w, "qweight") else [w]):
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            held += s.nbytes()
print(json.dumps({"peak": peak, "held": held}))
"""


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    import gguf

    from conftest import make_hf_model, save_hf_dir
    from test_gguf import write_tiny_gguf

    d = tmp_path_factory.mktemp("loadmem")
    hf = make_hf_model("llama", seed=0, hidden_size=512, intermediate_size=1536, num_hidden_layers=12,
                       num_attention_heads=8, num_key_value_heads=2)
    save_hf_dir(hf, d / "hf", tokenizer=False)
    for name, kind in (("f32", gguf.GGMLQuantizationType.F32), ("f16", gguf.GGMLQuantizationType.F16)):
        write_tiny_gguf(hf, d / f"{name}.gguf",
                        encode=lambda key, x, kind=kind: (gguf.quants.quantize(x, kind), kind))
    return d


@pytest.mark.parametrize("source", ["f32.gguf", "f16.gguf", "hf"])
def test_load_peak_within_115_percent_of_resident(model_files, source):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", PROBE, str(model_files / source)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["held"] > 140e6, r  # the weights dominate whatever else the load allocates
    assert r["peak"] <= 1.15 * r["held"], (f"{source}: loading peaked at {r['peak'] / 1e6:.1f} MB over "
                                           f"{r['held'] / 1e6:.1f} MB of weights held")
