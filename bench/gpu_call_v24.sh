#!/usr/bin/env bash
# Issue 34, forty-first session: a verify step's penalty counts kept across steps (DraftCounts) and its rows held
# to the largest decode graph (spec_max_rows); issue 35's tier files with a numpy digest. Sections by $WHAT:
#   stash old tests spec eight   bench/gpu_call_v23.sh's, the old tree = this tree with
#                                ${PATCH:-bench/pending/spec_rows.patch} reversed (the tree before the session)
#   tiers    bench/tier_reads.py: the disk tier's read path part by part on 1 / 4 / 16 threads
#   restart  issue 35's restart cell (bench/gpu_call_v17.sh WHAT=restart TREES=new: 8B shape, 20k-token prompt),
#            on an H200 only (the card the issue names)
# Prints as it goes; everything under $OUT.
. bench/device_prelude.sh
for w in ${WHAT:-old spec tests tiers}; do t0=$(date +%s); case $w in
tiers)
  timeout 200 python3 bench/tier_reads.py --threads 1,4,16 > $OUT/tier_reads.txt 2>&1; cat $OUT/tier_reads.txt ;;
restart)
  if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
    WHAT=restart TREES=new timeout ${RESTART_S:-300} bash bench/gpu_call_v17.sh 2>&1 | grep -v "FAILED\|^patching" | tail -22
  else echo "not an H200: issue 35's cell skipped"; fi ;;
*)
  OUT=$OUT WHAT=$w PATCH=${PATCH:-bench/pending/spec_rows.patch} bash bench/gpu_call_v23.sh 2>&1 | grep -v "^NVIDIA\|^Model name\|^[0-9]*$" ;;
esac; echo "[$w: $(( $(date +%s) - t0 )) s, call at $(( $(date +%s) - T0 )) s]"; done
