#!/usr/bin/env bash
# One device call (writes at most 8 files to $OUT: the device tool returns no more) that validates the GPU paths after the GGUF is staged (see docs/megakernel.md):
# megakernel + compiled GPU tests (incl. SmolLM2 256-token greedy vs reference), the chat selftest on
# the megakernel, flint bench (compiled vs megakernel, same run), and compute-sanitizer on a 1-layer model.
# Usage on the device: bash bench/gpu_validate.sh   (carry: build, .stage2; part_aa already in /var/tmp/flint;
# SANITIZE=0: without the sanitizers)
set -uo pipefail
export PYTHONUNBUFFERED=1 FLINT_KERNEL_DIR=build/kernels
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
G=/var/tmp/flint/smollm2.gguf
[ -f $G ] || cat /var/tmp/flint/part_aa .stage2/part_ab > $G
echo "sha256 $(sha256sum $G | cut -c1-16) expected $(cut -c1-16 .stage2/smollm2.sha256)"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .stage2/*.whl && export PYTHONPATH=/tmp/site:$PWD
export FLINT_SMOLLM2_GGUF=$G
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 -m pytest -q -m gpu tests/test_megakernel.py tests/test_compiled.py -rs 2>&1 | tee $OUT/pytest_gpu.log | tail -25
python3 -m flint chat --selftest --model $G 2>&1 | tee $OUT/selftest.log
python3 -m flint bench --model synthetic:smollm2-135m --backend compiled,megakernel --ctx 512,2048 --tokens 32 --repeats 3 --json $OUT/bench_smollm2.json 2>&1 | tail -8
python3 -m flint bench --model synthetic:granite-4.1-3b --backend compiled,megakernel \
  --ctx 512,2048,8192 --tokens 32 --repeats 3 --json $OUT/bench.json --plot $OUT/bench.png 2>&1 | tail -12
timeout 150 python3 -m flint bench --model $G --backend megakernel --ctx 512 --draft smollm2-135m --tokens 64 --repeats 3 --json $OUT/bench_spec.json 2>&1 | tail -8
# SANITIZE=0 skips the sanitizers (a change that leaves the kernel's SASS as validated: host or Python code only)
[ "${SANITIZE:-1}" = 0 ] && { echo "sanitizers skipped (SANITIZE=0)"; exit 0; }
for S in 0 1; do  # the down stage, then the FFN split-K path (forced on the 1-layer shape)
  echo "== FLINT_MK_FFN_SPLIT=$S" >> $OUT/memcheck.log; echo "== FLINT_MK_FFN_SPLIT=$S" >> $OUT/racecheck.log
  FLINT_MK_FFN_SPLIT=$S timeout 120 compute-sanitizer --tool memcheck --print-limit 5 python3 bench/sanitize_run.py >> $OUT/memcheck.log 2>&1; echo "memcheck split=$S rc=$?"; tail -3 $OUT/memcheck.log
  FLINT_MK_FFN_SPLIT=$S timeout 120 compute-sanitizer --tool racecheck --print-limit 5 python3 bench/sanitize_run.py >> $OUT/racecheck.log 2>&1; echo "racecheck split=$S rc=$?"; tail -3 $OUT/racecheck.log
done
# groups of 128 (the M = 1 object with gate|up's integer dot, MK_IDOT_RAW since v21), FFN split on
echo "== group 128" >> $OUT/racecheck.log; echo "== group 128" >> $OUT/memcheck.log
FLINT_MK_DEBUG_GROUP=128 FLINT_MK_FFN_SPLIT=1 timeout 120 compute-sanitizer --tool racecheck --print-limit 5 python3 bench/sanitize_run.py >> $OUT/racecheck.log 2>&1; echo "racecheck group=128 rc=$?"; tail -1 $OUT/racecheck.log
FLINT_MK_DEBUG_GROUP=128 FLINT_MK_FFN_SPLIT=1 timeout 120 compute-sanitizer --tool memcheck --print-limit 5 python3 bench/sanitize_run.py >> $OUT/memcheck.log 2>&1; echo "memcheck group=128 rc=$?"; tail -1 $OUT/memcheck.log
# head_dim 64 (the default 1-layer shape has 128): the attention paths kept to D = 64 (MK_PV3)
echo "== head_dim 64" >> $OUT/racecheck.log; echo "== head_dim 64" >> $OUT/memcheck.log
FLINT_MK_DEBUG_HEAD_DIM=64 timeout 120 compute-sanitizer --tool racecheck --print-limit 5 python3 bench/sanitize_run.py >> $OUT/racecheck.log 2>&1; echo "racecheck head_dim=64 rc=$?"; tail -1 $OUT/racecheck.log
FLINT_MK_DEBUG_HEAD_DIM=64 timeout 120 compute-sanitizer --tool memcheck --print-limit 5 python3 bench/sanitize_run.py >> $OUT/memcheck.log 2>&1; echo "memcheck head_dim=64 rc=$?"; tail -1 $OUT/memcheck.log
