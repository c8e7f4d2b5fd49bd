#!/usr/bin/env bash
# Run HERE (with internet to PyPI) before a GPU run: fills .cuda/ (git-ignored) with what the GPU
# host lacks, for the device tool to carry (`carry: [".cuda"]`):
#   .cuda/whl/        wheels for Python 3.12 (x86_64) of the pinned packages the host image does not
#                     hold at our version: transformers, pydantic (and pydantic-settings, which
#                     engine/config.py imports), xgrammar, pytest-asyncio and their own needs that
#                     are missing there or older than they ask (typing-extensions, regex)
#   .cuda/tokenizer/  the default model's tokenizer (prompts get their real lengths on the
#                     random-weight model; no weights travel)
# Then on the GPU host: `bash bench/cuda_check.sh` (see there).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .cuda && mkdir -p .cuda/whl .cuda/tokenizer
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64 any; do platforms+=(--platform "$p"); done
for pkg in transformers==5.24.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
           typing-inspection==0.4.5 typing-extensions==4.16.0 pydantic-settings==2.16.3 python-dotenv==1.2.4 \
           regex==2026.11.19 xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 pytest-asyncio==1.5.0; do
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platforms[@]}" -d .cuda/whl "$pkg"
done
model=$(.venv/bin/python -c "from bench import common; print(common.model_path(None))" | tail -n 1)
for f in tokenizer.json tokenizer_config.json chat_template.jinja generation_config.json; do
    [ -f "$model/$f" ] && cp "$model/$f" .cuda/tokenizer/
done
du -sh .cuda/whl .cuda/tokenizer
