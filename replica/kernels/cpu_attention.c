/* Paged decode attention on CPU: one query token per row over its context, read in place from
 * the K/V pool through the row's block table (replica/kernels/cpu_attention.py builds and calls this).
 *
 * Work is split over (KV head, chunk of adjacent rows). The blocks that begin every table of a
 * chunk (a cached system prompt: the runner lays rows sharing one next to each other) are read
 * once for all the chunk's rows, each key and value row used by every (row, query head) of the
 * chunk while it is in cache; the rest of each row's blocks are walked row by row. Softmax is
 * online, in float32, whatever the pool's dtype. Head sizes 64 and 128 get functions of their
 * own, whose fixed sizes let the compiler keep a query's accumulator in registers.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_QUERIES 32 /* (row, query head) pairs of a chunk: rows per chunk = MAX_QUERIES / group */
#define MAX_DIM 256    /* head_dim */
#define MAX_BLOCK 64   /* block_size */

static inline float bf16_to_float(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
#define LOAD_F32(x) (x)
#define LOAD_BF16(x) bf16_to_float(x)

typedef struct {
    float acc[MAX_QUERIES][MAX_DIM];
    float m[MAX_QUERIES], l[MAX_QUERIES], s[MAX_QUERIES][MAX_BLOCK];
} state;

/* Online softmax: fold the `n` new scores s[j][0:n] of queries [first, first + count) into
 * their running max and sum, rescaling what they accumulated; s becomes the weights. */
static inline void rescale(state *st, int first, int count, int n, int dim) {
    for (int j = first; j < first + count; j++) {
        float top = st->m[j];
        for (int t = 0; t < n; t++) top = st->s[j][t] > top ? st->s[j][t] : top;
        const float r = expf(st->m[j] - top);
        st->m[j] = top;
        st->l[j] *= r;
        for (int d = 0; d < dim; d++) st->acc[j][d] *= r;
        for (int t = 0; t < n; t++) {
            st->s[j][t] = expf(st->s[j][t] - top);
            st->l[j] += st->s[j][t];
        }
    }
}

/* NAME: the exported function; T, LOAD: the pool's element type and its conversion to float;
 * DIM: head_dim as a constant, or `dim` (any size up to MAX_DIM). */
#define DEFINE_DECODE(NAME, T, LOAD, DIM)                                                          \
/* One block's `n` tokens at pool slot `base`, for queries [first, first + count) of a chunk. */  \
static inline void NAME##_block(state *st, const float *qs, const T *kh, const T *vh,             \
                                int64_t base, int n, int first, int count, int dim) {              \
    for (int j = first; j < first + count; j++) {                                                  \
        const float *qj = qs + j * DIM;                                                            \
        for (int t = 0; t < n; t++) {                                                              \
            const T *k = kh + (base + t) * DIM;                                                    \
            float dot = 0.f;                                                                       \
            for (int d = 0; d < DIM; d++) dot += qj[d] * LOAD(k[d]);                               \
            st->s[j][t] = dot;                                                                     \
        }                                                                                          \
    }                                                                                              \
    rescale(st, first, count, n, DIM);                                                             \
    for (int j = first; j < first + count; j++) {                                                  \
        float a[MAX_DIM];                                                                          \
        for (int d = 0; d < DIM; d++) a[d] = st->acc[j][d];                                        \
        for (int t = 0; t < n; t++) {                                                              \
            const T *v = vh + (base + t) * DIM;                                                    \
            const float p = st->s[j][t];                                                           \
            for (int d = 0; d < DIM; d++) a[d] += p * LOAD(v[d]);                                  \
        }                                                                                          \
        for (int d = 0; d < DIM; d++) st->acc[j][d] = a[d];                                        \
    }                                                                                              \
}                                                                                                  \
                                                                                                   \
