"""The speculative-decoding draft head (EAGLE-style), and the `flint draft` commands that build it.

A draft step maps (the target's last-layer hidden state at position i, the embedding of token i+1)
to a guess of the target's hidden state at i+1, and reads the next token off it through the
target's own final norm and LM head (tied, read-only, never saved with the draft):

    f = fc([rmsnorm(h), rmsnorm(embed[t])])  2H -> H;   f += MLP(rmsnorm(f)) per block;
    logits = target_head(target_norm(f))

Rolling forward K steps feeds each predicted f back in as the next h. Drafts are saved as
``draft.safetensors`` + ``draft.json`` (format, shapes, target name/fingerprint, default K, training
record); ``load_draft`` refuses a draft whose hidden_size or vocab_size differ from the target's.

Commands (``flint draft ...``):
    harvest  the target generates continuations of the built-in prompt set ``flint-draft-prompts-v1``
             (code, explain, qa, chat; templated topics x instructions), batched, and stores the
             tokens and the hidden states the draft needs as resumable safetensors shards
    train    teacher forcing plus multi-step rollout (depth 3 default): the draft's own predicted
             hidden states are fed forward and every step is scored against the target
    eval     mean tokens per verify step of real speculative decoding on held-out prompts, by kind

Tests: ``pytest tests/test_draft.py tests/test_speculative.py``. The shipped SmolLM2 draft and its
measurements: docs/speculative.md.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .model import dense, rms_norm
from .quant import Int4Weight, fit_group_size, quantize_int4

FORMAT = "flint-draft-v1"
PROMPT_SET = "flint-draft-prompts-v1"
SHIPPED_DRAFTS = Path(__file__).parent / "data" / "drafts"
KINDS = ("code", "explain", "qa", "chat")


class DraftError(ValueError):
    """A draft file flint cannot use with this target; the message names the file and field."""


# ------------------------------------------------------------------ config and model

@dataclass
class DraftConfig:
    hidden_size: int
    vocab_size: int
    intermediate_size: int
    num_layers: int = 1
    rms_norm_eps: float = 1e-5
    k_default: int = 4
    draft_vocab: int = 0  # drafting vocabulary: the first N ids of vocab.safetensors' ranking (0: all V)
    target: dict = field(default_factory=dict)  # name, arch, num_layers, fingerprint
    training: dict = field(default_factory=dict)  # how it was trained (steps, depth, val acceptance)
    format: str = FORMAT


def target_fingerprint(cfg) -> str:
    """A short hash of the target's shape; equal shapes give equal fingerprints (any quantization)."""
    key = [cfg.arch, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers,
           cfg.num_heads, cfg.num_kv_heads, cfg.head_dim]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]


def draft_config_for(target_cfg, num_layers: int = 1, intermediate_size: int | None = None,
                     k_default: int = 4) -> DraftConfig:
    return DraftConfig(
        hidden_size=target_cfg.hidden_size, vocab_size=target_cfg.vocab_size,
        intermediate_size=intermediate_size or target_cfg.intermediate_size, num_layers=num_layers,
        rms_norm_eps=target_cfg.rms_norm_eps, k_default=k_default,
        target={"name": target_cfg.name, "arch": target_cfg.arch,
                "num_layers": target_cfg.num_layers, "fingerprint": target_fingerprint(target_cfg)})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        if torch.is_grad_enabled():  # training: the reference's op sequence
            return rms_norm(x, self.weight.to(x.dtype), self.eps)
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)  # one fused kernel on CUDA


