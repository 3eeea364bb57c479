"""`flint draft`: the commands that build, train and measure a speculative-decoding draft head.

    flint draft harvest --out SHARDS [--prompt-set v2] [--sampled-passes S]
                                                   the target's continuations -> hidden-state shards
    flint draft train --data SHARDS --out DRAFT    teacher forcing + multi-step rollout
    flint draft vocab --draft DRAFT [--data SHARDS] [--size N]   the drafting vocabulary
    flint draft eval --draft DRAFT [--k 2,3,4]     acceptance on held-out prompts, by kind

The work itself lives beside this file: draft_head.py (the model and its files), draft_data.py (prompts,
harvest, token ranking) and draft_train.py (training, evaluation). Tests:
``pytest tests/test_draft.py tests/test_cli.py``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..options import add_device_arg, finite_float, int_at_least
from .draft_head import (DraftError, DraftHead, draft_config_for, load_draft, load_vocab_ranking, num_parameters,
                    resolve_draft_path, save_draft, save_vocab_ranking)
from .draft_data import (ALL_KINDS, PROMPT_SET, PROMPT_SETS, draft_prompts, eval_prompts, harvest, harvest_passes,
                         load_harvest, rank_vocab, resolve_prompt_set)
from .draft_train import eval_acceptance, init_weights, print_eval_table, train_draft


def _device_dtype(args):
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return dev, (torch.float32 if dev.type == "cpu" else torch.bfloat16)


def temperature_list(s: str) -> list[float]:
    """argparse type: a temperature or a comma list of them."""
    one = finite_float(0.0)
    return [one(x) for x in s.split(",")]


def k_list(s: str) -> list[int]:
    """argparse type: a draft length (>= 1) or a comma list of them."""
    one = int_at_least(1)
    return [one(x) for x in s.split(",")]


def parse_passes(sampled: int, temperatures: list[float] | None, top_p: float | None):
    """--sampled-passes / --temperature / --top-p as harvest passes (pass 0 greedy); the sampling
    options without sampled passes are refused, not ignored."""
    if not sampled and (temperatures is not None or top_p is not None):
        raise DraftError("--temperature / --top-p set the sampled passes: give --sampled-passes N (N >= 1); "
                         "pass 0 is always greedy")
    return harvest_passes(sampled, temperatures or [0.7, 1.0], 0.95 if top_p is None else top_p)


def cmd_harvest(args) -> int:
    from ..loading import load_model

    prompt_set = resolve_prompt_set(args.prompt_set)
    passes = parse_passes(args.sampled_passes, args.temperature, args.top_p)
    lm = load_model(args.model)
    dev, dtype = _device_dtype(args)
    prompts = draft_prompts("train", prompt_set)
    if args.kinds:
        kinds = PROMPT_SETS[prompt_set][1]
        bad = set(args.kinds.split(",")) - set(kinds)
        if bad:
            raise DraftError(f"--kinds: {prompt_set} has no kind {sorted(bad)[0]!r}; choose from {', '.join(kinds)}")
        prompts = [p for p in prompts if p["kind"] in args.kinds.split(",")]
    if args.num_prompts:
        prompts = prompts[: args.num_prompts]
    print(f"harvest: {len(prompts)} prompts from {prompt_set} x {len(passes)} pass(es) "
          f"({', '.join('greedy' if p.greedy else f'T={p.temperature} top_p={p.top_p}' for p in passes)}) "
          f"on {dev} ({dtype}), batch {args.batch_size}, {args.max_new_tokens} new tokens each", flush=True)
    harvest(lm, args.out, prompts, args.batch_size, args.max_new_tokens, device=dev, dtype=dtype,
            time_budget=args.time_budget, seed=args.seed, passes=passes, prompt_set=prompt_set)
    return 0


def cmd_train(args) -> int:
    from ..loading import load_model

    if args.attention_heads < 0:
        raise DraftError(f"--attention-heads must be >= 0, got {args.attention_heads}")
    lm = load_model(args.model)
    dev, _ = _device_dtype(args)
    dcfg = draft_config_for(lm.cfg, args.layers, args.intermediate_size, args.k, args.attention_heads)
    draft = DraftHead(dcfg).to(dev)  # (refuses heads that do not divide the hidden size, before the harvest loads)
    data = load_harvest(args.data, lm.cfg)
    init = init_weights(draft, args.init, lm.cfg) if args.init else None
    draft.attach_target(lm.cfg, lm.params, dev, torch.float32 if dev.type == "cpu" else torch.bfloat16)
    print(f"train: {data.tokens.shape[0]} sequences; draft {num_parameters(draft) / 1e6:.2f}M params "
          f"({args.layers} block(s){f', attention in {args.attention_heads} heads' if args.attention_heads else ''}), "
          f"rollout depth {args.depth}, on {dev}", flush=True)
    rec = train_draft(draft, data, args.out, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                      depth=args.depth, reg_weight=args.reg_weight, time_budget=args.time_budget,
                      eval_every=args.eval_every, ckpt_every=args.ckpt_every, k_eval=args.k,
                      seed=args.seed, resume=args.resume, init=init)
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
    from ..backend import default_backend, make_backend
    from ..engine import SamplingParams
    from ..loading import load_model

    prompt_set = resolve_prompt_set(args.prompt_set)
    lm = load_model(args.model)
    if lm.tokenizer is None:
        raise DraftError(f"{lm.source}: eval needs a tokenizer (the prompts are text)")
    name = args.backend or default_backend()
    backend = make_backend(name, lm, args.max_seq_len, device=args.device)
    draft = load_draft(args.draft, lm.cfg, lm.params, device=backend.device, draft_vocab=args.draft_vocab)
    prompts = eval_prompts(args.prompts_per_kind, prompt_set=prompt_set)
    sp = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                        seed=args.seed)
    results = {"draft": str(args.draft), "backend": name, "device": str(backend.device),
               "prompt_set": prompt_set, "max_new_tokens": args.max_new_tokens,
               "temperature": args.temperature, "by_k": {}}
    ks = args.k or [draft.cfg.k_default]
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
        add_device_arg(q)
        q.add_argument("--seed", type=int, default=0)

    sets = ", ".join(n.rsplit("-", 1)[1] for n in PROMPT_SETS)
    q = dsub.add_parser("harvest", help="target continuations of a draft prompt set -> hidden-state shards")
    model_args(q)
    q.add_argument("--out", required=True,
                   help="shard directory (resumable: (prompt, pass) pairs already there are skipped)")
    q.add_argument("--prompt-set", default="v1", help=f"training prompts of: {sets} (default v1, {PROMPT_SET})")
    q.add_argument("--num-prompts", type=int, default=None, help="first N training prompts (default all)")
    q.add_argument("--kinds", default=None, help=f"comma list of the set's kinds ({', '.join(ALL_KINDS)}; default all)")
    q.add_argument("--batch-size", type=int, default=64)
    q.add_argument("--max-new-tokens", type=int, default=256)
    q.add_argument("--temperature", type=temperature_list, default=None,
                   help="temperature of the sampled passes, or a comma list they take in turn (default 0.7,1.0)")
    q.add_argument("--top-p", type=finite_float(0.0, 1.0, lo_open=True), default=None,
                   help="nucleus of the sampled passes (default 0.95)")
    q.add_argument("--sampled-passes", type=int_at_least(0), default=0,
                   help="after the greedy pass 0, this many passes sampled from the target (default 0)")
    q.add_argument("--time-budget", type=float, default=None, help="stop after this many seconds")
    q.set_defaults(func=cmd_harvest)

    q = dsub.add_parser("train", help="train a draft head (teacher forcing + multi-step rollout)")
    model_args(q)
    q.add_argument("--data", required=True, help="harvest shard directory")
    q.add_argument("--out", required=True,
                   help="draft directory (draft.json, draft.safetensors, train_state.pt)")
    q.add_argument("--layers", type=int, default=1, help="MLP blocks after the 2H->H projection")
    q.add_argument("--intermediate-size", type=int, default=None, help="default: the target's")
    q.add_argument("--attention-heads", type=int, default=0,
                   help="one attention block over the draft's own features after fc, in this many heads (0: none; "
                        "decoded on the torch path: the rollout kernel has no attention)")
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
    q.add_argument("--init", default=None,
                   help="start from this draft's weights (directory or shipped name) instead of a random init")
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
    q.add_argument("--k", type=k_list, default=None,
                   help="draft tokens per step; comma list to sweep (default: the draft's)")
    q.add_argument("--prompt-set", default="v1", help=f"held-out prompts of: {sets} (default v1)")
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
