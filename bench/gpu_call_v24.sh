#!/usr/bin/env bash
# Issue 34, forty-first session: a verify step's penalty counts kept across steps (DraftCounts) and its rows held
# to the largest decode graph (spec_max_rows); issue 35's tier files read and summed a chunk at a
# time without the GIL (imp.actors.kvtier_io). Sections by $WHAT:
#   stash old tests spec eight   bench/gpu_call_v23.sh's, the old tree = this tree with
#                                ${PATCH:-bench/pending/spec_rows.patch} reversed (50d55ac's imp: before the 41st session)
#   tiertests the GPU lane's tier tests (tests/test_gpu_kvcopy.py: the chunk loads on the device) and the CPU ones
#   tiers    bench/tier_reads.py: the disk tier's read path part by part on 1 / 8 / 16 threads, alone and beside a
#            busy Python thread (the GIL waits that kvtier_io's compiled chunk reads take away)
#   restart  issue 35's restart cell (bench/gpu_call_v17.sh WHAT=restart TREES=new: 8B shape, 20k-token prompt),
#            on an H200 only (the card the issue names) unless RESTART_ANY=1 (the loads' host side on any card)
# Prints as it goes; everything under $OUT.
. bench/device_prelude.sh
for w in ${WHAT:-old spec tests tiers}; do t0=$(date +%s); case $w in
tiertests)
  timeout ${TESTS_S:-200} python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/test_gpu_kvcopy.py \
    tests/test_kvtier_io.py tests/test_kv_tier.py > $OUT/tests_tier.txt 2>&1; grep -E "passed|failed|Error" $OUT/tests_tier.txt | tail -6 ;;
tiers)
  timeout 240 python3 bench/tier_reads.py --blocks 600 --threads 1,8,16 --busy 0,1 > $OUT/tier_reads.txt 2>&1; cat $OUT/tier_reads.txt ;;
restart)
  if [ -n "${RESTART_ANY:-}" ] || nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
    WHAT=restart TREES=new timeout ${RESTART_S:-300} bash bench/gpu_call_v17.sh 2>&1 | grep -v "FAILED\|^patching" | tail -22
  else echo "not an H200: issue 35's cell skipped"; fi ;;
*)
  OUT=$OUT WHAT=$w PATCH=${PATCH:-bench/pending/spec_rows.patch} bash bench/gpu_call_v23.sh 2>&1 | grep -v "^NVIDIA\|^Model name\|^[0-9]*$" ;;
esac; echo "[$w: $(( $(date +%s) - t0 )) s, call at $(( $(date +%s) - T0 )) s]"; done