class MLPBlock(nn.Module):
    """Pre-norm SwiGLU MLP with a residual, the target's own block shape minus attention."""

    def __init__(self, dim: int, inter: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(dim, eps)
        self.gate = nn.Linear(dim, inter, bias=False)
        self.up = nn.Linear(dim, inter, bias=False)
        self.down = nn.Linear(inter, dim, bias=False)

    def forward(self, x):
        h = self.norm(x)
        if torch.is_grad_enabled():
            return x + self.down(F.silu(self.gate(h)) * self.up(h))
        # drafting: gate|up as one matmul, the residual add fused into the down matmul (kernels, not
        # bytes, bound a draft step: each is a few microseconds of launch and tail)
        g, u = F.linear(h, self._gate_up()).chunk(2, -1)
        a = F.silu(g) * u
        if x.dim() == 2:
            return torch.addmm(x, a, self.down.weight.t())
        return x + self.down(a)

    def _gate_up(self) -> torch.Tensor:
        """The [2I, H] concatenation of gate and up, rebuilt when either changes (load, .to())."""
        key = (self.gate.weight.data_ptr(), self.up.weight.data_ptr(), self.gate.weight._version,
               self.up.weight._version, self.gate.weight.dtype)
        c = self.__dict__.get("_gu_cache")
        if c is None or c[0] != key:
            c = (key, torch.cat((self.gate.weight, self.up.weight)).detach())
            self.__dict__["_gu_cache"] = c
        return c[1]


class DraftHead(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.norm_hidden = RMSNorm(h, eps)
        self.norm_embed = RMSNorm(h, eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.blocks = nn.ModuleList(MLPBlock(h, cfg.intermediate_size, eps) for _ in range(cfg.num_layers))
        with torch.no_grad():  # start as "the next hidden state is the current one" plus noise
            nn.init.normal_(self.fc.weight, std=0.02)
            self.fc.weight[:, :h] += torch.eye(h)
            for b in self.blocks:
                b.down.weight.mul_(0.1)
        # the target's embedding, final norm and LM head: attached, read-only, never saved
        self.embed = self.head = self.final_norm = None
        self.vocab_ids = None  # the drafting vocabulary (None: all of the target's)
        self.embed_src = None  # the target's embedding for lookups of any token id
        self.target_eps, self.logits_scaling = cfg.rms_norm_eps, 1.0

    # ---------------------------------------------------------------- target tensors
    def attach_target(self, target_cfg, params: dict, device=None, dtype=None,
                      vocab: torch.Tensor | None = None) -> "DraftHead":
        """Borrow the target's embedding, final norm and LM head (dense, in ``dtype``).

        ``vocab``: a drafting vocabulary, the token ids the draft may propose (LongTensor [N]). The
        draft then reads a head of those N rows only (a pruned head: N / V of the bytes per draft
        token), embeds its own proposals from the same N rows, and looks up the one token per step
        that may lie outside them (the target's own) in the target's int4 layout. None: all V."""
        check_target(self.cfg, target_cfg, "draft")
        device = torch.device(device or "cpu")
        dtype = dtype or (torch.float32 if device.type == "cpu" else torch.bfloat16)
        src = params["embed"]
        head = params.get("lm_head", src)
        tied = head is src or target_cfg.tie_word_embeddings
        if vocab is None:
            self.embed = dense(src, dtype, device)
            self.head = self.embed if tied else dense(head, dtype, device)
            self.vocab_ids = self.embed_src = None
        else:
            ids = check_vocab(vocab, target_cfg.vocab_size, "vocab")
            self.embed = dense(_rows(src, ids), dtype, device)
            self.head = self.embed if tied else dense(_rows(head, ids), dtype, device)
            self.vocab_ids = ids.to(device)
            self.embed_src = _int4_embedding(src).to(device)
        self.final_norm = params["norm"].to(device=device, dtype=dtype)
        self.target_eps = target_cfg.rms_norm_eps
        self.logits_scaling = target_cfg.logits_scaling
        return self

    @property
    def device(self):
        return self.fc.weight.device

    @property
    def dtype(self):
        return self.fc.weight.dtype

    @property
    def draft_vocab_size(self) -> int:
        """Tokens the draft can propose: the drafting vocabulary's size, else the target's."""
        self._need_target()
        return self.head.shape[0]

    def _need_target(self):
        if self.head is None:
            raise DraftError("draft has no target attached: call attach_target(cfg, params) or "
                             "load it with load_draft(path, target_cfg, target_params)")

    def _need_full_vocab(self, what: str):
        if self.vocab_ids is not None:
            raise DraftError(f"{what} scores the draft against the target's full distribution: attach the "
                             "target without a drafting vocabulary (vocab=None)")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's head on a (true or predicted) hidden state: fp32 logits [..., N] over the
        drafting vocabulary (N = V without one; column j is token ``ids(j)``)."""
        self._need_target()
        x = rms_norm(hidden.to(self.head.dtype), self.final_norm, self.target_eps)
        logits = (x @ self.head.T).float()
        return logits / self.logits_scaling if self.logits_scaling != 1.0 else logits

    def ids(self, index: torch.Tensor) -> torch.Tensor:
        """Token ids of drafting-vocabulary indices."""
        return index if self.vocab_ids is None else self.vocab_ids[index]

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Embeddings of token ids (any of the target's)."""
        self._need_target()
        if self.vocab_ids is None:
            return F.embedding(tokens, self.embed)
        return self.embed_src.rows(tokens).dequantize(torch.float32).to(self.embed.dtype)

    # ---------------------------------------------------------------- the step
    def forward(self, hidden: torch.Tensor, token_embed: torch.Tensor) -> torch.Tensor:
        """(hidden at i [.., H], embedding of token i+1 [.., H]) -> predicted hidden at i+1."""
        dt = self.fc.weight.dtype
        x = torch.cat((self.norm_hidden(hidden.to(dt)), self.norm_embed(token_embed.to(dt))), -1)
        x = self.fc(x)
        for b in self.blocks:
            x = b(x)
        return x

    def _rollout(self, h: torch.Tensor, tok: torch.Tensor, k: int, u: torch.Tensor | None = None,
                 sampling: tuple = ()):
        """k draft steps from hidden h [1, H] and token tok [1], all on the device (no host sync,
        fixed shapes: the body of the captured graph). Greedy (u None): returns (ids [k], None);
        the argmax skips what cannot move it (the final norm's rstd and the logit scale are positive
        scalars per row). Sampling: ``sampling`` = (temperature, top_k, top_p) and u [k] uniform
        draws; step j takes the first token whose cumulative q exceeds u[j] (inverse CDF: never a
        token of q = 0); returns (ids [k], q [k, V], 0 outside the drafting vocabulary)."""
        from .engine import probs_from_logits

        idx, qs = [], []
        e = self.embed_tokens(tok)
        for j in range(k):
            h = self.forward(h, e)
            if u is None:
                x = F.rms_norm(h, (h.shape[-1],), self.final_norm, self.target_eps)
                i = torch.argmax(F.linear(x, self.head)[0]).view(1)
            else:
                q = probs_from_logits(self.logits(h)[0], *sampling)
                cdf = q.cumsum(0)
                i = torch.searchsorted(cdf, u[j:j + 1] * cdf[-1], right=True).clamp_max(q.shape[0] - 1)
                qs.append(q)
            idx.append(i)
            e = F.embedding(i, self.embed)  # a proposal is in the drafting vocabulary: its rows embed it
        ids = self.ids(torch.cat(idx))
        if u is None:
            return ids, None
        q = torch.stack(qs)
        if self.vocab_ids is not None:  # the target's vocabulary: q is 0 at tokens the draft cannot propose
            q = torch.zeros(k, self.cfg.vocab_size, device=q.device, dtype=q.dtype).index_copy_(1, self.vocab_ids, q)
        return ids, q

    def _graphed_rollout(self, k: int, sampling: tuple = ()) -> "_GraphedRollout | None":
        """The captured rollout for k (and the sampling transform) on CUDA, built on first use, or
        None where graphs do not apply (CPU, FLINT_DRAFT_GRAPH=0)."""
        if self.device.type != "cuda" or os.environ.get("FLINT_DRAFT_GRAPH", "1") == "0":
            return None
        cache = self.__dict__.setdefault("_graphs", {})
        key = (k, sampling, self.device, self.dtype, id(self.head), id(self.embed), id(self.vocab_ids))
        if key not in cache:
            if len(cache) >= 16:  # a server's requests bring their own sampling settings
                cache.pop(next(iter(cache)))
            cache[key] = _GraphedRollout(self, k, sampling)
        return cache[key]

    @torch.inference_mode()
    def propose(self, context_ids: list[int], hidden: torch.Tensor, k: int, sp=None, gen=None):
        """Draft ``k`` tokens after ``context_ids``. ``hidden`` is the target's hidden state [H] at
        the position before context_ids[-1]. Greedy (sp None or temperature 0): returns
        (tokens LongTensor[k], None); sampling: (tokens, q [k, V]) with tokens drawn from q, the
        draft distribution after the same temperature/top-k/top-p as the target's (over the
        drafting vocabulary: q is 0 outside it). On CUDA the rollout replays a captured CUDA graph
        (one launch of ~13 k small kernels greedy instead of Python-issued launches; the uniform
        draws come from ``gen`` outside it); FLINT_DRAFT_GRAPH=0 runs the same kernels eagerly."""
        self._need_target()
        greedy = sp is None or sp.temperature == 0
        tok = torch.tensor([context_ids[-1]], device=self.device)
        if greedy:
            kr = self._kernel_rollout()
            if kr is not None:
                return kr(hidden, tok, k), None
        h = hidden.reshape(1, -1).to(self.device, self.dtype)
        u = None if greedy else torch.rand(k, generator=gen, device=self.device)
        sampling = () if greedy else (float(sp.temperature), int(sp.top_k), float(sp.top_p))
        g = self._graphed_rollout(k, sampling)
        return g(h, tok, u) if g is not None else self._rollout(h, tok, k, u, sampling)

    def _kernel_rollout(self) -> "_KernelRollout | None":
        """The one-launch greedy rollout (flint/kernels/draft_kernel.cu) where it applies: CUDA, bf16, widths
        divisible by 8, at most 4 MLP blocks; FLINT_DRAFT_KERNEL=0 turns it off (the graph then runs)."""
        if (self.device.type != "cuda" or self.dtype != torch.bfloat16 or os.environ.get("FLINT_DRAFT_KERNEL", "1") == "0"
                or self.cfg.hidden_size % 8 or self.cfg.intermediate_size % 8 or not 1 <= len(self.blocks) <= 4
                or (self.embed_src is not None and self.embed_src.qweight.device != self.device)):
            return None
        key = (self.device, id(self.head), id(self.embed), id(self.vocab_ids), id(self.embed_src),
               tuple(p._version for p in self.parameters()))
        kr = self.__dict__.get("_kernel")
        if kr is None or kr.key != key:
            kr = _KernelRollout(self, key)
            self.__dict__["_kernel"] = kr
        return kr


class _KernelRollout:
    """The greedy k-step rollout as one cooperative launch of flint_draft_rollout (libflint_mk.so): the draft's
    tensors made contiguous once, scratch for the hand-offs, a pointer table refreshed per call for its inputs."""

    N_BLOCKS_MAX = 4

    def __init__(self, draft: DraftHead, key):
        import ctypes

        from .megakernel import load_library

        self.key = key
        lib = load_library()
        if not hasattr(lib, "flint_draft_rollout"):
            raise DraftError("the kernel library has no flint_draft_rollout (rebuild: python -m flint.kernels.build --force)")
        self.lib, self.ct = lib, ctypes
        dev, bf = draft.device, torch.bfloat16
        H, I = draft.cfg.hidden_size, draft.cfg.intermediate_size
        c = lambda t, dt=bf: t.detach().to(device=dev, dtype=dt).contiguous()  # noqa: E731
        self.keep = keep = {"fc": c(draft.fc.weight), "w_nh": c(draft.norm_hidden.weight), "w_ne": c(draft.norm_embed.weight),
                            "w_final": c(draft.final_norm), "head": c(draft.head), "embed": c(draft.embed)}
        for i, b in enumerate(draft.blocks):
            keep[f"bn{i}"] = c(b.norm.weight)
            keep[f"gu{i}"] = c(b._gate_up())
            keep[f"down{i}"] = c(b.down.weight)
        src = draft.embed_src
        if draft.vocab_ids is not None:
            keep["ids"] = c(draft.vocab_ids, torch.long)
            keep["e_q"], keep["e_s"], keep["e_m"] = src.qweight.contiguous(), src.scales.contiguous(), src.mins.contiguous()
        nb = lib.flint_draft_grid_blocks()
        if nb < 1:
            raise DraftError("flint_draft_grid_blocks: no CUDA device")
        keep["f"] = torch.empty(H, device=dev)
        keep["act"] = torch.empty(I, device=dev)
        keep["x"] = torch.empty(H, device=dev)
        keep["keys"] = torch.empty(nb, dtype=torch.long, device=dev)
        ptr = lambda name: keep[name].data_ptr() if name in keep else None  # noqa: E731
        nblk = len(draft.blocks)
        self.ptrs = [ptr("fc"), ptr("w_nh"), ptr("w_ne"),
                     *[ptr(f"bn{i}") for i in range(self.N_BLOCKS_MAX)],
                     *[ptr(f"gu{i}") for i in range(self.N_BLOCKS_MAX)],
                     *[ptr(f"down{i}") for i in range(self.N_BLOCKS_MAX)],
                     ptr("w_final"), ptr("head"), ptr("embed"), ptr("ids"),
                     None,  # tok
                     None if draft.vocab_ids is not None else ptr("embed"),
                     ptr("e_q"), ptr("e_s"), ptr("e_m"),
                     None,  # h0
                     ptr("f"), ptr("act"), ptr("x"), ptr("keys"),
                     None]  # out
        # the argument tables are built once; a call sets its inputs' slots (token, hidden state, output) and k
        self.i_tok, self.i_h0, self.i_out = 3 + 3 * self.N_BLOCKS_MAX + 4, 3 + 3 * self.N_BLOCKS_MAX + 9, len(self.ptrs) - 1
        self.ptrs = (ctypes.c_void_p * len(self.ptrs))(*self.ptrs)
        self.ints = (ctypes.c_longlong * 6)(H, I, draft.head.shape[0], nblk, 0,
                                            src.group_size if draft.vocab_ids is not None else 0)
        self.floats = (ctypes.c_float * 2)(draft.norm_hidden.eps, draft.target_eps)

    def __call__(self, hidden: torch.Tensor, tok: torch.Tensor, k: int) -> torch.Tensor:
        h0 = hidden.reshape(-1).to(device=self.keep["x"].device, dtype=torch.float32).contiguous()
        tok = tok.to(torch.long).contiguous()
        out = torch.empty(k, dtype=torch.long, device=h0.device)
        self.ptrs[self.i_tok], self.ptrs[self.i_h0], self.ptrs[self.i_out] = tok.data_ptr(), h0.data_ptr(), out.data_ptr()
        self.ints[4] = k
        stream = torch.cuda.current_stream(h0.device)
        rc = self.lib.flint_draft_rollout(self.ints, self.ptrs, self.floats, self.ct.c_void_p(stream.cuda_stream))
        if rc != 0:
            raise DraftError(f"flint_draft_rollout failed: CUDA error {rc}")
        return out


class _GraphedRollout:
    """A CUDA graph of DraftHead._rollout for one k and sampling transform: static input buffers
    (h, tok, u) are copied in, the graph replays, the tokens (and q) are copied out. Warmed up on a
    side stream before capture (cuBLAS picks its kernels there), as torch.cuda.graphs requires."""

    def __init__(self, draft: DraftHead, k: int, sampling: tuple):
        dev = draft.device
        self.h = torch.zeros(1, draft.cfg.hidden_size, device=dev, dtype=draft.dtype)
        self.tok = torch.zeros(1, dtype=torch.long, device=dev)
        self.u = torch.full((k,), 0.5, device=dev) if sampling else None
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.inference_mode(), torch.cuda.stream(side):
            for _ in range(2):
                draft._rollout(self.h, self.tok, k, self.u, sampling)
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(self.graph):
            self.ids, self.q = draft._rollout(self.h, self.tok, k, self.u, sampling)

    def __call__(self, h: torch.Tensor, tok: torch.Tensor, u: torch.Tensor | None):
        self.h.copy_(h)
        self.tok.copy_(tok)
        if u is not None:
            self.u.copy_(u)
        self.graph.replay()
        return self.ids.clone(), (None if self.q is None else self.q.clone())


def num_parameters(draft: DraftHead) -> int:
    return sum(p.numel() for p in draft.parameters())


def _rows(w, ids: torch.Tensor):
    """Rows ``ids`` of a target weight (Int4Weight or dense); exact."""
    return w.rows(ids) if isinstance(w, Int4Weight) else w[ids]


def _int4_embedding(w) -> Int4Weight:
    """The target's embedding in the int4 layout for single-row lookups: as it is when the target's
    is int4 (GGUF Q4_0/Q4_1, flint checkpoints), else rounded to nearest once (the draft's input
    only: a lookup of a quarter of the bytes, the output stays exact)."""
    if isinstance(w, Int4Weight):
        return w
    return quantize_int4(w.float(), fit_group_size(w.shape[1], 128, "embed"), name="embed")


def check_vocab(ids, vocab_size: int, source: str) -> torch.Tensor:
    """A drafting vocabulary: distinct token ids of the target, as a LongTensor [N], N >= 1."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.numel() < 1 or ids.dtype.is_floating_point:
        raise DraftError(f"{source}: a drafting vocabulary is a 1-D integer tensor of token ids")
    ids = ids.to("cpu", torch.long)
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise DraftError(f"{source}: token id {hi if hi >= vocab_size else lo} is outside the target's "
                         f"vocabulary (size {vocab_size})")
    if torch.unique(ids).numel() != ids.numel():
        raise DraftError(f"{source}: the drafting vocabulary repeats a token id")
    return ids


# ------------------------------------------------------------------ save / load

def check_target(dcfg: DraftConfig, target_cfg, source: str) -> None:
    for f in ("hidden_size", "vocab_size"):
        want, got = getattr(target_cfg, f), getattr(dcfg, f)
        if want != got:
            raise DraftError(f"{source}: field {f!r} is {got} but the target "
                             f"{target_cfg.name or target_cfg.arch!r} has {f}={want}: this draft was "
                             f"built for another target ({dcfg.target.get('name') or 'unnamed'})")
    fp = dcfg.target.get("fingerprint")
    if fp and fp != target_fingerprint(target_cfg):
        warnings.warn(f"{source}: built for target {dcfg.target.get('name')!r} (fingerprint {fp}); "
                      f"this target {target_cfg.name!r} has another shape: expect low acceptance "
                      "(output stays exact)", stacklevel=3)


def save_draft(draft: DraftHead, path: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write draft.safetensors + draft.json into directory ``path``."""
    from safetensors.torch import save_file

    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to("cpu", dtype or v.dtype).contiguous() for k, v in draft.state_dict().items()}
    save_file(sd, str(p / "draft.safetensors"), metadata={"format": FORMAT})
    (p / "draft.json").write_text(json.dumps(asdict(draft.cfg), indent=2) + "\n")
    return p


def resolve_draft_path(path: str | Path) -> Path:
    p = Path(path)
    if p.is_file() and p.name in ("draft.json", "draft.safetensors"):
        p = p.parent
    if p.is_dir():
        return p
    shipped = SHIPPED_DRAFTS / str(path)
    if shipped.is_dir():
        return shipped
    have = sorted(d.name for d in SHIPPED_DRAFTS.iterdir()) if SHIPPED_DRAFTS.is_dir() else []
    raise DraftError(f"{path}: no such draft directory (shipped drafts: {', '.join(have) or 'none'})")


def load_draft(path: str | Path, target_cfg, target_params: dict | None = None, device=None,
               dtype: torch.dtype | None = None, draft_vocab: int | None = None) -> DraftHead:
    """Load a draft directory (or a shipped draft's name) for ``target_cfg``; refuses a draft built
    for another target. With ``target_params`` the target's embedding/norm/head are attached, with
    a drafting vocabulary of ``draft_vocab`` tokens (None: draft.json's ``draft_vocab``; 0: all V)
    taken from the ranking in vocab.safetensors.
    ``ngram``: the draft-free prompt-lookup proposals of flint.ngram (any model, nothing loaded)."""
    from safetensors import safe_open

    if str(path) == "ngram":
        if draft_vocab:
            raise DraftError(f"draft_vocab={draft_vocab}: the ngram draft proposes tokens of the context, it has "
                             "no drafting vocabulary")
        from .ngram import NgramDraft
        return NgramDraft(target_cfg.vocab_size)

    p = resolve_draft_path(path)
    cj = p / "draft.json"
    if not cj.exists():
        raise DraftError(f"{cj}: file not found (a draft directory holds draft.json and draft.safetensors)")
    try:
        d = json.loads(cj.read_text())
    except json.JSONDecodeError as e:
        raise DraftError(f"{cj}: not valid JSON ({e})") from None
    if d.get("format") != FORMAT:
        raise DraftError(f"{cj}: field 'format' is {d.get('format')!r}, expected {FORMAT!r}")
    known = set(DraftConfig.__dataclass_fields__)
    for f in ("hidden_size", "vocab_size", "intermediate_size", "num_layers", "k_default"):
        v = d.get(f)
        if not isinstance(v, int) or v <= 0:
            raise DraftError(f"{cj}: field {f!r} must be a positive integer, got {v!r}")
    dv = d.get("draft_vocab", 0)
    if not isinstance(dv, int) or dv < 0:
        raise DraftError(f"{cj}: field 'draft_vocab' must be an integer >= 0 (0: the full vocabulary), got {dv!r}")
    dcfg = DraftConfig(**{k: v for k, v in d.items() if k in known})
    check_target(dcfg, target_cfg, str(cj))
    n_vocab = dcfg.draft_vocab if draft_vocab is None else draft_vocab
    if not isinstance(n_vocab, int) or n_vocab < 0:
        raise DraftError(f"draft_vocab must be an integer >= 0 (0: the full vocabulary), got {n_vocab!r}")
    vocab = None
    if 0 < n_vocab < target_cfg.vocab_size:
        vocab = load_vocab_ranking(p, target_cfg.vocab_size)[:n_vocab]
    st = p / "draft.safetensors"
    if not st.exists():
        raise DraftError(f"{st}: file not found")
    device = torch.device(device or "cpu")
    dtype = dtype or (torch.float32 if device.type == "cpu" else torch.bfloat16)
    draft = DraftHead(dcfg)
    want = draft.state_dict()
    try:
        with safe_open(str(st), framework="pt") as fh:
            got = {k: fh.get_tensor(k) for k in fh.keys()}
    except Exception as e:
        raise DraftError(f"{st}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    for k, v in want.items():
        if k not in got:
            raise DraftError(f"{st}: tensor {k!r} is missing")
        if tuple(got[k].shape) != tuple(v.shape):
            raise DraftError(f"{st}: tensor {k!r} has shape {list(got[k].shape)}, draft.json implies "
                             f"{list(v.shape)}")
    extra = sorted(set(got) - set(want))
    if extra:
        raise DraftError(f"{st}: unexpected tensor {extra[0]!r}")
    draft.load_state_dict({k: got[k].float() for k in want})
    draft.to(device=device, dtype=dtype).eval()
    if target_params is not None:
        draft.attach_target(target_cfg, target_params, device, dtype, vocab=vocab)
    return draft


VOCAB_FILE = "vocab.safetensors"


def rank_vocab(data: "HarvestData", vocab_size: int) -> tuple[torch.Tensor, dict]:
    """All token ids ranked by how often the target generated them in the harvest (most frequent
    first; ties and tokens never generated in id order), and a summary. The first N are the
    drafting vocabulary of size N."""
    n = data.tokens.shape[1]
    gen = (torch.arange(n)[None, :] >= 1) & (torch.arange(n)[None, :] <= data.lengths.cpu()[:, None])
    toks = data.tokens.cpu()[gen]
    if toks.numel() and (int(toks.min()) < 0 or int(toks.max()) >= vocab_size):
        raise DraftError(f"harvest: a token id outside the target's vocabulary (size {vocab_size})")
    counts = torch.bincount(toks, minlength=vocab_size)
    order = torch.sort(-counts, stable=True).indices
    cum = counts[order].cumsum(0).double() / max(int(counts.sum()), 1)
    cover = {str(m): round(float(cum[m - 1]), 5) for m in (1024, 2048, 4096, 8192, 16384, 32768) if m <= vocab_size}
    harvest = {k: data.meta.get(k) for k in ("prompt_set", "max_new_tokens", "temperature") if k in data.meta}
    return order, {"harvest": {**harvest, "sequences": int(data.tokens.shape[0])},
                   "tokens_counted": int(counts.sum()), "distinct": int((counts > 0).sum()), "coverage": cover}


def save_vocab_ranking(path: str | Path, order: torch.Tensor, meta: dict) -> Path:
    """Write the ranking to ``path``/vocab.safetensors (a temporary name, then renamed)."""
    from safetensors.torch import save_file

    out = Path(path) / VOCAB_FILE
    tmp = out.with_name(out.name + ".tmp")
    save_file({"ids": order.to(torch.int32).contiguous()}, str(tmp),
              metadata={"format": FORMAT + "-vocab", **{k: json.dumps(v) for k, v in meta.items()}})
    os.replace(tmp, out)
    return out


def load_vocab_ranking(draft_dir: Path, vocab_size: int) -> torch.Tensor:
    from safetensors import safe_open

    f = Path(draft_dir) / VOCAB_FILE
    if not f.exists():
        raise DraftError(f"{f}: file not found (a drafting vocabulary needs the draft's token ranking: "
                         "`flint draft vocab --data SHARDS --draft DIR` writes it)")
    try:
        with safe_open(str(f), framework="pt") as fh:
            ids = fh.get_tensor("ids")
    except Exception as e:
        raise DraftError(f"{f}: not a readable ranking ({type(e).__name__}: {e})") from None
    if ids.dim() != 1 or ids.numel() != vocab_size:
        raise DraftError(f"{f}: tensor 'ids' must rank all {vocab_size} token ids, it holds {ids.numel()}")
    return check_vocab(ids, vocab_size, str(f))


# ------------------------------------------------------------------ the prompt set

_LANGS = ["Python", "JavaScript", "TypeScript", "C", "C++", "Rust", "Go", "Java", "Bash", "SQL"]
_CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the nth Fibonacci number",
    "sorts a list of numbers with merge sort", "finds the largest element in an array",
    "counts the words in a text", "removes duplicates from a list", "reads a CSV file and sums a column",
    "implements binary search", "checks whether a string is a palindrome", "merges two sorted lists",
    "computes the factorial of a number", "converts Celsius to Fahrenheit", "flattens a nested list",
    "validates an email address", "implements a stack with push and pop", "computes the GCD of two numbers",
    "finds all anagrams of a word in a list", "parses a date string", "implements a simple linked list",
    "counts the vowels in a string", "rotates a matrix by 90 degrees", "generates all permutations of a list",
    "implements a queue using two stacks", "computes the average of a list", "capitalizes every word",
    "checks whether parentheses are balanced", "implements bubble sort", "finds the second largest number",
    "converts a number to binary", "computes the sum of digits of a number", "implements a LRU cache",
    "reads a file and prints the longest line", "finds the intersection of two lists",
    "implements quicksort", "checks whether two strings are anagrams", "counts character frequencies",
    "implements depth-first search on a graph", "implements breadth-first search on a graph",
    "computes the power set of a set", "transposes a matrix", "finds the missing number in a range",
    "splits a list into chunks", "implements a binary search tree insert", "computes a running average",
    "formats a number with thousands separators", "finds the longest common prefix of strings",
    "implements FizzBuzz", "retries a function call with exponential backoff", "computes a SHA-256 hash",
]
_CODE_TEMPLATES = ["Write a {lang} function that {task}.", "Implement a {lang} program that {task}.",
                   "Show me {lang} code that {task}, with comments.",
                   "How would I write code in {lang} that {task}? Give an example."]
_TOPICS = [
    "photosynthesis", "black holes", "the water cycle", "machine learning", "blockchain", "inflation",
    "the immune system", "plate tectonics", "quantum computing", "the French Revolution", "vaccines",
    "climate change", "the stock market", "DNA replication", "neural networks", "the internet",
    "compound interest", "gravity", "the Roman Empire", "renewable energy", "recursion", "encryption",
    "supply and demand", "the theory of evolution", "volcanoes", "the human heart", "cloud computing",
    "electric cars", "the greenhouse effect", "operating systems", "databases", "the Renaissance",
    "sleep", "nutrition", "the solar system", "earthquakes", "antibiotics", "the printing press",
    "democracy", "memory in the brain", "tides", "rainbows", "compilers", "hash tables", "TCP/IP",
    "garbage collection", "the Big Bang", "magnetism", "batteries", "3D printing", "bees and pollination",
    "coral reefs", "the Industrial Revolution", "GPS", "solar panels", "the moon landing", "caching",
    "version control with git", "the scientific method", "probability", "statistics", "algorithms",
    "photosynthesis in algae", "ocean currents", "the nervous system", "weather forecasting",
    "programming languages", "virtual memory", "public key cryptography", "sorting algorithms",
]
_EXPLAIN_TEMPLATES = ["Explain {t} in simple terms.", "Explain how {t} works.",
                      "What is {t} and why does it matter?", "Give a short overview of {t} for a beginner.",
                      "Describe {t} in a few paragraphs.", "Teach me the basics of {t}."]
_QA_TEMPLATES = ["What are the main facts about {t}?", "List five interesting facts about {t}.",
                 "What are common misconceptions about {t}?",
                 "What are the advantages and disadvantages of {t}?",
                 "Who were the key people involved in {t}?",
                 "What questions do students often ask about {t}?"]
_CHAT_SUBJECTS = [
    "a rainy day", "friendship", "the ocean", "a lost cat", "autumn leaves", "a robot learning to paint",
    "a trip to the mountains", "starting a new job", "a small bakery", "the first day of school",
    "a city at night", "a garden", "a dragon who loves books", "learning to cook", "a long train ride",
    "moving to a new city", "a birthday party", "a lighthouse keeper", "winter mornings", "a marathon",
    "a family dinner", "a space explorer", "a quiet library", "a summer festival", "an old clock",
    "a snowy forest", "a coffee shop", "learning a new language", "a soccer match", "a music lesson",
    "a camping trip", "an inventor's workshop", "a farmer's market", "a haunted house", "the night sky",
    "a job interview", "a wedding", "a museum visit", "a science fair", "a road trip",
    "a talking tree", "a pirate ship", "a small village", "a busy airport", "saving money",
]
_CHAT_TEMPLATES = ["Write a short poem about {t}.", "Write a short story about {t}.",
                   "Write a friendly email to a colleague about {t}.", "Give me some tips related to {t}.",
                   "Write a diary entry about {t}.", "Write a product description inspired by {t}.",
                   "Help me write a speech about {t}."]


def _heldout(kind: str, subject: str) -> bool:
    """About one subject in ten per kind is held out: eval prompts have subjects training never saw."""
    return int(hashlib.sha256(f"{kind}|{subject}".encode()).hexdigest(), 16) % 10 == 0


def draft_prompts(split: str | None = None) -> list[dict]:
    """The prompt set flint-draft-prompts-v1: [{'kind', 'text', 'subject', 'split'}], deterministic.

    Kinds: code (languages x tasks), explain and qa (topics x instructions), chat (writing
    requests). split 'train' or 'eval' (held out by subject), None for both."""
    out = []
    for task in _CODE_TASKS:
        for lang in _LANGS:
            for tpl in _CODE_TEMPLATES:
                out.append(("code", task, tpl.format(lang=lang, task=task)))
    for t in _TOPICS:
        out += [("explain", t, tpl.format(t=t)) for tpl in _EXPLAIN_TEMPLATES]
        out += [("qa", t, tpl.format(t=t)) for tpl in _QA_TEMPLATES]
    for t in _CHAT_SUBJECTS:
        out += [("chat", t, tpl.format(t=t)) for tpl in _CHAT_TEMPLATES]
    rows = [{"kind": k, "text": text, "subject": s, "split": "eval" if _heldout(k, s) else "train"}
            for k, s, text in out]
    random.Random(0).shuffle(rows)
    return [r for r in rows if split is None or r["split"] == split]


def eval_prompts(per_kind: int, kinds=KINDS) -> list[dict]:
    """``per_kind`` held-out prompts of each kind, spread over subjects."""
    rows = draft_prompts("eval")
    out = []
    for kind in kinds:
        mine = [r for r in rows if r["kind"] == kind]
        by_subject: dict[str, list] = {}
        for r in mine:
            by_subject.setdefault(r["subject"], []).append(r)
        order = [lst[i] for i in range(max(map(len, by_subject.values()), default=0))
                 for lst in by_subject.values() if i < len(lst)]
        out += order[:per_kind]
    return out


# ------------------------------------------------------------------ harvest

@dataclass
class HarvestData:
    """Per sequence, the region from the last prompt position P-1 on. Region index r is position
    P-1+r: tokens [N, G+1] (the last prompt token, then the G generated), hidden [N, G+1, H] (the
    target's last-layer hidden state there), lengths [N]: hidden states 0..length-1 are valid, and
    tokens 0..length (token `length` is the last generated one: eos or the G-th). group [N]: the
    prompt's subject (validation holds out whole subjects); kind [N]: index into KINDS, -1 unknown."""
    tokens: torch.Tensor
    hidden: torch.Tensor
    lengths: torch.Tensor
    prompt_index: torch.Tensor
    meta: dict
    group: torch.Tensor | None = None
    kind: torch.Tensor | None = None


def _prompt_key(ids) -> int:
    return int(hashlib.sha256(json.dumps([int(t) for t in ids]).encode()).hexdigest(), 16) % (2**62)


def _group_key(r: dict, index: int) -> int:
    if "subject" not in r:
        return index
    return int(hashlib.sha256(f"{r.get('kind')}|{r['subject']}".encode()).hexdigest(), 16) % (2**31)


def harvest(lm, out_dir: str | Path, prompts: list[dict], batch_size: int = 64,
            max_new_tokens: int = 256, temperature: float = 0.0, device=None,
            dtype: torch.dtype | None = None, time_budget: float | None = None, seed: int = 0,
            log=print) -> int:
    """Self-distillation: generate continuations of ``prompts`` (rows with 'text', chat-templated,
    or pre-tokenized 'ids') with the target and write shards (one per batch) to ``out_dir``;
    prompts already in a shard are skipped (resume). Returns the number of sequences written."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from tqdm import tqdm

    from .engine import probs_from_logits
    from .model import Transformer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg, tok = lm.cfg, lm.tokenizer
    if tok is None and any("ids" not in r for r in prompts):
        raise DraftError(f"{lm.source}: harvest needs a tokenizer (the prompts are text)")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.float32 if device.type == "cpu" else torch.bfloat16)
    meta = {"format": FORMAT + "-harvest", "prompt_set": PROMPT_SET, "target": cfg.name,
            "fingerprint": target_fingerprint(cfg), "max_new_tokens": max_new_tokens,
            "temperature": temperature, "hidden_size": cfg.hidden_size}
    done = set()
    for sh in sorted(out.glob("shard_*.safetensors")):
        with safe_open(str(sh), framework="pt") as fh:
            m = fh.metadata() or {}
            for key in ("fingerprint", "max_new_tokens", "temperature"):
                if str(m.get(key)) != str(meta[key]):
                    raise DraftError(f"{sh}: metadata {key!r} is {m.get(key)!r}, this harvest uses "
                                     f"{meta[key]!r}; pass another --out to start a new harvest")
            done.update(fh.get_tensor("prompt_key").tolist())
    todo = []
    for i, r in enumerate(prompts):
        ids = r["ids"] if "ids" in r else tok.encode_chat([{"role": "user", "content": r["text"]}])
        if _prompt_key(ids) not in done:  # keyed by content: any prompt list or order resumes
            todo.append((i, list(ids)))
    if not todo:
        log(f"harvest: all {len(prompts)} prompts already in {out}")
        return 0
    # Batches mix prompt lengths: all rows share one position per step (the reference decoder takes
    # [B, M] at one start_pos), and a row whose prompt is not over yet is fed its next prompt token
    # instead of a generated one. Sorting by length keeps the extra steps per batch few.
    todo.sort(key=lambda x: len(x[1]))
    batches = [todo[s: s + batch_size] for s in range(0, len(todo), batch_size)]
    random.Random(seed).shuffle(batches)  # a time budget then leaves a mix of lengths and kinds
    longest = max(len(ids) for _, ids in todo)
    model = Transformer(cfg, lm.params, longest + max_new_tokens, device=device, dtype=dtype,
                        batch_size=min(batch_size, len(todo)))
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    eos = torch.tensor(sorted(set(cfg.eos_token_ids) or {-1}), device=device)
    shard_no = len(list(out.glob("shard_*.safetensors")))
    t0 = time.perf_counter()
    written = 0
    bar = tqdm(total=len(todo), desc="harvest", unit="seq", disable=None)
    for batch in batches:
        if time_budget is not None and time.perf_counter() - t0 > time_budget:
            log(f"harvest: time budget {time_budget:.0f}s reached")
            break
        idx = [i for i, _ in batch]
        b = len(batch)
        plen = torch.tensor([len(ids) for _, ids in batch], device=device)
        pmin, pmax = min(len(ids) for _, ids in batch), max(len(ids) for _, ids in batch)
        seq = torch.zeros(b, pmax + max_new_tokens, dtype=torch.long, device=device)
        for r, (_, ids) in enumerate(batch):
            seq[r, : len(ids)] = torch.tensor(ids, device=device)
        logits, hid = model.forward(seq[:, :pmin], 0, return_hidden=True)
        hiddens = [hid[:, -1]]  # hidden at position pmin - 1 + j is hiddens[j]
        logits = logits[:, -1]
        finished = torch.zeros(b, dtype=torch.bool, device=device)
        eos_pos = torch.full((b,), -1, dtype=torch.long, device=device)
        last = pmax + max_new_tokens - 1  # the last position any row needs a token at
        for pos in range(pmin, last + 1):
            if temperature == 0:
                chosen = torch.argmax(logits, -1)
            else:
                chosen = torch.multinomial(probs_from_logits(logits, temperature), 1, generator=gen)[:, 0]
            generated = pos >= plen
            tok_now = torch.where(generated, chosen, seq[:, pos])
            seq[:, pos] = tok_now
            new_eos = generated & ~finished & torch.isin(tok_now, eos)
            eos_pos = torch.where(new_eos, pos, eos_pos)
            finished |= new_eos | (pos >= plen + max_new_tokens - 1)
            if pos == last or bool(finished.all()):
                break  # a finished row's last token needs no hidden state: it predicts nothing kept
            logits, hid = model.forward(tok_now[:, None], pos, return_hidden=True)
            hiddens.append(hid[:, 0])
            logits = logits[:, 0]
        hiddens = torch.stack(hiddens, 1)  # [b, steps, H]
        n = max_new_tokens + 1
        tokens = torch.zeros(b, n, dtype=torch.int32)
        hidden = torch.zeros(b, n, cfg.hidden_size, dtype=torch.bfloat16)
        lengths = []
        for r in range(b):
            p = int(plen[r])  # region index 0 is position p - 1
            ln = max_new_tokens if int(eos_pos[r]) < 0 else int(eos_pos[r]) - p + 1
            lengths.append(ln)
            tokens[r, : ln + 1] = seq[r, p - 1: p + ln].to("cpu", torch.int32)
            hidden[r, :ln] = hiddens[r, p - pmin: p - pmin + ln].to("cpu", torch.bfloat16)
        shard = out / f"shard_{shard_no:05d}.safetensors"
        groups = [_group_key(prompts[i], i) for i in idx]
        kinds = [KINDS.index(prompts[i]["kind"]) if prompts[i].get("kind") in KINDS else -1 for i in idx]
        save_file({"tokens": tokens, "hidden": hidden, "lengths": torch.tensor(lengths, dtype=torch.int32),
                   "prompt_index": torch.tensor(idx, dtype=torch.int32),
                   "prompt_key": torch.tensor([_prompt_key(ids) for _, ids in batch], dtype=torch.int64),
                   "group": torch.tensor(groups, dtype=torch.int32),
                   "kind": torch.tensor(kinds, dtype=torch.int32)}, str(shard),
                  metadata={k: str(v) for k, v in meta.items()})
        shard_no += 1
        written += b
        bar.update(b)
    bar.close()
    dt = time.perf_counter() - t0
    log(f"harvest: {written} sequences in {dt:.1f}s -> {out} ({len(done) + written} in total)")
    return written


def load_harvest(data_dir: str | Path, target_cfg=None) -> HarvestData:
    from safetensors import safe_open

    d = Path(data_dir)
    shards = sorted(d.glob("shard_*.safetensors"))
    if not shards:
        raise DraftError(f"{d}: no harvest shards (shard_*.safetensors); run `flint draft harvest` first")
    parts = {"tokens": [], "hidden": [], "lengths": [], "prompt_index": [], "group": [], "kind": []}
    meta = {}
    for sh in shards:
        with safe_open(str(sh), framework="pt") as fh:
            meta = fh.metadata() or {}
            if target_cfg is not None and meta.get("fingerprint") != target_fingerprint(target_cfg):
                raise DraftError(f"{sh}: harvested from target {meta.get('target')!r} "
                                 f"(fingerprint {meta.get('fingerprint')}), not this target "
                                 f"{target_cfg.name!r}")
            for k in parts:
                parts[k].append(fh.get_tensor(k))
    cat = {k: torch.cat(v) for k, v in parts.items()}
    return HarvestData(cat["tokens"].long(), cat["hidden"], cat["lengths"].long(), cat["prompt_index"].long(),
                       meta, cat["group"].long(), cat["kind"].long())


# ------------------------------------------------------------------ training

def rollout_losses(draft: DraftHead, hidden: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor,
                   depth: int, reg_weight: float = 0.5):
    """Teacher forcing (step 1) plus multi-step rollout (steps 2..depth) on a batch.

    hidden [B, L, H] (true), tokens [B, L], lengths [B]. Step s feeds the draft's step s-1
    prediction of hidden[j-1] with the true token j, and is scored at position j against the
    target's distribution there (KL) and its normalized hidden state (smooth L1).
    Returns (loss, per-step stats [{'kl', 'reg', 'top1'}])."""
    draft._need_full_vocab("training")
    b, L, _ = hidden.shape
    pos = torch.arange(L, device=hidden.device)
    with torch.no_grad():
        logp = torch.log_softmax(draft.logits(hidden[:, 1:]), -1)  # target at positions 1..L-1
        p = logp.exp()
        entropy = -(p * logp).sum(-1)
        target_tok = logp.argmax(-1)
        del logp
        hn = F.normalize(hidden[:, 1:].float(), dim=-1) * math.sqrt(hidden.shape[-1])
    emb = draft.embed_tokens(tokens)
    f_prev = hidden[:, :-1]
    total, stats = 0.0, []
    for s in range(1, depth + 1):
        if L - s < 1:
            break
        f = draft(f_prev, emb[:, s:])  # predicted hidden at positions s..L-1
        mask = (pos[s:][None, :] < lengths[:, None]).float()  # [B, L-s]
        n = mask.sum().clamp_min(1)
        logq = torch.log_softmax(draft.logits(f), -1)
        kl = -(p[:, s - 1:] * logq).sum(-1) - entropy[:, s - 1:]  # KL(p || q), same gradient as CE
        fn = F.normalize(f.float(), dim=-1) * math.sqrt(f.shape[-1])
        reg = F.smooth_l1_loss(fn, hn[:, s - 1:], reduction="none").mean(-1)
        kl_m, reg_m = (kl * mask).sum() / n, (reg * mask).sum() / n
        top1 = ((logq.argmax(-1) == target_tok[:, s - 1:]).float() * mask).sum() / n
        total = total + kl_m + reg_weight * reg_m
        stats.append({"kl": float(kl_m.detach()), "reg": float(reg_m.detach()), "top1": float(top1)})
        f_prev = f[:, :-1]
    return total / max(len(stats), 1), stats


@torch.no_grad()
def accepted_runs(draft: DraftHead, hidden: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor,
                  k: int) -> torch.Tensor:
    """a[b, i] = how many of the k tokens the draft proposes from region position i the greedy
    target would accept (leading matches with the target's argmax), for i < lengths-1; -1 elsewhere."""
    draft._need_full_vocab("the replayed acceptance")
    b, L, _ = hidden.shape
    tgt = draft.logits(hidden).argmax(-1)  # target's greedy token after each position
    emb = draft.embed_tokens(tokens)
    alive = torch.ones(b, L, dtype=torch.bool, device=hidden.device)  # run from start i still matching
    runs = torch.zeros(b, L, dtype=torch.long, device=hidden.device)
    f_prev = hidden[:, :-1]
    for s in range(1, k + 1):
        if L - s < 1:
            break
        f = draft(f_prev, emb[:, s:])  # positions j = s..L-1; start i = j - s
        ok = draft.logits(f).argmax(-1) == tgt[:, s:]  # draft's token j+1 == target's token j+1
        # the target's token j+1 is known where its hidden state j is: j < length
        ok &= torch.arange(s, L, device=hidden.device)[None] < lengths[:, None]
        step_ok = torch.zeros(b, L, dtype=torch.bool, device=hidden.device)
        step_ok[:, : L - s] = ok
        alive &= step_ok
        runs += alive.long()
        f_prev = f[:, :-1]
    starts = torch.arange(L, device=hidden.device)[None] < (lengths[:, None] - 1)
    return torch.where(starts, runs, torch.full_like(runs, -1))


def simulated_acceptance(runs: torch.Tensor, lengths: torch.Tensor) -> float:
    """Mean tokens per verify step (accepted drafts + the target's own token) of greedy speculative
    decoding over the sequences, walking each from its first position as the engine would."""
    steps = toks = 0
    r = runs.tolist()
    for row, n in zip(r, lengths.tolist()):
        i = 0
        while i < n - 1:
            a = min(row[i], n - 2 - i)
            steps += 1
            toks += a + 1
            i += a + 1
    return toks / steps if steps else 0.0


def evaluate_val(draft, data: HarvestData, rows, ks, device, batch: int = 16) -> dict:
    """{k: {'all': tokens per step, KIND: ...}} of the greedy walk over the ``rows`` sequences
    (exact for greedy harvests: the walk is what the engine does on those prompts)."""
    runs_by_k = {k: [] for k in ks}
    lens = []
    draft.eval()
    for s in range(0, len(rows), batch):
        r = rows[s: s + batch]
        L = int(data.lengths[r].max())
        h = data.hidden[r, :L].to(device)
        t = data.tokens[r, :L].to(device)
        ln = data.lengths[r].to(device)
        with _autocast(device):
            for k in ks:
                runs = accepted_runs(draft, h, t, ln, k)
                runs_by_k[k].append(F.pad(runs, (0, data.tokens.shape[1] - L), value=-1).cpu())
        lens.append(data.lengths[r])
    draft.train()
    lens = torch.cat(lens).cpu()
    kinds = data.kind[rows].cpu() if data.kind is not None else torch.full((len(rows),), -1)
    out = {}
    for k, v in runs_by_k.items():
        runs = torch.cat(v)
        out[k] = {"all": simulated_acceptance(runs, lens)}
        for ki, name in enumerate(KINDS):
            sel = kinds == ki
            if sel.any():
                out[k][name] = simulated_acceptance(runs[sel], lens[sel])
    return out


def _autocast(device):
    device = torch.device(device)
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def train_draft(draft: DraftHead, data: HarvestData, out_dir: str | Path, steps: int = 2000,
                batch_size: int = 32, lr: float = 1e-3, depth: int = 3, reg_weight: float = 0.5,
                val_frac: float = 0.05, time_budget: float | None = None, eval_every: int = 250,
                ckpt_every: int = 500, k_eval: int = 4, seed: int = 0, resume: bool = False,
                log=print) -> dict:
    """Train ``draft`` (its target attached, fp32 weights) on harvested data; checkpoints and the
    final draft go to ``out_dir``. Returns the training record (also stored in draft.json)."""
    from tqdm import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = draft.device
    if device.type == "cuda":  # the whole harvest fits: no per-step host gathers
        data = HarvestData(data.tokens.to(device), data.hidden.to(device), data.lengths.to(device),
                           data.prompt_index, data.meta, data.group, data.kind)
    usable = [i for i, ln in enumerate(data.lengths.tolist()) if ln >= 2]
    # validation holds out whole prompt subjects, so it measures prompts unlike any trained on
    groups = data.group.tolist() if data.group is not None else data.prompt_index.tolist()
    uniq = sorted({groups[i] for i in usable})
    g = torch.Generator().manual_seed(seed)
    uniq = [uniq[i] for i in torch.randperm(len(uniq), generator=g).tolist()]
    n_val = min(len(uniq) - 1, math.ceil(len(uniq) * val_frac)) if val_frac > 0 else 0
    held = set(uniq[:max(n_val, 0)])
    val_rows = [i for i in usable if groups[i] in held]
    train_rows = [i for i in usable if groups[i] not in held]
    opt = torch.optim.AdamW(draft.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    warm = max(1, min(100, steps // 10))

    def lr_at(step: int, elapsed: float) -> float:
        # linear warmup, cosine to lr/10 over whichever runs out first: steps or the time budget
        prog = step / steps
        if time_budget:
            prog = max(prog, elapsed / time_budget)
        return lr * min(1.0, (step + 1) / warm) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(prog, 1.0))))

    step0 = 0
    state_path = out / "train_state.pt"
    if resume and state_path.exists():
        st = torch.load(state_path, map_location=device)
        draft.load_state_dict(st["draft"])
        opt.load_state_dict(st["opt"])
        step0 = st["step"]
        log(f"train: resumed at step {step0} from {state_path}")
    hist = {"steps": [], "val": []}
    best = (-1.0, None, 0)  # (val tokens/step, weights, step): the final draft is the best validated
    t0 = time.perf_counter()
    draft.train()
    bar = tqdm(range(step0, steps), desc="train", unit="step", disable=None)
    done = step0
    rng = random.Random(seed + step0)
    for step in bar:
        elapsed = time.perf_counter() - t0
        if time_budget is not None and elapsed > time_budget:
            log(f"train: time budget {time_budget:.0f}s reached at step {step}")
            break
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, elapsed)
        rows = rng.sample(train_rows, min(batch_size, len(train_rows)))
        L = int(data.lengths[rows].max())
        h = data.hidden[rows, :L].to(device, non_blocking=True).float()
        t = data.tokens[rows, :L].to(device, non_blocking=True)
        ln = data.lengths[rows].to(device)
        with _autocast(device):
            loss, st = rollout_losses(draft, h, t, ln, depth, reg_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        done = step + 1
        rec = {"step": step + 1, "loss": float(loss.detach()), "kl": [x["kl"] for x in st],
               "top1": [x["top1"] for x in st]}
        hist["steps"].append(rec)
        bar.set_postfix(loss=f"{rec['loss']:.3f}", top1="/".join(f"{x:.2f}" for x in rec["top1"]))
        if val_rows and ((step + 1) % eval_every == 0):
            acc = evaluate_val(draft, data, val_rows, [k_eval], device)[k_eval]["all"]
            hist["val"].append({"step": step + 1, f"tokens_per_step_k{k_eval}": acc})
            log(f"train: step {step + 1} loss {rec['loss']:.3f} top1 "
                f"{'/'.join(f'{x:.3f}' for x in rec['top1'])} val tokens/step (k={k_eval}) {acc:.3f}")
            if acc > best[0]:
                best = (acc, {k: v.detach().clone() for k, v in draft.state_dict().items()}, step + 1)
        if (step + 1) % ckpt_every == 0:
            torch.save({"draft": draft.state_dict(), "opt": opt.state_dict(), "step": step + 1}, state_path)
    bar.close()
    kept = done
    if val_rows and done > step0:
        acc = evaluate_val(draft, data, val_rows, [k_eval], device)[k_eval]["all"]
        if best[1] is not None and best[0] > acc:
            log(f"train: keeping the step-{best[2]} weights (val {best[0]:.3f} > final {acc:.3f})")
            draft.load_state_dict(best[1])
            kept = best[2]
    torch.save({"draft": draft.state_dict(), "opt": opt.state_dict(), "step": done}, state_path)
    record = {"steps": done, "kept_step": kept, "depth": depth, "batch_size": batch_size, "lr": lr,
              "reg_weight": reg_weight,
              "sequences": len(train_rows), "val_sequences": len(val_rows),
              "harvest": {"prompt_set": data.meta.get("prompt_set"),
                          "max_new_tokens": int(data.meta.get("max_new_tokens", 0)),
                          "temperature": float(data.meta.get("temperature", 0))},
              "train_s": round(time.perf_counter() - t0, 1)}
    if val_rows:
        ks = list(range(1, 9))
        acc = evaluate_val(draft, data, val_rows, ks, device)
        record["val_tokens_per_step"] = {str(k): round(v["all"], 3) for k, v in acc.items()}
        record["val_tokens_per_step_by_kind"] = {name: round(x, 3) for name, x in acc[k_eval].items()}
        log("train: val tokens/step by k (greedy walk on held-out subjects, target token counted): " +
            ", ".join(f"k={k}: {v['all']:.3f}" for k, v in acc.items()))
        log(f"train: val tokens/step at k={k_eval} by kind: " +
            ", ".join(f"{n}: {x:.3f}" for n, x in acc[k_eval].items()))
    if hist["steps"]:
        first, last = hist["steps"][0], hist["steps"][-1]
        record["loss_first"], record["loss_last"] = round(first["loss"], 4), round(last["loss"], 4)
    draft.cfg.training = record
    (out / "train_log.json").write_text(json.dumps(hist) + "\n")
    return record


# ------------------------------------------------------------------ acceptance eval

def eval_acceptance(backend, tokenizer, draft, prompts: list[dict], k: int, max_new_tokens: int = 128,
                    sp=None, compare_plain: bool = True, time_budget: float | None = None,
                    log=print) -> dict:
    """Real speculative decoding on ``prompts`` (chat-templated); per kind: mean tokens per verify
    step (accepted drafts + the target's own token), acceptance rate, tok/s; optionally plain
    decoding on the same prompts for tok/s and, when greedy, token identity."""
    from tqdm import tqdm

    from .engine import Engine, SamplingParams
    from .speculative import SpeculativeEngine

    sp = sp or SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    spec = SpeculativeEngine(backend, tokenizer, draft, k=k)
    plain = Engine(backend, tokenizer)
    rows: dict[str, dict] = {}
    if prompts:  # warm-up, untimed: the draft's graphs (one per k reached, K shrinks at the end), caches
        ids = tokenizer.encode_chat([{"role": "user", "content": prompts[0]["text"]}])
        for eng in (spec, plain) if compare_plain else (spec,):
            eng.cached = []
            eng.generate(ids, dataclasses.replace(sp, max_new_tokens=min(sp.max_new_tokens, 2 * k + 2)))
    t0 = time.perf_counter()
    for r in tqdm(prompts, desc=f"eval k={k}", unit="prompt", disable=None):
        if time_budget is not None and time.perf_counter() - t0 > time_budget:
            log(f"eval: time budget {time_budget:.0f}s reached")
            break
        ids = tokenizer.encode_chat([{"role": "user", "content": r["text"]}])
        spec.cached = plain.cached = []  # the two engines share one KV cache: no prefix reuse
        res = spec.generate(ids, sp)
        st = spec.last_stats
        d = rows.setdefault(r["kind"], {"prompts": 0, "steps": 0, "accepted": 0, "drafted": 0,
                                        "tokens": 0, "spec_s": 0.0, "plain_tokens": 0, "plain_s": 0.0,
                                        "identical": 0})
        d["prompts"] += 1
        d["steps"] += st.steps
        d["accepted"] += st.accepted
        d["drafted"] += st.drafted
        d["tokens"] += len(res.token_ids) - 1
        d["spec_s"] += res.decode_s
        if compare_plain:
            spec.cached = plain.cached = []
            pres = plain.generate(ids, sp)
            d["plain_tokens"] += len(pres.token_ids) - 1
            d["plain_s"] += pres.decode_s
            d["identical"] += int(pres.token_ids == res.token_ids)
    table = {}
    for kind, d in list(rows.items()) + [("all", {key: sum(v[key] for v in rows.values())
                                                 for key in next(iter(rows.values()), {})})]:
        if not d or not d.get("steps"):
            continue
        row = {"prompts": d["prompts"],
               "tokens_per_step": round((d["accepted"] + d["steps"]) / d["steps"], 3),
               "accept_rate": round(d["accepted"] / max(d["drafted"], 1), 3),
               "spec_tok_s": round(d["tokens"] / d["spec_s"], 1) if d["spec_s"] else None}
        if compare_plain:
            row["plain_tok_s"] = round(d["plain_tokens"] / d["plain_s"], 1) if d["plain_s"] else None
            if sp.temperature == 0:
                row["identical_to_plain"] = f"{d['identical']}/{d['prompts']}"
        table[kind] = row
    return table


def print_eval_table(table: dict, k: int, out=sys.stdout) -> None:
    cols = ["prompts", "tokens_per_step", "accept_rate", "spec_tok_s", "plain_tok_s", "identical_to_plain"]
    cols = [c for c in cols if any(c in r for r in table.values())]
    print(f"k={k}  (tokens_per_step counts the target's own token: 1 + accepted drafts)", file=out)
    print(f"{'kind':<8}" + "".join(f"{c:>20}" for c in cols), file=out)
    for kind, r in table.items():
        print(f"{kind:<8}" + "".join(f"{str(r.get(c, '')):>20}" for c in cols), file=out)


# ------------------------------------------------------------------ CLI

def _device_dtype(args):
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return dev, (torch.float32 if dev.type == "cpu" else torch.bfloat16)


def cmd_harvest(args) -> int:
    from .loading import load_model

    lm = load_model(args.model)
    dev, dtype = _device_dtype(args)
    prompts = draft_prompts("train")
    if args.kinds:
        bad = set(args.kinds.split(",")) - set(KINDS)
        if bad:
            raise DraftError(f"--kinds: unknown kind {sorted(bad)[0]!r}; choose from {', '.join(KINDS)}")
        prompts = [p for p in prompts if p["kind"] in args.kinds.split(",")]
    if args.num_prompts:
        prompts = prompts[: args.num_prompts]
    print(f"harvest: {len(prompts)} prompts from {PROMPT_SET} on {dev} ({dtype}), batch {args.batch_size}, "
          f"{args.max_new_tokens} new tokens each", flush=True)
    harvest(lm, args.out, prompts, args.batch_size, args.max_new_tokens, args.temperature, dev, dtype,
            args.time_budget, args.seed)
    return 0


def cmd_train(args) -> int:
    from .loading import load_model

    lm = load_model(args.model)
    dev, _ = _device_dtype(args)
    data = load_harvest(args.data, lm.cfg)
    dcfg = draft_config_for(lm.cfg, args.layers, args.intermediate_size, args.k)
    draft = DraftHead(dcfg).to(dev)
    draft.attach_target(lm.cfg, lm.params, dev, torch.float32 if dev.type == "cpu" else torch.bfloat16)
    print(f"train: {data.tokens.shape[0]} sequences; draft {num_parameters(draft) / 1e6:.2f}M params "
          f"({args.layers} block(s)), rollout depth {args.depth}, on {dev}", flush=True)
    rec = train_draft(draft, data, args.out, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                      depth=args.depth, reg_weight=args.reg_weight, time_budget=args.time_budget,
                      eval_every=args.eval_every, ckpt_every=args.ckpt_every, k_eval=args.k,
                      seed=args.seed, resume=args.resume)
    save_draft(draft, args.out, dtype=getattr(torch, args.save_dtype))
    order, meta = rank_vocab(data, lm.cfg.vocab_size)
    save_vocab_ranking(args.out, order, meta)
    brief = {k: rec[k] for k in ("steps", "kept_step", "loss_first", "loss_last") if k in rec}
    print(f"train: draft saved to {args.out} ({json.dumps(brief)})")
    return 0


def cmd_vocab(args) -> int:
    p = resolve_draft_path(args.draft)
    cj = p / "draft.json"
    if not cj.exists():
        raise DraftError(f"{cj}: file not found")
    d = json.loads(cj.read_text())
    vocab_size = d.get("vocab_size")
    if not isinstance(vocab_size, int) or vocab_size <= 0:
        raise DraftError(f"{cj}: field 'vocab_size' must be a positive integer, got {vocab_size!r}")
    if args.size is not None and not 0 <= args.size <= vocab_size:
        raise DraftError(f"--size must lie in 0..{vocab_size} (0: the full vocabulary), got {args.size}")
    if args.data:
        order, meta = rank_vocab(load_harvest(args.data), vocab_size)
        save_vocab_ranking(p, order, meta)
        print(f"vocab: {meta['tokens_counted']} generated tokens, {meta['distinct']} distinct; share covered by "
              "the first N: " + ", ".join(f"{n}: {c:.4f}" for n, c in meta["coverage"].items()))
    if args.size is not None:
        load_vocab_ranking(p, vocab_size)  # a size needs a ranking
        d["draft_vocab"] = args.size
        tmp = cj.with_name(cj.name + ".tmp")
        tmp.write_text(json.dumps(d, indent=2) + "\n")
        os.replace(tmp, cj)
        print(f"vocab: {cj} drafts from the first {args.size or vocab_size} ranked tokens")
    return 0


def cmd_eval(args) -> int:
    from .backend import default_backend, make_backend
    from .engine import SamplingParams
    from .loading import load_model

    lm = load_model(args.model)
    if lm.tokenizer is None:
        raise DraftError(f"{lm.source}: eval needs a tokenizer (the prompts are text)")
    name = args.backend or default_backend()
    backend = make_backend(name, lm, args.max_seq_len, device=args.device)
    draft = load_draft(args.draft, lm.cfg, lm.params, device=backend.device, draft_vocab=args.draft_vocab)
    prompts = eval_prompts(args.prompts_per_kind)
    sp = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                        seed=args.seed)
    results = {"draft": str(args.draft), "backend": name, "device": str(backend.device),
               "prompt_set": PROMPT_SET, "max_new_tokens": args.max_new_tokens,
               "temperature": args.temperature, "by_k": {}}
    ks = [int(x) for x in args.k.split(",")] if args.k else [draft.cfg.k_default]
    for i, k in enumerate(ks):
        table = eval_acceptance(backend, lm.tokenizer, draft, prompts, k, args.max_new_tokens, sp,
                                compare_plain=args.plain and i == 0, time_budget=args.time_budget)
        print_eval_table(table, k)
        results["by_k"][str(k)] = table
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results))
    return 0


