#!/bin/sh
# Everything measured on the lent H200, in one call per section, beside the anchors.
# Usage (repo root on the GPU machine, with .anchors prepared by ../shared/anchors/prepare.sh
# and carried, and pytest wheels carried in .whl):  sh bench/h200.sh SECTION...  (in that order;
# BENCH_PROFILE=1 adds a JSON line per tts / vision / fullft run: its last step's kernels by category
# BENCH_PROFILE=python instead: cProfile of that step (the host's Python by function) in $OUT/<label>.cprofile.txt
# BENCH_PROFILE=memory instead: a JSON line of what is allocated at that step's peak, by where it was allocated
# (that step runs slower: take step times from a run without it).
# sections: machine, tests, kernels, trainer, profile, ab, host, moe, moetune, notebook, families, families_call, generation,
# genab, nf4mm, grpo, tts, fullft, vision, dpo, multigpu; all = machine tests kernels trainer)
# Results land in $OUT (logs and JSON lines; generation and grpo keep each run's whole output, warnings
# included, in <section>-<impl>.log). SHAPES="bf16 qlora" picks the trainer's and ab's shapes.
set -u
OUT=${OUT:-/tmp/h200-out}
mkdir -p "$OUT"
ROOT=$(pwd)
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
# Our source first: .anchors/site also holds the public `unsloth` package, whose import name is ours.
export PYTHONPATH="/tmp/site:$ROOT/src:$ROOT/kernels:$ROOT/.anchors/site" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

machine() {
  nvidia-smi | tee "$OUT/nvidia-smi.txt"
  python3 -c "import unsloth, unsloth_kernels; print('unsloth from', unsloth.__file__)"
  python3 src/unsloth/selftest/script.py --backend cuda 2>&1 | tee "$OUT/env-probe.json"
  python3 - <<'PY' 2>&1 | tee "$OUT/detect.json"
import json, os
from unsloth.platform.detect import detect_live
from unsloth.platform.dump import write_dump
platform, results = detect_live()
write_dump(os.path.join(os.environ.get("OUT", "/tmp"), "h200-dump"), results)
print(json.dumps(platform.to_json()))
PY
}

tests() {
  # shellcheck disable=SC2086  # TESTS is a list of paths
  UNSLOTH_TEST_REAL_SHAPES=1 timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -q -x -p no:cacheprovider \
    ${TESTS:-tests/kernels tests/models/test_models_embedding.py} 2>&1 | tail -25 | tee "$OUT/gpu-tests.txt"
}

kernels() {
  timeout 240 python3 .anchors/anchor_kernels.py 2>&1 | tee "$OUT/anchor-kernels.jsonl"
  # shellcheck disable=SC2086
  timeout 300 python3 bench/bench_kernels.py --no-compile --no-liger ${KERNELS:+--only $KERNELS} 2>&1 | tee "$OUT/bench-kernels.txt"
}

shape_args() {  # the harness's arguments for a shape named in $SHAPES
  case $1 in
    bf16) echo "" ;;
    qlora) echo "--four-bit --batch 2" ;;
    *) echo "unknown shape: $1 (bf16 or qlora)" >&2; exit 2 ;;
  esac
}

trainer() {
  python3 .anchors/anchor_lora.py --impl make >/dev/null
  for shape in ${SHAPES:-bf16 qlora}; do
    four=$(shape_args "$shape") || exit 2
    # ours first, through the very same harness loop (our package answers `import unsloth`)
    # shellcheck disable=SC2086
    timeout 200 python3 .anchors/anchor_lora.py --impl unsloth $four 2>&1 | tail -4 | sed 's/"impl": "unsloth"/"impl": "ours"/' | tee -a "$OUT/trainer.jsonl"
    for impl in ${ANCHOR_IMPLS-unsloth hf}; do
      # the public packages: the anchors' site first, without our source
      # shellcheck disable=SC2086
      PYTHONPATH="/tmp/site:$ROOT/.anchors/site" timeout 200 python3 .anchors/anchor_lora.py --impl $impl $four 2>&1 | tail -1 | tee -a "$OUT/trainer.jsonl"
    done
  done
}

