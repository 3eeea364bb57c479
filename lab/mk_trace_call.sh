#!/usr/bin/env bash
# One device call for traced variants built by lab/mk_variants.py (carry: ["build"]; a traced variant needs
# MK_WS_ALL=1 (+ MK_WS_MAT) for lab/mk_units.py or MK_WS_RING=1 for lab/mk_ring.py): each NAME:TOOL runs the
# variant's own copy of the tool (build/var/NAME/lab/mk_TOOL.py; bench/ in a variant of a revision from before lab/)
# with FLINT_MK_TRACE=1 and keeps its output in $OUT/NAME_TOOL.txt.
#   here:   python3 lab/mk_variants.py gu=.:MK_WS_ALL=1:MK_WS_MAT=MAT_GU ring=.:MK_WS_RING=1
#   device: TRACES="gu:units ring:ring" MS=1 bash lab/mk_trace_call.sh
set -u
R=$PWD; export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
for T in ${TRACES:?set TRACES to NAME:TOOL pairs, TOOL units or ring}; do
  V=${T%%:*}; TOOL=${T#*:}
  case $TOOL in units|ring) ;; *) echo "mk_trace_call: $T: TOOL must be units or ring"; exit 2;; esac
  D=lab; [ -f build/var/$V/lab/mk_$TOOL.py ] || D=bench
  echo "== $V $TOOL ($D/mk_$TOOL.py)"
  (cd build/var/$V && PYTHONPATH=$PWD FLINT_KERNEL_DIR=$R/build/kernels FLINT_MK_TRACE=1 \
     timeout ${TT:-120} python3 $D/mk_$TOOL.py ${MS:-1} 2>&1 | tee "$OUT/${V}_$TOOL.txt" | head -${LINES_SHOWN:-40})
done
