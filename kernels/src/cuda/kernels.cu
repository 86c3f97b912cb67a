// Bulkhead's CUDA kernels. Compiled at run time by NVRTC (or ahead of time into PTX by
// `cuda-ptx`, see scripts/gpu-bundle). Self-contained: no CUDA headers, so NVRTC needs no
// toolkit include directory. Each kernel mirrors a CPU kernel of this crate, which is its
// oracle; the comments name it.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define QBLOCK 32
#define INT_MAX_ 0x7fffffff

// Weight formats, as `DType::code` numbers them.
#define DT_F32 0
#define DT_F16 1
#define DT_Q4_0 2
#define DT_Q4_1 3
#define DT_Q8_0 4

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// A little-endian f16 at a 2-byte aligned address (every block format keeps its f16 fields
// at even offsets of blocks of even size).
__device__ __forceinline__ float ld_f16(const u8* p) { return h2f(*(const u16*)p); }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ int warp_sum_i(int v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// ops::rms_norm. One block (a multiple of 32 threads, at most 1024) per row.
extern "C" __global__ void rms_norm(const float* x, const float* w, float* out, int dim,
                                    float eps) {
    __shared__ float part[32];
    const float* xr = x + (size_t)blockIdx.x * dim;
    float* o = out + (size_t)blockIdx.x * dim;
    float s = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) s += xr[i] * xr[i];
    s = warp_sum(s);
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    if (lane == 0) part[wid] = s;
    __syncthreads();
    if (wid == 0) {
        s = lane < (int)(blockDim.x >> 5) ? part[lane] : 0.0f;
        s = warp_sum(s);
        if (lane == 0) part[0] = s;
    }
    __syncthreads();
    float scale = 1.0f / sqrtf(part[0] / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = xr[i] * scale * w[i];
}

// ops::Rope, interleaved pairs: pair (x[2i], x[2i+1]) of every head turns by
// pos * inv_freq[i]. `width` values per row (whole heads), `half` = head_dim / 2.
extern "C" __global__ void rope(float* x, const int* pos, const float* inv_freq, int rows,
                                int width, int half) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int pairs = width / 2;
    if (i >= rows * pairs) return;
    int r = i / pairs, p = i % pairs;
    float s, c;
    sincosf((float)pos[r] * inv_freq[p % half], &s, &c);
    float* v = x + (size_t)r * width + 2 * p;
    float a = v[0], b = v[1];
    v[0] = a * c - b * s;
    v[1] = a * s + b * c;
}

// ops::silu_mul: gate = silu(gate) * up.
extern "C" __global__ void silu_mul(float* gate, const float* up, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float g = gate[i];
    gate[i] = g / (1.0f + expf(-g)) * up[i];
}

// ops::add_assign: a += b.
extern "C" __global__ void add_assign(float* a, const float* b, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) a[i] += b[i];
}

// BlockQ8::quantize: one warp per 32-value block of `x` (`blocks` of them).
extern "C" __global__ void quantize_q8(const float* x, i8* qs, float* ds, float* ss,
                                       int blocks) {
    int b = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (b >= blocks) return;  // whole warps leave together: blocks are warp-aligned
    float v = x[(size_t)b * QBLOCK + lane];
    float amax = warp_max(fabsf(v));
    float d = amax / 127.0f;
    float id = d == 0.0f ? 0.0f : 1.0f / d;
    // Halves to even, as the CPU's round_ties_even (roundf takes them away from zero).
    float r = rintf(v * id);
    // Rust's `as i8` saturates and maps NaN to 0.
    int q = r != r ? 0 : (int)fminf(fmaxf(r, -128.0f), 127.0f);
    qs[(size_t)b * QBLOCK + lane] = (i8)q;
    int sum = warp_sum_i(q);
    if (lane == 0) {
        ds[b] = h2f(f2h(d));
        ss[b] = h2f(f2h(d * (float)sum));
    }
}