ab() {  # ours under each environment setting in $AB (e.g. "X=1 X=0"; no "|" in them), then Unsloth, both shapes
  python3 .anchors/anchor_lora.py --impl make >/dev/null
  for shape in ${SHAPES:-bf16 qlora}; do
    four=$(shape_args "$shape") || exit 2
    for setting in ${AB:-UNSLOTH_REPLAY_PROJECTIONS=1}; do
      # shellcheck disable=SC2086
      env "$setting" timeout 200 python3 .anchors/anchor_lora.py --impl unsloth $four 2>&1 | tail -1 | sed "s|\"impl\": \"unsloth\"|\"impl\": \"ours $setting\"|" | tee -a "$OUT/ab.jsonl"
    done
    # shellcheck disable=SC2086
    [ -n "${ANCHOR_IMPLS-unsloth}" ] && PYTHONPATH="/tmp/site:$ROOT/.anchors/site" timeout 200 python3 .anchors/anchor_lora.py --impl ${ANCHOR_IMPLS-unsloth} $four 2>&1 | tail -1 | tee -a "$OUT/ab.jsonl"
  done
}

profile() {  # where our step's GPU time and memory go (bench/profile_trainer.py), bf16 and QLoRA
  python3 .anchors/anchor_lora.py --impl make >/dev/null
  timeout 200 python3 bench/profile_trainer.py --harness .anchors/anchor_lora.py --impl unsloth 2>&1 | tee "$OUT/profile-bf16.txt"
  timeout 200 python3 bench/profile_trainer.py --harness .anchors/anchor_lora.py --impl unsloth --four-bit --batch 2 2>&1 | tee "$OUT/profile-qlora.txt"
}

host() {  # where the host's time goes in our QLoRA step (host-paced at batch 2)
  python3 .anchors/anchor_lora.py --impl make >/dev/null
  timeout 200 python3 bench/profile_trainer.py --harness .anchors/anchor_lora.py --impl unsloth --four-bit --batch 2 --host 2>&1 | tee "$OUT/host-qlora.txt"
}

notebook() {  # a TRL SFTTrainer run in the notebooks' style (QLoRA 2 x 4, adamw_8bit, 2048): ours, then Unsloth
  python3 .anchors/anchor_lora.py --impl make >/dev/null
  timeout 200 python3 bench/bench_notebook_sft.py --impl ours 2>&1 | tail -1 | tee -a "$OUT/notebook.jsonl"
  PYTHONPATH="/tmp/site:$ROOT/.anchors/site" timeout 200 python3 bench/bench_notebook_sft.py --impl unsloth 2>&1 | tail -1 | tee -a "$OUT/notebook.jsonl"
}

moe() {  # MoE: the experts alone (ours vs torch._grouped_mm + LoRA matmuls), then training steps of
  # ours, transformers + peft and Unsloth. One (shape, bits) pair fits a call: MOE_SHAPES=gpt-oss-20b
  # MOE_BITS=bf16 (or qlora); MOE_KERNEL=0 skips the kernel part, MOE_IMPLS picks the step impls.
  [ "${MOE_KERNEL:-1}" = 0 ] || timeout 150 python3 bench/bench_moe.py --part kernel 2>&1 | tee -a "$OUT/moe.jsonl"
  for shape in ${MOE_SHAPES:-gpt-oss-20b}; do
    for bits in ${MOE_BITS:-bf16}; do
      case $bits in bf16) four="" ;; qlora) four="--four-bit" ;; *) echo "MOE_BITS: bf16 or qlora" >&2; exit 2 ;; esac
      for impl in ${MOE_IMPLS:-ours hf unsloth}; do
        path="$PYTHONPATH"
        # the public Unsloth: the anchors' site first, without our source (bench_moe imports nothing of ours then)
        [ "$impl" = unsloth ] && path="/tmp/site:$ROOT/.anchors/site"
        # shellcheck disable=SC2086
        PYTHONPATH="$path" timeout 100 python3 bench/bench_moe.py --part step --impl "$impl" --shape "$shape" $four 2>&1 | tail -1 | tee -a "$OUT/moe.jsonl"
      done
    done
  done
}

vision() {  # Qwen2.5-VL-7B-shaped vision QLoRA (bench/bench_vision.py): ours, then Unsloth's FastVisionModel
  # VISION_LAYERS="8 8" (text, vision) to fit one call; the defaults of the real model are 28 and 32
  # shellcheck disable=SC2086  # two numbers, split on purpose
  set -- ${VISION_LAYERS:-8 8}
  timeout 200 python3 bench/bench_vision.py --impl make --text-layers "$1" --vision-layers "$2" 2>&1 | tail -1 | tee -a "$OUT/vision.jsonl"
  timeout 150 python3 bench/bench_vision.py --impl ours --text-layers "$1" --vision-layers "$2" 2>&1 | grep '^{' | tee -a "$OUT/vision.jsonl"
  PYTHONPATH="/tmp/site:$ROOT/.anchors/site" timeout 150 python3 bench/bench_vision.py --impl unsloth \
    --text-layers "$1" --vision-layers "$2" 2>&1 | grep '^{' | tee -a "$OUT/vision.jsonl"
  # VISION_AB=1: ours again with transformers' per-window vision attention (the windowed patch off)
  if [ "${VISION_AB:-0}" = 1 ]; then
    UNSLOTH_VISION_ATTENTION=0 timeout 150 python3 bench/bench_vision.py --impl ours --text-layers "$1" \
      --vision-layers "$2" 2>&1 | grep '^{' | sed 's/"vision ours"/"vision ours-stock-vision"/; s/"impl": "ours"/"impl": "ours-stock-vision"/' \
      | tee -a "$OUT/vision.jsonl"
  fi
}

