#!/usr/bin/env bash
# Everything that needs an NVIDIA GPU, in one run of under 8 minutes on one GPU:
# every test marked gpu / multi_gpu (tests/gpu, the collectives between plain processes, plus
# the GPU logic tests), then the GPU transport benchmark (benchmarks/gpu.py) and the process
# scenarios of `tensorwire bench` (the Ray ones need Ray, which the device machine lacks: the
# one Ray GPU test, test_ray_actors_with_fractional_gpus_share_one_gpu, skips saying so; see
# docs/performance.md, "What the GPU check cannot run"). benchmarks.gpu exits 1 when a method
# fails or delivers wrong data; its exit status is in the report.
# Writes device_report.md, pytest.log, bench.log and bench.json under $OUT (the device tool's
# output folder) or ./device_report/.
#
# Wheels in .whl/ (ucxx and its libraries, for a machine without network) are installed into
# /tmp/tw-site first. Run from anywhere: bash benchmarks/device_check.sh
set -u
cd "$(dirname "$0")/.."
out=${OUT:-$PWD/device_report}
mkdir -p "$out"
report=$out/device_report.md
py=${PYTHON:-python3}
export RAY_USAGE_STATS_ENABLED=0 TENSORWIRE_HOST=127.0.0.1 PYTHONUNBUFFERED=1 UCX_WARN_UNUSED_ENV_VARS=n
if ls .whl/*.whl >/dev/null 2>&1; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/tw-site .whl/*.whl \
        && export PYTHONPATH=/tmp/tw-site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

{
    echo "# tensorwire device check"
    echo
    echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "- GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -1)"
    echo "- $("$py" -c 'import sys, torch; print("python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA", torch.version.cuda, "| GPUs", torch.cuda.device_count())' 2>&1 | tail -1)"
    echo "- ucxx: $("$py" -c 'import ucxx; print(ucxx.__version__)' 2>&1 | tail -1)"
    echo "- nixl: $("$py" -c 'import importlib.metadata as m; print(next((d + " " + m.version(d) for d in ("nixl", "nixl-cu12", "nixl-cu13") if list(m.distributions(name=d))), "not installed"))' 2>&1 | tail -1) (tests/gpu/test_nixl_gpu.py needs it)"
    echo
    echo "## Tests: tests/gpu (all marked gpu / multi_gpu), tests/collectives/weight_sync/test_standalone.py, tests/transport/backends/test_gpu_logic.py"
    echo
} > "$report"

start=$(date +%s)
timeout 240 "$py" -m pytest -o addopts="" -p no:cacheprovider -ra -v --timeout 120 \
    tests/gpu tests/collectives/weight_sync/test_standalone.py tests/transport/backends/test_gpu_logic.py tests/runtime/refs/test_device_check.py \
    > "$out/pytest.log" 2>&1
status=$?
{
    echo "exit status $status after $(( $(date +%s) - start )) s; summary:"
    echo
    echo '```'
    grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$out/pytest.log" | tail -40
    echo '```'
    echo
    echo "## Benchmark: python -m benchmarks.gpu"
    echo
} >> "$report"

start=$(date +%s)
timeout 150 "$py" -m benchmarks.gpu >> "$report" 2> "$out/bench.log"
echo "(benchmark exit status $? after $(( $(date +%s) - start )) s)" >> "$report"

{
    echo
    echo "## tensorwire bench (process scenarios)"
    echo
    echo '```'
    timeout 120 "$py" -m tensorwire bench --scenarios p2p-processes,concurrent -b 1M -e 256M -f 16 -n 10 --check \
        --json "$out/bench.json" 2>&1 | tail -40
    echo '```'
    echo
    echo "## tensorwire topo and doctor"
    echo
    echo '```'
    timeout 60 "$py" -m tensorwire topo 2>&1 | tail -25
    echo
    timeout 90 "$py" -m tensorwire doctor 2>&1 | tail -30
    echo '```'
} >> "$report"
cat "$report"
