#!/usr/bin/env bash
# sglang-jax (cddbf6f1) made importable on a machine without network (the TPU machine), for
# benchmarks/sglang_jax_driver.py. Source it, so that PYTHONPATH is exported:
#
#   source benchmarks/sglang_jax_setup.sh          # then: python3 benchmarks/sglang_jax_driver.py ...
#
# It installs, with --no-deps, the packages below into $SGL_SITE (default /tmp/sgl-site): each from
# the machine's own index ($SGL_INDEX, default file:///opt/pypi/simple) where that holds the pinned
# version, else from the wheels carried in .whl-sgl/; then appends .sgl-src (sgl_jax's patched
# source) and $SGL_SITE to the END of PYTHONPATH, so the machine's own JAX, numpy and friends stay
# first. It prints where each package came from. Both folders are made, on a machine with network,
# by benchmarks/sglang_jax_prepare.sh.
#
# The list is what importing sgl_jax's ModelWorker and single-process Engine and running them
# (dummy weights, LoRA, skip_tokenizer_init) needs on Python 3.11, found by importing and running
# the driver in an environment holding only JAX (the chip's set) plus these: sglang-jax's own
# pyproject pins where it has them. Not installed: jax/jaxlib/numpy/scipy (the machine's), the HTTP
# server's, multimodal and grammar packages (llguidance is imported lazily by the patch,
# benchmarks/sglang_jax_py311.patch), torch.
#
#   bash benchmarks/sglang_jax_setup.sh --list     # the pinned list (read by the prepare script)

# One requirement a line: the version tried (==, the wheel carried in .whl-sgl) then the range
# accepted from the index (sglang-jax's own pins where its pyproject has one, else the requiring
# package's bounds); the highest version in range wins, the index's where it is newer.
SGL_PACKAGES="
flax 0.12.4 ==0.12.4
absl-py 2.3.1 >=2.1
msgpack 1.1.1 >=1.0
optax 0.2.8 >=0.2.6
rich 14.1.0 >=13
treescope 0.1.10 >=0.1.7
pyyaml 6.0.2 >=5.1
typing-extensions 4.14.1 ~=4.14.1
transformers 4.57.1 ~=4.57.1
huggingface-hub 0.34.6 ~=0.34.3
tokenizers 0.22.1 >=0.22.0,<=0.23.0
safetensors 0.6.2 ~=0.6.1
regex 2025.9.18 !=2019.12.17
requests 2.32.5 ~=2.32.4
urllib3 2.5.0 >=1.21.1,<3
idna 3.10 >=2.5,<4
certifi 2025.8.3 >=2017.4.17
tqdm 4.67.1 >=4.27
filelock 3.19.1 >=3
packaging 25.0 >=20
psutil 7.0.0 ~=7.0.0
pyzmq 27.0.2 ~=27.0.1
pydantic 2.11.7 ~=2.11.7
pydantic-core 2.33.2 ==2.33.2
annotated-types 0.7.0 >=0.6.0
typing-inspection 0.4.1 >=0.4.0
orjson 3.11.3 ~=3.11.1
partial-json-parser 0.2.1.1.post6 >=0.2
pybase64 1.4.2 >=1.4
setproctitle 1.3.6 ~=1.3.6
uvloop 0.21.0 ~=0.21.0
fastapi 0.116.1 ~=0.116.1
starlette 0.47.3 >=0.40.0,<0.48.0
anyio 4.10.0 ==4.10.0
sniffio 1.3.1 >=1.1
uvicorn 0.35.0 ~=0.35.0
click 8.2.1 >=7.0
httpx 0.28.1 >=0.28
"

if [ "${1:-}" = "--list" ]; then  # the versions carried
  echo "$SGL_PACKAGES" | awk 'NF { print $1 "==" $2 }'
  return 0 2>/dev/null || exit 0
fi

_sgl_setup() {
  local root site wheels src index py report
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  site=${SGL_SITE:-/tmp/sgl-site}
  wheels=${SGL_WHEELS:-$root/.whl-sgl}
  src=${SGL_SRC:-$root/.sgl-src}
  index=${SGL_INDEX:-file:///opt/pypi/simple}
  py=${PYTHON:-python3}
  report=$(mktemp)
  local specs
  specs=$(echo "$SGL_PACKAGES" | awk 'NF { print $1 $3 }')
  [ -d "$src/sgl_jax" ] || { echo "sglang_jax_setup: no sgl_jax under $src (run benchmarks/sglang_jax_prepare.sh)" >&2; return 1; }
  # shellcheck disable=SC2086
  local pip="env PIP_CONFIG_FILE=/dev/null $py -m pip install --isolated -q --no-deps --no-compile --no-cache-dir
             --disable-pip-version-check --only-binary=:all: --upgrade --target $site --report $report"
  # one resolver run: the index and the carried wheels side by side; each pin is taken from where
  # it is found (the index where it holds that version); without a usable index, the wheels alone
  # shellcheck disable=SC2086
  if ! $pip --index-url "$index" --find-links "$wheels" $specs 2>/tmp/sgl-setup.err; then
    echo "sglang_jax_setup: the index did not serve the list ($(tail -1 /tmp/sgl-setup.err)); carried wheels only" >&2
    # shellcheck disable=SC2086
    $pip --no-index --find-links "$wheels" $specs || { cat /tmp/sgl-setup.err >&2; return 1; }
  fi
  "$py" - "$report" <<'EOF'
import json, sys
items = json.load(open(sys.argv[1]))["install"]
for it in sorted(items, key=lambda i: i["metadata"]["name"].lower()):
    url = it["download_info"]["url"]
    where = "carried" if ".whl-sgl" in url else ("index" if url.startswith("file://") else url)
    print(f"  {it['metadata']['name']:22} {it['metadata']['version']:16} {where}")
print(f"sglang_jax_setup: {len(items)} packages installed")
EOF
  rm -f "$report"
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$src:$site"
  echo "sglang_jax_setup: PYTHONPATH=$PYTHONPATH"
}
_sgl_setup