void NAME(const float *q, int64_t q_row_stride, const T *k_pool, const T *v_pool,                  \
          int64_t kv_head_stride, const int64_t *tables, const int64_t *offsets,                 \
          const int64_t *lens, int rows, int heads, int kv_heads, int dim, int block_size,         \
          float *out, int64_t out_row_stride, int threads) {                                      \
    const int group = heads / kv_heads;                                                           \
    const int per_chunk = MAX_QUERIES / group;                                                    \
    const int chunks = (rows + per_chunk - 1) / per_chunk;                                        \
    _Pragma("omp parallel for collapse(2) schedule(dynamic) num_threads(threads)")                \
    for (int c = 0; c < chunks; c++) {                                                            \
        for (int h = 0; h < kv_heads; h++) {                                                      \
            state st;                                                                             \
            float qs[MAX_QUERIES * MAX_DIM];                                                      \
            const int r0 = c * per_chunk;                                                         \
            const int nr = rows - r0 < per_chunk ? rows - r0 : per_chunk;                         \
            const T *kh = k_pool + h * kv_head_stride, *vh = v_pool + h * kv_head_stride;         \
            for (int i = 0; i < nr; i++)                                                          \
                memcpy(qs + i * group * DIM, q + (r0 + i) * q_row_stride + (int64_t)h * group * DIM, \
                       sizeof(float) * group * DIM);                                               \
            for (int j = 0; j < nr * group; j++) {                                                \
                st.m[j] = -FLT_MAX;                                                               \
                st.l[j] = 0.f;                                                                    \
                for (int d = 0; d < DIM; d++) st.acc[j][d] = 0.f;                                  \
            }                                                                                     \
            /* the leading blocks every row of the chunk holds whole, under the same id */        \
            int64_t shared = nr > 1 ? lens[r0] / block_size : 0;                                  \
            const int64_t *first = tables + offsets[r0];                                          \
            for (int i = 1; i < nr && shared; i++) {                                              \
                const int64_t *table = tables + offsets[r0 + i];                                  \
                const int64_t full = lens[r0 + i] / block_size;                                   \
                int64_t b = 0;                                                                    \
                while (b < shared && b < full && table[b] == first[b]) b++;                       \
                shared = b;                                                                       \
            }                                                                                     \
            for (int64_t b = 0; b < shared; b++)                                                  \
                NAME##_block(&st, qs, kh, vh, first[b] * block_size, block_size, 0, nr * group, dim); \
            for (int i = 0; i < nr; i++) {                                                        \
                const int64_t *table = tables + offsets[r0 + i];                                  \
                const int64_t n = lens[r0 + i];                                                   \
                for (int64_t start = shared * block_size; start < n; start += block_size) {       \
                    const int count = n - start < block_size ? (int)(n - start) : block_size;     \
                    NAME##_block(&st, qs, kh, vh, table[start / block_size] * block_size, count,  \
                                 i * group, group, dim);                                          \
                }                                                                                 \
                float *o = out + (r0 + i) * out_row_stride + (int64_t)h * group * DIM;            \
                for (int g = 0; g < group; g++) {                                                 \
                    const int j = i * group + g;                                                  \
                    const float inv = 1.f / st.l[j];                                              \
                    for (int d = 0; d < DIM; d++) o[g * DIM + d] = st.acc[j][d] * inv;            \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
}

DEFINE_DECODE(paged_decode_f32_64, float, LOAD_F32, 64)
DEFINE_DECODE(paged_decode_f32_128, float, LOAD_F32, 128)
DEFINE_DECODE(paged_decode_f32_any, float, LOAD_F32, dim)
DEFINE_DECODE(paged_decode_bf16_64, uint16_t, LOAD_BF16, 64)
DEFINE_DECODE(paged_decode_bf16_128, uint16_t, LOAD_BF16, 128)
DEFINE_DECODE(paged_decode_bf16_any, uint16_t, LOAD_BF16, dim)

int max_queries(void) { return MAX_QUERIES; }
int max_dim(void) { return MAX_DIM; }
int max_block(void) { return MAX_BLOCK; }