// Σ q·y over one 4-bit block (low nibbles are values 0..15, high nibbles 16..31).
__device__ __forceinline__ int nibble_dot(const u8* qs, const i8* y) {
    int acc = 0;
    for (int j = 0; j < QBLOCK / 2; j++) {
        acc += (int)(qs[j] & 0x0f) * (int)y[j];
        acc += (int)(qs[j] >> 4) * (int)y[j + QBLOCK / 2];
    }
    return acc;
}

#define MM_TILE 8
#define MM_WARPS 4

// matmul: out[t][r] = w.row(r) · x.row(t). One warp per (weight row, tile of MM_TILE
// activation rows); lanes stride over the row's blocks (values for the float formats) and
// the warp sums in a fixed order, so every output is computed the same way whatever the
// batch (batch invariance, as on the CPU).
extern "C" __global__ void matmul(const u8* w, int dtype, int m, int k, int row_bytes,
                                  const float* xf, const i8* xq, const float* xd,
                                  const float* xs, int n, float* out) {
    int r = blockIdx.x * MM_WARPS + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    int t0 = blockIdx.y * MM_TILE;
    if (r >= m) return;
    int tiles = n - t0 < MM_TILE ? n - t0 : MM_TILE;
    const u8* row = w + (size_t)r * row_bytes;
    int nb = k / QBLOCK;
    float acc[MM_TILE];
    for (int j = 0; j < MM_TILE; j++) acc[j] = 0.0f;
    if (dtype == DT_F32 || dtype == DT_F16) {
        for (int i = lane; i < k; i += 32) {
            float wv = dtype == DT_F32 ? ((const float*)row)[i] : h2f(((const u16*)row)[i]);
            for (int j = 0; j < tiles; j++) acc[j] += wv * xf[(size_t)(t0 + j) * k + i];
        }
    } else {
        for (int b = lane; b < nb; b += 32) {
            for (int j = 0; j < tiles; j++) {
                size_t xb = (size_t)(t0 + j) * nb + b;
                const i8* y = xq + xb * QBLOCK;
                float yd = xd[xb], ys = xs[xb];
                if (dtype == DT_Q4_0) {
                    const u8* blk = row + (size_t)b * 18;
                    acc[j] += ld_f16(blk) * (yd * (float)nibble_dot(blk + 2, y) - 8.0f * ys);
                } else if (dtype == DT_Q4_1) {
                    const u8* blk = row + (size_t)b * 20;
                    acc[j] += ld_f16(blk) * yd * (float)nibble_dot(blk + 4, y) +
                              ld_f16(blk + 2) * ys;
                } else {
                    const u8* blk = row + (size_t)b * 34;
                    const i8* q = (const i8*)(blk + 2);
                    int s = 0;
                    for (int i = 0; i < QBLOCK; i++) s += (int)q[i] * (int)y[i];
                    acc[j] += ld_f16(blk) * yd * (float)s;
                }
            }
        }
    }
    for (int j = 0; j < tiles; j++) {
        float v = warp_sum(acc[j]);
        if (lane == 0) out[(size_t)(t0 + j) * m + r] = v;
    }
}

// QMatrix::dequantize_row for a list of row ids (the embedding lookup). A row id outside
// the matrix gives zeros (the caller fails that sequence).
extern "C" __global__ void get_rows(const u8* w, int dtype, int m, int k, int row_bytes,
                                    const u32* ids, int n, float* out) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n * k) return;
    int t = (int)(i / k), j = (int)(i % k);
    u32 id = ids[t];
    float v = 0.0f;
    if (id < (u32)m) {
        const u8* row = w + (size_t)id * row_bytes;
        int b = j / QBLOCK, e = j % QBLOCK;
        if (dtype == DT_F32) {
            v = ((const float*)row)[j];
        } else if (dtype == DT_F16) {
            v = h2f(((const u16*)row)[j]);
        } else if (dtype == DT_Q8_0) {
            const u8* blk = row + (size_t)b * 34;
            v = ld_f16(blk) * (float)((const i8*)(blk + 2))[e];
        } else {
            int bb = dtype == DT_Q4_1 ? 20 : 18;
            const u8* blk = row + (size_t)b * bb;
            float d = ld_f16(blk);
            float mn = dtype == DT_Q4_1 ? ld_f16(blk + 2) : -8.0f * d;
            const u8* qs = blk + (dtype == DT_Q4_1 ? 4 : 2);
            int q = e < QBLOCK / 2 ? (qs[e] & 0x0f) : (qs[e - QBLOCK / 2] >> 4);
            v = d * (float)q + mn;
        }
    }
    out[i] = v;
}