moetune() {  # the MoE kernel's launch configurations swept at both shapes (about 4 minutes); prints the
  # best, with its ratios against torch._grouped_mm + LoRA matmuls measured in the same process
  timeout 280 python3 bench/bench_moe.py --part tune --budget-s "${MOE_TUNE_BUDGET:-200}" 2>&1 | grep '^{' | tee -a "$OUT/moe_tune.jsonl"
}

families() {  # today's families (bench/bench_families.py): ours, ours with family patches off, Unsloth, HF
  # FAMILIES="qwen3_5 gemma4 phi3", SHAPES="qlora bf16", FAMILY_IMPLS: pick fewer to fit one call
  for family in ${FAMILIES:-qwen3_5 gemma4 phi3}; do
    timeout 200 python3 bench/bench_families.py --family "$family" --impl make 2>&1 | tail -1 | tee -a "$OUT/families.jsonl"
    for shape in ${SHAPES:-qlora bf16}; do
      for impl in ${FAMILY_IMPLS:-ours generic unsloth hf}; do
        case $impl in
          ours) set -- --impl ours ;;
          generic) set -- --impl ours --generic ;;
          *) set -- --impl "$impl" ;;
        esac
        path=$PYTHONPATH  # ours: our source first; the public packages: the anchors' site alone
        [ "$impl" = unsloth ] || [ "$impl" = hf ] && path="/tmp/site:$ROOT/.anchors/site"
        PYTHONPATH=$path timeout 150 python3 bench/bench_families.py --family "$family" --shape "$shape" "$@" 2>&1 \
          | tail -1 | tee -a "$OUT/families.jsonl"
      done
    done
  done
}

families_call() {  # ours vs Unsloth, QLoRA + bf16, three families, within one device call of <= 9 min
  # Fewer layers than the defaults (the lines say how many): Qwen3.5 4 (one full-attention layer in 4),
  # Gemma 4 6 (five sliding, one full), Phi-4-mini shapes (phi3) 4. Each row has its own timeout, and
  # no row starts past FAMILY_BUDGET seconds: a skipped row prints {"skipped": ...} instead.
  budget=${FAMILY_BUDGET:-510}
  start=$(date +%s)
  for spec in ${FAMILY_ROWS:-qwen3_5:4 gemma4:6 phi3:4}; do
    family=${spec%%:*} layers=${spec##*:}
    for impl in make ours unsloth; do
      case $impl in make) cap=${MAKE_TIMEOUT:-60} ;; ours) cap=${OURS_TIMEOUT:-120} ;; *) cap=${UNSLOTH_TIMEOUT:-240} ;; esac
      left=$((budget - ($(date +%s) - start)))
      [ "$cap" -le "$left" ] || cap=$left
      if [ "$cap" -lt 20 ]; then
        echo "{\"skipped\": \"$impl\", \"family\": \"$family\", \"reason\": \"call budget ${budget}s spent\"}" \
          | tee -a "$OUT/families.jsonl"
        continue
      fi
      path=$PYTHONPATH
      [ "$impl" = unsloth ] && path="/tmp/site:$ROOT/.anchors/site"
      PYTHONPATH=$path timeout "$cap" python3 bench/bench_families.py --family "$family" --layers "$layers" \
        --shape qlora,bf16 --impl "$impl" --steps "${FAMILY_STEPS:-4}" --warmup 2 >"$OUT/family-row.log" 2>&1
      grep '^{' "$OUT/family-row.log" | tee -a "$OUT/families.jsonl"
      # the rest of each row's output (where a row that printed nothing spent its time) in one log
      { echo "== $family $impl"; grep -v '^{' "$OUT/family-row.log" | tail -30; } >>"$OUT/families.log"
      [ "$impl" = make ] || echo "{\"row\": \"$impl\", \"family\": \"$family\", \"cap_s\": $cap, \"elapsed_s\": $(($(date +%s) - start))}" \
        | tee -a "$OUT/families.jsonl"
    done
  done
}

