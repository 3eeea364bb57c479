"""GPTQ for flint-int4-v1: int4 weights whose rounding errors are compensated using activations.

`flint quantize --method gptq` (and `flint eval --quantize G:gptq`) run this. For a linear weight
W [N, K] whose inputs x [K] have the second-moment matrix H = sum x x^T over a calibration text,
GPTQ quantizes W column by column and, after each column, moves the rounding error onto the
columns not yet quantized in proportion to H's inverse, so that the layer's output error
||(W - Wq) X|| is small rather than the weight error ||W - Wq||. The layout is unchanged (codes
0..15, one fp16 scale and min per group of G along K), so every backend runs the result.

* Group parameters: a group's (scale, min) are fitted when the loop reaches its first column, on
  the weights as updated by the errors so far, with the searched fit (flint.quant.int4.fit_groups_searched).
* Hessians are collected in one pass of the reference decoder (fp32) over the calibration text, with
  the source's weights (not layer by layer on the already-quantized model: simpler, one forward).
* Damping: 1% of H's mean diagonal is added, which also covers inputs that never vary on the text.
* Where it runs: on the CPU by default, or on a GPU (``device="cuda"``, `flint quantize --device
  cuda`), which a 3B model needs (its fp32 weights for the calibration pass and 28 GB of Hessians).
  SmolLM2-135M on a 2-core CPU: 20 s for the calibration pass, 23 s for the head, 0.4-1.8 s a
  layer weight (measured on a loaded machine).

The calibration text is flint/data/calibration.txt (written for flint, disjoint from the eval
corpus: see flint/data/README.md), 1,252 SmolLM2 tokens. What GPTQ buys on SmolLM2: docs/eval.md.
Test: ``pytest tests/test_gptq.py`` (the CUDA path: its ``gpu`` test, skipped without a GPU).
"""
from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from ..params import LINEAR_NAMES
from .int4 import Int4Weight, group_codes, check_shape, fit_groups_searched, pack_int4

CALIBRATION_TEXT = Path(__file__).parent.parent / "data" / "calibration.txt"
DAMP = 0.01
BLOCK = 128  # columns updated together; a multiple of every group size

# which linear-input site feeds each weight: the reference decoder calls its linear_input hook four
# times per layer (q|k|v input, o input, gate|up input, down input), then once for the head
_SITE = {"wq": 0, "wk": 0, "wv": 0, "wo": 1, "w_gate": 2, "w_up": 2, "w_down": 3}


def calibration_ids(tokenizer, path: str | Path | None = None) -> list[int]:
    p = Path(path) if path else CALIBRATION_TEXT
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{p}: calibration text not found") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{p}: calibration text is not UTF-8 ({e})") from None
    ids = tokenizer.encode(text)
    if len(ids) < 16:
        raise ValueError(f"{p}: calibration text has {len(ids)} tokens; GPTQ needs at least 16")
    return ids


@torch.inference_mode()
def collect_hessians(cfg, params: dict, ids: list[int], window: int = 512, progress: bool = True,
                     device="cpu") -> dict:
    """{weight name: H [K, K] float64 on ``device``} for every linear weight and "lm_head", from
    the reference decoder (fp32, on ``device``) run over ``ids`` in consecutive windows of
    ``window`` tokens (each from position 0). Weights that read the same input share one tensor.

    Memory: 8 * sum(K^2) bytes over the 4 inputs per layer and the head's: 0.8 GB for SmolLM2-135M,
    28 GB for Granite-4.1-3B (its 40 w_down inputs of K = 8192 take 21 GB): run a 3B model with
    ``device="cuda"`` (`flint quantize --device cuda`)."""
    from ..model import Transformer

    window = min(window, cfg.max_position_embeddings)
    model = Transformer(cfg, params, max_seq_len=window, device=device, dtype=torch.float32)
    sites = 4 * cfg.num_layers + 1
    acc: list[torch.Tensor | None] = [None] * sites
    calls = [0]

    def hook(x):
        i = calls[0] % sites
        calls[0] += 1
        xf = x.reshape(-1, x.shape[-1]).double()
        h = xf.T @ xf
        acc[i] = h if acc[i] is None else acc[i] + h
        return x

    model.linear_input = hook
    chunks = [ids[i:i + window] for i in range(0, len(ids), window)]
    for c in tqdm(chunks, desc="gptq: calibration", unit="window", disable=not progress or None, leave=False):
        model.forward(torch.tensor(c, dtype=torch.long), 0)
    out = {"lm_head": acc[4 * cfg.num_layers]}
    for li in range(cfg.num_layers):
        for n, site in _SITE.items():
            out[f"layers.{li}.{n}"] = acc[4 * li + site]
    return out