// The paged KV pool (attention::KvLayout): page → layer → K/V → kv head → slot → head_dim.
// The kernels that touch it take these as their first parameters (KV_PARAMS), in this order.
struct KvArgs {
    u16* pool;            // f16 bits
    const u64* pool_tags; // current tag of every page
    u32 pages;            // pages in the pool
    int layers, kv_heads, head_dim, page_tokens;
    const int* tok_seq;   // per token: its sequence, or -1 to skip it
    const int* tok_pos;   // per token: its position in the sequence
    const int* seq_table; // per sequence: offset of its page table in table_pages/tags
    const u32* table_pages;
    const u64* table_tags;
    int* status;          // per sequence: [lowest mismatched table index, lowest canary position]
    int check;            // compare tags (TagCheck::On)
    int canary;           // look for the canary in every key read
    u32 canary_bits;
};

#define KV_PARAMS                                                                          \
    u16 *pool, const u64 *pool_tags, u32 pages, int layers, int kv_heads, int head_dim,    \
        int page_tokens, const int *tok_seq, const int *tok_pos, const int *seq_table,     \
        const u32 *table_pages, const u64 *table_tags, int *status, int check, int canary, \
        u32 canary_bits
#define KV_ARGS                                                                             \
    KvArgs a = {pool,     pool_tags,   pages,      layers,     kv_heads, head_dim,          \
                page_tokens, tok_seq,  tok_pos,    seq_table,  table_pages, table_tags,     \
                status,   check,       canary,     canary_bits}

__device__ __forceinline__ size_t kv_at(const KvArgs& a, u32 page, int layer, int v, int head,
                                        int slot) {
    return ((((size_t)page * a.layers + layer) * 2 + v) * a.kv_heads + head) *
               (size_t)a.page_tokens * a.head_dim +
           (size_t)slot * a.head_dim;
}

// Whether the page at table index `ti` of sequence `s` may be touched: it exists and (with
// the check on) the pool's current tag is the one the sequence was given.
__device__ __forceinline__ bool page_ok(const KvArgs& a, int s, int ti, u32* page) {
    int at = a.seq_table[s] + ti;
    *page = a.table_pages[at];
    if (*page >= a.pages) return false;
    return !a.check || a.pool_tags[*page] == a.table_tags[at];
}

// attention::write_kv: K and V rows of the new tokens (n × kv_heads × head_dim, f32) into
// their slots as f16. A slot whose page fails the tag check is not written.
extern "C" __global__ void write_kv(KV_PARAMS, int layer, const float* k, const float* v,
                                    int n) {
    KV_ARGS;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    int kvd = a.kv_heads * a.head_dim;
    if (i >= (size_t)n * kvd) return;
    int t = (int)(i / kvd), h = (int)(i % kvd) / a.head_dim, d = (int)(i % a.head_dim);
    int s = a.tok_seq[t];
    if (s < 0) return;
    int pos = a.tok_pos[t];
    int ti = pos / a.page_tokens;
    u32 page;
    if (!page_ok(a, s, ti, &page)) {
        if (d == 0) atomicMin(&a.status[2 * s], ti);
        return;
    }
    int slot = pos % a.page_tokens;
    a.pool[kv_at(a, page, layer, 0, h, slot) + d] = f2h(k[i]);
    a.pool[kv_at(a, page, layer, 1, h, slot) + d] = f2h(v[i]);
}

#define ATT_MAX_DIMS 4  // head_dim ≤ 128 (checked by the host)

