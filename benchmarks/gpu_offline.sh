#!/usr/bin/env bash
# Run benchmarks/gpu_check.py on a GPU machine that has a CUDA build of torch (>= 2.11) and
# triton (>= 3.6) in its own python3 but no package index, and that receives files in
# copies of at most 64 MiB (the checkout plus what you carry).
#
#   bash benchmarks/gpu_offline.sh pack   # here, in the project root: fills .gpu/a and .gpu/b
#   bash .gpu/a/part1.sh                  # there, with the checkout + .gpu/a copied: unpacks
#                                         #   the wheels, keeps model part 1 in /tmp/minillm-gpu,
#                                         #   starts the kernel sections detached
#   bash .gpu/b/part2.sh                  # there, with the checkout + .gpu/b copied (same
#                                         #   machine, soon after): joins the model (sha256
#                                         #   checked), waits for the kernel sections, runs the
#                                         #   model sections, puts everything in $OUT
#
# The SmolLM2 GGUF (98 MB) travels in two parts of at most 50 MB, one per copy; the checkout
# is about 9 MB (.venv and .gpu are ignored, so they do not travel with it: keep other large
# untracked files out of the checkout, or a copy crosses 64 MiB; `pack` checks). Wheels go
# only for what the GPU image lacks: gguf (benchmarks/gpu_env.py lists what the check needs;
# WHEELS="gguf other" to add one). Nothing of the serving stack is needed.
#
# Results (part2): $OUT (default benchmarks/results/gpu-offline) gets kernels.{json,md,log}
# and model.{json,md,log}. Each JSON is rewritten after every section, so a cut run keeps
# what it measured.
# Environment, read by part1.sh and part2.sh there:
#   GPU_PYTHON       the interpreter (default python3)
#   GPU_CHECK_ARGS   extra gpu_check arguments for both parts, e.g. "--quick", "--autotune"
#   KERNEL_SECTIONS  part1 (default flash_attention,paged_decode,varlen,w4a16; empty: none)
#   MODEL_SECTIONS   part2 (default greedy_match,decode,serving,pytest; empty: none)
#   KWAIT            part2: seconds to wait for the kernel sections (default 120)
#   MODEL_S          part2: outer limit on the model sections in seconds (default 345)
#   GPU_WORK         where both parts keep their state (default /tmp/minillm-gpu)
# Planned on an H100 with the pinned tile configs (gpu_check.TOTAL_BUDGET_S, 420 s, and
# START_UP_S, 60 s: 8 minutes in all): kernel sections 103 s of time boxes (they started in
# part1, so part2 waits for what is left of them), model sections 317 s (+ ~15 s of process
# start and at most GRACE_S past a box: MODEL_S), part1 about 20 s.
set -euo pipefail
cmd=${1:-}
[ "$cmd" = pack ] || { sed -n 2,35p "$0"; exit 2; }
[ -f benchmarks/gpu_check.py ] || { echo "run this in the project root" >&2; exit 2; }
py=${PYTHON:-.venv/bin/python}
limit=$((64 * 1024 * 1024))
rm -rf .gpu; mkdir -p .gpu/a/whl .gpu/b

gguf=$("$py" -c 'from minillm.gguf_loader import find_model_path; print(find_model_path())')
sha256sum "$gguf" | cut -d' ' -f1 > .gpu/a/model.sha256
half=50000000
head -c $half "$gguf" > .gpu/a/model.part1
tail -c +$((half + 1)) "$gguf" > .gpu/b/model.part2
cp .gpu/a/model.sha256 .gpu/b/

# The wheels, at the versions this project pins (pure Python: any platform).
pins=$("$py" -m pip list --format=freeze 2>/dev/null \
       | grep -iE "^($(echo "${WHEELS:-gguf}" | tr ' ' '|'))==" || true)
[ -n "$pins" ] || { echo "none of '${WHEELS:-gguf}' is installed in $py" >&2; exit 1; }
"$py" -m pip download -q --no-deps --only-binary=:all: -d .gpu/a/whl $pins

