#!/usr/bin/env bash
# The CUDA checks of docs/benchmarks.md ("On a GPU"), in one run on a machine with one NVIDIA GPU.
#   bash benchmarks/gpu_checks.sh OUTDIR
# Writes one log per check and summary.txt to OUTDIR. Each check is time-boxed; a failing check does not stop the
# others. Needs: torch with CUDA, lightning, transformers, pytest (+ pytest-timeout), and this package importable.
set -u
out=${1:?usage: bash benchmarks/gpu_checks.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
summary="$out/summary.txt"
step() {  # step NAME SECONDS COMMAND...: run, keep the log, record the exit status and the time taken
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - start))s" >>"$summary"
  tail -3 "$out/$name.log" | sed "s/^/  $name| /" >>"$summary"
}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, lightning, transformers; print('torch', torch.__version__, 'lightning', lightning.__version__, 'transformers', transformers.__version__)"
  python3 -c "import lightning_moe_overlap as m; print('import ok')"
} >"$summary" 2>&1
# 1. The GPU suite as is (the suite's conftest fixes cuBLAS's workspace), and once with it exported before Python.
step gpu_suite 180 python3 -m pytest tests/gpu -q -rs -p no:cacheprovider --timeout 120
step gpu_suite_cublas_env 70 env CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m pytest -q -p no:cacheprovider \
  --timeout 60 tests/gpu/test_cublas_workspace.py tests/gpu/test_simulated_ep.py tests/gpu/test_engine_cuda.py
# 3. Simulated EP (loopback all-to-all of 2 ms): top-8 over 16 experts, a shared expert, the delay_wgrad mode, host
#    syncs per overlapped step, a Chrome trace; once without deterministic algorithms (bitwise still?), once with.
bench=(python3 benchmarks/overlap.py --device cuda --simulate-ep 2 --top-k 8 --experts 16 --shared-ffn 512
       --layers 4 --hidden 1024 --ffn 512 --dense-ffn 1024 --tokens 2048 --microbatches 4 --steps 5 --warmup 2)
step sim_ep_nondeterministic 80 "${bench[@]}" --nondeterministic --trace "$out/sim_ep_trace.json"
step sim_ep_deterministic 80 "${bench[@]}"
# 4. The same shape in bf16 (the grouped GEMM path), plain and static dispatch (host syncs per step: 0 expected with
#    --static), and the ATen ops and host reads per MoE layer of each dispatch path (the launches' proxy).
step sim_ep_bf16 80 "${bench[@]}" --dtype bfloat16
step sim_ep_bf16_static 80 "${bench[@]}" --dtype bfloat16 --static
step moe_ops 60 python3 benchmarks/moe_ops.py --dtype bfloat16 --repeats 5
cat "$summary"
