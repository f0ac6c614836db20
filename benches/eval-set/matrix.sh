#!/bin/bash
# The evaluation-set matrix: each workload light (32 engines) and saturated (8 engines; multi-turn
# and rag also 4x faster arrivals), kvroute's policies and the reference's replay on the same trace.
set -e
# Usage: EVAL_DIR=DIR matrix.sh WORKLOAD:RATE:ENGINES ...; DIR holds NAME.jsonl from
# `kvroute replay --workload NAME --write-trace DIR/NAME.jsonl`. RATE divides timestamps.
# KVROUTE: the kvroute binary (default: the release build of `cargo build --release -p kvroute`).
HERE=$(cd "$(dirname "$0")" && pwd)
B=${KVROUTE:-${CARGO_TARGET_DIR:-$HERE/../../target}/release/kvroute}
PY=$HOME/.cache/kvroute/reference-venv/bin/python
cd "${EVAL_DIR:-/tmp/evalset}"
RUNS=${RUNS:-2}
for spec in "$@"; do
  IFS=: read w speed n <<< "$spec"
  f=$w-x$speed.jsonl
  python3 -c "
import json
out=open('$f','w'); ref=open('ref-$f','w')
for l in open('$w.jsonl'):
    d=json.loads(l); d['timestamp']=round(d['timestamp']/$speed)
    out.write(json.dumps(d)+'\n')
    d.pop('session_id',None); d.pop('parent_session_id',None)
    ref.write(json.dumps(d)+'\n')
"
  tag=$w-x$speed-$n
  $B replay --trace $f --workers $n --engine-profile reference --policy round-robin --policy kv --policy kv-adaptive --policy kv-locality --policy kv-affinity --json kv-$tag.json > kv-$tag.txt 2>&1
  $B replay --trace $f --workers $n --engine-profile reference --policy kv-locality --sticky-sessions --json sticky-$tag.json > sticky-$tag.txt 2>&1
  ( DYN_LOG=warn $PY "$HERE/reference_replay.py" ref-$f round_robin $n 512 64 16384 | tail -1 ) > ref-rr-$tag.json
  for i in $(seq $RUNS); do ( DYN_LOG=warn $PY "$HERE/reference_replay.py" ref-$f kv_router $n 512 64 16384 | tail -1 ) > ref-kv$i-$tag.json; done
  echo "done $tag $(date +%T)"
done
