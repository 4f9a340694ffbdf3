"""The adapter pool's gather on XLA's CPU backend: what bgmv pays to fetch each token's adapter
rows, for the three layouts multilora has had. 64 tokens over 8 adapters, rank 16, 1536 features:

  old    slots padded to the max rank, (S, R, X): one (R, X) slice per token
  rows   a pool of single rank rows through a row table: R one-row slices per token
  pages  the same pool in aligned pages of 8 rows (multilora.adapters.pool): R/8 slices per token

Each followed by the per-token product, jitted; medians of 30 interleaved rounds of 20 calls.

    python benchmarks/pool_gather.py
"""
import time, numpy as np, jax, jax.numpy as jnp
from jax import lax
S, R, X, T, P = 65, 16, 1536, 64, 8
U = S * R
rng = np.random.default_rng(0)
pool_SRX = jnp.asarray(rng.standard_normal((S, R, X), np.float32))
pool_UX = pool_SRX.reshape(U, X)
slot_T = jnp.asarray(rng.integers(1, 9, T).astype(np.int32))
rows_SR = jnp.asarray(np.arange(U, dtype=np.int32).reshape(S, R))
x_TX = jnp.asarray(rng.standard_normal((T, X), np.float32))
@jax.jit
def old(pool_SRX, slot_T, x):
    a = jnp.take(pool_SRX, slot_T, axis=0, mode="clip"); return jnp.einsum("tx,trx->tr", x, a)
@jax.jit
def rows(pool_UX, rows_SR, slot_T, x):
    r = jnp.take(rows_SR, slot_T, axis=0, mode="clip"); a = jnp.take(pool_UX, r, axis=0, mode="clip")
    return jnp.einsum("tx,trx->tr", x, a)
@jax.jit
def pages(pool_UX, rows_SR, slot_T, x):
    r = jnp.take(rows_SR, slot_T, axis=0, mode="clip")[:, ::P]  # (T, R/P)
    dn = lax.GatherDimensionNumbers(offset_dims=(2, 3), collapsed_slice_dims=(), start_index_map=(0,))
    a = lax.gather(pool_UX, r[..., None], dn, slice_sizes=(P, X), mode="clip").reshape(T, R, X)
    return jnp.einsum("tx,trx->tr", x, a)
fns = dict(old=(old, (pool_SRX, slot_T, x_TX)), rows=(rows, (pool_UX, rows_SR, slot_T, x_TX)), pages=(pages, (pool_UX, rows_SR, slot_T, x_TX)))
ref = np.asarray(old(pool_SRX, slot_T, x_TX))
for n,(f,a) in fns.items():
    assert np.allclose(np.asarray(f(*a)), ref, atol=1e-3), n
res = {n: [] for n in fns}
for _ in range(30):
    for n,(f,a) in fns.items():
        t=time.perf_counter(); 
        for _ in range(20): o=f(*a)
        o.block_until_ready(); res[n].append((time.perf_counter()-t)/20)
for n,v in res.items(): print(n, "%.1f us" % (1e6*np.median(v)))
