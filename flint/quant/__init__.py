"""The int4 wing: flint's one packed weight layout and everything that writes it.

    int4.py      the flint-int4-v1 layout (Int4Weight), round-to-nearest and searched fits, the GGUF block
                 conversions into it, and the requantizing the backends do at load
    gptq.py      GPTQ: int4 rounding errors compensated over calibration activations
    hfquant.py   GPTQ, AWQ and compressed-tensors int4 checkpoints read straight into the layout
    quantize.py  `flint quantize MODEL OUT`: a flint int4 checkpoint that `--model OUT` loads directly

This file imports nothing: a module of the wing is imported by name (flint.quant.int4), and brings only what it uses.
"""
