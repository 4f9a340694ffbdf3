"""multilora's own CPU kernels, built on first use and called through XLA's FFI: per-token LoRA
shrink and expand (lora_kernels.cc, the `native` LoRA backend) and decode attention over the
paged KV cache (attention_kernels.cc, decode and prefill), the base model's projections in
bfloat16 (gemm_kernels.cc: Intel AMX, AVX512-BF16 dot products, or AVX2 + FMA on weights widened
in registers, the best the CPU has: select_isa) and with 8- or 4-bit weights in groups of 32
(quant_kernels.cc: GGUF's Q8_0 and Q4_0 arithmetic, AVX2 + FMA), and
in-place row writes into the LoRA pools (pool_kernels.cc).

The C++ source ships with the package and is compiled once per machine into the user cache
(`$MULTILORA_CACHE/native/<key>/`, the key covering the source, jaxlib's FFI headers, the
compiler and the CPU), with `-march=native` so that it uses the vector units of the host it runs
on. Where no C++ compiler is found, the build fails, or `MULTILORA_NATIVE=0` is set,
`available()` is False and `auto` keeps to the XLA backends: the kernels make steps faster,
never required.

A first build takes tens of seconds: its sources compile side by side (one compiler process per
source, then a link), and an engine starts it on a thread (`start_build()`) before it fetches,
converts and reads the model, so that the two overlap; `available()` then waits for that build.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger("multilora.kernels")

HERE = Path(__file__).parent
SOURCES = (HERE / "lora_kernels.cc", HERE / "attention_kernels.cc", HERE / "gemm_kernels.cc",
           HERE / "pool_kernels.cc", HERE / "quant_kernels.cc")
HEADERS = (HERE / "parallel.h",)
DISABLE_ENV = "MULTILORA_NATIVE"
TARGETS = {"multilora_lora_shrink": "MultiloraLoraShrink", "multilora_lora_expand": "MultiloraLoraExpand",
           "multilora_lora_apply": "MultiloraLoraApply",
           "multilora_decode_attention": "MultiloraDecodeAttention", "multilora_gemm_bf16": "MultiloraGemmBf16",
           "multilora_prefill_attention": "MultiloraPrefillAttention", "multilora_pool_write": "MultiloraPoolWrite",
           "multilora_gemm_quant": "MultiloraGemmQuant"}

_lock = threading.Lock()
_build_lock = threading.Lock()
_state: dict = {}


def compiler() -> str | None:
    """The C++ compiler the kernels are built with ($CXX, else g++, c++ or clang++), or None."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build_key(cxx: str) -> str:
    h = hashlib.sha256()
    for src in SOURCES + HEADERS:
        h.update(src.read_bytes())
    for part in (jax.ffi.include_dir(), jax.__version__, cxx, platform.machine(), _cpu_model()):
        h.update(str(part).encode())
    return h.hexdigest()[:16]


def _build(cxx: str, out: Path) -> None:
    """Each source compiled to an object by its own compiler process (lora_kernels.cc alone
    takes about half of a one-command build: on two cores the build took 20 s in one command,
    ~11 s side by side), then linked into `out`."""
    from concurrent.futures import ThreadPoolExecutor
    out.parent.mkdir(parents=True, exist_ok=True)
    flags = ["-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-fPIC", "-w",
             f"-I{jax.ffi.include_dir()}", f"-I{HERE}"]

    def run(cmd: list) -> None:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")

    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        so = Path(tmp) / out.name
        objs = [Path(tmp) / (src.stem + ".o") for src in SOURCES]
        with ThreadPoolExecutor(max(1, min(len(SOURCES), os.cpu_count() or 1))) as pool:
            # the longest first, so that it never waits for a core at the end
            order = sorted(zip(SOURCES, objs), key=lambda so_: -so_[0].stat().st_size)
            list(pool.map(lambda p: run([cxx, *flags, "-c", str(p[0]), "-o", str(p[1])]), order))
        run([cxx, "-shared", *map(str, objs), "-o", str(so)])
        os.replace(so, out)  # atomic: a concurrent process sees the old file or the whole new one


def _library_path() -> "Path | None":
    """Where the kernels' library for this machine lives (None: disabled, or no compiler)."""
    if os.environ.get(DISABLE_ENV, "1").lower() in ("0", "false", "no", "off"):
        _state["reason"] = f"disabled by {DISABLE_ENV}"
        return None
    cxx = compiler()
    if cxx is None:
        _state["reason"] = "no C++ compiler (set CXX, or install g++)"
        return None
    from multilora.default_model import user_cache_dir

    return user_cache_dir() / "native" / _build_key(cxx) / "libmultilora_kernels.so"


