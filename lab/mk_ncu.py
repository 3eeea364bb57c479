"""Launcher for Nsight Compute: the synthetic Granite-4.1-3B int4 G128 backend, warmed up (4 M = 1
steps at ctx 512, mk_dev.warm_granite), then 2 more steps. Profile the 5th launch:

    ncu --clock-control none --set full --import-source yes -k regex:decode_kernel --launch-skip 4 \
        --launch-count 1 -f -o $OUT/mk python3 lab/mk_ncu.py
    ncu -i $OUT/mk.ncu-rep --page source --csv --print-source sass > $OUT/mk_sass.csv
    python3 lab/mk_stalls.py $OUT/mk_sass.csv     # (here) warp-stall samples per source region
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from mk_dev import warm_granite  # noqa: E402

mk, step = warm_granite()
for _ in range(2):
    step()
torch.cuda.synchronize()
print("mk_ncu: done")
