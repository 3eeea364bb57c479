"""The gap between consecutive decode launches of the device loop (greedy_run, as `flint bench` runs it): the
synthetic Granite-4.1-3B int4 G128 backend at ctx 512, 64 greedy steps after a warm-up. Run it under Nsight Systems
and read the kernels' start and end times:

    nsys profile -o $OUT/gap -f true python3 lab/mk_gap.py
    nsys stats -q --report cuda_gpu_trace --format csv -o $OUT/gap $OUT/gap.nsys-rep
    python3 lab/mk_gap.py --csv $OUT/gap_cuda_gpu_trace.csv      # (here or there) the per-launch gaps

Without --csv it runs the steps (and prints the step time from CUDA events), then the same 64 steps under
torch.profiler (CUPTI kernel records: the gaps without Nsight Systems, which the device machine lacks).
"""
import argparse
import csv
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def gaps(path: str) -> None:
    rows = [r for r in csv.DictReader(open(path)) if "decode_kernel" in r.get("Name", "")]
    if len(rows) < 3:
        sys.exit(f"mk_gap: {path}: fewer than 3 decode_kernel launches")
    start = [int(r["Start (ns)"]) for r in rows]
    dur = [int(r["Duration (ns)"]) for r in rows]
    g = [start[i + 1] - (start[i] + dur[i]) for i in range(len(rows) - 1)]
    period = [start[i + 1] - start[i] for i in range(len(rows) - 1)]
    print(f"{len(rows)} decode launches: duration median {statistics.median(dur) / 1e3:.1f} us, period median "
          f"{statistics.median(period) / 1e3:.1f} us, gap (next start - this end) median "
          f"{statistics.median(g) / 1e3:.2f} us, min {min(g) / 1e3:.2f}, max {max(g) / 1e3:.2f}")
    print(f"the gap is {100 * statistics.median(g) / statistics.median(period):.2f}% of the period")


def run() -> None:
    import torch
    from mk_dev import warm_granite
    mk, step = warm_granite()
    mk.greedy_run(7, 511, 16)  # warm the loop
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    mk.greedy_run(7, 480, 64)
    e1.record()
    torch.cuda.synchronize()
    print(f"greedy_run: 64 steps, {e0.elapsed_time(e1) * 1e3 / 64:.1f} us per step (CUDA events)")
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        mk.greedy_run(7, 480, 64)
        torch.cuda.synchronize()
    ks = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                if "decode_kernel" in e.name and e.device_type.name == "CUDA")
    if len(ks) < 3:
        sys.exit(f"mk_gap: the profiler recorded {len(ks)} decode_kernel launches")
    dur = [b - a for a, b in ks]
    period = [ks[i + 1][0] - ks[i][0] for i in range(len(ks) - 1)]
    g = [ks[i + 1][0] - ks[i][1] for i in range(len(ks) - 1)]
    print(f"torch.profiler: {len(ks)} decode launches: duration median {statistics.median(dur):.1f} us, period median "
          f"{statistics.median(period):.1f} us, gap (next start - this end) median {statistics.median(g):.2f} us, "
          f"min {min(g):.2f}, max {max(g):.2f} ({100 * statistics.median(g) / statistics.median(period):.2f}% of the "
          f"period)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", help="an nsys cuda_gpu_trace CSV: print the launch gaps instead of running")
    a = ap.parse_args()
    gaps(a.csv) if a.csv else run()
