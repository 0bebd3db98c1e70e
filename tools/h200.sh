#!/usr/bin/env bash
# Build peagle from source on the H200 machine (offline, torch 2.11 cu130) and run the GPU tests,
# compute-sanitizer and benchmarks. Logs and JSON results go to $OUT.
#   bash tools/h200.sh [build|test|sanitize|bench|all] ...      (carry .deps with the CUTLASS wheel)
#   test [pytest args]      the GPU test command: build + the whole suite (CUDA and CPU tests, the
#                           `slow` set included) under pytest-xdist, one OpenMP thread per worker;
#                           prints its wall time, build included (README "Building for a GPU")
#   bench [families]        `peagle bench ops` for prep verify attention kv (default) and/or e2e
#                           (concurrency 1), results in $OUT/<family>-<gpu>.json (gpu_tag: h200,
#                           or h100 where a lease gave an H100)
#   ab OLD_SRC [families]   old vs new in one reservation: builds the source tree OLD_SRC (e.g.
#                           `git archive <commit> | tar -x -C .ab/old`, carried) into /tmp/oldsite
#                           while the current tree builds, then times each family old, new, old,
#                           new (the repeat gives the same-variant spread, PERF.md §4); JSON + logs
#                           in $OUT/ab.tgz. AB_VARIANTS="DIR ..." adds trees (named by their
#                           folder: letters and underscores), built at the same time into
#                           /tmp/site-<name> and timed after new in each round
#   pair [args]             the default pair, recipe v3 (scripts/train_default_pair.py --device cuda)
#                           in build/pair-v3, each call stopping in time for the 9.5-minute limit;
#                           exit 75 = call again (the machine must stay warm: the work dir lives
#                           on it), 0 = done: the pair and its records are in $OUT (<= 8 files
#                           of <= 16 MiB; unpack with scripts/default_pair/bundle.py unpack)
#   e2e [args]              issue 19's end-to-end run on the packaged pair: `peagle bench e2e --k 1 3
#                           5 7 10 --concurrency 1 8 64 --num-prompts 64` (+ args) into
#                           build/e2e/e2e-h200.json (kept on the warm machine between calls),
#                           stopping in time for the 9.5-minute limit; exit 75 = call again
#                           (SKIP_BUILD=1), 0 = done: then `peagle tune` per concurrency; the JSON,
#                           its log and tune.txt are copied to $OUT after every call
#   ablate [args]           the head ablation (scripts/ablate_default_pair.py) in build/ablate:
#                           one reservation, target and data included (3 calls by its --dry-run;
#                           the first builds, then SKIP_BUILD=1), each call stopping in time for
#                           the 9.5-minute limit; ABLATE_LANES=N runs the variants on N GPUs at
#                           once; ablation.md/.json and choice.json (rewritten after every
#                           variant) are copied to $OUT; exit 75 = call again
#   flashinfer [families]   FlashInfer (the carried copy in .deps/flashinfer, tools/flashinfer_carry.py)
#                           as the peer: installs it into /tmp/fi-site (no network), loads its
#                           modules (AOT) or JIT-builds the missing ones (FI_JIT_SECONDS, default
#                           480; returned as $OUT/fi-aot-*.tar; FI_MODULES="sampling topk ..."
#                           limits them), timed ($OUT/fi-jit.json), then
#                           `peagle bench ops` for verify attention (default) with the FlashInfer
#                           rows, JIT off; FI_BENCH_ARGS adds arguments (e.g. --no-flex); logs in
#                           $OUT/logs.tgz
#   bits OLD_SRC [--quick]  bitwise old == new of paged_attention for a change meant to keep the
#                           bits: builds OLD_SRC (as ab) and the current tree side by side, then
#                           tools/bitwise_attention.py dump under each and compare (exit 1 and
#                           DIFF lines where a fingerprint differs); $OUT/bits-{old,new}.json
#   abverify OLD_SRC        quick verify_chain A/B (~4 min with both builds): builds OLD_SRC into
#                           /tmp/oldsite beside the current tree's build, runs the verify tests
#                           meanwhile, then tools/time_verify.py (default paths) and
#                           PEAGLE_VERIFY_CHUNKS=1 ... --batch 1 8 64, old/new/old/new; logs in
#                           $OUT/abverify.tgz. AB_VARIANTS="DIR ..." adds trees as in ab (built
#                           at the same time, each under the verify tests, timed after new)
#   lines KERNEL_REGEX CMD...  per-instruction ncu profile of the 3rd launch of KERNEL_REGEX under
#                           CMD (e.g. `python3 tools/verify_case.py 64`), matched to the build's
#                           -lineinfo disassembly by tools/ncu_lines.py: $OUT/lines.txt (per
#                           source function), lines.json (and per line), lines-sass.csv;
#                           LINES_NCU_ARGS adds ncu options (e.g. --cache-control none: ncu
#                           otherwise flushes the caches before the launch, unlike a replay)
# CALL_SECONDS (default 555) is what a pair/ablate call may take, build included.
# SKIP_BUILD=1 reuses the builds (current tree, and the old tree in /tmp/oldsite) of an earlier
# call on the same warm machine; SANITIZE_TOOLS picks tools;
# TEST_WORKERS (default 12) and TEST_TIMEOUT (s, default 420) size the test run.
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
  # One OpenMP thread per worker: the CPU references and CPU tests otherwise start 16 threads in
  # every worker and the run spends its time in oversubscribed thread pools.
  # Tests marked `serial` compare GPU times and run alone afterwards.
  local t0=$(date +%s) rc=0
  OMP_NUM_THREADS=1 timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -rfEs --timeout=300 \
    -p no:cacheprovider -n ${TEST_WORKERS:-12} --dist worksteal -m "not serial" "${@:-tests}" \
    > "$OUT/tests.log" 2>&1 || rc=$?
  timeout 120 python3 -m pytest -q -rfE --timeout=100 -p no:cacheprovider -m serial "${@:-tests}" \
    > "$OUT/tests-serial.log" 2>&1 || { r=$?; [ $r -eq 5 ] || rc=$r; }  # 5: none selected
  echo "pytest rc=$rc in $(( $(date +%s) - t0 )) s"
  grep -hE "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" "$OUT/tests-serial.log" | tail -30
  return $rc
}
# The results-file suffix for the card this call runs on: a call for the H200 may get an H100.
gpu_tag() {
  case "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)" in
    *H100*) echo h100 ;;
    *B200*) echo b200 ;;
    *) echo h200 ;;
  esac
}
run_bench() {
  for fam in ${@:-prep verify attention kv}; do
    case $fam in
      e2e) python3 -m peagle bench e2e --device cuda --concurrency 1 --max-minutes 8 \
             --out "$OUT/e2e-h200.json" > "$OUT/bench-e2e.log" 2>&1 ;;
      *) python3 -m peagle bench ops "$fam" --out "$OUT/$fam-$(gpu_tag).json" > "$OUT/bench-$fam.log" 2>&1 ;;
    esac
    echo "bench $fam: rc=$?"; tail -25 "$OUT/bench-$fam.log"
  done
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
run_ab() {
  local old_src=$1; shift
  python3 -m pip install -q --no-index --no-deps --target /tmp/deps .deps/nvidia_cutlass-4.2.0.0-py3-none-any.whl || true
  # The old tree, each AB_VARIANTS tree and the current one build at the same time.
  local pids="" variants="" d n
  build_old "$old_src" & pids+=" $!"
  for d in ${AB_VARIANTS:-}; do
    n=$(basename "$d")
    [[ $n =~ ^[A-Za-z_]+$ ]] || { echo "AB_VARIANTS: name $n must be letters and underscores"; exit 2; }
    build_tree "$d" /tmp/site-$n "$OUT/build-$n.log" & pids+=" $!"; variants+=" $n"
  done
  build
  for d in $pids; do wait $d || exit 1; done
  local fams=${@:-attention prep verify e2e}
  for rep in 1 2; do
    for side in old new $variants; do
      local pp=""; [ $side = old ] && pp=/tmp/oldsite
      [ $side != old ] && [ $side != new ] && pp=/tmp/site-$side
      for fam in $fams; do
        local out="$OUT/ab-$fam-$side$rep"
        case $fam in
          e2e) PYTHONPATH=$pp timeout 150 python3 -m peagle bench e2e --device cuda --concurrency 1 \
                 --k 1 3 7 --num-prompts 16 --out "$out.json" > "$out.log" 2>&1 ;;
          attention) PYTHONPATH=$pp timeout 150 python3 -m peagle bench ops attention --no-baselines \
                 --out "$out.json" > "$out.log" 2>&1 ;;
          *) PYTHONPATH=$pp timeout 150 python3 -m peagle bench ops "$fam" --out "$out.json" \
                 > "$out.log" 2>&1 ;;
        esac
        echo "ab $fam $side$rep: rc=$?"
      done
    done
    [ -n "${AB_ONCE:-}" ] && break
  done
  (cd "$OUT" && tar czf ab.tgz ab-* build-*.log && rm -f ab-*.json ab-*.log build-*.log)
}
run_flashinfer() {
  [ -d .deps/flashinfer ] || { echo "flashinfer: no .deps/flashinfer (tools/flashinfer_carry.py pack; carry .deps)"; exit 2; }
  local t0=$(date +%s) site=/tmp/fi-site
  python3 tools/flashinfer_carry.py install --carry .deps/flashinfer --target $site || exit 1
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
  # A JIT build needs curand.h: the toolkit's, else the pip nvidia-curand headers torch ships.
  local inc=$(python3 -c "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13', 'include'))" 2>/dev/null)
  [ -f /usr/local/cuda/include/curand.h ] || [ ! -f "$inc/curand.h" ] || export FLASHINFER_EXTRA_CUDAFLAGS="-isystem $inc"
  # Modules the carry lacks are JIT-built here (all cores, FI_JIT_SECONDS at most) and come back
  # as $OUT/fi-aot-*.tar for `flashinfer_carry.py pack --aot-from`.
  # FI_MODULES (labels of module_specs, e.g. "sampling topk prefill-fa2 xqa") limits the modules
  # loaded / built; the benchmarks' other backends then fail fast (recorded), JIT being off.
  python3 tools/flashinfer_carry.py prebuild --seconds ${FI_JIT_SECONDS:-480} --export "$OUT" \
    ${FI_MODULES:+--only $FI_MODULES} --out "$OUT/fi-jit.json" > "$OUT/fi-jit.log" 2>&1
  tail -16 "$OUT/fi-jit.log"
  echo "flashinfer install + modules: $(( $(date +%s) - t0 )) s"
  export FLASHINFER_DISABLE_JIT=1  # a module still missing fails its backend (recorded), no JIT
  for fam in ${@:-verify attention}; do
    python3 -m peagle bench ops "$fam" ${FI_BENCH_ARGS:-} --out "$OUT/$fam-$(gpu_tag).json" > "$OUT/bench-$fam.log" 2>&1
    echo "bench $fam: rc=$? ($(( $(date +%s) - t0 )) s)"; grep -E "flashinfer|BAD" "$OUT/bench-$fam.log" | tail -12; tail -4 "$OUT/bench-$fam.log"
  done
  (cd "$OUT" && tar czf logs.tgz *.log && rm -f *.log)  # $OUT returns 8 files at most
}
build_tree() {  # build_tree SRC SITE LOG: the source tree SRC installed into SITE
  local src=$1 site=$2 log=$3
  [ -d "$src" ] || { echo "no such source tree: $src"; exit 2; }
  # SKIP_BUILD=1 also keeps a build an earlier call of this reservation left there.
  if [ -n "${SKIP_BUILD:-}" ] && [ -d "$site/peagle" ]; then return 0; fi
  [ -d "$src/python/peagle/default_models" ] || cp -r python/peagle/default_models "$src/python/peagle/"
  export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++  # as in build()
  export PEAGLE_CUTLASS_INCLUDE=${PEAGLE_CUTLASS_INCLUDE:-/tmp/deps/cutlass_library/source/include}
  (cd "$src" && PEAGLE_CUDA_ARCHS="${PEAGLE_CUDA_ARCHS:-9.0a}" python3 -m pip install -q \
    --no-build-isolation --no-deps --target "$site" -C build-dir="/tmp/build-$(basename "$site")" . \
    > "$log" 2>&1) || { tail -20 "$log"; return 1; }
}
build_old() {  # build_old SRC: the tree SRC into /tmp/oldsite (for ab / abverify / bits)
  build_tree "$1" /tmp/oldsite "$OUT/build-old.log"
}
run_bits() {
  local old_src=$1; shift
  local t0=$(date +%s)
  python3 -m pip install -q --no-index --no-deps --target /tmp/deps .deps/nvidia_cutlass-4.2.0.0-py3-none-any.whl || true
  build_old "$old_src" & local bg=$!
  build
  wait $bg || exit 1
  echo "builds: $(( $(date +%s) - t0 )) s"
  PYTHONPATH=/tmp/oldsite timeout 240 python3 tools/bitwise_attention.py dump "$OUT/bits-old.json" "$@" \
    > "$OUT/bits.log" 2>&1 || { tail -20 "$OUT/bits.log"; exit 1; }
  timeout 240 python3 tools/bitwise_attention.py dump "$OUT/bits-new.json" "$@" >> "$OUT/bits.log" 2>&1 \
    || { tail -20 "$OUT/bits.log"; exit 1; }
  python3 tools/bitwise_attention.py compare "$OUT/bits-old.json" "$OUT/bits-new.json" > "$OUT/bits-diff.txt"
  local rc=$?
  tail -3 "$OUT/bits.log"; head -30 "$OUT/bits-diff.txt"; tail -1 "$OUT/bits-diff.txt"
  echo "bits: rc=$rc ($(( $(date +%s) - t0 )) s)"
  return $rc
}
run_abverify() {
  local old_src=$1 t0=$(date +%s) pids="" variants="" d n
  build_old "$old_src" & pids+=" $!"
  for d in ${AB_VARIANTS:-}; do  # extra trees, timed after new (as in ab)
    n=$(basename "$d")
    [[ $n =~ ^[A-Za-z_]+$ ]] || { echo "AB_VARIANTS: name $n must be letters and underscores"; exit 2; }
    build_tree "$d" /tmp/site-$n "$OUT/build-$n.log" & pids+=" $!"; variants+=" $n"
  done
  OMP_NUM_THREADS=1 timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 --timeout=150 \
    tests/test_verify_chain.py > "$OUT/abv-tests.log" 2>&1
  echo "verify tests: rc=$? $(tail -1 "$OUT/abv-tests.log") ($(( $(date +%s) - t0 )) s)"
  for d in $pids; do wait $d || exit 1; done
  for n in $variants; do  # each variant's own build under the same tests
    PYTHONPATH=/tmp/site-$n OMP_NUM_THREADS=1 timeout 200 python3 -m pytest -q -p no:cacheprovider \
      -n 8 --timeout=150 tests/test_verify_chain.py > "$OUT/abv-tests-$n.log" 2>&1
    echo "verify tests ($n): rc=$? $(tail -1 "$OUT/abv-tests-$n.log") ($(( $(date +%s) - t0 )) s)"
  done
  for rep in 1 2; do
    for side in old new $variants; do
      local pp=""; [ $side = old ] && pp=/tmp/oldsite
      [ $side != old ] && [ $side != new ] && pp=/tmp/site-$side
      PYTHONPATH=$pp PEAGLE_VERIFY_CHUNKS=1 timeout 60 python3 tools/time_verify.py --batch 1 8 64 \
        > "$OUT/abv-chunks-$side$rep.log" 2>&1
      PYTHONPATH=$pp timeout 80 python3 tools/time_verify.py > "$OUT/abv-default-$side$rep.log" 2>&1
      echo "$side$rep chunks: $(tail -1 "$OUT/abv-chunks-$side$rep.log")"
      echo "$side$rep default: $(tail -1 "$OUT/abv-default-$side$rep.log")"
    done
  done
  (cd "$OUT" && tar czf abverify.tgz abv-*.log build-*.log && rm -f abv-*.log build-*.log)
}
run_lines() {
  local k=$1; shift
  timeout ${LINES_TIMEOUT:-150} ncu --clock-control none -k "regex:$k" --launch-skip 2 --launch-count 1 \
    --section SourceCounters --section WarpStateStats --warp-sampling-interval 0 --import-source yes \
    ${LINES_NCU_ARGS:-} -f -o /tmp/lines "$@" > "$OUT/lines-ncu.log" 2>&1 || { tail -20 "$OUT/lines-ncu.log"; exit 1; }
  ncu -i /tmp/lines.ncu-rep --page source --csv --print-source sass > "$OUT/lines-sass.csv"
  local so=$(python3 -c "import os, peagle; print(os.path.join(os.path.dirname(peagle.__file__), 'peagle_ops.so'))")
  rm -rf /tmp/cubins && mkdir -p /tmp/cubins && (cd /tmp/cubins && cuobjdump -xelf all "$so" > /dev/null)
  for c in /tmp/cubins/*.cubin; do nvdisasm -g -c "$c"; done > /tmp/lines-listing.sass
  python3 tools/ncu_lines.py "$OUT/lines-sass.csv" /tmp/lines-listing.sass --src csrc \
    --json "$OUT/lines.json" | tee "$OUT/lines.txt"
}
call_minutes() {  # minutes left for the recipe in this call, after the build
  python3 -c "print(max(0.5, (${CALL_SECONDS:-555} - ($(date +%s) - $t_start) - 25) / 60))"
}
run_pair() {
  local w=${PAIR_WORK_DIR:-build/pair-v3} rc=0
  python3 scripts/train_default_pair.py --device cuda --work-dir "$w" --max-minutes "$(call_minutes)" \
    --bundle "$OUT" "$@" > "$OUT/pair.log" 2>&1 || rc=$?
  echo "pair: rc=$rc ($([ $rc -eq 75 ] && echo 'work left: call again' || echo done))"
  grep -vE "target: step [0-9]*[1-9]00/|^step " "$OUT/pair.log" | tail -40
  return $rc
}
run_e2e() {
  local d=build/e2e rc=0
  mkdir -p "$d"
  python3 -m peagle bench e2e --device cuda --k 1 3 5 7 10 --concurrency 1 8 64 --num-prompts 64 \
    --max-minutes "$(call_minutes)" --out "$d/e2e-h200.json" "$@" >> "$d/bench-e2e.log" 2>&1 || rc=$?
  echo "e2e: rc=$rc ($([ $rc -eq 75 ] && echo 'work left: call again' || echo done))"
  if [ $rc -eq 0 ]; then
    python3 -m peagle tune --results "$d/e2e-h200.json" > "$d/tune.txt" 2>&1
    echo "tune: rc=$?"; cat "$d/tune.txt"
  else
    tail -12 "$d/bench-e2e.log"
  fi
  for f in e2e-h200.json bench-e2e.log tune.txt; do [ -f "$d/$f" ] && cp "$d/$f" "$OUT/"; done
  return $rc
}
run_ablate() {
  local w=${ABLATE_WORK_DIR:-build/ablate} lanes=${ABLATE_LANES:-1} rc=0
  local s=scripts/ablate_default_pair.py
  if [ "$lanes" -gt 1 ]; then
    python3 $s --device cuda --work-dir "$w" --max-minutes "$(call_minutes)" --prepare-only "$@" \
      > "$OUT/ablate.log" 2>&1 || rc=$?
    if [ $rc -eq 0 ]; then
      local m=$(call_minutes) pids=""
      for i in $(seq 0 $((lanes - 1))); do
        CUDA_VISIBLE_DEVICES=$i python3 $s --device cuda --work-dir "$w" --max-minutes "$m" \
          --lanes "$lanes" --lane "$i" "$@" > "$w/lane$i.log" 2>&1 & pids="$pids $!"
      done
      for p in $pids; do wait $p || { r=$?; [ $r -eq 75 ] && rc=75 || { [ $rc -eq 0 ] && rc=$r; }; }; done
      python3 $s --work-dir "$w" --summarize "$@" >> "$OUT/ablate.log" 2>&1
      cat "$w"/lane*.log >> "$OUT/ablate.log"
    fi
  else
    python3 $s --device cuda --work-dir "$w" --max-minutes "$(call_minutes)" "$@" \
      > "$OUT/ablate.log" 2>&1 || rc=$?
  fi
  for f in ablation.md ablation.json choice.json; do [ -f "$w/$f" ] && cp "$w/$f" "$OUT/"; done
  echo "ablate: rc=$rc"
  grep -E "ablate:|target: done|target: [0-9]+ ms/step|regen: (budget|[0-9]+ seq)|corpus v3|time budget|^finished|train: the stream" \
    "$OUT/ablate.log" | tail -40
  return $rc
}
t_start=$(date +%s)
case $cmd in
  build) build ;;
  test) build; run_tests "$@"; rc=$?; echo "h200.sh test: $(( $(date +%s) - t_start )) s wall (build + tests)"; exit $rc ;;
  sanitize) build; sanitize "$@" ;;
  bench) build; run_bench "$@" ;;
  ab) run_ab "$@" ;;
  pair) build; run_pair "$@"; exit $? ;;
  e2e) build; run_e2e "$@"; exit $? ;;
  ablate) build; run_ablate "$@"; exit $? ;;
  flashinfer) build; run_flashinfer "$@" ;;
  lines) build; run_lines "$@" ;;
  abverify) build; run_abverify "$@" ;;
  bits) run_bits "$@"; exit $? ;;
  all) build; run_tests; sanitize ;;
  *) echo "usage: bash tools/h200.sh [build|test|sanitize|bench|ab|abverify|pair|e2e|ablate|flashinfer|lines|all] ..."; exit 2 ;;
esac
