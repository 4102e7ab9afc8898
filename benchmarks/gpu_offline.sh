#!/usr/bin/env bash
# Run benchmarks/gpu_check.py on a GPU machine that has a CUDA build of torch (>= 2.11) and
# triton (>= 3.6) in its own python3 but no package index, and that receives files in
# copies of at most 64 MiB (the checkout plus what you carry).
#
#   bash benchmarks/gpu_offline.sh pack   # here, in the project root: fills .gpu/a, .gpu/b
#                                         #   and .gpu/c
#   bash .gpu/a/part1.sh                  # there, with the checkout + .gpu/a copied: unpacks
#                                         #   the wheels, keeps model part 1 in /tmp/minillm-gpu,
#                                         #   starts the kernel sections detached
#   bash .gpu/b/part2.sh                  # there, with the checkout + .gpu/b copied (same
#                                         #   machine, soon after): joins the model (sha256
#                                         #   checked), waits for the kernel sections, runs the
#                                         #   model sections, puts everything in $OUT
#   bash .gpu/c/part3.sh                  # there, with the checkout + .gpu/c copied (same
#                                         #   machine, after part2): installs the labs' wheels,
#                                         #   runs every lab under nbval, LAB_PARALLEL at once
#
# The SmolLM2 GGUF (98 MB) travels in two parts of at most 50 MB, one per copy; the checkout
# is about 9 MB (.venv and .gpu are ignored, so they do not travel with it: keep other large
# untracked files out of the checkout, or a copy crosses 64 MiB; `pack` checks). Wheels go
# only for what the GPU image lacks: gguf in .gpu/a (benchmarks/gpu_env.py lists what the
# check needs; WHEELS="gguf other" to add one; nothing of the serving stack is needed), and
# in .gpu/c what the labs need (gpu_env.LAB_WHEELS: nbval, a notebook kernel, ipywidgets,
# the server of Labs 09-10 and their dependencies, about 19 MB, at this project's pins, for
# the image's Python, GPU_PY_VERSION, default 3.12) with the Lee corpus of Labs 06-08 and 10
# (minillm.data fetches it from PyPI otherwise).
#
# Results: $OUT (default benchmarks/results/gpu-offline) gets kernels.{json,md,log} and
# model.{json,md,log} from part2, labs.{json,md,log} from part3. Each JSON is rewritten
# after every section and every row, so a cut run keeps what it measured.
# Environment, read by the parts there:
#   GPU_PYTHON       the interpreter (default python3)
#   GPU_CHECK_ARGS   extra gpu_check arguments for part1 and part2, e.g. "--quick", "--autotune"
#   KERNEL_SECTIONS  part1 (default flash_attention,paged_decode,varlen,w4a16,decode_gemv; empty: none)
#   MODEL_SECTIONS   part2 (default greedy_match,decode,serving,pytest; empty: none)
#   KWAIT            part2: seconds to wait for the kernel sections (default 120); when they
#                    finish first and wrote kernels.tuned.json (gemv_tiles in KERNEL_SECTIONS,
#                    or --autotune), the model sections launch those configs (MINILLM_TUNED).
#                    gemv_tiles adds ~150 s to part1's sections: wait for them in a call of
#                    their own between part1 and part2 (a call runs 10 minutes at most):
#                    while [ ! -f /tmp/minillm-gpu/kernels.done ]; do sleep 2; done
#   MODEL_S          part2: outer limit on the model sections in seconds (default 345)
#   LABS             part3: the labs, e.g. 01,05 (default all)
#   LAB_PARALLEL     part3: labs at once (default 5; 1 for clean per-lab seconds)
#   LABS_S           part3: outer limit in seconds, install included (default 240); the labs
#                    section gets what is left less LABS_MARGIN_S (40: gpu_check's start and
#                    the stop of the labs it cuts), and whatever it cuts is listed as skipped
#   LAB_ARGS         part3: extra gpu_check arguments, e.g. "--lab-timeout 200"
#   GPU_WORK         where the parts keep their state (default /tmp/minillm-gpu)
#   GPU_DIR          pack: where to pack (default .gpu, which the device call carries; each
#                    part reads the files beside it); GPU_PY_VERSION: the image's Python
# Planned on an H100 with the pinned tile configs (gpu_check.TOTAL_BUDGET_S, 420 s, and
# START_UP_S, 60 s: 8 minutes in all): kernel sections 111 s of time boxes (they started in
# part1, so part2 waits for what is left of them), model sections 309 s (+ ~15 s of process
# start and at most GRACE_S past a box: MODEL_S), part1 about 20 s. A session's 15 minutes
# of device time leave part3 about 4 (LABS_S 240): ten labs in that time only side by side.
set -euo pipefail
cmd=${1:-}
[ "$cmd" = pack ] || { sed -n 2,57p "$0"; exit 2; }
[ -f benchmarks/gpu_check.py ] || { echo "run this in the project root" >&2; exit 2; }
py=${PYTHON:-.venv/bin/python}
limit=$((64 * 1024 * 1024))
G=${GPU_DIR:-.gpu}  # where to pack; the parts find their files beside themselves
rm -rf "$G"/a "$G"/b "$G"/c; mkdir -p "$G"/a/whl "$G"/b "$G"/c/whl