generation() {  # decoding after for_inference, LoRA attached, batch 1 and 8; GEN_ARGS="--four-bit" for 4-bit
  # (UNSLOTH_NF4_SUM_IN_GRAPH=0 in the environment: nf4_matmul's second pass as a kernel of its own, for an A/B)
  [ -f /tmp/llama8b/config.json ] || python3 .anchors/anchor_lora.py --impl make >/dev/null
  # shellcheck disable=SC2086
  # ours compiles the decode step once per batch size (4-bit batch 8: about 160 s on an H100 with cold
  # compile caches, 30 s warm): a longer limit, GEN_OURS_TIMEOUT
  timeout "${GEN_OURS_TIMEOUT:-300}" python3 bench/bench_generation.py --impl ours ${GEN_ARGS:-} 2>&1 | tee -a "$OUT/generation-ours.log" | grep '^{' | tee -a "$OUT/generation.jsonl"
  for impl in ${ANCHOR_IMPLS-unsloth hf}; do
    # shellcheck disable=SC2086
    PYTHONPATH="/tmp/site:$ROOT/.anchors/site" timeout 120 python3 bench/bench_generation.py --impl $impl ${GEN_ARGS:-} 2>&1 | tee -a "$OUT/generation-$impl.log" | grep '^{' | tee -a "$OUT/generation.jsonl"
  done
}

genab() {  # decoding at GRPO's shape (4-bit, batch 8, 256-token prompt, 256 new) under each setting in $AB, ours only,
  # on an 8-layer Llama-3.1-8B shape (a cold compile per setting fits a call), e.g.
  # AB="UNSLOTH_NF4_UNROLL_RANK=16 UNSLOTH_NF4_UNROLL_RANK=0"; no "|" in the settings
  [ -f /tmp/llama8b-dpo/config.json ] || timeout 150 python3 bench/bench_dpo.py --impl make --layers 8 2>&1 | tail -1
  for setting in ${AB:?AB: settings to compare}; do
    # shellcheck disable=SC2086
    env "$setting" timeout "${GEN_OURS_TIMEOUT:-200}" python3 bench/bench_generation.py --impl ours --four-bit \
      --batch 8 --prompt 256 --new 256 --model-dir /tmp/llama8b-dpo ${GEN_ARGS:-} 2>&1 | tee -a "$OUT/genab.log" | grep '^{' \
      | sed "s|\"impl\": \"ours\"|\"impl\": \"ours $setting\"|" | tee -a "$OUT/genab.jsonl"
  done
}

nf4mm() {  # the few-row NF4 matmul against bitsandbytes (in .anchors) at the 8B projections, M = 1, 8, 16
  # NF4MM_ARGS="--sweep --tuning-out $OUT/nf4-tuning.json" first picks the launch configurations;
  # GEN_ARGS="--four-bit --nf4-tuning $OUT/nf4-tuning.json" then decodes with them in the same call
  # shellcheck disable=SC2086
  timeout "${NF4MM_TIMEOUT:-300}" python3 bench/nf4_matmul.py ${NF4MM_ARGS:-} 2>&1 | tee "$OUT/nf4_matmul.log"
}

grpo() {  # a notebook-style GRPO step (QLoRA, a group of 8 x 256 after a 256-token prompt, no vLLM): ours, then Unsloth
  # GRPO_TIMEOUT (s, each run): ours' first step compiles the 4-bit decode step, about 160 s with cold caches
  [ -f /tmp/llama8b/config.json ] || python3 .anchors/anchor_lora.py --impl make >/dev/null
  # shellcheck disable=SC2086
  timeout -k 15 "${GRPO_TIMEOUT:-240}" python3 bench/bench_grpo.py --impl ours ${GRPO_ARGS:-} 2>&1 | tee -a "$OUT/grpo-ours.log" | grep '^{"' | tee -a "$OUT/grpo.jsonl"
  # shellcheck disable=SC2086
  PYTHONPATH="/tmp/site:$ROOT/.anchors/site" timeout -k 15 "${GRPO_TIMEOUT:-240}" python3 bench/bench_grpo.py --impl unsloth ${GRPO_ARGS:-} 2>&1 | tee -a "$OUT/grpo-unsloth.log" | grep '^{"' | tee -a "$OUT/grpo.jsonl"
}