cat > .gpu/a/part1.sh <<'P1'
#!/usr/bin/env bash
# Unpack the wheels, keep model part 1, start the kernel sections detached (see
# benchmarks/gpu_offline.sh).
set -u
export PYTHONUNBUFFERED=1
D=${GPU_WORK:-/tmp/minillm-gpu}; R=$(pwd); PY=${GPU_PYTHON:-python3}
rm -rf $D; mkdir -p $D/site
cp .gpu/a/model.part1 .gpu/a/model.sha256 $D/
for w in .gpu/a/whl/*.whl; do "$PY" -m zipfile -e "$w" $D/site/; done  # pure-Python wheels
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
export PYTHONPATH=$D/site:$R MINILLM_GGUF=$D/model.gguf HF_HUB_OFFLINE=1
"$PY" -c "import torch, triton, gguf; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
S=${KERNEL_SECTIONS-flash_attention,paged_decode,varlen,w4a16}
if [ -z "$S" ]; then echo "KERNEL_SECTIONS is empty: no kernel sections"; exit 0; fi
touch $D/kernels.started
setsid -f bash -c "'$PY' benchmarks/gpu_check.py --sections $S --out $D/kernels.json \
  --markdown $D/kernels.md ${GPU_CHECK_ARGS:-} > $D/kernels.log 2>&1; echo \$? > $D/kernels.done" < /dev/null
sleep 8; tail -c 1500 $D/kernels.log
P1

cat > .gpu/b/part2.sh <<'P2'
#!/usr/bin/env bash
# Join the model, wait for the kernel sections, run the model sections; results in $OUT
# (see benchmarks/gpu_offline.sh).
set -u
export PYTHONUNBUFFERED=1
D=${GPU_WORK:-/tmp/minillm-gpu}; R=$(pwd); PY=${GPU_PYTHON:-python3}
O=${OUT:-$R/benchmarks/results/gpu-offline}; mkdir -p "$O"
[ -f $D/model.part1 ] || { echo "no $D/model.part1: run .gpu/a/part1.sh on this machine first"; exit 1; }
cat $D/model.part1 .gpu/b/model.part2 > $D/model.gguf
echo "$(cat .gpu/b/model.sha256)  $D/model.gguf" | sha256sum -c - || exit 1
export PYTHONPATH=$D/site:$R MINILLM_GGUF=$D/model.gguf HF_HUB_OFFLINE=1
"$PY" benchmarks/gpu_env.py
t0=$(date +%s)
if [ -f $D/kernels.started ]; then
  while [ ! -f $D/kernels.done ] && [ $(( $(date +%s) - t0 )) -lt ${KWAIT:-120} ]; do sleep 2; done
  [ -f $D/kernels.done ] && echo "kernel sections exit $(cat $D/kernels.done)" \
    || echo "kernel sections still running after ${KWAIT:-120} s: copying what they wrote so far"
  cp $D/kernels.log $D/kernels.json $D/kernels.md "$O"/ 2>/dev/null
fi
S=${MODEL_SECTIONS-greedy_match,decode,serving,pytest}
if [ -n "$S" ]; then
  timeout ${MODEL_S:-345} "$PY" benchmarks/gpu_check.py --sections $S --out "$O"/model.json \
    --markdown "$O"/model.md ${GPU_CHECK_ARGS:-} > "$O"/model.log 2>&1
  echo "model sections exit $? after $(( $(date +%s) - t0 )) s"
fi
[ -f $D/kernels.done ] || cp $D/kernels.log $D/kernels.json $D/kernels.md "$O"/ 2>/dev/null
grep -h "^== \|^    [a-z]\|^wrote\|^interrupted" "$O"/kernels.log "$O"/model.log 2>/dev/null \
  | cut -c1-300 | tail -c 9000
P2
chmod +x .gpu/a/part1.sh .gpu/b/part2.sh

# Each copy: the checkout (tracked and untracked files git does not ignore) plus one part.
checkout=$(git ls-files -co --exclude-standard -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
for part in a b; do
  size=$(du -sb .gpu/$part | cut -f1)
  echo "copy $part: checkout $((checkout / 1048576)) MiB + .gpu/$part $((size / 1048576)) MiB"
  [ $((checkout + size)) -le $limit ] || { echo "copy $part is over 64 MiB: remove large untracked files" >&2; exit 1; }
done
echo "packed: copy the checkout with .gpu/a and run 'bash .gpu/a/part1.sh' there; then with .gpu/b, 'bash .gpu/b/part2.sh'"