def _build_if_missing(so: Path) -> None:
    with _build_lock:
        if not so.is_file():
            t0 = time.perf_counter()
            log.info("building multilora's CPU kernels with %s ...", compiler())
            _build(compiler(), so)
            log.info("built %s in %.1f s", so, time.perf_counter() - t0)


def start_build() -> None:
    """Build the kernels' library on a thread now, if it is not built yet (nothing else: loading
    and registering it with XLA waits for `available()`). A failure here is tried again, and
    reported, by available()."""
    with _lock:
        if "ok" in _state or "builder" in _state:
            return
        so = _library_path()
        if so is None or so.is_file():
            return

        def build() -> None:
            try:
                _build_if_missing(so)
            except Exception as e:  # noqa: BLE001 - available() builds again and says why
                log.debug("kernels' early build failed: %s", e)

        _state["builder"] = t = threading.Thread(target=build, name="multilora-kernels-build", daemon=True)
        t.start()


def _load() -> bool:
    so = _library_path()
    if so is None:
        return False
    try:
        builder = _state.get("builder")
        if builder is not None:
            builder.join()  # start_build's, under way
        _build_if_missing(so)
        lib = ctypes.cdll.LoadLibrary(str(so))
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except Exception as e:  # noqa: BLE001  (any failure means: use the XLA backends)
        _state["reason"] = f"build or load failed: {e}"
        log.warning("multilora's CPU kernels are not available (%s); using the XLA backends", e)
        return False
    _state["lib"] = lib
    return True


def available() -> bool:
    """True once the kernels are built, loaded and registered with XLA (tried once per process)."""
    with _lock:
        if "ok" not in _state:
            _state["ok"] = _load()
        return _state["ok"]


def _lib_fn(symbol: str, argtypes: tuple, restype):
    """A plain C function of the loaded kernels through ctypes (which drops the GIL around the
    call), or None unless the kernels are loaded already: never builds them (its callers are the
    adapter loader's threads)."""
    lib = _state.get("lib")
    if lib is None:
        return None
    fn = _state.get(symbol)
    if fn is None:
        fn = getattr(lib, symbol)
        fn.argtypes, fn.restype = argtypes, restype
        _state[symbol] = fn
    return fn


def bf16_rounder():
    """`round(src_ptr, dst_ptr, n)`: n float32 values rounded to bfloat16 (nearest, ties to even,
    as pool_write rounds); None unless the kernels are loaded (_lib_fn)."""
    return _lib_fn("multilora_round_to_bf16", (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64), None)


def tensor_copier():
    """`copy(src_ptr, dst_ptr, dst_kind, jobs_ptr, n_jobs) -> first bad job or -1`: an
    adapter's tensors copied from its file's bytes into its host copy, converted, scaled and
    checked for NaN/Inf in one pass (pool_kernels.cc, multilora_copy_tensors: the job layout);
    None unless the kernels are loaded (_lib_fn)."""
    return _lib_fn("multilora_copy_tensors",
                   (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64), ctypes.c_int64)


def unavailable_reason() -> str:
    available()
    return _state.get("reason", "")


def shrink(x_TD: jax.Array, a_LUD: jax.Array, layer: jax.Array, slot_T: jax.Array,
           scalings_S: jax.Array, ranks_S: jax.Array, rows_SR: jax.Array, blocks: int = 1) -> jax.Array:
    """h_TR (blocks * R columns, R = rows_SR's width): per token, its slot's rows of layer
    `layer` of the pool (rows_SR[slot, r] for r below the slot's rank, in each of `blocks`
    blocks of U rows) against x, times the slot's scaling; base rows zero."""
    t, rt = x_TD.shape[0], blocks * rows_SR.shape[1]
    return jax.ffi.ffi_call("multilora_lora_shrink", jax.ShapeDtypeStruct((t, rt), jnp.float32))(
        x_TD.astype(jnp.float32), a_LUD, jnp.asarray(layer, jnp.int32), slot_T.astype(jnp.int32),
        scalings_S.astype(jnp.float32), ranks_S.astype(jnp.int32), rows_SR.astype(jnp.int32),
        blocks=np.int64(blocks))


