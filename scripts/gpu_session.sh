#!/usr/bin/env bash
# CUDA checks and GPU benchmarks on a machine with an NVIDIA GPU whose python3 already holds
# PyTorch and which has no package registry (the README's "GPU validation" section):
#
#   bash scripts/gpu_session.sh STAGE...        stages run in the order given:
#     build      pip install --no-build-isolation --no-deps -e . for the visible GPU's architecture, then
#                how libstdc++ was linked: the flags, scripts/libstdcxx_link_check.py (the logged link
#                command relinked with and without setup.py's explicit libstdc++.so.6), tests/test_build.py
#     smoke      scripts/cuda_smoke.py: every kernel once, checked against the CPU kernels
#     cuda-tests pytest -m cuda (the CUDA cases of the test suite)
#     suite      the whole test suite with the GPU visible (pytest-xdist's 8 workers where it is
#                installed: a worker that crashes is replaced and the run goes on)
#     errors     scripts/cuda_error_probe.py: argument errors raised inside the compiled ops, each in
#                a fresh process (a segmentation fault there ended the suite on the H100)
#     sanitize   compute-sanitizer memcheck, racecheck, synccheck, initcheck on cuda_smoke.py --small
#     peers      build the source distributions in .whl/ (turbo-gnn: CUDA GNN kernels, a GATv2 peer)
#                into /tmp/torch_gradops_site
#     bench-gat, bench-gat-bf16, bench-gatv2, bench-conv, bench-conv-gatv2
#                the GPU benchmarks (JSON in benchmarks/results/*_cuda*.json): the GAT op at E = 2M,
#                10M, 50M in float32 and bfloat16, the GATv2 op, GATConv/GATv2Conv against PyG's
#                (bench-conv-gatv2: GATv2Conv alone)
#     bench-conv-scale
#                GATConv against PyG's at E = 20M and 100M (PyG runs out of memory there; a full-batch
#                layer of ours at E = 100M should fit in 80 GB)
#     bench-gat-ab  the GAT and GATv2 (edge_dim 16) ops' forward at E = 10M and 50M with
#                TORCH_GRADOPS_CUDA_EDGE_BATCH=1 (one edge at a time) and the default batch,
#                alternating, three processes each (the log)
#     bench-tn-lattice, bench-tn-circuit, bench-tn-unsliced
#                benchmarks/tensornet_sliced.py on the GPU: sliced lattices and circuits against
#                cotengra + autograd, unsliced circuits against torch.einsum / opt_einsum /
#                cotengra, with achieved FLOP/s against a same-run matmul
#
# Packages the machine lacks (cotengra, autoray, quimb, cytoolz; pytest-xdist and execnet for the
# suite stage) are taken from wheels in .whl/ when present (installed into
# /tmp/torch_gradops_site on every call, a few seconds). Each stage
# writes LOGDIR/<stage>.log and a line to LOGDIR/summary.txt (LOGDIR: gpu_logs); at the end the
# logs and the benchmarks' CUDA JSON are packed into gpu_logs.tar.gz, which goes, with
# summary.txt, to $OUT when that is set (the device tool returns at most 8 files).
# A failing stage does not stop the later ones (a failed build does). Exit status: the number of
# failed stages. A lent machine runs a call for at most 10 minutes and stays warm (keeping the
# build) for 30 s after it; a session has 15 device-minutes in all, its start included (about
# 30 s). Stage times measured on the H100 (2026-11-24): build 79 s, import 13 s, smoke 35 s,
# cuda-tests 81 s, sanitize 99 s, bench-gat 210 s, bench-conv 143-153 s per layer; on the H200
# (2026-11-27): build 64 s, import 9 s, errors 192 s (six cuda-gdb backtraces; now one, so about
# 60 s), smoke 53 s, cuda-tests 95 s, sanitize's memcheck 31 s, racecheck over 90 s. In 15
# minutes, with the device tool's timeout_s at 600:
#   call 1 (about 6 min): build errors cuda-tests sanitize
#   call 2, at once: suite (never completed on a GPU machine: the errors stage's crash ended it;
#   pytest-xdist is installed there) then bench-conv-gatv2 (about 2.5 min)
# and in a later session: bench-gatv2, bench-gat, bench-gat-bf16, bench-conv, the tensor-network
# stages.
# The stages' own time limits add up to more than one call may run: summary.txt, the last
# stage's log and an archive of every log so far go to $OUT after every stage, so a call cut off
# at its limit still returns them.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
LOGDIR="${LOGDIR:-gpu_logs}"
mkdir -p "$LOGDIR"
SUMMARY="$LOGDIR/summary.txt"

