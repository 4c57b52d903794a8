#!/usr/bin/env bash
# The command a lent GPU machine runs (benchmarks/README.md, "gpu_check.py" and "gpu_health.py"): installs the wheels
# carried in .whl/ (benchmarks/gpu_check_wheels.txt) beside the machine's PyTorch, then runs
# benchmarks/$GPU_CHECK_SCRIPT.py (gpu_check, the default, or gpu_health) in what is left of GPU_CHECK_BUDGET_S
# (default 510 s, for a call of 9 minutes). The JSON and the log go to $OUT where the device tool sets it, else to
# benchmarks/results and a temporary log. Arguments go on to the script (--commit SHA).
set -u
cd "$(dirname "$0")/.."
script=${GPU_CHECK_SCRIPT:-gpu_check}
case "$script" in
    gpu_check | gpu_health) ;;
    *) echo "gpu_check.sh: GPU_CHECK_SCRIPT must be gpu_check or gpu_health, not '$script'" >&2; exit 2 ;;
esac
budget=${GPU_CHECK_BUDGET_S:-510}
wheels=${GPU_CHECK_WHEELS:-.whl}
site=${GPU_CHECK_SITE:-/tmp/gpu_check_site}
python=${PYTHON:-python3}
out=${OUT:-benchmarks/results}
if ! "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    "$wheels"/*.whl; then
    echo "gpu_check.sh: installing $wheels/*.whl failed; $script.py runs anyway and records what fails" >&2
fi
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$python" "benchmarks/$script.py" --budget_s $((budget - SECONDS)) --out_dir "$out" \
    ${OUT:+--log "$OUT/$script.log"} "$@"
