"""The speculative-decoding wing: a drafter proposes tokens, the target verifies them in one forward, and the
output is exactly the target's own.

    verify.py           SpeculativeEngine: the verify loop (greedy and lossless sampling) on any backend
    auto.py             `--draft auto`, the default: suffix proposals where they match strongly, else the shipped
                        draft head, else a plain step
    suffix.py           draft-free proposals from suffix tries over this request and recent outputs
    ngram.py            draft-free prompt-lookup (n-gram) proposals
    draft_head.py       the trained draft head (EAGLE-style): the model, its rollouts, its files, shipped drafts
    draft_attention.py  the draft head's optional attention over its own features
    draft_data.py       its training data: the prompt sets, the harvest of the target's hidden states, the vocabulary
    draft_train.py      its training and the measurement of its acceptance
    oracle.py           a benchmarking-only draft whose acceptance is set by hand (synthetic models)
    cli.py              `flint draft harvest | train | vocab | eval`

docs/speculative.md describes the design and its measurements. This file imports nothing: a module of the wing is
imported by name (flint.speculative.verify), and brings only what it uses.
"""