[ $# -gt 0 ] || set -- build smoke cuda-tests sanitize
for s in "$@"; do
  case "$s" in
    build|smoke|cuda-tests|suite|errors|sanitize|peers|bench-gat|bench-gat-bf16|bench-gat-ab|bench-gatv2|bench-conv) ;;
    bench-conv-gatv2|bench-conv-scale) ;;
    bench-tn-lattice|bench-tn-circuit|bench-tn-unsliced|__sanitize|__linkage) ;;
    *) echo "unknown stage: $s (build smoke cuda-tests suite errors sanitize peers bench-gat bench-gat-bf16 bench-gat-ab bench-conv-scale" \
            "bench-gatv2 bench-conv bench-conv-gatv2 bench-tn-lattice bench-tn-circuit bench-tn-unsliced)" >&2; exit 2 ;;
  esac
done
if ls .whl/*.whl >/dev/null 2>&1 && [[ ":${PYTHONPATH:-}:" != *:/tmp/torch_gradops_site:* ]]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/torch_gradops_site .whl/*.whl >"$LOGDIR/wheels.log" 2>&1 || echo "wheels: install failed" >>"$SUMMARY"
  export PYTHONPATH="/tmp/torch_gradops_site${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
  TORCH_CUDA_ARCH_LIST="$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())' 2>/dev/null || echo 9.0)"
  export TORCH_CUDA_ARCH_LIST
fi
export PYTHONUNBUFFERED=1 MAX_JOBS="${MAX_JOBS:-16}"
SIZES="100000:2000000 500000:10000000 2500000:50000000"  # NODES:EDGES of the GAT op benchmark (E = 2M, 10M, 50M)

failed=0
pack() {  # pack DIR: every log so far as DIR/<LOGDIR's name>.tar.gz (gpu_logs.tar.gz by default)
  tar -czf "$1/$(basename "$LOGDIR").tar.gz" -C "$(dirname "$LOGDIR")" "$(basename "$LOGDIR")" 2>/dev/null
}
conv_gatv2() {  # conv_gatv2 STAGE_NAME: GATv2Conv against PyG's, with and without edge features
  stage "$1" 270 "$PY" benchmarks/gat_conv.py --device cuda --layer gatv2 --edge-dims 0,16 \
    --sizes 100000:2000000 --out benchmarks/results/gatv2_conv_cuda.json
}
stage() {  # stage NAME TIMEOUT_S COMMAND...: run, log, time and record one stage
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS rc
  echo "== $name: $*" | tee -a "$LOGDIR/$name.log"
  timeout --kill-after=10 "$limit" "$@" >>"$LOGDIR/$name.log" 2>&1
  rc=$?
  printf '%-12s rc=%-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - t0))" "$*" | tee -a "$SUMMARY"
  if [ -n "${OUT:-}" ]; then  # after every stage: a call cut off at the tool's limit still returns these
    cp "$SUMMARY" "$OUT"/ 2>/dev/null
    cp "$LOGDIR/$name.log" "$OUT/last_stage.log" 2>/dev/null
    pack "$OUT"
  fi
  tail -n 3 "$LOGDIR/$name.log"
  [ "$rc" = 0 ] || failed=$((failed + 1))
  return "$rc"
}

sanitize() {  # (internal stage __sanitize)
  local tool rc=0
  for tool in memcheck racecheck synccheck initcheck; do
    echo "-- $tool"
    compute-sanitizer --tool "$tool" --error-exitcode 9 --print-limit 50 \
      "$PY" scripts/cuda_smoke.py --small >"$LOGDIR/sanitize_$tool.log" 2>&1 || rc=1
    tail -n 4 "$LOGDIR/sanitize_$tool.log"
  done
  return "$rc"
}

linkage() {  # (internal stage __linkage) a static libstdc++ copy crashed the first error message there
  "$PY" -c 'import sysconfig; print("LDSHARED:", sysconfig.get_config_var("LDSHARED"), "CXX:", sysconfig.get_config_var("CXX"))'
  env | grep -E '^(LD|C|CXX|CPP)FLAGS=|^CXX=|^CC=|^(LIBRARY_PATH|LD_LIBRARY_PATH)='
  # the compiler setup.py asks (_shared_libstdcxx): $CXX, else Python's configured one
  local cxx=${CXX:-$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("CXX") or "c++")')}
  $cxx --version | head -n 1
  echo "libstdc++.so.6: $($cxx -print-file-name=libstdc++.so.6)  libstdc++.so: $($cxx -print-file-name=libstdc++.so)" \
       " libstdc++.a: $($cxx -print-file-name=libstdc++.a)"
  local rc=0
  "$PY" scripts/libstdcxx_link_check.py "$LOGDIR/build.log" || rc=$?
  "$PY" -m pytest -q -p no:cacheprovider tests/test_build.py || rc=1
  return "$rc"
}

case "${1:-}" in  # stages that are shell functions run in a child, under the stage's timeout
  __sanitize) sanitize; exit $? ;;
  __linkage) linkage; exit $? ;;
esac
{ echo "# $(date -u +%FT%TZ) $(hostname)"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1; } >>"$SUMMARY"
for s in "$@"; do
  case "$s" in
    build) stage build 540 "$PY" -m pip install -v --no-build-isolation --no-deps -e . \
             && stage import 60 "$PY" -c 'import torch_gradops as t; assert t.built_with_cuda(), "no CUDA kernels"' \
             || break
           stage linkage 120 bash "$0" __linkage ;;  # how libstdc++ was linked
    smoke) stage smoke 300 "$PY" scripts/cuda_smoke.py ;;
    cuda-tests) stage cuda-tests 420 "$PY" -m pytest -q -m cuda -p no:cacheprovider ;;
    suite) workers=$("$PY" -c 'import xdist; print("-n 8")' 2>/dev/null)
           stage suite 540 "$PY" -m pytest -q -p no:cacheprovider $workers ;;
    errors) stage errors 300 "$PY" scripts/cuda_error_probe.py ;;
    sanitize) stage sanitize 540 bash "$0" __sanitize ;;
    peers) stage peers 540 bash -c '[ -z "$(ls .whl/*.tar.gz 2>/dev/null)" ] || "$0" -m pip install --no-build-isolation \
             --no-deps --no-cache-dir --target /tmp/torch_gradops_site .whl/*.tar.gz' "$PY" ;;
    bench-gat) stage bench-gat 540 "$PY" benchmarks/gat_attention.py --device cuda --sizes $SIZES \
                 --out benchmarks/results/gat_attention_cuda.json ;;
    bench-gat-bf16) stage bench-gat-bf16 540 "$PY" benchmarks/gat_attention.py --device cuda --dtype bfloat16 \
                      --sizes $SIZES --out benchmarks/results/gat_attention_cuda_bf16.json ;;
    bench-conv-scale) stage bench-conv-scale 540 "$PY" benchmarks/gat_conv.py --device cuda --layer gat \
                        --sizes 1000000:20000000,5000000:100000000 --repeats 2 \
                        --out benchmarks/results/gat_conv_cuda_scale.json ;;
    bench-gat-ab) stage bench-gat-ab 540 bash -c 'for rep in 1 2 3; do for size in 500000:10000000 2500000:50000000; do
                    for b in 1 default; do printf "gat edge_batch=%s nodes:edges=%s " "$b" "$size"
                      TORCH_GRADOPS_CUDA_EDGE_BATCH=$b "$0" benchmarks/gat_attention.py --worker --impl op --mode fwd \
                        --nodes "${size%%:*}" --edges "${size##*:}" --device cuda --repeats 10 || echo failed
                      printf "gatv2 edge_batch=%s nodes:edges=%s edge_dim=16 " "$b" "$size"
                      TORCH_GRADOPS_CUDA_EDGE_BATCH=$b "$0" benchmarks/gatv2_attention.py --worker --impl op --mode fwd \
                        --nodes "${size%%:*}" --edges "${size##*:}" --edge-dim 16 --device cuda --repeats 10 || echo failed
                    done; done; done' "$PY" ;;
    bench-gatv2) stage bench-gatv2 540 "$PY" benchmarks/gatv2_attention.py --device cuda \
                   --sizes 100000:2000000 500000:10000000 --out benchmarks/results/gatv2_attention_cuda.json ;;
    bench-conv) stage bench-conv 270 "$PY" benchmarks/gat_conv.py --device cuda --layer gat \
                  --sizes 100000:2000000,500000:10000000 --out benchmarks/results/gat_conv_cuda.json
                conv_gatv2 bench-conv ;;
    bench-conv-gatv2) conv_gatv2 bench-conv-gatv2 ;;
    bench-tn-lattice|bench-tn-circuit|bench-tn-unsliced)
      which=${s#bench-tn-}
      stage "$s" 540 "$PY" benchmarks/tensornet_sliced.py --device cuda --only "$which" --repeat 2 \
        --out "benchmarks/results/tensornet_sliced_${which}_cuda.json" ;;
  esac
done
cp benchmarks/results/*cuda*.json "$LOGDIR"/ 2>/dev/null
pack "$(dirname "$LOGDIR")"
if [ -n "${OUT:-}" ]; then
  cp "$LOGDIR.tar.gz" "$SUMMARY" "$OUT"/
fi
cat "$SUMMARY"
exit "$failed"