def expand(h_TR: jax.Array, b_LUO: jax.Array, layer: jax.Array, slot_T: jax.Array,
           ranks_S: jax.Array, rows_SR: jax.Array) -> jax.Array:
    """y_TO: per token, h times its slot's B rows of layer `layer` (up to the slot's rank)."""
    t, o = h_TR.shape[0], b_LUO.shape[2]
    return jax.ffi.ffi_call("multilora_lora_expand", jax.ShapeDtypeStruct((t, o), jnp.float32))(
        h_TR.astype(jnp.float32), b_LUO, jnp.asarray(layer, jnp.int32), slot_T.astype(jnp.int32),
        ranks_S.astype(jnp.int32), rows_SR.astype(jnp.int32))


def lora_apply(x_TD: jax.Array, a_LUD: jax.Array, b_LUOs: "tuple[jax.Array, ...]", layer: jax.Array,
               slot_T: jax.Array, scalings_S: jax.Array, ranks_S: jax.Array,
               rows_SR: jax.Array) -> "tuple[jax.Array, ...]":
    """(y_TO per B pool): expand(shrink(x)) for a group in one call, the A pool holding one block
    of U rows per B pool (q/k/v: three, gate/up: two, one projection: one); float32 results.
    The pools are float32 or bfloat16: bf16 rows are widened in registers (x, h and the sums stay
    float32), except where bf16_gemm_isa() is avx512-bf16 or amx, where bf16 pools are multiplied
    as bf16 pairs (VDPBF16PS: x and h rounded to bfloat16, the sums float32)."""
    t = x_TD.shape[0]
    outs = tuple(jax.ShapeDtypeStruct((t, b.shape[2]), jnp.float32) for b in b_LUOs)
    return tuple(jax.ffi.ffi_call("multilora_lora_apply", outs)(
        x_TD.astype(jnp.float32), jnp.asarray(layer, jnp.int32), slot_T.astype(jnp.int32),
        scalings_S.astype(jnp.float32), ranks_S.astype(jnp.int32), rows_SR.astype(jnp.int32), a_LUD, *b_LUOs,
        dot_bf16=np.int64(bf16_gemm_isa() in ("avx512-bf16", "amx"))))


def pool_write(pool_LUX: jax.Array, rows_R: jax.Array, new_LRX: jax.Array) -> jax.Array:
    """pool_LUX with pool[:, rows_R[j]] = new_LRX[:, j] (rows of the pool's dtype copied, others
    rounded to the pool's float32 or bfloat16), written in place where the pool is donated (the
    result aliases it): XLA's CPU backend would run a bfloat16 scatter in float32 over the whole
    pool."""
    if new_LRX.dtype != pool_LUX.dtype:
        new_LRX = new_LRX.astype(jnp.float32)
    return jax.ffi.ffi_call("multilora_pool_write", jax.ShapeDtypeStruct(pool_LUX.shape, pool_LUX.dtype),
                            input_output_aliases={0: 0})(pool_LUX, rows_R.astype(jnp.int32), new_LRX)


def decode_attention(q_TNH: jax.Array, k_LPpKH: jax.Array, v_LPpKH: jax.Array, layer: jax.Array,
                     kv_pages_X: jax.Array, kv_page_seq_X: jax.Array, positions_T: jax.Array,
                     num_decode: jax.Array, sliding_window: int | None = None) -> jax.Array:
    """multilora.model.attention.decode_attention's result (float32), reading the pages of the
    layer `layer` of the whole cache in place."""
    if not available():
        raise RuntimeError(f"multilora's CPU kernels are not available: {unavailable_reason()}")
    return jax.ffi.ffi_call("multilora_decode_attention", jax.ShapeDtypeStruct(q_TNH.shape, jnp.float32))(
        q_TNH.astype(jnp.float32), k_LPpKH, v_LPpKH, jnp.asarray(layer, jnp.int32),
        kv_pages_X.astype(jnp.int32), kv_page_seq_X.astype(jnp.int32), positions_T.astype(jnp.int32),
        jnp.asarray(num_decode, jnp.int32), sliding_window=np.int64(sliding_window or 0))


