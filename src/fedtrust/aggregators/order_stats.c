/* Order statistics of float32 column blocks, for fedtrust.aggregators.order_stats (loaded with ctypes;
 * the tiny module below only makes the shared object importable).
 *
 * window_block: for each column of an (n, c) row-major block, the mean of its values of rank lo..hi-1, and
 * each row's count of the (column, rank) slots of that window, counted as #(x >= low) - #(x > high) with
 * low, high the window's edge values. Columns whose edge value is tied across the edge are flagged: the
 * caller shares their slots among the tied rows.
 *
 * Columns go through a comparator network LANES at a time, in an L1-resident copy: each comparator is a
 * min and a max of two rows of LANES values, which the compiler turns into a few vector instructions. The
 * network (a list of comparator pairs) is the caller's: Batcher's merge sort pruned to the ranks read.
 * Build with -ffinite-math-only so that `u < v ? u : v` compiles to a vector min; the caller screens
 * non-finite values out first.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define LANES 64

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

/* Bumped whenever window_block's signature changes: the loader refuses a stale build. */
int32_t order_stats_abi(void) { return 1; }

/* always_inline: a helper left out of line is built for the baseline instruction set, not the clone's */
#if defined(__GNUC__)
__attribute__((always_inline))
#endif
static inline void compare_exchange(float *restrict a, float *restrict b)
{
    for (int l = 0; l < LANES; l++) {
        float u = a[l], v = b[l];
        a[l] = u < v ? u : v;
        b[l] = u < v ? v : u;
    }
}

/* x: block start, row stride `stride` floats; pairs: npairs comparators (i, j), i < j; out, low, high,
 * crossing: c entries each; slots: n counts, added to; scratch: n * LANES + 16 floats.
 * Returns the number of flagged (tied) columns. */
CLONES int64_t window_block(const float *x, int64_t stride, int32_t n, int64_t c, const int32_t *pairs,
                            int32_t npairs, int32_t lo, int32_t hi, float *out, float *low, float *high,
                            uint8_t *crossing, double *slots, float *scratch)
{
    float *buf = (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    const float scale = 1.0f / (float)(hi - lo);
    int64_t tied = 0;
    for (int64_t c0 = 0; c0 < c; c0 += LANES) {
        const int64_t w = c - c0 < LANES ? c - c0 : LANES;
        for (int32_t r = 0; r < n; r++) {
            float *row = buf + (int64_t)r * LANES;
            memcpy(row, x + r * stride + c0, (size_t)w * sizeof(float));
            if (w < LANES) memset(row + w, 0, (size_t)(LANES - w) * sizeof(float));
        }
        for (int32_t p = 0; p < npairs; p++)
            compare_exchange(buf + (int64_t)pairs[2 * p] * LANES, buf + (int64_t)pairs[2 * p + 1] * LANES);
        float sum[LANES];
        for (int l = 0; l < LANES; l++) sum[l] = 0.0f;
        for (int32_t k = lo; k < hi; k++)
            for (int l = 0; l < LANES; l++) sum[l] += buf[(int64_t)k * LANES + l];
        const float *first = buf + (int64_t)lo * LANES, *last = buf + (int64_t)(hi - 1) * LANES;
        for (int64_t l = 0; l < w; l++) {
            out[c0 + l] = sum[l] * scale;
            low[c0 + l] = first[l];
            high[c0 + l] = last[l];
            uint8_t t = 0;
            if (lo > 0) t |= first[l - LANES] == first[l];
            if (hi < n) t |= last[l + LANES] == last[l];
            crossing[c0 + l] = t;
            tied += t;
        }
    }
    for (int32_t r = 0; r < n; r++) {
        const float *xr = x + r * stride;
        int64_t count = 0;
        for (int64_t j0 = 0; j0 < c; j0 += 1 << 20) {  /* int32 partial counts, vectorised */
            const int64_t j1 = c - j0 < (1 << 20) ? c : j0 + (1 << 20);
            int32_t part = 0;
            for (int64_t j = j0; j < j1; j++) part += (xr[j] >= low[j]) - (xr[j] > high[j]);
            count += part;
        }
        slots[r] += (double)count;
    }
    return tied;
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_order_stats",
                                    "Compiled order-statistics kernels (called through ctypes).", -1, NULL};

PyMODINIT_FUNC PyInit__order_stats(void) { return PyModule_Create(&module); }
