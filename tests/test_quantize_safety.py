"""`flint quantize` under the things that go wrong while it writes: SIGTERM / SIGHUP / Ctrl-C, a
writer's own error (safetensors' and tokenizers' are not OSError), a filesystem root as OUT, and
the hidden folders a killed run left behind. Every case ends without a traceback, with OUT
absent (or the old OUT unchanged) and no partial folder next to it.

Run: ``pytest tests/test_quantize_safety.py`` (~10 s); ``-m slow`` adds signals at random times to
real `python -m flint quantize` processes.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flint.cli import main

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
            rope_theta=10000.0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)


@pytest.fixture
def src(tmp_path) -> str:
    p = tmp_path / "tiny.json"
    p.write_text(json.dumps(TINY))
    return f"synthetic:{p}"


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(".out."))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_signal_while_writing_leaves_nothing(src, tmp_path, monkeypatch, sig):
    import flint.quant.quantize

    out = tmp_path / "out"
    before = signal.getsignal(sig)

    def killed(lm, where):
        assert (where / "model.safetensors").exists()
        os.kill(os.getpid(), sig)
        time.sleep(5)  # the handler raises before this ends
        raise AssertionError("the signal did not interrupt the write")
    monkeypatch.setattr(flint.quant.quantize, "_write_tokenizer", killed)
    with pytest.raises(SystemExit) as info:
        main(["quantize", src, str(out)])
    assert info.value.code == 128 + sig
    assert not out.exists() and leftovers(tmp_path) == []
    assert signal.getsignal(sig) == before  # the handler is put back


def test_writer_error_is_a_clear_error_naming_out(src, tmp_path, monkeypatch, capsys):
    import safetensors.torch

    out = tmp_path / "out"

    def full_disk(*a, **k):
        raise safetensors.SafetensorError("Error while serializing: IoError(No space left on device)")
    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    assert main(["quantize", src, str(out)]) == 2
    err = capsys.readouterr().err
    assert f"flint: error: {out}: writing the checkpoint failed" in err and "No space left" in err
    assert "Traceback" not in err and not out.exists() and leftovers(tmp_path) == []


def test_filesystem_root_as_out_refused(src, capsys):
    assert main(["quantize", src, "/"]) == 2
    assert "flint: error: /: is a filesystem root" in capsys.readouterr().err


def test_stale_folders_of_dead_runs_removed(src, tmp_path):
    dead = 2**22 + 12345  # above Linux's pid_max: no process has it
    stale = tmp_path / f".out.partial-{dead}-0badc0de"
    (stale / "sub").mkdir(parents=True)
    mine = tmp_path / f".out.partial-{os.getpid()}-00000000"  # a live process's: kept
    mine.mkdir()
    assert main(["quantize", src, str(tmp_path / "out")]) == 0
    assert not stale.exists() and mine.exists()
    old = tmp_path / f".out.old-{dead}-0badc0de"  # a swap that completed, OUT in place: removed
    old.mkdir()
    assert main(["quantize", "--force", src, str(tmp_path / "out")]) == 0
    assert leftovers(tmp_path) == [mine.name]


def test_stale_old_folder_kept_while_out_is_missing(tmp_path):
    """A run killed between its two renames: the old folder holds the only copy of OUT."""
    from flint.quant.quantize import remove_stale_siblings

    old = tmp_path / f".out.old-{2**22 + 7}-00000000"
    old.mkdir()
    assert remove_stale_siblings(tmp_path / "out") == [] and old.exists()


@pytest.mark.slow
@pytest.mark.usefixtures("slow_run")
def test_signals_at_random_times(src, tmp_path):
    """Real processes, a signal at a random time from start to finish: never a traceback, never
    a partial folder, OUT complete or absent."""
    rng = random.Random(0)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    env.pop("FLINT_DEBUG", None)
    for i in range(12):
        out = tmp_path / "out"
        sig = rng.choice([signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
        p = subprocess.Popen([sys.executable, "-m", "flint", "quantize", src, str(out), "--force"], env=env,
                             stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, cwd=tmp_path)
        time.sleep(rng.uniform(0.0, 6.0))
        p.send_signal(sig)
        _, err = p.communicate(timeout=120)
        assert b"Traceback" not in err, err.decode(errors="replace")
        assert leftovers(tmp_path) == [], (i, sig)
        if out.exists():
            assert (out / "config.json").exists() and (out / "model.safetensors").exists()
