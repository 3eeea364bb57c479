"""lab/mk_gap.py's reading of a kernel trace (CPU: a hand-made Nsight Systems cuda_gpu_trace CSV)."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

LAB = Path(__file__).resolve().parents[1]  # lab/


def load():
    spec = importlib.util.spec_from_file_location("mk_gap", LAB / "mk_gap.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gaps_from_csv(tmp_path, capsys):
    rows = ["Start (ns),Duration (ns),Name",
            "1000,1000000,void mk::decode_kernel<1>(...)",
            "1001500,50,memset",                              # other kernels are ignored
            "1003000,1000000,void mk::decode_kernel<1>(...)",
            "2005000,1000000,void mk::decode_kernel<1>(...)"]
    p = tmp_path / "t.csv"
    p.write_text("\n".join(rows) + "\n")
    load().gaps(str(p))
    out = capsys.readouterr().out
    assert "3 decode launches" in out
    assert "gap (next start - this end) median 2.00 us" in out     # 1003000 - 1001000 and 2005000 - 2003000
    assert "period median 1002.0 us" in out


def test_too_few_launches_is_an_error(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("Start (ns),Duration (ns),Name\n1000,10,void mk::decode_kernel<1>(...)\n")
    r = subprocess.run([sys.executable, str(LAB / "mk_gap.py"), "--csv", str(p)], capture_output=True,
                       text=True)
    assert r.returncode != 0 and "fewer than 3 decode_kernel launches" in r.stderr


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
