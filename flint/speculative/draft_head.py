"""The speculative-decoding draft head (EAGLE-style): the model, its rollouts, and its files.

A draft step maps (the target's last-layer hidden state at position i, the embedding of token i+1)
to a guess of the target's hidden state at i+1, and reads the next token off it through the
target's own final norm and LM head (tied, read-only, never saved with the draft):

    f = fc([rmsnorm(h), rmsnorm(embed[t])])  2H -> H;   f += MLP(rmsnorm(f)) per block;
    logits = target_head(target_norm(f))

Rolling forward K steps feeds each predicted f back in as the next h (on CUDA: one kernel launch
greedy, else a captured CUDA graph). ``attention_heads`` > 0 adds one attention block over the draft's own features
after fc (flint/speculative/draft_attention.py: state across steps, decoded on torch only). Drafts are saved
as ``draft.safetensors`` + ``draft.json`` (format, shapes, target name/fingerprint, default K, training record); ``load_draft`` refuses a
draft whose hidden_size or vocab_size differ from the target's. A drafting vocabulary comes from
the token ranking in ``vocab.safetensors``, read and written here.

The rest of the draft: flint/speculative/draft_data.py (the prompt set, harvest shards, the token ranking),
flint/speculative/draft_train.py (training, validation, acceptance eval), flint/speculative/cli.py (`flint draft`).

Tests: ``pytest tests/test_draft.py tests/test_speculative.py``. The shipped SmolLM2 draft and its
measurements: docs/speculative.md.
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import FlintError
from .draft_attention import DraftAttention, heads_fit
from ..model import dense, rms_norm
from ..quant.int4 import Int4Weight, fit_group_size, quantize_int4

FORMAT = "flint-draft-v1"
SHIPPED_DRAFTS = Path(__file__).parent.parent / "data" / "drafts"


class DraftError(FlintError, ValueError):
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
    # > 0: one attention block over the draft's own features after fc (flint/speculative/draft_attention.py)
    attention_heads: int = 0
    target: dict = field(default_factory=dict)  # name, arch, num_layers, fingerprint
    training: dict = field(default_factory=dict)  # how it was trained (steps, depth, val acceptance)
    format: str = FORMAT


def target_fingerprint(cfg) -> str:
    """A short hash of the target's shape; equal shapes give equal fingerprints (any quantization)."""
    key = [cfg.arch, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers,
           cfg.num_heads, cfg.num_kv_heads, cfg.head_dim]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]