gguf=$("$py" -c 'from minillm.gguf_loader import find_model_path; print(find_model_path())')
sha256sum "$gguf" | cut -d' ' -f1 > "$G"/a/model.sha256
half=50000000
head -c $half "$gguf" > "$G"/a/model.part1
tail -c +$((half + 1)) "$gguf" > "$G"/b/model.part2
cp "$G"/a/model.sha256 "$G"/b/

# The wheels, at the versions this project pins (pure Python: any platform).
pins=$("$py" -m pip list --format=freeze 2>/dev/null \
       | grep -iE "^($(echo "${WHEELS:-gguf}" | tr ' ' '|'))==" || true)
[ -n "$pins" ] || { echo "none of '${WHEELS:-gguf}' is installed in $py" >&2; exit 1; }
"$py" -m pip download -q --no-deps --only-binary=:all: -d "$G"/a/whl $pins

# The labs' wheels (gpu_env.LAB_WHEELS, pinned to this venv's versions) for the image's
# Python on x86-64 Linux: pure-Python ones match any platform, binary ones (pyzmq, tornado,
# debugpy, rpds-py, pydantic-core, wcwidth) need a manylinux tag, and pip matches each tag
# exactly, so every level up to glibc 2.35 is named (the image's Python 3.12.3 runs on a
# newer glibc); a pin with no such wheel stops the pack here, not the labs there.
labpins=$("$py" benchmarks/gpu_env.py --lab-pins) || exit 1
plats="--platform manylinux1_x86_64 --platform manylinux2010_x86_64 --platform manylinux2014_x86_64"
for n in 5 12 $(seq 17 35); do plats="$plats --platform manylinux_2_${n}_x86_64"; done
"$py" -m pip download -q --no-deps --only-binary=:all: --implementation cp \
  --python-version "${GPU_PY_VERSION:-3.12}" $plats -d "$G"/c/whl $labpins
[ "$(ls "$G"/c/whl | wc -l)" -eq "$(echo "$labpins" | wc -l)" ] \
  || { echo "pip download gave $(ls "$G"/c/whl | wc -l) wheels for $(echo "$labpins" | wc -l) pins" >&2; exit 1; }
corpus=$("$py" -c 'from minillm.data import lee_corpus_path; print(lee_corpus_path())')
cp "$corpus" "$G"/c/

