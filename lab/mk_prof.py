"""A few megakernel launches on a reduced-depth Granite-4.1-3B shape, for ncu / compute-sanitizer:

    FLINT_KERNEL_DIR=build/kernels ncu --clock-control none -k regex:decode_kernel --launch-skip 2 \
        --launch-count 1 --section SpeedOfLight --section WarpStateStats python3 lab/mk_prof.py [layers]
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from mk_dev import warm_granite  # noqa: E402

mk, step = warm_granite(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
cfg = mk.cfg
print("done")
if mk.trace is not None:
    mk.trace.zero_()  # some slots accumulate
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(); step(); e.record(); e.synchronize()
    print(f"step {s.elapsed_time(e) * 1e3:.1f} us for {cfg.num_layers} layers")
    for b in (0, 1):
        print(f"block {'0' if b == 0 else 'last'}:", {k: round(v, 2) for k, v in mk.stage_times(b).items()})
