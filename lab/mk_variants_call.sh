#!/usr/bin/env bash
# One device call for variants built by lab/mk_variants.py (carry: ["build"]): the megakernel GPU tests
# inside each variant's tree, then one same-call A/B (lab/mk_ab.py). The real-SmolLM2 test runs when the
# GGUF was staged first at /var/tmp/flint/smollm2.gguf (docs/megakernel.md, "Build, test, measure"); else it skips.
#   device: VARS="a b" AB="base a b" ROUNDS=4 bash lab/mk_variants_call.sh
#   (AB_TOOL=mk_ab1 AB_ARGS="--check --model smollm2-135m --group 64": the one-process A/B, its options)
set -u
R=$PWD; export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
G=/var/tmp/flint/smollm2.gguf
[ -f $G ] && export FLINT_SMOLLM2_GGUF=$G && echo "gguf $(sha256sum $G | cut -c1-16)"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
for V in ${VARS:?set VARS to the variants to test}; do
  echo "== tests $V"
  (cd build/var/$V && export PYTHONPATH=/tmp/site:$PWD FLINT_KERNEL_DIR=$R/build/kernels &&
   python3 -c "import flint; print(flint.__file__)" &&
   timeout ${TT:-150} python3 -u -m pytest -q -x -m gpu $R/tests/test_megakernel.py -p no:cacheprovider -rs 2>&1 | tail -6;
   echo "tests $V rc=${PIPESTATUS[0]} (124: timed out, e.g. a deadlock)")
done
# AB_TOOL=mk_ab1: the variants in one process on one backend (they must share the host side; --check diffs their
# logits against the first's); mk_ab (default): one process each
FLINT_KERNEL_DIR=build/kernels timeout 400 python3 -u lab/${AB_TOOL:-mk_ab}.py ${AB:?set AB to the A/B variants} \
  --m ${MS:-1,2} --rounds ${ROUNDS:-4} ${AB_ARGS:-} 2>&1 | tee $OUT/ab.log | tail -30
