#!/usr/bin/env bash
# bench/gpu.py on the lent H200, as ONE call of the device tool's `run`:
#   here first:  .venv/bin/python -m bench.gpu --wheels .whl
#   then:        run(command="bash bench/gpu_device.sh", carry=[".whl"], timeout_s=420)
#   what was cut, in a second call right after (the machine still warm: the model is
#   kept under /tmp and loaded, not built again):  PARTS=b,c,d bash bench/gpu_device.sh
# The machine reaches nothing: diffq and the wheels it lacks are installed from the
# carried files into /tmp/site (pyproject maps worker/ and producer/ into the diffq
# package, so the tree cannot be imported in place), then bench.gpu runs from /tmp so
# the repo's own diffq/ does not shadow the installed one. It stops itself at DEADLINE
# seconds (default 330) and rewrites $OUT/gpu.json and gpu.png after each figure.
set -uo pipefail
repo=$(pwd)
site=${SITE:-/tmp/site}
out=${OUT:-/tmp/bench-gpu}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --no-build-isolation --upgrade \
    --target "$site" .whl/*.whl "$repo" || exit 1
export PYTHONPATH=$site:$repo PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
cd /tmp || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
df -h /tmp | tail -1
python3 -m bench.gpu --out "$out" --deadline "${DEADLINE:-330}" --parts "${PARTS:-a,b,c,d,e}" --keep-model "$@" 2>&1 | tee "$out/gpu.log"
