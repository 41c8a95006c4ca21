#!/usr/bin/env bash
# One prepared run on a GPU machine (steps 1-3 took under 8 minutes on an H200 without the glm sets;
# those and step 4 are not timed there yet, and the deadline of --budget skips what does not fit), or
# its CPU half here (--cpu-smoke):
#   1. dump sets with the hub file (`--reference hf-hub`) and with fla (`--reference fla`) on the GPU:
#      the mini set, and T64/T1024 at the real size (kimi-linear-48b-a3b); then the lower-bound family
#      with fla (fused_kda_gate and chunk_kda with safe_gate / lower_bound): glm5-next-mini, all cases,
#      and T64/T1024 at glm-5.3-flash's size;
#   2. `python -m conformance run --kernel naive` (kda_impl's plain-JAX kernels on JAX's GPU) on each;
#   3. fla's Triton chunk_kda against the plain-JAX chunk_kda at H=32, D=128, T = 1024, 8192, 32768;
#   4. TF32 against IEEE fp32: the hub set of the last Kimi-Linear shape (fla's without a snapshot) made
#      again with TRITON_F32_DEFAULT=tf32, and `benchmarks.tf32_compare`: each set's fp32 nRMSE against
#      the float64 truth and tf32 against ieee (tf32.json).
# It uses the torch, JAX and triton already installed (python3, or $PYTHON) and installs nothing but the
# wheels in .whl/ (fla-core, flash-linear-attention; add any other missing one there), into a
# temporary folder. Every step has a time limit and the run a deadline (--budget); a step that fails or
# runs out of time is recorded and the next one runs. Everything lands in the output folder: logs/,
# dumps/, reports/, timing.json, tf32.json, summary.tsv. Exit status 0 only if every step that ran worked (a
# conformance run that finds checks out of tolerance worked: its report says which).
#
#   benchmarks/device_check.sh [--cpu-smoke] [--out DIR] [--hub-snapshot DIR] [--budget SECONDS]
#
# --out defaults to $OUT (the device tool's folder that comes back), else /tmp/kda-device-check.
# --hub-snapshot defaults to $HUB_SNAPSHOT, else .hub-snapshot/ (git-ignored; never commit the hub
# files): a folder with the hub's modeling_kimi.py, configuration_kimi.py and config.json. Without one
# the hf-hub steps are skipped. --cpu-smoke: the same steps on this CPU at tiny sizes (hidden 32, 2 heads
# of 16; the hub stand-in of the tests unless --hub-snapshot is given; no real-size sets), in about
# 2.5 min.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
SMOKE=0
OUT_DIR="${OUT:-/tmp/kda-device-check}"
SNAPSHOT="${HUB_SNAPSHOT:-$REPO/.hub-snapshot}"
SNAPSHOT_GIVEN=0
BUDGET=470

while (($#)); do
  case "$1" in
    --cpu-smoke) SMOKE=1 ;;
    --out) OUT_DIR="$2"; shift ;;
    --hub-snapshot) SNAPSHOT="$2"; SNAPSHOT_GIVEN=1; shift ;;
    --budget) BUDGET="$2"; shift ;;
    *) echo "device_check.sh: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
  shift
done
if ((SMOKE)) && ((!SNAPSHOT_GIVEN)) && [[ -z "${HUB_SNAPSHOT:-}" ]]; then
  SNAPSHOT="$REPO/tests/dump_gen/hub_standin"
fi

mkdir -p "$OUT_DIR/logs" "$OUT_DIR/dumps" "$OUT_DIR/reports" || exit 2
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
SUMMARY="$OUT_DIR/summary.tsv"
printf 'step\tstatus\tseconds\tlog\n' >"$SUMMARY"
DEADLINE=$((SECONDS + BUDGET))
FAILED=0

# JAX and torch share the GPU (the timing step runs both in one process): no preallocation.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-/tmp/kda-jax-cache}"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
cd "$REPO" || exit 2

record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$SUMMARY"; echo "== $1: $2 (${3}s)"; }

# step NAME LIMIT_SECONDS COMMAND...: runs COMMAND with its output in logs/NAME.log, within LIMIT and the
# run's deadline; records passed / failed (exit N) / timed out / skipped (deadline). A conformance run
# that ends with exit 1 (checks out of tolerance) is a finding, recorded as such, not a failed step.
step() {
  local name="$1" limit="$2"; shift 2
  local log="$OUT_DIR/logs/$name.log" left=$((DEADLINE - SECONDS))
  if ((left < 10)); then record "$name" "skipped (deadline)" 0 "-"; return 1; fi
  ((limit > left)) && limit=$left
  local start=$SECONDS status
  echo "== $name (limit ${limit}s): $*"
  timeout --kill-after=5 "$limit" "$@" >"$log" 2>&1
  status=$?
  case $status in
    0) record "$name" passed $((SECONDS - start)) "$log" ;;
    1) if [[ $name == conform-* ]]; then
         record "$name" "ran: checks out of tolerance (see its report)" $((SECONDS - start)) "$log"
       else
         record "$name" "failed (exit 1)" $((SECONDS - start)) "$log"; FAILED=1; tail -n 3 "$log"
       fi ;;
    124 | 137) record "$name" "timed out" $((SECONDS - start)) "$log"; FAILED=1 ;;
    *) record "$name" "failed (exit $status)" $((SECONDS - start)) "$log"; FAILED=1; tail -n 3 "$log" ;;
  esac
  return $status
}

