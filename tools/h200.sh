#!/usr/bin/env bash
# Build peagle from source on the H200 machine (offline, torch 2.11 cu130) and run the GPU tests,
# compute-sanitizer and benchmarks. Logs and JSON results go to $OUT.
#   bash tools/h200.sh [build|test|sanitize|bench|all] ...      (carry .deps with the CUTLASS wheel)
# SKIP_BUILD=1 reuses the build of an earlier call in the same command; SANITIZE_TOOLS picks tools.
set -uo pipefail
OUT=${OUT:-/tmp/peagle-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
build() {
  if [ -n "${SKIP_BUILD:-}" ]; then return 0; fi
  # The image sets CXX to a newer GCC (/opt/gcc) whose libstdc++ headers do not match the system
  # libstdc++ torch runs with (iostream/locale code then crashes while formatting an error).
  # Build with the compiler torch was built with (GCC 13.3 = /usr/bin/g++ there).
  export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
  python3 -m pip install -q --no-index --no-deps --target /tmp/deps .deps/nvidia_cutlass-4.2.0.0-py3-none-any.whl || true
  export PEAGLE_CUTLASS_INCLUDE=/tmp/deps/cutlass_library/source/include
  local t0=$(date +%s)
  PEAGLE_CUDA_ARCHS="${PEAGLE_CUDA_ARCHS:-9.0a}" python3 -m pip install --no-build-isolation --no-deps \
    -C build-dir=build/h200 . > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s"
  python3 -c "import torch, peagle; print(torch.__version__, torch.cuda.get_device_name(0), torch._C._dispatch_dump('peagle::prepare_draft_inputs').count('CUDA'), 'CUDA kernels')"
}
run_tests() {
  timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -rfE --timeout=120 -p no:cacheprovider "${@:-tests}" \
    > "$OUT/tests.log" 2>&1
  echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -30
}
sanitize() {
  local tag=$(echo "${*:-all}" | tr ' ' '-')
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
    timeout ${SANITIZE_TIMEOUT:-150} compute-sanitizer --tool $tool --error-exitcode 1 \
      python3 tools/sanitize_ops.py "$@" > "$OUT/sanitize-$tool-$tag.log" 2>&1
    echo "compute-sanitizer $tool ($tag): rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize-$tool-$tag.log" | tail -1)"
  done
}
cmd=${1:-all}; shift || true
case $cmd in
  build) build ;;
  test) build; run_tests "$@" ;;
  sanitize) build; sanitize "$@" ;;
  all) build; run_tests; sanitize ;;
esac
