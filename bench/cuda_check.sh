#!/usr/bin/env bash
# The prepared GPU run, one command on the device host (under 10 minutes; first run on an H200
# on 2026-12-04 in 266 s, results in bench/results/cuda/):
#   bash bench/cuda_prepare.sh            # here, once: wheels and tokenizer into .cuda/
#   device run, carry [".cuda"]: bash bench/cuda_check.sh
# 1. exactness on CUDA: the engine's end-to-end tests on tiny fp32 models (batched = alone,
#    chunked prefill, preemption, compressed vs uncompressed, pruning, constrained decoding) with
#    TEST_DEVICE=cuda; the kernel-level unit tests are device-free and stay on the CPU run;
# 2. the engine benchmark on a Llama-3-8B-shaped model with random weights in bf16 (speed and
#    KV bytes are the real model's; its text is noise): generate one at a time, transformers'
#    generate_batch, our engine with DYNAMIC_BATCHING=true, and the same with int8 and int4 KV.
#    No TTFT-isolation part: its arrival offsets are sized for CPU prefill times.
# Writes into $OUT (the device tool's) or bench/results/cuda/; exits non-zero if either part failed.
# SMOKE=1 TEST_DEVICE=cpu PYTHON=.venv/bin/python: the same plumbing on a CPU in about two minutes
# (one test, a 1-layer model, 2 documents x 4 tokens), to check the script, not the numbers.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench/results/cuda}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
py=${PYTHON:-python3}
device=${TEST_DEVICE:-cuda}
tests=(tests/engine/test_engine.py tests/engine/test_kv_compression.py)
size=(--docs 32 --new-tokens 96 --kv-cache-mib 16384)
name=engine-llama3-8b
if [ "${SMOKE:-0}" = 1 ]; then
    tests=(tests/engine/test_engine.py -k self_test)
    size=(--docs 2 --new-tokens 4 --kv-cache-mib 256 --layers 1)
    name=engine-smoke
fi
[ -f .cuda/tokenizer/tokenizer.json ] || { echo "no .cuda/tokenizer: run bench/cuda_prepare.sh first" >&2; exit 2; }
# The wheels are the GPU host's (Python 3.12); a smoke run uses the local environment as it is.
if [ "${SMOKE:-0}" != 1 ] && compgen -G ".cuda/whl/*.whl" > /dev/null; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .cuda/whl/*.whl || exit 2
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
$py -c "import transformers, xgrammar, pydantic" || exit 2
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    $py -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$out/gpu.txt"
# -W default: the host's library versions may warn where ours do not; warnings are shown, not fatal.
TEST_DEVICE=$device timeout 200 $py -m pytest -q -x -p no:cacheprovider --confcutdir=tests/engine -W default \
    "${tests[@]}" 2>&1 | tee "$out/engine-tests-$device.txt"
tests_rc=$?
timeout 330 $py -m bench.engine_bench --random-shape llama3-8b --tokenizer .cuda/tokenizer --no-isolate \
    --repeats 1 --scenarios burst --max-batch 64 --step-tokens 2048 --no-ttft-isolation "${size[@]}" \
    --variants hf_generate_1,hf_generate_batch,engine_dynamic,engine_dynamic_int8,engine_dynamic_int4 \
    --out "$out/$name.json" 2>&1 | tee "$out/$name.txt"
bench_rc=$?
echo "tests: exit $tests_rc, benchmark: exit $bench_rc"
exit $(( tests_rc || bench_rc ))