# 0. The wheels in .whl/, into a temporary folder ahead of the installed packages.
if compgen -G "$REPO/.whl/*.whl" >/dev/null; then
  WHEELS="$(mktemp -d /tmp/kda-wheels.XXXXXX)"
  step install-wheels 60 "$PYTHON" -m pip install --quiet --no-deps --no-index --target "$WHEELS" "$REPO"/.whl/*.whl \
    && export PYTHONPATH="$WHEELS:$PYTHONPATH"
fi
step environment 120 "$PYTHON" -c '
import importlib, importlib.metadata as m
for dist in ("torch", "triton", "jax", "jaxlib", "flax", "transformers", "fla-core", "flash-linear-attention",
             "einops", "numpy", "ml_dtypes", "fsspec", "safetensors", "tqdm"):
    try:
        print(f"{dist} {m.version(dist)}")
    except m.PackageNotFoundError:
        print(f"{dist} MISSING: carry its wheel in .whl/")
import torch, jax
print("torch cuda:", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "")
print("jax devices:", jax.devices())
for module in ("fla.ops.kda", "fla.layers.utils", "transformers.models.kimi_linear", "flax.nnx"):
    importlib.import_module(module)
'
cp "$OUT_DIR/logs/environment.log" "$OUT_DIR/environment.txt" 2>/dev/null

declare -A SHAPE CASES
if ((SMOKE)); then
  DEVICE=cpu
  SET_NAMES=(mini glm-mini)
  TF32_SHAPE=mini
  SHAPE[mini]="--preset mini --hidden-size 32 --head-dim 16" CASES[mini]="T1 T65"
  SHAPE[glm-mini]="--preset glm5-next-mini --hidden-size 32 --head-dim 16" CASES[glm-mini]="T1 T65"
  TIMING=(--device cpu --heads 2 --dim 16 --tokens 64 --repeats 1)
else
  DEVICE=cuda
  SET_NAMES=(mini real glm-mini glm-real)
  TF32_SHAPE=real
  SHAPE[mini]="--preset mini" CASES[mini]=""
  SHAPE[real]="--preset kimi-linear-48b-a3b" CASES[real]="T64 T1024"
  SHAPE[glm-mini]="--preset glm5-next-mini" CASES[glm-mini]=""
  SHAPE[glm-real]="--preset glm-5.3-flash" CASES[glm-real]="T64 T1024"
  TIMING=(--device cuda --heads 32 --dim 128 --tokens 1024 8192 32768 --repeats 3)
fi
REFERENCES=(fla)
if [[ -f "$SNAPSHOT/modeling_kimi.py" ]]; then
  REFERENCES=(hf-hub fla)
else
  record hf-hub "skipped (no modeling_kimi.py in $SNAPSHOT)" 0 "-"
fi

# dump_args REFERENCE NAME FOLDER: the dump_gen flags of set NAME's shape and cases with REFERENCE, into
# dumps/FOLDER (in the array `args`).
dump_args() {
  # shellcheck disable=SC2206  # the shape flags and case ids split on spaces
  args=(--out "$OUT_DIR/dumps/$3" --reference "$1" --device "$DEVICE" ${SHAPE[$2]} --no-progress)
  [[ $1 == hf-hub ]] && args+=(--hub-snapshot "$SNAPSHOT")
  # shellcheck disable=SC2206
  [[ -n ${CASES[$2]} ]] && args+=(--cases ${CASES[$2]})
}

# 1. The dump sets, the hub's first (the RFC's ground truth); the hub file has only Kimi-Linear's layer.
DUMPED=()
for name in "${SET_NAMES[@]}"; do
  references=("${REFERENCES[@]}")
  [[ $name == glm-* ]] && references=(fla)
  for reference in "${references[@]}"; do
    dump_args "$reference" "$name" "$reference-$name"
    step "dump-$reference-$name" 150 "$PYTHON" -m dump_gen "${args[@]}" && DUMPED+=("$reference-$name")
  done
done

# 2. The fla-vs-JAX kernel timing (before the conformance runs, which take what time is left).
step timing 150 "$PYTHON" -m benchmarks.device_timing "${TIMING[@]}" --out "$OUT_DIR/timing.json"

# 3. kda_impl (plain-JAX kernels) against each set.
for dumped in "${DUMPED[@]}"; do
  step "conform-$dumped" 150 "$PYTHON" -m conformance run --dumps "$OUT_DIR/dumps/$dumped" --kernel naive \
    --report-dir "$OUT_DIR/reports/$dumped"
done

# 4. TF32 against IEEE fp32 (dump_gen keeps a TRITON_F32_DEFAULT it finds; its manifest records it).
IEEE_SET="${REFERENCES[0]}-$TF32_SHAPE"
if [[ " ${DUMPED[*]} " == *" $IEEE_SET "* ]]; then
  dump_args "${REFERENCES[0]}" "$TF32_SHAPE" "$IEEE_SET-tf32"
  step "dump-$IEEE_SET-tf32" 150 env TRITON_F32_DEFAULT=tf32 "$PYTHON" -m dump_gen "${args[@]}" \
    && step tf32-vs-ieee 60 "$PYTHON" -m benchmarks.tf32_compare "$OUT_DIR/dumps/$IEEE_SET" \
      "$OUT_DIR/dumps/$IEEE_SET-tf32" --out "$OUT_DIR/tf32.json"
fi

echo
column -t -s $'\t' "$SUMMARY" 2>/dev/null || cat "$SUMMARY"
for dumped in "${DUMPED[@]}"; do
  report="$OUT_DIR/reports/$dumped/report.md"
  [[ -f $report ]] && { echo; echo "### $dumped"; head -n 40 "$report"; }
done
[[ -f "$OUT_DIR/timing.json" ]] && grep -h -E "first|FAILED" "$OUT_DIR/logs/timing.log"
[[ -f "$OUT_DIR/tf32.json" ]] && cat "$OUT_DIR/logs/tf32-vs-ieee.log"
exit $FAILED
