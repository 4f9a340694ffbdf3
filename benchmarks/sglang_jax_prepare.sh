#!/usr/bin/env bash
# Makes, on a machine with network, the two folders that sglang-jax needs on the TPU machine (which
# has none); both are ignored through .git/info/exclude and travel with the device tool's `carry`:
#   .sgl-src/  sgl_jax at the pinned commit: the Python package alone (its tests, tools, benchmark
#              scripts and the multimodal server stack dropped), patched by
#              benchmarks/sglang_jax_py311.patch (Python 3.11, lazy imports of optional packages)
#   .whl-sgl/  py3.11 manylinux x86_64 wheels of benchmarks/sglang_jax_setup.sh's pinned list
#
#   bash benchmarks/sglang_jax_prepare.sh [DEST]     # DEST: the repository root (default: this one)
#   SGL_GIT=/work/.mirror/sgl-project+sglang-jax/repo bash benchmarks/sglang_jax_prepare.sh
#
# SGL_GIT: a git directory holding the commit (default: a fresh clone from GitHub).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dest=$(cd "${1:-$here/..}" && pwd)
commit=${SGL_COMMIT:-cddbf6f1}
src=$dest/.sgl-src
wheels=$dest/.whl-sgl

git_dir=${SGL_GIT:-}
if [ -z "$git_dir" ]; then
  git_dir=$(mktemp -d)/sglang-jax.git
  git clone --bare --filter=blob:none https://github.com/sgl-project/sglang-jax "$git_dir"
fi
rm -rf "$src" && mkdir -p "$src"
git --git-dir="$git_dir" archive "$commit" -- python/sgl_jax ':(exclude)python/sgl_jax/test' \
  | tar -x -C "$src" --strip-components=1
( cd "$src/sgl_jax" && rm -rf tools bench_serving.py bench_offline_throughput.py bench_one_batch_server.py \
    srt/multimodal/manager srt/multimodal/model_executor srt/multimodal/entrypoint )
patch -d "$src" -p1 --no-backup-if-mismatch < "$here/sglang_jax_py311.patch"
echo "$commit" > "$src/SGL_COMMIT"

mkdir -p "$wheels"
# shellcheck disable=SC2046
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 --platform manylinux_2_5_x86_64 \
  --platform manylinux1_x86_64 -d "$wheels" $(bash "$here/sglang_jax_setup.sh" --list)
exclude=$(git -C "$dest" rev-parse --path-format=absolute --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
for f in .sgl-src .whl-sgl; do
  grep -qxF "/$f/" "$exclude" 2>/dev/null || echo "/$f/" >> "$exclude"
done
du -sh "$src" "$wheels"
