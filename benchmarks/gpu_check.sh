#!/usr/bin/env bash
# The GPU check (issue 5): on a machine with an NVIDIA GPU, build shardstate,
# run the GPU tests, then the CUDA save/load benchmark against torch DCP.
# Uses the python3 that holds a CUDA build of torch (PYTHON to override);
# needs numpy, pytest and setuptools there. Finishes in under 8 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/python" PYTHONUNBUFFERED=1
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY -c "import sys, torch, numpy; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available())"
$PY setup.py -q build_ext --inplace
$PY -c "import shardstate.cuda as c; print(c.status())"
echo "== GPU tests"
$PY -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_cuda_loader.py
echo "== pipeline tests (host backend and stand-in libcudart)"
$PY -m pytest -q -p no:cacheprovider tests/test_stage.py
echo "== benchmark"
df -h /dev/shm | tail -1
timeout $(( 470 - ($(date +%s) - start) )) $PY benchmarks/bench_gpu.py --gb "${GPU_CHECK_GB:-20}" --dir /dev/shm
echo "gpu_check: done in $(( $(date +%s) - start )) s"