def draft_config_for(target_cfg, num_layers: int = 1, intermediate_size: int | None = None,
                     k_default: int = 4, attention_heads: int = 0) -> DraftConfig:
    return DraftConfig(
        hidden_size=target_cfg.hidden_size, vocab_size=target_cfg.vocab_size,
        intermediate_size=intermediate_size or target_cfg.intermediate_size, num_layers=num_layers,
        rms_norm_eps=target_cfg.rms_norm_eps, k_default=k_default, attention_heads=attention_heads,
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
    pipelined = True  # greedy rollouts from device inputs: begin / finish (flint.speculative.verify)

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.norm_hidden = RMSNorm(h, eps)
        self.norm_embed = RMSNorm(h, eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.blocks = nn.ModuleList(MLPBlock(h, cfg.intermediate_size, eps) for _ in range(cfg.num_layers))
        if cfg.attention_heads and not heads_fit(h, cfg.attention_heads):
            raise DraftError(f"attention_heads {cfg.attention_heads}: must divide the hidden size {h} into heads of "
                             "even width")
        self.attn = DraftAttention(h, cfg.attention_heads, RMSNorm(h, eps)) if cfg.attention_heads else None
        with torch.no_grad():  # start as "the next hidden state is the current one" plus noise
            nn.init.normal_(self.fc.weight, std=0.02)
            self.fc.weight[:, :h] += torch.eye(h)
            for b in self.blocks:
                b.down.weight.mul_(0.1)
        # the target's embedding, final norm and LM head: attached, read-only, never saved
        self.embed = self.head = self.final_norm = None
        self.vocab_ids = None  # the drafting vocabulary (None: all of the target's)
        self.embed_src = None  # the target's embedding for lookups of any token id
        self.target_mats = None  # (embed, lm_head, tied) as the target holds them
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
            self.embed_src = _as_int4(src).to(device)
        self.final_norm = params["norm"].to(device=device, dtype=dtype)
        self.target_mats = (src, head, tied)  # the kernel rollout's int4 view (int4_rollout_weights)
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
        x = self._features(hidden, token_embed)
        # over the true pairs so far and this rollout's own steps (flint/speculative/draft_attention.py)
        if self.attn is not None:
            x = x + self.attn(self.attn.norm(x))
        for b in self.blocks:
            x = b(x)
        return x

    def _features(self, hidden: torch.Tensor, token_embed: torch.Tensor) -> torch.Tensor:
        """fc([norm(h), norm(embed)]): the step's feature (and, with attention, what it attends over)."""
        dt = self.fc.weight.dtype
        return self.fc(torch.cat((self.norm_hidden(hidden.to(dt)), self.norm_embed(token_embed.to(dt))), -1))

    # ---------------------------------------------------------------- state (a draft with attention)
    @property
    def stateful(self) -> bool:
        """Whether decoding carries state across steps (``reset_state`` / ``observe``): a draft with attention."""
        return self.attn is not None

    def _need_state(self):
        if not self.attn.has_state:
            raise DraftError("a draft with attention decodes with state: call reset_state(max_len) when a generation "
                             "starts (flint.speculative.verify does)")

    def begin_rollout(self) -> None:
        """Training and validation: the next forward is step 1 of a batched rollout
        (flint/speculative/draft_train.py)."""
        if self.attn is not None:
            self.attn.begin_rollout()

    def reset_state(self, max_len: int) -> None:
        """A generation starts: the attention's cache of true pairs, empty, for ``max_len`` positions of the region
        (from the prompt's last token on). Nothing to do without attention."""
        if self.attn is not None:
            self.attn.reset_state(max_len, self.device, self.dtype)

    @torch.inference_mode()
    def observe(self, hidden: torch.Tensor, tokens: torch.Tensor, count: torch.Tensor) -> None:
        """After a verify: the first ``count`` [1] (on the device) of the pairs (hidden[j], tokens[j]), the target's
        state at the step's position j and the token after it, were accepted; they join the attention's true pairs
        before the next rollout (whose own start pair joins there itself). Nothing to do without attention."""
        if self.attn is None or tokens.shape[0] == 0:
            return
        self._need_target()
        self._need_state()
        h = hidden.reshape(-1, self.cfg.hidden_size).to(self.device, self.dtype)
        x = self._features(h, self.embed_tokens(tokens.reshape(-1).to(self.device)))
        self.attn.append(self.attn.norm(x), count.to(self.device))

    def _rollout(self, h: torch.Tensor, tok: torch.Tensor, k: int, u: torch.Tensor | None = None,
                 sampling: tuple = ()):
        """k draft steps from hidden h [1, H] and token tok [1], all on the device (no host sync,
        fixed shapes: the body of the captured graph). Greedy (u None): returns (ids [k], None);
        the argmax skips what cannot move it (the final norm's rstd and the logit scale are positive
        scalars per row). Sampling: ``sampling`` = (temperature, top_k, top_p) and u [k] uniform
        draws; step j takes the first token whose cumulative q exceeds u[j] (inverse CDF: never a
        token of q = 0); returns (ids [k], q [k, V], 0 outside the drafting vocabulary)."""
        from ..engine import inverse_cdf_draw, probs_from_logits

        idx, qs = [], []
        e = self.embed_tokens(tok)
        if self.attn is not None:
            self._need_state()
            self.attn.begin_decode()
        for j in range(k):
            h = self.forward(h, e)
            if u is None:
                x = F.rms_norm(h, (h.shape[-1],), self.final_norm, self.target_eps)
                i = torch.argmax(F.linear(x, self.head)[0]).view(1)
            else:
                q = probs_from_logits(self.logits(h)[0], *sampling)
                i = inverse_cdf_draw(q, u[j:j + 1])
                qs.append(q)
            idx.append(i)
            e = F.embedding(i, self.embed)  # a proposal is in the drafting vocabulary: its rows embed it
        if u is None:
            return self.ids(torch.cat(idx)), None
        return self.ids(torch.cat(idx)), self._full_q(torch.stack(qs))

    def _full_q(self, q: torch.Tensor) -> torch.Tensor:
        """q [k, N] over the drafting vocabulary -> [k, V]: 0 at the tokens the draft cannot propose."""
        if self.vocab_ids is None:
            return q
        return torch.zeros(q.shape[0], self.cfg.vocab_size, device=q.device, dtype=q.dtype).index_copy_(1, self.vocab_ids, q)

    def _graphed_rollout(self, k: int, sampling: tuple = ()) -> "_GraphedRollout | None":
        """The captured rollout for k (and the sampling transform) on CUDA, built on first use, or
        None where graphs do not apply (CPU, FLINT_DRAFT_GRAPH=0)."""
        if self.device.type != "cuda" or os.environ.get("FLINT_DRAFT_GRAPH", "1") == "0" or self.attn is not None:
            return None  # (attention: its state is not captured; the rollout runs eagerly)
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
        draft's distribution over the drafting vocabulary (q is 0 outside it). On CUDA the rollout is one
        launch of the rollout kernel (greedy, or sampling with its seed drawn from ``gen``: q = softmax(logits / T),
        a request's top-k / top-p left to the target's side, ``samples_pipelined``); otherwise it replays a
        captured CUDA graph of ~13 k small kernels (q after the same temperature / top-k / top-p as the target's,
        its uniform draws from ``gen`` outside it);
        FLINT_DRAFT_GRAPH=0 runs the same kernels eagerly."""
        self._need_target()
        greedy = sp is None or sp.temperature == 0
        tok = torch.full((1,), int(context_ids[-1]), dtype=torch.long, device=self.device)  # (a fill: no host sync)
        if greedy:
            return self.begin(hidden, tok, k), None
        if self.samples_pipelined(sp):  # one launch on the int4 matrices: q = softmax(logits / T), Gumbel-max draws
            return self.finish_sampled(self.begin_sampled(hidden, tok, k, sp, gen), k, sp)
        sampling = (float(sp.temperature), int(sp.top_k), float(sp.top_p))
        h = hidden.reshape(1, -1).to(self.device, self.dtype)
        u = torch.rand(k, generator=gen, device=self.device)
        g = self._graphed_rollout(k, sampling)
        return g(h, tok, u) if g is not None else self._rollout(h, tok, k, u, sampling)

    @torch.inference_mode()
    def begin(self, hidden: torch.Tensor, tok: torch.Tensor, k: int) -> torch.Tensor:
        """The greedy rollout of ``k`` tokens from device inputs, enqueued without a host synchronisation:
        ``hidden`` [H] (or [1, H]) is the target's hidden state before token ``tok`` (LongTensor [1] on the
        draft's device). Returns the proposals' LongTensor [k] on the device, still being computed;
        flint.speculative.verify enqueues the next step's rollout this way before it reads the current step's verify
        back (``finish``)."""
        self._need_target()
        kr = self._kernel_rollout()
        if kr is not None:
            return kr(hidden, tok, k)
        h = hidden.reshape(1, -1).to(self.device, self.dtype)
        g = self._graphed_rollout(k)
        return g(h, tok, None)[0] if g is not None else self._rollout(h, tok, k)[0]

    def samples_pipelined(self, sp) -> bool:
        """Whether a sampled rollout for ``sp`` runs from device inputs (``begin_sampled``): on the rollout kernel, for
        any temperature, top-k and top-p. The kernel draws from softmax(logits / T) alone; speculative sampling is
        exact for any proposal distribution q as long as the acceptance uses the q the draws came from, so a request's
        top-k / top-p shape the target's p only (its drafts outside the target's nucleus are rejected; the graph
        rollout, without the kernel, applies them to q as well)."""
        if sp is None or sp.temperature == 0:
            return False
        return self._kernel_rollout() is not None

    @torch.inference_mode()
    def begin_sampled(self, hidden: torch.Tensor, tok: torch.Tensor, k: int, sp, gen):
        """``begin`` for sampling at a temperature (``samples_pipelined``): the kernel rollout draws each token from
        softmax(logits / T) by the Gumbel-max rule, its seed drawn from ``gen`` on the device. Returns the pending
        (token ids [k], logits [k, N]) for ``finish_sampled``."""
        seed = torch.randint(0, 2 ** 62, (1,), generator=gen, device=self.device, dtype=torch.long)
        return self._kernel_rollout()(hidden, tok, k, float(sp.temperature), seed)

    def finish_sampled(self, pending, k: int, sp, raw: bool = False):
        """The first ``k`` proposals of a ``begin_sampled`` rollout and their q [k, V] (softmax(logits / T) over the
        drafting vocabulary, 0 elsewhere; ``q_from_logits``); a draw does not depend on the steps after it, so a
        shorter k keeps q. ``raw``: (ids, logits [k, N]) instead, q left to the caller (flint.speculative.verify
        computes it inside its captured acceptance)."""
        ids, logits = pending
        if k > ids.shape[0]:
            raise ValueError(f"draft finish: {k} proposals asked of a rollout of {ids.shape[0]}")
        if raw:
            return ids[:k], logits[:k]
        return ids[:k], self.q_from_logits(logits[:k], float(sp.temperature))

    def q_from_logits(self, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """The kernel rollout's q [k, V] from its logits [k, N] at a temperature: softmax(logits / T) over the drafting
        vocabulary, 0 elsewhere (no host sync: capturable)."""
        from ..engine import probs_from_logits

        return self._full_q(probs_from_logits(logits, temperature))

    def finish(self, pending: torch.Tensor, context_ids: list[int], k: int) -> torch.Tensor:
        """The first ``k`` proposals of a rollout ``begin`` enqueued (k no more than it was asked for)."""
        if k > pending.shape[0]:
            raise ValueError(f"draft finish: {k} proposals asked of a rollout of {pending.shape[0]}")
        return pending[:k]

    def _kernel_rollout(self) -> "_KernelRollout | None":
        """The one-launch rollout (flint/kernels/draft_kernel.cu; greedy, or sampling at a temperature) where it applies: CUDA, bf16, widths
        divisible by 8, at most 4 MLP blocks; FLINT_DRAFT_KERNEL=0 turns it off (the graph then runs). It reads
        the int4 matrices of ``int4_rollout_weights`` where the widths are multiples of 32 (FLINT_DRAFT_WEIGHTS=bf16,
        or other widths: the bf16 ones)."""
        if (self.device.type != "cuda" or self.dtype != torch.bfloat16 or os.environ.get("FLINT_DRAFT_KERNEL", "1") == "0"
                or self.attn is not None  # (the kernel has no attention)
                or self.cfg.hidden_size % 8 or self.cfg.intermediate_size % 8 or not 1 <= len(self.blocks) <= 4
                or (self.embed_src is not None and self.embed_src.qweight.device != self.device)):
            return None
        weights = kernel_weights()
        if weights == "int4" and (self.cfg.hidden_size % 32 or self.cfg.intermediate_size % 32):
            if "FLINT_DRAFT_WEIGHTS" in os.environ:  # asked for, cannot be honoured
                raise DraftError(f"FLINT_DRAFT_WEIGHTS=int4: the draft's hidden {self.cfg.hidden_size} and intermediate "
                                 f"{self.cfg.intermediate_size} must be multiples of 32 (int4 groups)")
            weights = "bf16"  # the default follows the shapes
        key = (self.device, id(self.head), id(self.embed), id(self.vocab_ids), id(self.embed_src),
               weights, tuple(p._version for p in self.parameters()))
        kernels = self.__dict__.setdefault("_kernels", {})  # one per weights format (an A/B keeps both)
        kr = kernels.get(weights)
        if kr is None or kr.key != key:
            kr = kernels[weights] = _KernelRollout(self, key, weights)
        return kr


class _KernelRollout:
    """The greedy k-step rollout as one cooperative launch of flint_draft_rollout (libflint_mk.so): the draft's
    tensors made contiguous once, scratch for the hand-offs, a pointer table refreshed per call for its inputs."""

    N_BLOCKS_MAX = 4

    def __init__(self, draft: DraftHead, key, weights: str):
        import ctypes

        from ..megakernel import load_library

        self.key = key
        lib = load_library()
        if not hasattr(lib, "flint_draft_rollout"):
            raise DraftError("the kernel library has no flint_draft_rollout (rebuild: python -m flint.kernels.build --force)")
        self.lib, self.ct = lib, ctypes
        dev, bf = draft.device, torch.bfloat16
        H, I = draft.cfg.hidden_size, draft.cfg.intermediate_size
        nblk = len(draft.blocks)
        c = lambda t, dt=bf: t.detach().to(device=dev, dtype=dt).contiguous()  # noqa: E731
        self.weights = weights
        self.keep = keep = {"w_nh": c(draft.norm_hidden.weight), "w_ne": c(draft.norm_embed.weight),
                            "w_final": c(draft.final_norm)}
        groups = {}  # a matrix's group size (0: bf16)

        def put(name, w):  # a matrix: bf16 rows, or int4 rows (flint-int4-v1)
            if isinstance(w, Int4Weight):
                keep[name + ".q"], keep[name + ".s"], keep[name + ".m"] = (
                    t.to(dev).contiguous() for t in (w.qweight, w.scales, w.mins))
                groups[name] = w.group_size
            else:
                keep[name + ".w"] = c(w)
                groups[name] = 0

        ids = draft.vocab_ids
        if self.weights == "int4":
            q = int4_rollout_weights(draft)
            put("fc", q["fc"])
            for i in range(nblk):
                put(f"gu{i}", q[f"gu{i}"])
                put(f"down{i}", q[f"down{i}"])
            put("head", q["head"])  # the target's rows, through the drafting vocabulary's ids
            emb = q["embed"]
        else:
            put("fc", draft.fc.weight)
            for i, b in enumerate(draft.blocks):
                put(f"gu{i}", b._gate_up())
                put(f"down{i}", b.down.weight)
            put("head", draft.head)
            keep["embed"] = c(draft.embed)
            emb = draft.embed_src if ids is not None else None
        if ids is not None:
            keep["ids"] = c(ids, torch.long)
        if emb is not None:
            keep["e_q"], keep["e_s"], keep["e_m"] = (t.to(dev).contiguous() for t in (emb.qweight, emb.scales, emb.mins))
        nb = lib.flint_draft_grid_blocks()
        if nb < 1:
            raise DraftError("flint_draft_grid_blocks: no CUDA device")
        keep["f"] = torch.empty(H, device=dev)
        keep["act"] = torch.empty(I, device=dev)
        keep["x"] = torch.empty(H, device=dev)
        keep["keys"] = torch.empty(nb, dtype=torch.long, device=dev)
        ptr = lambda name: keep[name].data_ptr() if name in keep else None  # noqa: E731
        mat = lambda name: [ptr(name + f) for f in (".w", ".q", ".s", ".m")]  # noqa: E731
        nmax = self.N_BLOCKS_MAX
        for i, b in enumerate(draft.blocks):
            keep[f"bn{i}"] = c(b.norm.weight)
        ptrs = [*mat("fc"), ptr("w_nh"), ptr("w_ne"), *[ptr(f"bn{i}") for i in range(nmax)]]
        for i in range(nmax):
            ptrs += mat(f"gu{i}")
        for i in range(nmax):
            ptrs += mat(f"down{i}")
        int4_head = self.weights == "int4"
        ptrs += [ptr("w_final"), *mat("head"), ptr("ids") if int4_head else None,
                 ptr("embed"), ptr("ids")]
        self.i_tok = len(ptrs)
        ptrs += [None,  # tok
                 ptr("embed") if ids is None and not int4_head else None,  # emb_full
                 ptr("e_q"), ptr("e_s"), ptr("e_m")]
        self.i_h0 = len(ptrs)
        ptrs += [None, ptr("f"), ptr("act"), ptr("x"), ptr("keys")]
        self.i_out = len(ptrs)
        ptrs += [None, None, None, None]  # out; sampling: logits, seed; the traced build's stamps (lab/draft_trace.py)
        self.i_trace = self.i_out + 3
        # the argument tables are built once; a call sets its inputs' slots (token, hidden state, output) and k
        self.ptrs = (ctypes.c_void_p * len(ptrs))(*ptrs)
        gs = [groups["fc"], *[groups.get(f"gu{i}", 0) for i in range(nmax)],
              *[groups.get(f"down{i}", 0) for i in range(nmax)], groups["head"]]
        self.ints = (ctypes.c_longlong * (6 + len(gs)))(H, I, draft.draft_vocab_size, nblk, 0,
                                                        emb.group_size if emb is not None else 0, *gs)
        self.floats = (ctypes.c_float * 4)(draft.norm_hidden.eps, draft.target_eps, draft.logits_scaling, 1.0)
        self.n_rows = draft.draft_vocab_size

    def __call__(self, hidden: torch.Tensor, tok: torch.Tensor, k: int, temperature: float = 0.0,
                 seed: torch.Tensor | None = None):
        """Greedy (temperature 0): the proposals' ids [k]. Sampling: (ids [k], logits [k, N] fp32 over the drafting
        vocabulary, the target's logit scale applied), token j drawn from softmax(logits[j] / temperature) by the
        Gumbel-max rule on uniforms hashed from ``seed`` (an int64 [1] on the device) and (j, row)."""
        h0 = hidden.reshape(-1).to(device=self.keep["x"].device, dtype=torch.float32).contiguous()
        tok = tok.to(torch.long).contiguous()
        out = torch.empty(k, dtype=torch.long, device=h0.device)
        self.ptrs[self.i_tok], self.ptrs[self.i_h0], self.ptrs[self.i_out] = tok.data_ptr(), h0.data_ptr(), out.data_ptr()
        logits = None
        if temperature > 0:
            if seed is None or seed.dtype != torch.long or seed.device != h0.device:
                raise DraftError("kernel rollout sampling needs seed, an int64 tensor [1] on the draft's device")
            logits = torch.empty(k, self.n_rows, device=h0.device)
            self.ptrs[self.i_out + 1], self.ptrs[self.i_out + 2] = logits.data_ptr(), seed.data_ptr()
            self.floats[3] = max(float(temperature), 1e-6)  # (probs_from_logits' floor)
        else:
            self.ptrs[self.i_out + 1] = self.ptrs[self.i_out + 2] = None
        self.ints[4] = k
        stream = torch.cuda.current_stream(h0.device)
        rc = self.lib.flint_draft_rollout(self.ints, self.ptrs, self.floats, self.ct.c_void_p(stream.cuda_stream))
        if rc != 0:
            raise DraftError(f"flint_draft_rollout failed: CUDA error {rc}")
        return out if logits is None else (out, logits)


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


KERNEL_WEIGHTS = ("int4", "bf16")


def kernel_weights() -> str:
    """The format of the matrices the kernel rollout reads: FLINT_DRAFT_WEIGHTS, int4 (default) or bf16."""
    w = os.environ.get("FLINT_DRAFT_WEIGHTS", "int4")
    if w not in KERNEL_WEIGHTS:
        raise DraftError(f"FLINT_DRAFT_WEIGHTS={w!r}: expected one of {', '.join(KERNEL_WEIGHTS)}")
    return w


@torch.no_grad()
def int4_rollout_weights(draft: DraftHead) -> dict:
    """The int4 matrices (flint-int4-v1) the kernel rollout reads: the draft's fc, gate|up and down rounded to
    nearest once (groups of 128, or the largest that divides K), and the target's own embedding and head as the
    target holds them when they are int4 (else rounded once); the head's rows are the target's whole head, which
    the kernel reads through the drafting vocabulary's ids. {"fc", "gu<i>", "down<i>", "head", "embed"} ->
    Int4Weight on the draft's device."""
    draft._need_target()
    dev = draft.device
    out = {"fc": _as_int4(draft.fc.weight, "fc").to(dev)}
    for i, b in enumerate(draft.blocks):
        out[f"gu{i}"] = _as_int4(b._gate_up(), f"blocks.{i}.gate_up").to(dev)
        out[f"down{i}"] = _as_int4(b.down.weight, f"blocks.{i}.down").to(dev)
    src, head, tied = draft.target_mats
    out["embed"] = _kernel_int4(draft.embed_src if draft.embed_src is not None else _as_int4(src, "embed")).to(dev)
    out["head"] = out["embed"] if tied else _kernel_int4(_as_int4(head, "lm_head")).to(dev)
    return out


def _kernel_int4(w: Int4Weight) -> Int4Weight:
    """The fields the int4 kernels read (an ExactInt4Weight's fp16 scales / mins)."""
    return w.kernel_view() if hasattr(w, "kernel_view") else w


def num_parameters(draft: DraftHead) -> int:
    return sum(p.numel() for p in draft.parameters())


def _rows(w, ids: torch.Tensor):
    """Rows ``ids`` of a target weight (Int4Weight or dense); exact."""
    return w.rows(ids) if isinstance(w, Int4Weight) else w[ids]


def _as_int4(w, name: str = "embed") -> Int4Weight:
    """A matrix in the int4 layout: as it is when it is int4 (the target's GGUF Q4_0/Q4_1 or flint checkpoint
    tensors), else rounded to nearest once in groups of 128 or the largest that divides K (the target's embedding
    for the draft's single-row lookups, the draft's own matrices for its kernel rollout: its input and proposals
    only, the output stays exact)."""
    if isinstance(w, Int4Weight):
        return w
    return quantize_int4(w.detach().float(), fit_group_size(w.shape[1], 128, name), name=name)


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


def shipped_head_for(target_cfg) -> str | None:
    """The name of a shipped draft head built for this model's shape (draft.json's target fingerprint), or None."""
    if not SHIPPED_DRAFTS.is_dir():
        return None
    want = target_fingerprint(target_cfg)
    for d in sorted(SHIPPED_DRAFTS.iterdir()):
        try:
            meta = json.loads((d / "draft.json").read_text())
        except (OSError, ValueError):
            continue
        if meta.get("target", {}).get("fingerprint") == want:
            return d.name
    return None


def load_draft(path: str | Path, target_cfg, target_params: dict | None = None, device=None,
               dtype: torch.dtype | None = None, draft_vocab: int | None = None) -> DraftHead:
    """Load a draft directory (or a shipped draft's name) for ``target_cfg``; refuses a draft built
    for another target. With ``target_params`` the target's embedding/norm/head are attached, with
    a drafting vocabulary of ``draft_vocab`` tokens (None: draft.json's ``draft_vocab``; 0: all V)
    taken from the ranking in vocab.safetensors.
    ``ngram``: the draft-free prompt-lookup proposals of flint.speculative.ngram (any model, nothing loaded);
    ``suffix``: the draft-free suffix-trie proposals of flint.speculative.suffix; ``auto``: flint.speculative.auto's
    choice per step between the suffix draft and the draft head shipped for this model, if any."""
    from safetensors import safe_open

    if str(path) == "ngram":
        if draft_vocab:
            raise DraftError(f"draft_vocab={draft_vocab}: the ngram draft proposes tokens of the context, it has "
                             "no drafting vocabulary")
        from .ngram import NgramDraft
        return NgramDraft(target_cfg.vocab_size)
    if str(path) in ("suffix", "auto"):
        from .suffix import SuffixDraft
        if str(path) == "suffix":
            if draft_vocab:
                raise DraftError(f"draft_vocab={draft_vocab}: the suffix draft proposes tokens of the context and "
                                 "earlier outputs, it has no drafting vocabulary")
            return SuffixDraft(target_cfg.vocab_size)
        from .auto import AutoDraft
        name = shipped_head_for(target_cfg) if target_params is not None else None
        if draft_vocab and name is None:
            raise DraftError(f"draft_vocab={draft_vocab}: no draft head is shipped for this model, so the auto draft "
                             "has no drafting vocabulary")
        head = load_draft(name, target_cfg, target_params, device, dtype, draft_vocab) if name else None
        return AutoDraft(SuffixDraft(target_cfg.vocab_size), head)

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
