"""Training the draft head, and measuring it: teacher forcing plus multi-step rollout on a
harvest, the validation estimate of acceptance, and the acceptance of real speculative decoding.

    train_draft       teacher forcing plus multi-step rollout (depth 3 default): the draft's own
                      predicted hidden states are fed forward and every step is scored against the
                      target; checkpoints, resume, validation on greedy sequences of held-out
                      subjects (sampled passes train only)
    init_weights      warm start from an existing draft's weights
    accepted_runs     the greedy walk on harvested sequences: how many draft tokens the target
                      would accept, without running it (simulated_acceptance, evaluate_val)
    eval_acceptance   mean tokens per verify step of real speculative decoding, by prompt kind

Run through ``flint draft train`` / ``flint draft eval`` (flint/speculative/cli.py). Tests:
``pytest tests/test_draft.py``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .draft_head import DraftError, DraftHead, load_draft
from .draft_data import ALL_KINDS, HarvestData


# ------------------------------------------------------------------ training

def _begin_rollout(draft) -> None:
    """A draft with state across the steps of one rollout (lab/draft_attn_study.py's attention over its own
    features) starts a new one here; the shipped DraftHead has none."""
    begin = getattr(draft, "begin_rollout", None)
    if begin is not None:
        begin()


def _top_hidden(draft, hidden: torch.Tensor) -> torch.Tensor:
    """The target's last-layer hidden state in a harvest's hidden rows: all of it for the shipped DraftHead; a draft
    that reads several layers' states (lab/draft_eagle3_study.py) says which part is the last layer's."""
    top = getattr(draft, "top_hidden", None)
    return hidden if top is None else top(hidden)


def rollout_losses(draft: DraftHead, hidden: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor,
                   depth: int, reg_weight: float = 0.5):
    """Teacher forcing (step 1) plus multi-step rollout (steps 2..depth) on a batch.

    hidden [B, L, H] (true), tokens [B, L], lengths [B]. Step s feeds the draft's step s-1
    prediction of hidden[j-1] with the true token j, and is scored at position j against the
    target's distribution there (KL) and its normalized hidden state (smooth L1).
    Returns (loss, per-step stats [{'kl', 'reg', 'top1'}])."""
    draft._need_full_vocab("training")
    _begin_rollout(draft)
    b, L, _ = hidden.shape
    pos = torch.arange(L, device=hidden.device)
    with torch.no_grad():
        logp = torch.log_softmax(draft.logits(hidden[:, 1:]), -1)  # target at positions 1..L-1
        p = logp.exp()
        entropy = -(p * logp).sum(-1)
        target_tok = logp.argmax(-1)
        del logp
        ht = _top_hidden(draft, hidden[:, 1:]).float()
        hn = F.normalize(ht, dim=-1) * math.sqrt(ht.shape[-1])
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
    _begin_rollout(draft)
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
    """{k: {'all': tokens per step, KIND: ...}} of the greedy walk over the ``rows`` sequences.
    On greedy sequences this is what greedy speculative decoding does on those prompts; on a
    sampled sequence it is no decoding's figure (the target's argmax scored along a path that it
    did not take greedily), which is why train_draft validates on greedy sequences only."""
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
        for ki, name in enumerate(ALL_KINDS):
            sel = kinds == ki
            if sel.any():
                out[k][name] = simulated_acceptance(runs[sel], lens[sel])
    return out


def _autocast(device):
    device = torch.device(device)
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def init_weights(draft: DraftHead, path, target_cfg) -> dict:
    """Start ``draft`` from the weights of the draft directory (or shipped draft name) ``path``
    instead of its random init; refuses one of another shape, naming the field. Returns where the
    weights came from, for the training record."""
    src = load_draft(path, target_cfg, dtype=torch.float32)
    for f in ("hidden_size", "intermediate_size", "num_layers"):
        a, b = getattr(src.cfg, f), getattr(draft.cfg, f)
        if a != b:
            raise DraftError(f"--init {path}: field {f!r} is {a}, the draft being trained has {f}={b}")
    with torch.no_grad():
        for k, v in src.state_dict().items():
            draft.state_dict()[k].copy_(v)
    tr = src.cfg.training or {}
    return {"draft": str(path), "prompt_set": (tr.get("harvest") or {}).get("prompt_set"), "steps": tr.get("steps")}


def train_draft(draft: DraftHead, data: HarvestData, out_dir: str | Path, steps: int = 2000,
                batch_size: int = 32, lr: float = 1e-3, depth: int = 3, reg_weight: float = 0.5,
                val_frac: float = 0.05, time_budget: float | None = None, eval_every: int = 250,
                ckpt_every: int = 500, k_eval: int = 4, seed: int = 0, resume: bool = False,
                init: dict | None = None, log=print) -> dict:
    """Train ``draft`` (its target attached, fp32 weights) on harvested data; checkpoints and the
    final draft go to ``out_dir``. Returns the training record (also stored in draft.json).

    Training uses every sequence of the training subjects, greedy and sampled passes alike;
    validation holds out ``val_frac`` of the subjects that have greedy sequences and replays
    greedy speculative decoding on those greedy sequences (evaluate_val); sampled sequences of
    held-out subjects are left out of both. ``init``: where the starting weights came from (see
    init_weights), for the record."""
    from tqdm import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = draft.device
    if device.type == "cuda":  # the whole harvest fits: no per-step host gathers
        data = dataclasses.replace(data, tokens=data.tokens.to(device), hidden=data.hidden.to(device),
                                   lengths=data.lengths.to(device))
    usable = [i for i, ln in enumerate(data.lengths.tolist()) if ln >= 2]
    greedy = data.greedy_rows().tolist()
    # validation holds out whole prompt subjects, so it measures prompts unlike any trained on
    groups = data.group.tolist() if data.group is not None else data.prompt_index.tolist()
    uniq = sorted({groups[i] for i in usable if greedy[i]})
    g = torch.Generator().manual_seed(seed)
    uniq = [uniq[i] for i in torch.randperm(len(uniq), generator=g).tolist()]
    n_val = min(len(uniq) - 1, math.ceil(len(uniq) * val_frac)) if val_frac > 0 else 0
    held = set(uniq[:max(n_val, 0)])
    val_rows = [i for i in usable if groups[i] in held and greedy[i]]
    train_rows = [i for i in usable if groups[i] not in held]
    if not train_rows:
        raise DraftError(f"train: no training sequences ({len(usable)} usable, all in the validation subjects)")
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
              "sequences": len(train_rows), "sampled_sequences": sum(1 for i in train_rows if not greedy[i]),
              "val_sequences": len(val_rows), "init": init,
              "harvest": {"prompt_set": data.meta.get("prompt_set"),
                          "max_new_tokens": int(data.meta.get("max_new_tokens", 0)),
                          "passes": data.meta.get("passes") or
                          [{"pass": 0, "temperature": float(data.meta.get("temperature", 0))}]},
              "train_s": round(time.perf_counter() - t0, 1)}
    if val_rows:
        ks = list(range(1, 9))
        acc = evaluate_val(draft, data, val_rows, ks, device)
        record["val_tokens_per_step"] = {str(k): round(v["all"], 3) for k, v in acc.items()}
        record["val_tokens_per_step_by_kind"] = {name: round(x, 3) for name, x in acc[k_eval].items()}
        log("train: val tokens/step by k (greedy walk on greedy sequences of held-out subjects, target token "
            "counted): " +
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

    from ..engine import Engine, SamplingParams
    from .verify import SpeculativeEngine

    sp = sp or SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    spec = SpeculativeEngine(backend, tokenizer, draft, k=k)
    plain = Engine(backend, tokenizer)
    rows: dict[str, dict] = {}
    if prompts:  # warm-up, untimed: the draft's graphs (one per k reached, K shrinks at the end), caches
        ids = tokenizer.encode_chat(_messages(prompts[0]))
        for eng in (spec, plain) if compare_plain else (spec,):
            eng.cached = []
            eng.generate(ids, dataclasses.replace(sp, max_new_tokens=min(sp.max_new_tokens, 2 * k + 2)))
    t0 = time.perf_counter()
    for r in tqdm(prompts, desc=f"eval k={k}", unit="prompt", disable=None):
        if time_budget is not None and time.perf_counter() - t0 > time_budget:
            log(f"eval: time budget {time_budget:.0f}s reached")
            break
        ids = tokenizer.encode_chat(_messages(r))
        spec.cached = plain.cached = []  # the two engines share one KV cache: no prefix reuse
        res = spec.generate(ids, sp)
        st = spec.last_stats
        d = rows.setdefault(r["kind"], {"prompts": 0, "steps": 0, "accepted": 0, "drafted": 0,
                                        "tokens": 0, "spec_s": 0.0, "plain_tokens": 0, "plain_s": 0.0,
                                        "identical": 0, "drafters": {}})
        d["prompts"] += 1
        for name, n in st.drafters.items():
            d["drafters"][name] = d["drafters"].get(name, 0) + n
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
    every = {key: sum(v[key] for v in rows.values()) for key in next(iter(rows.values()), {}) if key != "drafters"}
    every["drafters"] = {}
    for v in rows.values():
        for name, n in v["drafters"].items():
            every["drafters"][name] = every["drafters"].get(name, 0) + n
    for kind, d in list(rows.items()) + [("all", every)]:
        if not d or not d.get("steps"):
            continue
        row = {"prompts": d["prompts"],
               "tokens_per_step": round((d["accepted"] + d["steps"]) / d["steps"], 3),
               "accept_rate": round(d["accepted"] / max(d["drafted"], 1), 3),
               "spec_tok_s": round(d["tokens"] / d["spec_s"], 1) if d["spec_s"] else None,
               "drafters": {name: round(n / d["steps"], 3) for name, n in sorted(d["drafters"].items())}}
        if compare_plain:
            row["plain_tok_s"] = round(d["plain_tokens"] / d["plain_s"], 1) if d["plain_s"] else None
            if sp.temperature == 0:
                row["identical_to_plain"] = f"{d['identical']}/{d['prompts']}"
        table[kind] = row
    return table


def _messages(r: dict) -> list[dict]:
    """A prompt's conversation: its messages (the workload set), else its text as one user message."""
    return r.get("messages") or [{"role": "user", "content": r["text"]}]


def print_eval_table(table: dict, k: int, out=sys.stdout) -> None:
    cols = ["prompts", "tokens_per_step", "accept_rate", "spec_tok_s", "plain_tok_s", "identical_to_plain"]
    cols = [c for c in cols if any(c in r for r in table.values())]
    print(f"k={k}  (tokens_per_step counts the target's own token: 1 + accepted drafts)", file=out)
    print(f"{'kind':<8}" + "".join(f"{c:>20}" for c in cols), file=out)
    for kind, r in table.items():
        print(f"{kind:<8}" + "".join(f"{str(r.get(c, '')):>20}" for c in cols), file=out)