tts() {  # an Orpheus-3B-shaped TTS SFT as the notebook runs it (bench/bench_tts.py): ours, then Unsloth
  # TTS_ARGS="--layers 16" for a shallower model (said in the JSON line)
  # shellcheck disable=SC2086
  timeout 120 python3 bench/bench_tts.py --impl make ${TTS_ARGS:-} 2>&1 | tail -2
  # shellcheck disable=SC2086
  timeout 200 python3 bench/bench_tts.py --impl ours ${TTS_ARGS:-} 2>&1 | grep '^{' | tee -a "$OUT/tts.jsonl"
  # shellcheck disable=SC2086
  PYTHONPATH="/tmp/site:$ROOT/.anchors/site" timeout 200 python3 bench/bench_tts.py --impl unsloth ${TTS_ARGS:-} 2>&1 | grep '^{' | tee -a "$OUT/tts.jsonl"
}

fullft() {  # full fine-tuning of a Llama-3.2-1B shape (bf16, 8 x 2048, adamw_8bit): ours, Unsloth, transformers.
  # FULLFT_MODES="full lora8" adds 8-bit LoRA rows (batch 2); FULLFT_IMPLS picks fewer; FULLFT_OPTIM=adamw.
  [ -f /tmp/llama1b/config.json ] || timeout 120 python3 bench/bench_fullft.py --impl make 2>&1 | tail -1
  for mode in ${FULLFT_MODES:-full}; do
    batch=8
    [ "$mode" = lora8 ] && batch=2
    for impl in ${FULLFT_IMPLS:-ours unsloth hf}; do
      path=$PYTHONPATH  # ours: our source first; the public packages: the anchors' site alone
      [ "$impl" = ours ] || path="/tmp/site:$ROOT/.anchors/site"
      PYTHONPATH=$path timeout "${FULLFT_TIMEOUT:-150}" python3 bench/bench_fullft.py --impl "$impl" --mode "$mode" \
        --batch "$batch" --optim "${FULLFT_OPTIM:-adamw_8bit}" 2>&1 | grep '^{' | tee -a "$OUT/fullft.jsonl"
    done
  done
}

dpo() {  # DPO, QLoRA, Llama-3.1-8B shapes with DPO_LAYERS layers (default 8), 2 pairs x 1024: ours, Unsloth, TRL + PEFT
  layers="--layers ${DPO_LAYERS:-8}"
  # shellcheck disable=SC2086
  [ -f /tmp/llama8b-dpo/config.json ] || timeout 120 python3 bench/bench_dpo.py --impl make $layers 2>&1 | tail -1
  # shellcheck disable=SC2086
  timeout 100 python3 bench/bench_dpo.py --impl ours $layers 2>&1 | grep '^{' | tee -a "$OUT/dpo.jsonl"
  for impl in ${ANCHOR_IMPLS-unsloth trl}; do
    [ "$impl" = hf ] && impl=trl
    # shellcheck disable=SC2086
    PYTHONPATH="/tmp/site:$ROOT/.anchors/site" timeout 100 python3 bench/bench_dpo.py --impl $impl $layers 2>&1 | grep '^{' | tee -a "$OUT/dpo.jsonl"
  done
}

multigpu() {  # several GPUs (bench/bench_multigpu.py; a kind with 2+ GPUs): DDP LoRA on Llama-3.1-8B shapes on 1
  # and MULTIGPU_GPUS GPUs (tokens/s, scaling efficiency), FSDP2 QLoRA on a 70B shape with MULTIGPU_LAYERS layers
  # on 2 (peak per GPU); MULTIGPU_ONLY=ddp|fsdp runs one of the two (one device call each if both do not fit)
  # shellcheck disable=SC2086
  NCCL_NVLS_ENABLE=0 timeout "${MULTIGPU_TIMEOUT:-560}" python3 bench/bench_multigpu.py --gpus "${MULTIGPU_GPUS:-2}" \
    --layers "${MULTIGPU_LAYERS:-8}" ${MULTIGPU_ONLY:+--only $MULTIGPU_ONLY} 2>&1 | grep '^{' | tee -a "$OUT/multigpu.jsonl"
}

[ $# -gt 0 ] || set -- all
for section in "$@"; do
  case $section in
    machine|tests|kernels|trainer|profile|ab|host|moe|moetune|notebook|families|families_call|generation|genab|nf4mm|grpo|tts|fullft|vision|dpo|multigpu) $section ;;
    all) machine; tests; kernels; trainer ;;
    *) echo "unknown section: $section" >&2; exit 2 ;;
  esac
done
