#!/usr/bin/env bash
# The GPU suite for one lent machine (15 device-minutes, starts included): two calls of under 10 minutes, the most
# important parts first, each part under its own time limit so that a slow one leaves the rest their turn.
#
#   CALL=1 BUDGET=580 bash scripts/gpu_session.sh   # scratch, then finetune (about 8 minutes, predicted)
#   CALL=2 BUDGET=200 bash scripts/gpu_session.sh   # cost, placement, first_reading, scratch355 as time allows;
#                                                   # BUDGET: the device time call 1 left, less 15 s (docs/gpu-suite.md)
#   PARTS="tests overhead" bash scripts/gpu_session.sh   # any parts, in the order below
#   PRESET=smoke bash scripts/gpu_session.sh   # every part at tiny shapes on a CPU (tests/test_gpu_session.py)
#
# The parts:
#   scratch     GPT-2 124M from scratch at a tenth of the tuned 6e-4: the Trainer, the hybrid, Prodigy, Mechanic, and
#               the Trainer at 6e-4 (the sweep's reference, whose gain G is measured against)
#   finetune    a 124M pretrained inside the call (recipes/configs/gpt2-124m-pretrain.yaml), fine-tuned on another
#               corpus at TrainingArguments' default 5e-5 with linear decay; the same arms, the reference at 6e-4
#   cost        three alternating Trainer/hybrid pairs at the tuned 6e-4 with deterministic kernels
#   first_reading  the hybrid at the tuned LR for 100 steps, the steps around its first two readings profiled
#   scratch355  GPT-2 medium's shape from scratch at a tenth of 3e-4, the Trainer and the hybrid
#   tests exact ab overhead overhead_ga jumps faults   the earlier sessions' checks, on request
# Logs, reports and traces go to $WORK, packed into $OUT/work.tgz; the suite's table is $OUT/summary.txt (the reply
# brings back at most 8 files, so the logs travel inside the archive).
#
# Wheels the machine lacks travel in .whl/ (ignored by git; name it in the call's carry): `bash scripts/gpu_wheels.sh`.
set -u
CALL_START=$(date +%s)  # BUDGET counts from here, the wheels' install included
OUT=${OUT:-/tmp/gpu_out}
PRESET=${PRESET:-gpt2-124m}
WORK=${WORK:-/tmp/gpu_work}
PY=${PY:-python3}
rm -rf "$WORK"  # a report left by an earlier call must not stand in for a part that did not run
mkdir -p "$OUT" "$WORK/logs"
if [ -z "${NO_WHEELS:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
  # The machine's own pyarrow decides which datasets imports (gpu_wheels.sh): a failed import here would fail every part.
  if ! $PY -c "import datasets" >/dev/null 2>&1 && ls .whl/fallback/*.whl >/dev/null 2>&1; then
    echo "datasets from .whl does not import beside this machine's pyarrow: installing .whl/fallback instead"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/fallback/*.whl || exit 1
  fi
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv 2>/dev/null
# What every part imports, once: a machine where one fails (a carried wheel against the image's own packages, say
# huggingface-hub or tokenizers older than transformers asks) ends the call here, in seconds, and says which. The
# peers' optimizers only fail their own arms, so they are named in the summary instead.
if ! $PY -c "import platform, torch, transformers, accelerate, datasets, pyarrow, huggingface_hub, tokenizers
import safetensors, hf_hybrid
from transformers import Trainer
print('python', platform.python_version(), '| torch', torch.__version__, '| transformers', transformers.__version__,
      '| accelerate', accelerate.__version__, '| datasets', datasets.__version__, '| pyarrow', pyarrow.__version__,
      '| hub', huggingface_hub.__version__, '| tokenizers', tokenizers.__version__, '| safetensors',
      safetensors.__version__, '| cuda', torch.cuda.is_available())"; then
  echo "== the suite's libraries do not import here (above): no part can run" | tee "$OUT/summary.txt"
  exit 1
fi
if [ "$PRESET" != smoke ] && ! $PY -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  echo "== no CUDA device: the GPU presets would run on the CPU until their limits" | tee "$OUT/summary.txt"
  exit 1
fi

# The presets each part runs; PRESET=smoke runs every part on the smoke presets.
# FIRST_PROFILE: the steps first_reading profiles, around the first two readings (steps 50 and 60 at 124M's 50-step
# warmup; 12 and 22 on the smoke preset).
if [ "$PRESET" = smoke ]; then
  FINETUNE=smoke-finetune MEDIUM=smoke FIRST_PROFILE=${FIRST_PROFILE:-8-25}
else
  FINETUNE=$PRESET-finetune MEDIUM=gpt2-355m FIRST_PROFILE=${FIRST_PROFILE:-44-62}
fi
case "${CALL:-}" in
  1) DEFAULT_PARTS="scratch finetune" ;;
  2) DEFAULT_PARTS="cost placement first_reading scratch355" ;;
  *) DEFAULT_PARTS="scratch finetune cost placement first_reading scratch355" ;;
esac
PARTS=${PARTS:-$DEFAULT_PARTS}
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
$PY -c "import prodigyopt, mechanic_pytorch" >/dev/null 2>&1 \
  || echo "== Prodigy or Mechanic does not import here: their arms in scratch and finetune will fail" | tee -a "$SUMMARY"
# BUDGET (seconds, 0 = none): the call's own limit. A part gets at most what is left of it, less FINISH seconds for
# the summary and the archive, and is skipped when under MIN_PART are left: a call cut off by the machine's timeout
# would bring back no archive at all.
BUDGET=${BUDGET:-0} FINISH=${FINISH:-20} MIN_PART=${MIN_PART:-15}
part() {  # part NAME SECONDS COMMAND...: runs COMMAND with a limit, its log in $WORK/logs/NAME.log
  local name=$1 limit=$2 start rc left
  shift 2
  case " $PARTS " in *" $name "*) ;; *) return ;; esac
  if [ "$BUDGET" -gt 0 ]; then
    left=$(( BUDGET - FINISH - ($(date +%s) - CALL_START) ))
    if [ "$left" -lt "$MIN_PART" ]; then
      echo "== $name: skipped, ${left} s of the call's budget left" | tee -a "$SUMMARY"
      return
    fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  start=$(date +%s)
  timeout -k 10 "$limit" "$@" > "$WORK/logs/$name.log" 2>&1  # -k: a part deaf to SIGTERM is killed 10 s later
  rc=$?
  echo "== $name: rc $rc, $(( $(date +%s) - start )) s (limit $limit)" | tee -a "$SUMMARY"
  tail -n "${TAIL:-12}" "$WORK/logs/$name.log"
}
BENCH="$PY scripts/benchmark.py --repeats 1 --seed 0"
PEERS=hybrid,prodigy,mechanic,swept

part scratch "${T_SCRATCH:-240}" $BENCH --preset "$PRESET" --lr_scale 0.1 --arms $PEERS \
  --max_steps "${SCRATCH_STEPS:-300}" --output_dir "$WORK/scratch"
part finetune "${T_FINETUNE:-240}" $BENCH --preset "$FINETUNE" --learning_rate 5e-5 --arms $PEERS \
  --output_dir "$WORK/finetune"
# Deterministic kernels: a hybrid whose every jump was rolled back and whose autopilot never raised must evaluate
# exactly as the Trainer does, so that whatever differs in wall clock is the hybrid's cost.
part cost "${T_COST:-200}" $PY scripts/benchmark.py --preset "$PRESET" --repeats 3 --seed 0 --full_determinism \
  --max_steps "${COST_STEPS:-200}" --output_dir "$WORK/cost"
# The rollback copies on the device and in pinned memory: where each went, and the two runs bit for bit equal.
part placement "${T_PLACEMENT:-60}" $PY -m pytest -q -p no:cacheprovider tests/test_cuda_memory.py -k rollback_copies
# Where the autopilot's first reading spends the second it took over later ones: the steps around it, each profiled.
part first_reading "${T_FIRST:-60}" $PY scripts/first_reading.py --preset "$PRESET" --max_steps "${FIRST_STEPS:-100}" \
  --profile_steps "$FIRST_PROFILE" --output_dir "$WORK/first_reading" --out "$WORK/first_reading.json"
part scratch355 "${T_355:-100}" $BENCH --preset "$MEDIUM" --lr_scale 0.1 --max_steps "${STEPS_355:-150}" \
  --output_dir "$WORK/scratch355"

part tests "${T_TESTS:-200}" $PY -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_cuda.py tests/test_cuda_memory.py \
  tests/test_memory.py tests/test_fsdp2.py}
part exact "${T_EXACT:-150}" $PY scripts/benchmark.py --preset "$PRESET" --repeats 1 --seed 0 --full_determinism \
  --max_steps "${EXACT_STEPS:-200}" --output_dir "$WORK/exact"
part ab "${T_AB:-170}" $BENCH --preset "$PRESET" --output_dir "$WORK/ab"
# The hooks' and guard's share of a step, at one micro-batch and at 8 (32K tokens, nearer what a GPU run trains on).
part overhead "${T_OVERHEAD:-75}" $BENCH --preset "$PRESET" --mode overhead --max_steps "${OVERHEAD_STEPS:-200}" \
  --output_dir "$WORK/overhead"
part overhead_ga "${T_OVERHEAD_GA:-200}" $BENCH --preset "$PRESET" --mode overhead \
  --max_steps "${OVERHEAD_STEPS:-200}" --grad_accum 8 --output_dir "$WORK/overhead_ga"
# The defaults forced to predict wherever they may, the autopilot off: what a jump costs, and the device peak.
part jumps "${T_JUMPS:-120}" $BENCH --preset "$PRESET" --mode memory --max_steps "${JUMP_STEPS:-300}" \
  --output_dir "$WORK/jumps"
part faults "${T_FAULTS:-180}" $PY scripts/benchmark.py --preset "$PRESET" --mode faults --full_determinism \
  --max_steps "${FAULT_STEPS:-300}" --output_dir "$WORK/faults"

# Where each part's rollback copies went (memory/placement.py): the line the trainer says at its second step.
grep -h -m1 -o "the rollback copies.*" "$WORK"/logs/*.log 2>/dev/null | sort | uniq -c | tee -a "$SUMMARY"
$PY scripts/gpu_summary.py "$WORK" --json "$OUT/suite.json" | tee -a "$SUMMARY"
tar czf "$OUT/work.tgz" -C "$WORK" --exclude='*.png' --exclude='checkpoint-*' . 2>/dev/null