def _fit_rtn(wf):
    lo, hi = wf.amin(-1), wf.amax(-1)
    return ((hi - lo) / 15.0).half(), lo.half()


def gptq_int4(w: torch.Tensor, h: torch.Tensor, group_size: int, name: str = "weight",
              damp: float = DAMP, fit: str = "searched") -> Int4Weight:
    """GPTQ of a [N, K] weight against the input second moments ``h`` [K, K], on ``h``'s device;
    the result is on the CPU. ``fit`` picks how a group's (scale, min) are chosen: "searched"
    (fit_groups_searched) or "rtn" (its min and max)."""
    fit_groups = {"searched": fit_groups_searched, "rtn": _fit_rtn}[fit]
    if w.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D weight, got shape {tuple(w.shape)}")
    n, k = w.shape
    check_shape(name, n, k, group_size)
    if tuple(h.shape) != (k, k):
        raise ValueError(f"{name}: Hessian shape {tuple(h.shape)} does not match in_features K={k}")
    dev = h.device
    W = w.detach().to(dev, torch.float32).clone()
    H = h.detach().to(torch.float64).clone()
    diag = torch.diagonal(H)
    diag[diag <= 0] = 1.0  # an input that is always zero on the text: no correlations to use
    diag += damp * float(diag.mean())
    try:
        L = torch.linalg.cholesky(H)
        U = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True).to(torch.float32)
    except RuntimeError:  # torch.linalg.LinAlgError: not positive definite even damped
        raise ValueError(f"{name}: the calibration Hessian is not positive definite; "
                         "use a longer calibration text") from None
    codes = torch.empty((n, k), dtype=torch.uint8, device=dev)
    scales = torch.empty((n, k // group_size), dtype=torch.float16, device=dev)
    mins = torch.empty_like(scales)
    for b0 in range(0, k, BLOCK):
        b1 = min(b0 + BLOCK, k)
        W1 = W[:, b0:b1].clone()
        E1 = torch.empty_like(W1)
        U1 = U[b0:b1, b0:b1]
        s = m = None
        for i in range(b1 - b0):
            col = b0 + i
            if col % group_size == 0:
                gi = col // group_size
                s16, m16 = fit_groups(W1[:, i:i + group_size])
                scales[:, gi], mins[:, gi] = s16, m16
                s, m = s16.float(), m16.float()
            x = W1[:, i]
            q = group_codes(x[:, None], s, m)[:, 0]
            codes[:, col] = q.to(torch.uint8)
            err = (x - (q * s + m)) / U1[i, i]
            W1[:, i:] -= err[:, None] * U1[i, i:][None, :]
            E1[:, i] = err
        W[:, b1:] -= E1 @ U[b0:b1, b1:]
    return Int4Weight(pack_int4(codes).cpu(), scales.cpu(), mins.cpu(), group_size)


def output_error(w: torch.Tensor, q: Int4Weight, h: torch.Tensor) -> float:
    """tr((W - Wq) H (W - Wq)^T): the squared output error summed over the calibration tokens."""
    d = (w.float().cpu() - q.dequantize()).double()
    return float(((d @ h.double().cpu()) * d).sum())


def gptq_params(cfg, params: dict, names: list[str], group_sizes: dict, ids: list[int] | None = None,
                hessians: dict | None = None, progress: bool = True, device="cpu") -> dict:
    """{name: Int4Weight} for ``names`` (linear weights and/or "lm_head") by GPTQ at
    ``group_sizes[name]``, with ``hessians`` (collect_hessians), or collected here on ``device``
    from ``params`` as they are (the source's weights) over ``ids``. GPTQ runs where the Hessians
    are."""
    if hessians is None:
        if ids is None:
            raise ValueError("gptq_params: pass the calibration ids or the Hessians")
        hessians = collect_hessians(cfg, params, ids, progress=progress, device=device)
    out = {}
    for name in tqdm(names, desc="gptq", unit="tensor", disable=not progress or None):
        if name != "lm_head" and name.rsplit(".", 1)[-1] not in LINEAR_NAMES:
            raise ValueError(f"gptq: {name!r} is not a linear weight or the LM head")
        w = params[name]
        dense = w.dequantize(torch.float32) if isinstance(w, Int4Weight) else w.float()
        out[name] = gptq_int4(dense, hessians[name], group_sizes[name], name)
    return out