def register(sub) -> None:
    p = sub.add_parser("draft", help="speculative-decoding draft head: harvest, train, eval")
    dsub = p.add_subparsers(dest="draft_command", required=True)

    def model_args(q):
        q.add_argument("--model", default=None, help="target model spec (default: the embedded SmolLM2)")
        q.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
        q.add_argument("--seed", type=int, default=0)

    q = dsub.add_parser("harvest", help=f"target continuations of {PROMPT_SET} -> hidden-state shards")
    model_args(q)
    q.add_argument("--out", required=True, help="shard directory (resumable: done prompts are skipped)")
    q.add_argument("--num-prompts", type=int, default=None, help="first N training prompts (default all)")
    q.add_argument("--kinds", default=None, help=f"comma list of {', '.join(KINDS)} (default all)")
    q.add_argument("--batch-size", type=int, default=64)
    q.add_argument("--max-new-tokens", type=int, default=256)
    q.add_argument("--temperature", type=float, default=0.0, help="0 = greedy continuations")
    q.add_argument("--time-budget", type=float, default=None, help="stop after this many seconds")
    q.set_defaults(func=cmd_harvest)

    q = dsub.add_parser("train", help="train a draft head (teacher forcing + multi-step rollout)")
    model_args(q)
    q.add_argument("--data", required=True, help="harvest shard directory")
    q.add_argument("--out", required=True,
                   help="draft directory (draft.json, draft.safetensors, train_state.pt)")
    q.add_argument("--layers", type=int, default=1, help="MLP blocks after the 2H->H projection")
    q.add_argument("--intermediate-size", type=int, default=None, help="default: the target's")
    q.add_argument("--depth", type=int, default=3, help="rollout depth (1 = teacher forcing only)")
    q.add_argument("--steps", type=int, default=2000)
    q.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    q.add_argument("--lr", type=float, default=1e-3)
    q.add_argument("--reg-weight", type=float, default=0.5, help="weight of the hidden-state loss")
    q.add_argument("--k", type=int, default=4, help="draft tokens per step for validation and the default K")
    q.add_argument("--eval-every", type=int, default=250)
    q.add_argument("--ckpt-every", type=int, default=500)
    q.add_argument("--time-budget", type=float, default=None, help="stop after this many seconds")
    q.add_argument("--save-dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    q.add_argument("--resume", action="store_true", help="continue from OUT/train_state.pt")
    q.set_defaults(func=cmd_train)

    q = dsub.add_parser("vocab", help="the drafting vocabulary: rank tokens by a harvest, choose how many to draft from")
    q.add_argument("--draft", required=True, help="draft directory")
    q.add_argument("--data", default=None, help="harvest shard directory: (re)write the ranking from it")
    q.add_argument("--size", type=int, default=None,
                   help="draft from the first N ranked tokens (stored in draft.json; 0: the full vocabulary)")
    q.set_defaults(func=cmd_vocab)

    q = dsub.add_parser("eval", help="acceptance of speculative decoding on held-out prompts, by kind")
    model_args(q)
    q.add_argument("--draft", required=True, help="draft directory or shipped draft name")
    q.add_argument("--backend", default=None, help="decode backend (default: as flint chat)")
    q.add_argument("--max-seq-len", type=int, default=1024)
    q.add_argument("--k", default=None,
                   help="draft tokens per step; comma list to sweep (default: the draft's)")
    q.add_argument("--prompts-per-kind", type=int, default=8)
    q.add_argument("--max-new-tokens", type=int, default=128)
    q.add_argument("--temperature", type=float, default=0.0)
    q.add_argument("--top-p", type=float, default=1.0)
    q.add_argument("--plain", action="store_true", help="also decode without the draft (tok/s, identity)")
    q.add_argument("--draft-vocab", type=int, default=None,
                   help="drafting vocabulary size (default: draft.json's draft_vocab; 0: the full vocabulary)")
    q.add_argument("--time-budget", type=float, default=None, help="per k, stop after this many seconds")
    q.add_argument("--json", default=None, help="write the results here")
    q.set_defaults(func=cmd_eval)