// attention::attend: causal GQA attention of every new token over positions 0..=pos of its
// sequence. One warp per (token, head); lane l holds dimensions l, l + 32, … below head_dim;
// online softmax. Every page is tag-checked before it is read and every key slot is checked
// for the canary; a failure records itself in `status` and stops that warp (the host fails
// the sequence and discards its rows).
extern "C" __global__ void attend(KV_PARAMS, int layer, const float* q, int heads,
                                  float scale, float* out) {
    KV_ARGS;
    int t = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
    int hd = a.head_dim;
    float* o = out + ((size_t)t * heads + h) * hd;
    int s = a.tok_seq[t];
    float acc[ATT_MAX_DIMS], qv[ATT_MAX_DIMS];
    for (int i = 0; i < ATT_MAX_DIMS; i++) {
        int d = lane + 32 * i;
        acc[i] = 0.0f;
        qv[i] = d < hd ? q[((size_t)t * heads + h) * hd + d] : 0.0f;
    }
    float mx = __int_as_float(0xff800000), l = 0.0f;  // -inf
    if (s >= 0) {
        int kvh = h / (heads / a.kv_heads);
        int len = a.tok_pos[t] + 1;
        int cur = -1;
        u32 page = 0;
        for (int p = 0; p < len; p++) {
            int ti = p / a.page_tokens, slot = p % a.page_tokens;
            if (ti != cur) {
                if (!page_ok(a, s, ti, &page)) {
                    if (lane == 0) atomicMin(&a.status[2 * s], ti);
                    break;
                }
                cur = ti;
            }
            const u16* key = a.pool + kv_at(a, page, layer, 0, kvh, slot);
            const u16* val = a.pool + kv_at(a, page, layer, 1, kvh, slot);
            if (a.canary && (u32)key[0] == a.canary_bits) {
                if (lane == 0) atomicMin(&a.status[2 * s + 1], p);
                break;
            }
            float part = 0.0f;
            for (int i = 0; i < ATT_MAX_DIMS; i++) {
                int d = lane + 32 * i;
                if (d < hd) part += qv[i] * h2f(key[d]);
            }
            float score = warp_sum(part) * scale;
            float mnew = fmaxf(mx, score);
            float corr = expf(mx - mnew);
            float e = expf(score - mnew);
            l = l * corr + e;
            for (int i = 0; i < ATT_MAX_DIMS; i++) {
                int d = lane + 32 * i;
                if (d < hd) acc[i] = acc[i] * corr + e * h2f(val[d]);
            }
            mx = mnew;
        }
    }
    for (int i = 0; i < ATT_MAX_DIMS; i++) {
        int d = lane + 32 * i;
        if (d < hd) o[d] = l > 0.0f ? acc[i] / l : 0.0f;
    }
}

// Fills `n` f16 values with `bits` (the scrub of a released page: zero or the canary).
extern "C" __global__ void fill_u16(u16* p, u32 n, u16 bits) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] = bits;
}

// KvMemory::read_slots: `runs` runs of `width` values, run r starting at `src + r * stride`,
// packed one after the other into `dst`. scatter_runs is the inverse (write_slots).
extern "C" __global__ void gather_runs(const u16* src, u16* dst, int runs, int stride,
                                       int width) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)runs * width) return;
    size_t r = i / width, j = i % width;
    dst[i] = src[r * stride + j];
}

extern "C" __global__ void scatter_runs(const u16* src, u16* dst, int runs, int stride,
                                        int width) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)runs * width) return;
    size_t r = i / width, j = i % width;
    dst[r * stride + j] = src[i];
}

// Rows `ids[..n]` of a row-major f32 matrix of `rows × width` (the last token of each
// sequence, for the LM head); an id outside the matrix gives a zero row.
extern "C" __global__ void gather_rows(const float* src, int rows, int width, const u32* ids,
                                       int n, float* out) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n * width) return;
    u32 id = ids[i / width];
    out[i] = id < (u32)rows ? src[(size_t)id * width + i % width] : 0.0f;
}
