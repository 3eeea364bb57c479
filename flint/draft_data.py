"""The draft's training data: the built-in prompt set, the harvest of the target's hidden states,
and the ranking of the tokens the target generated (the drafting vocabulary).

    prompt set  ``flint-draft-prompts-v1``: code, explain, qa, chat; templated subjects x
                instructions, deterministic, about one subject in ten held out for evaluation
    harvest     the target generates continuations of the prompts, batched, and stores the tokens
                and the hidden states the draft learns from as resumable safetensors shards
    rank_vocab  tokens by how often the target generated them; flint.draft saves and loads it

Run through ``flint draft harvest`` / ``flint draft vocab`` (flint/draft_cli.py). Tests:
``pytest tests/test_draft.py``.
"""
from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .draft import FORMAT, DraftError, target_fingerprint

PROMPT_SET = "flint-draft-prompts-v1"
KINDS = ("code", "explain", "qa", "chat")


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


def rank_vocab(data: HarvestData, vocab_size: int) -> tuple[torch.Tensor, dict]:
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