def prefill_attention(q_TNH: jax.Array, k_LPpKH: jax.Array, v_LPpKH: jax.Array, layer: jax.Array,
                      kv_pages_X: jax.Array, kv_page_seq_X: jax.Array, seq_idx_T: jax.Array,
                      positions_T: jax.Array, sliding_window: int | None = None) -> jax.Array:
    """multilora.model.attention.prefill_attention's result (float32): every token with a
    sequence (seq_idx_T >= 0) against its own sequence's keys up to its position, the pages of
    layer `layer` read in place; other rows zeros."""
    if not available():
        raise RuntimeError(f"multilora's CPU kernels are not available: {unavailable_reason()}")
    return jax.ffi.ffi_call("multilora_prefill_attention", jax.ShapeDtypeStruct(q_TNH.shape, jnp.float32))(
        q_TNH.astype(jnp.float32), k_LPpKH, v_LPpKH, jnp.asarray(layer, jnp.int32),
        kv_pages_X.astype(jnp.int32), kv_page_seq_X.astype(jnp.int32), seq_idx_T.astype(jnp.int32),
        positions_T.astype(jnp.int32), sliding_window=np.int64(sliding_window or 0))


KERNEL_ISAS = ("avx2", "avx512-bf16", "amx")   # the ISA-specific paths, in order (MultiloraKernelIsas' bits)
BF16_GEMM_ISAS = ("",) + KERNEL_ISAS            # by gemm_bf16's `isa` attribute
# What a CPU must report (/proc/cpuinfo's flags) to run each path, every lower path's flags included.
ISA_CPU_FLAGS = {"avx2": ("avx2", "fma"),
                 "avx512-bf16": ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16"),
                 "amx": ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16")}
ISA_ENV = "MULTILORA_KERNEL_ISA"   # the best path the kernels may take (tests and benchmarks of a lower one)


def cpu_flags() -> frozenset:
    """This CPU's feature flags as Linux reports them (empty where /proc/cpuinfo is not there)."""
    if "cpu_flags" not in _state:
        flags: frozenset = frozenset()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("flags"):
                    flags = frozenset(line.split(":", 1)[1].split())
                    break
        except OSError:
            pass
        _state["cpu_flags"] = flags
    return _state["cpu_flags"]


def select_isa(flags, built=KERNEL_ISAS, cap: str = "") -> str:
    """The best ISA-specific path for a CPU with these flags: the last of KERNEL_ISAS, up to
    `cap` (one of them; "" none), that the build has and whose ISA_CPU_FLAGS the CPU all has;
    "" where none. An AVX2 + FMA CPU without AVX512-BF16 (AMD Zen 1-3, Intel Haswell to Ice
    Lake client parts) takes "avx2"; Zen 4 and Cooper Lake "avx512-bf16"; Sapphire Rapids "amx"."""
    if cap and cap not in KERNEL_ISAS:
        raise ValueError(f"{ISA_ENV}={cap!r}: choose one of {', '.join(KERNEL_ISAS)}")
    best = ""
    for isa in KERNEL_ISAS:
        if isa not in built or not set(ISA_CPU_FLAGS[isa]) <= set(flags):
            break
        best = isa
        if isa == cap:
            break
    return best


def built_isas() -> tuple[str, ...]:
    """The ISA-specific paths this machine's build of the kernels has and may run (AMX: where
    Linux grants the tile state); () where the kernels are not available."""
    if not available():
        return ()
    bits = _state["lib"].MultiloraKernelIsas()
    return tuple(isa for i, isa in enumerate(KERNEL_ISAS) if bits >> i & 1)


def bf16_gemm_isa() -> str:
    """The best instructions gemm_bf16 runs here (select_isa of this CPU's flags and build, at
    most $MULTILORA_KERNEL_ISA): "amx" (an Intel CPU from Sapphire Rapids on, where Linux grants
    the process the tile state), "avx512-bf16" (AMD Zen 4 and later, Intel Cooper Lake), "avx2"
    (AVX2 + FMA: x float32, the weights widened) or "" (none, or the kernels are not built).
    An unknown $MULTILORA_KERNEL_ISA is a ValueError naming the choices."""
    cap = os.environ.get(ISA_ENV, "").strip().lower()
    return select_isa(cpu_flags(), built_isas(), cap) if available() else select_isa((), (), cap)


def bf16_gemm_isas() -> tuple[str, ...]:
    """Every instruction set gemm_bf16 can run here, best last (for tests of each)."""
    best = bf16_gemm_isa()
    return BF16_GEMM_ISAS[1:BF16_GEMM_ISAS.index(best) + 1] if best else ()


def pack_bf16(w_LKN) -> jax.Array:
    """Stacked (L, K, N) weights in gemm_bf16's tile layout, bfloat16 (L, J, I, 16, 32):
    w[l, j, i, r, 2c + e] = W[l, 32i + 2r + e, 16j + c], zero past K and N (J = 2 ceil(N / 32),
    I = ceil(K / 32))."""
    w = jnp.asarray(w_LKN).astype(jnp.bfloat16)
    l, k, n = w.shape
    kp, np_ = -(-k // 32) * 32, -(-n // 32) * 32
    w = jnp.pad(w, ((0, 0), (0, kp - k), (0, np_ - n)))
    w = w.reshape(l, kp // 32, 16, 2, np_ // 16, 16)      # l, i, r, e, j, c
    return w.transpose(0, 4, 1, 2, 5, 3).reshape(l, np_ // 16, kp // 32, 16, 32)


def gemm_bf16(x_TK: jax.Array, w_LJIRC: jax.Array, layer: jax.Array, n: int, isa: str | None = None,
              rows: "jax.Array | int | None" = None) -> jax.Array:
    """y_TN (float32) = x times layer `layer` of the packed weights (pack_bf16 of an (L, K, N)
    stack), accumulated in float32, read in place; on `isa` (one of bf16_gemm_isas(); default
    the best). On "amx" and "avx512-bf16" x is rounded to bfloat16 first (bf16 products); on
    "avx2" x stays float32 and the weights are widened exactly (a float32 product).
    rows (an int32 scalar, may be traced; default all T): x's rows from rows on are padding, not
    multiplied, and y's rows there are zeros; the rows before it are the same bits either way."""
    isa = bf16_gemm_isa() if isa is None else isa
    if isa not in BF16_GEMM_ISAS[1:]:
        raise ValueError(f"gemm_bf16 runs on one of {', '.join(BF16_GEMM_ISAS[1:])}, not {isa!r}")
    rows = x_TK.shape[0] if rows is None else rows
    return jax.ffi.ffi_call("multilora_gemm_bf16", jax.ShapeDtypeStruct((x_TK.shape[0], n), jnp.float32))(
        x_TK.astype(jnp.float32), w_LJIRC, jnp.asarray(layer, jnp.int32), jnp.asarray(rows, jnp.int32),
        isa=np.int64(BF16_GEMM_ISAS.index(isa)))


Q8_GROUP = 32  # rows of K that share a scale in gemm_quant's weights (GGUF's blocks of 32)


def quant_gemm_available() -> bool:
    """Whether gemm_q8 and gemm_q4 run here (the kernels built with AVX2 + FMA)."""
    return available() and bool(_state["lib"].MultiloraGemmQuantAvailable())


def _groups(w_LKN) -> jax.Array:
    """(L, K, N) float32 weights as (L, G, 32, N), K padded with zero rows to whole groups."""
    w = jnp.asarray(w_LKN, jnp.float32)
    l, k, n = w.shape
    kp = -(-k // Q8_GROUP) * Q8_GROUP
    return jnp.pad(w, ((0, 0), (0, kp - k), (0, 0))).reshape(l, kp // Q8_GROUP, Q8_GROUP, n)


def quantize_q8(w_LKN) -> tuple[jax.Array, jax.Array]:
    """(q_LKN int8, s_LGN float32) of stacked (L, K, N) weights, K padded with zero rows to whole
    groups of Q8_GROUP: per group of 32 rows of a column, s = max |w| / 127 (1 where all are
    zero) and q = round(w / s), so every |w - q s| <= s / 2 (GGUF's Q8_0, its scale in float32)."""
    w = _groups(w_LKN)
    amax = jnp.max(jnp.abs(w), axis=2)
    s = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(w / s[:, :, None, :]), -127, 127).astype(jnp.int8)
    return q.reshape(q.shape[0], -1, q.shape[-1]), s


def quantize_q4(w_LKN) -> tuple[jax.Array, jax.Array]:
    """(v_LKN uint8 in 0-15, s_LGN float32), GGUF's Q4_0 per group of 32 rows of a column: m the
    group's value of largest magnitude (the first, with its sign), s = m / -8, v = min(15,
    floor(w / s + 8.5)) (8 where s is 0), standing for (v - 8) s; |w - (v - 8) s| <= |s| / 2 but
    at m's end of the range."""
    w = _groups(w_LKN)
    at = jnp.argmax(jnp.abs(w), axis=2)[:, :, None, :]
    s = jnp.take_along_axis(w, at, axis=2)[:, :, 0, :] / -8.0
    inv = jnp.where(s != 0, 1.0 / jnp.where(s != 0, s, 1.0), 0.0)
    v = jnp.minimum(15.0, jnp.floor(w * inv[:, :, None, :] + 8.5)).astype(jnp.uint8)
    return v.reshape(v.shape[0], -1, v.shape[-1]), s


def dequantize_q8(q_LKN, s_LGN) -> jax.Array:
    """The float32 weights (L, Kp, N) that quantize_q8's (q, s) stand for: q * s, as gemm_q8
    multiplies them."""
    l, kp, n = q_LKN.shape
    w = q_LKN.reshape(l, kp // Q8_GROUP, Q8_GROUP, n).astype(jnp.float32) * s_LGN[:, :, None, :]
    return w.reshape(l, kp, n)


def dequantize_q4(v_LKN, s_LGN) -> jax.Array:
    """The float32 weights (L, Kp, N) that quantize_q4's (v, s) stand for: (v - 8) s."""
    return dequantize_q8(v_LKN.astype(jnp.int8) - 8, s_LGN)


def _blocks(a_LKN, fill) -> jax.Array:
    """(L, Kp, N) -> (L, J, Kp, 16): column blocks of 16, padded past N with `fill`."""
    l, kp, n = a_LKN.shape
    np_ = -(-n // 16) * 16
    a = jnp.pad(a_LKN, ((0, 0), (0, 0), (0, np_ - n)), constant_values=fill)
    return a.reshape(l, kp, np_ // 16, 16).transpose(0, 2, 1, 3)


def pack_q8(q_LKN, s_LGN) -> tuple[jax.Array, jax.Array]:
    """quantize_q8's (q, s) in gemm_q8's layout: q (L, J, Kp, 16) int8 and s (L, J, G, 16)
    float32, a column block of 16 a stream (J = ceil(N / 16); zero columns past N, scale 1)."""
    return _blocks(q_LKN, 0), _blocks(s_LGN, 1.0)


def pack_q4(v_LKN, s_LGN) -> tuple[jax.Array, jax.Array]:
    """quantize_q4's (v, s) in gemm_q4's layout: v (L, J, Kp, 8) uint8, byte c of a block's row
    holding column c (low nibble) and c + 8 (high), and s (L, J, G, 16) float32 (columns past N:
    v 8, scale 0, zeros)."""
    v = _blocks(v_LKN, 8)
    return v[..., :8] | (v[..., 8:] << 4), _blocks(s_LGN, 0.0)


def _gemm_quant(x_TK, q, s, layer, n: int, rows, bits: int) -> jax.Array:
    if not quant_gemm_available():
        raise RuntimeError(f"gemm_q{bits} needs multilora's CPU kernels built with AVX2 + FMA "
                           f"({unavailable_reason() or 'this CPU or build has no AVX2 + FMA'})")
    rows = x_TK.shape[0] if rows is None else rows
    return jax.ffi.ffi_call("multilora_gemm_quant", jax.ShapeDtypeStruct((x_TK.shape[0], n), jnp.float32))(
        x_TK.astype(jnp.float32), q, s, jnp.asarray(layer, jnp.int32), jnp.asarray(rows, jnp.int32),
        bits=np.int64(bits))


def gemm_q8(x_TK: jax.Array, q_LJKC: jax.Array, s_LJGC: jax.Array, layer: jax.Array, n: int,
            rows: "jax.Array | int | None" = None) -> jax.Array:
    """y_TN (float32) = x times layer `layer` of pack_q8's weights (q * s, widened and scaled in
    registers, summed in float32), read in place; rows as gemm_bf16's (padding rows from there
    on: not multiplied, zeros)."""
    return _gemm_quant(x_TK, q_LJKC, s_LJGC, layer, n, rows, 8)


def gemm_q4(x_TK: jax.Array, v_LJKB: jax.Array, s_LJGC: jax.Array, layer: jax.Array, n: int,
            rows: "jax.Array | int | None" = None) -> jax.Array:
    """y_TN (float32) = x times layer `layer` of pack_q4's weights ((v - 8) s), as gemm_q8."""
    return _gemm_quant(x_TK, v_LJKB, s_LJGC, layer, n, rows, 4)