cat > "$G"/a/part1.sh <<'P1'
#!/usr/bin/env bash
# Unpack the wheels, keep model part 1, start the kernel sections detached (see
# benchmarks/gpu_offline.sh).
set -u
export PYTHONUNBUFFERED=1
H=$(cd "$(dirname "$0")" && pwd)  # this copy (.gpu/a)
D=${GPU_WORK:-/tmp/minillm-gpu}; R=$(pwd); PY=${GPU_PYTHON:-python3}
rm -rf $D; mkdir -p $D/site
cp "$H"/model.part1 "$H"/model.sha256 $D/
for w in "$H"/whl/*.whl; do "$PY" -m zipfile -e "$w" $D/site/; done  # pure-Python wheels
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
export PYTHONPATH=$D/site:$R MINILLM_GGUF=$D/model.gguf HF_HUB_OFFLINE=1
"$PY" -c "import torch, triton, gguf; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
S=${KERNEL_SECTIONS-flash_attention,paged_decode,varlen,w4a16,decode_gemv}
if [ -z "$S" ]; then echo "KERNEL_SECTIONS is empty: no kernel sections"; exit 0; fi
touch $D/kernels.started
setsid -f bash -c "'$PY' benchmarks/gpu_check.py --sections $S --out $D/kernels.json \
  --markdown $D/kernels.md ${GPU_CHECK_ARGS:-} > $D/kernels.log 2>&1; echo \$? > $D/kernels.done" < /dev/null
sleep 8; tail -c 1500 $D/kernels.log
P1

cat > "$G"/b/part2.sh <<'P2'
#!/usr/bin/env bash
# Join the model, wait for the kernel sections, run the model sections; results in $OUT
# (see benchmarks/gpu_offline.sh).
set -u
export PYTHONUNBUFFERED=1
H=$(cd "$(dirname "$0")" && pwd)  # this copy (.gpu/b)
D=${GPU_WORK:-/tmp/minillm-gpu}; R=$(pwd); PY=${GPU_PYTHON:-python3}
O=${OUT:-$R/benchmarks/results/gpu-offline}; mkdir -p "$O"
[ -f $D/model.part1 ] || { echo "no $D/model.part1: run .gpu/a/part1.sh on this machine first"; exit 1; }
cat $D/model.part1 "$H"/model.part2 > $D/model.gguf
echo "$(cat "$H"/model.sha256)  $D/model.gguf" | sha256sum -c - || exit 1
export PYTHONPATH=$D/site:$R MINILLM_GGUF=$D/model.gguf HF_HUB_OFFLINE=1
"$PY" benchmarks/gpu_env.py
t0=$(date +%s)
if [ -f $D/kernels.started ]; then
  while [ ! -f $D/kernels.done ] && [ $(( $(date +%s) - t0 )) -lt ${KWAIT:-120} ]; do sleep 2; done
  [ -f $D/kernels.done ] && echo "kernel sections exit $(cat $D/kernels.done)" \
    || echo "kernel sections still running after ${KWAIT:-120} s: copying what they wrote so far" \
            "(copied again at the end; while both ran they shared the GPU)"
  cp $D/kernels.log $D/kernels.json $D/kernels.md $D/kernels.tuned.json "$O"/ 2>/dev/null
fi
# Tile configs the kernel sections measured (gemv_tiles' fastest decode GEMV tiles, or
# --autotune's): the model sections launch them (tuning.load_measured).
if [ -f $D/kernels.done ] && [ -f $D/kernels.tuned.json ]; then
  export MINILLM_TUNED=$D/kernels.tuned.json
  echo "the model sections use the tile configs the kernel sections measured: $MINILLM_TUNED"
fi
S=${MODEL_SECTIONS-greedy_match,decode,serving,pytest}
if [ -n "$S" ]; then
  timeout -k 10 ${MODEL_S:-345} "$PY" benchmarks/gpu_check.py --sections $S --out "$O"/model.json \
    --markdown "$O"/model.md ${GPU_CHECK_ARGS:-} > "$O"/model.log 2>&1
  echo "model sections exit $? after $(( $(date +%s) - t0 )) s"
fi
# The kernels' latest report, whether they finished before the model sections or during
# them (the copy above may be a snapshot taken while they still ran).
[ -f $D/kernels.started ] && cp $D/kernels.log $D/kernels.json $D/kernels.md $D/kernels.tuned.json \
  "$O"/ 2>/dev/null
grep -h "^== \|^    \[\|^wrote\|^interrupted" "$O"/kernels.log "$O"/model.log 2>/dev/null \
  | cut -c1-300 | tail -c 9000
P2
cat > "$G"/c/part3.sh <<'P3'
#!/usr/bin/env bash
# Install the labs' wheels, put the Lee corpus where minillm looks, run the labs section
# on the model part2 joined, LAB_PARALLEL labs at once, within LABS_S; results in $OUT
# (see benchmarks/gpu_offline.sh).
set -u
export PYTHONUNBUFFERED=1
t0=$(date +%s)
H=$(cd "$(dirname "$0")" && pwd)  # this copy (.gpu/c)
D=${GPU_WORK:-/tmp/minillm-gpu}; R=$(pwd); PY=${GPU_PYTHON:-python3}
O=${OUT:-$R/benchmarks/results/gpu-offline}; mkdir -p "$O"
[ -f benchmarks/gpu_check.py ] || { echo "run this in the project root"; exit 1; }
[ -f $D/model.gguf ] || { echo "no $D/model.gguf: run .gpu/a/part1.sh, then .gpu/b/part2.sh on this machine first (part2 joins the model)"; exit 1; }
# Binary wheels (pyzmq, tornado, ...) need pip's install; --no-deps: the wheels are the
# whole closure, and nothing of the image is replaced (they go to a folder of their own).
rm -rf $D/site-labs; mkdir -p $D/site-labs $D/cache
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $D/site-labs \
  "$H"/whl/*.whl || { echo "installing the labs' wheels failed"; exit 1; }
cp "$H"/lee_background.cor $D/cache/
# The notebook kernel: nbval --nbval-current-env starts it as `$PY -m ipykernel_launcher`
# (no kernelspec on disk needed), and it inherits PYTHONPATH, so it sees site-labs too.
export PYTHONPATH=$D/site-labs:$R MINILLM_GGUF=$D/model.gguf MINILLM_CACHE_DIR=$D/cache \
  HF_HUB_OFFLINE=1
# An image package older than a carried one needs shows here (and would fail a lab there).
names=$(ls "$H"/whl | sed 's/-.*//; s/[-_.]/[-_.]/g' | paste -sd'|')
"$PY" -m pip check 2>&1 | grep -iE "^($names) " | sed 's/^/pip check: /'
"$PY" -c "import nbval, ipykernel, IPython, ipywidgets, fastapi, uvicorn, gguf; print('labs: packages import')" || exit 1
left=$(( ${LABS_S:-240} - ($(date +%s) - t0) ))
budget=$(( left - ${LABS_MARGIN_S:-40} ))
[ $budget -gt 0 ] || { echo "LABS_S leaves no time for the labs ($left s left)"; exit 1; }
echo "labs ${LABS:-all}, ${LAB_PARALLEL:-5} at a time, section budget $budget s (outer limit $left s)"
timeout -k 10 $left "$PY" benchmarks/gpu_check.py --sections labs --labs ${LABS:-all} \
  --lab-parallel ${LAB_PARALLEL:-5} --lab-budget $budget --out "$O"/labs.json \
  --markdown "$O"/labs.md ${LAB_ARGS:-} > "$O"/labs.log 2>&1
echo "labs exit $? after $(( $(date +%s) - t0 )) s"
grep -h "^== \|^    \[\|^wrote\|^interrupted\|Error" "$O"/labs.log | cut -c1-400 | tail -c 9000
P3
chmod +x "$G"/a/part1.sh "$G"/b/part2.sh "$G"/c/part3.sh

# Each copy: the checkout (tracked and untracked files git does not ignore) plus one part.
checkout=$(git ls-files -co --exclude-standard -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
for part in a b c; do
  size=$(du -sb "$G"/$part | cut -f1)
  echo "copy $part: checkout $((checkout / 1048576)) MiB + $G/$part $((size / 1048576)) MiB"
  [ $((checkout + size)) -le $limit ] || { echo "copy $part is over 64 MiB: remove large untracked files" >&2; exit 1; }
done
echo "packed: copy the checkout with .gpu/a and run 'bash .gpu/a/part1.sh' there; then with .gpu/b, 'bash .gpu/b/part2.sh'; then with .gpu/c, 'bash .gpu/c/part3.sh'"
