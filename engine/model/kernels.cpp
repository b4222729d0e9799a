// The engine's native kernels for a batched step on a CPU in fp32 (native.py builds and loads them as
// torch.ops.ace_engine.*): where a step's work is a few passes over small tensors, one pass here
// instead of a handful of torch operations, each a dispatch and a trip through memory.
//
// decode_attention: attention for rows that decode one token each, over a static cache with a row
// per sequence: every row read as far as its own length, each key and value once for all the query
// heads that share it. The same work as two batched products (keys x queries, then weights x
// values) ran at about a quarter of the memory's speed here, because a product with four columns
// (the query heads of one KV head) takes BLAS's slowest path, and a group of rows is read as far as
// its longest row. One task per (row, KV head) streams that row's keys and values once, with its
// queries and its output in registers.
// (q [n, heads, d] fp32 contiguous, cache_k, cache_v [rows, kv_heads, slots, d] fp32 (slots' stride
// free, d contiguous), rows [n] int64, lengths [n] int64, scale) -> [n, heads, d]: query i attends
// to the first lengths[i] slots of cache row rows[i].
//
// rms_norm: torch's rms_norm of rows [n, h] in one pass a row (torch's is five operations).
//
// rope_write: a step's fused q/k/v projection [n, (heads + 2 kv_heads) d] into RoPE'd queries
// [n, heads, d], with RoPE'd keys and the values written to their cache rows and slots: what a
// layer did with a split, two rotations of five operations each and two scattered writes.
//
// silu_mul: silu(gate) * up of the fused gate/up projection [n, 2 i] -> [n, i].
//
// panel_linear (AVX-512 builds): x [n, k] fp32 times a weight [out, k] held as bf16 panels
// [out / 16, k, 16] (16 output columns, each k deep), where bf16 holds the weight exactly: each
// weight widened exactly, fp32 products and sums, as an fp32 product (its summation order is its
// own, as any kernel's). For decoding steps of a few rows, whose products read the weights once a
// step: half the bytes of fp32, and each 8-row block's weights read once for all its rows (8 rows
// x 48 columns of accumulators in registers, a broadcast of x and a widened panel row per FMA).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mul.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

// A batch cache's keys and values: fp32 [rows, kv_heads, slots, d], d contiguous, alike.
void check_caches(const at::Tensor& cache_k, const at::Tensor& cache_v) {
  TORCH_CHECK(cache_k.dim() == 4 && cache_k.scalar_type() == at::kFloat && cache_k.stride(3) == 1 &&
                  cache_v.sizes() == cache_k.sizes() && cache_v.strides() == cache_k.strides() &&
                  cache_v.scalar_type() == at::kFloat,
              "cache_k, cache_v: fp32 [rows, kv_heads, slots, d], d contiguous, alike");
}

float sum_of(Vec x) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, x);
}

// Scores of the G queries (already scaled) against the first len keys, as scores[j * len + l].
// D and G known at compile time (D a multiple of the vector width) keep the queries in registers.
template <int64_t D, int64_t G>
void score(const float* queries, const float* keys, int64_t stride, int64_t len, int64_t d, int64_t g, float* scores) {
  if constexpr (D > 0 && D % Vec::size() == 0) {
    constexpr int64_t C = D / Vec::size();
    Vec q[G][C];
    for (int64_t j = 0; j < G; ++j)
      for (int64_t c = 0; c < C; ++c) q[j][c] = Vec::loadu(queries + j * D + c * Vec::size());
    for (int64_t l = 0; l < len; ++l) {
      Vec k[C];
      for (int64_t c = 0; c < C; ++c) k[c] = Vec::loadu(keys + l * stride + c * Vec::size());
      for (int64_t j = 0; j < G; ++j) {
        Vec acc = q[j][0] * k[0];
        for (int64_t c = 1; c < C; ++c) acc = at::vec::fmadd(q[j][c], k[c], acc);
        scores[j * len + l] = sum_of(acc);
      }
    }
  } else {
    for (int64_t l = 0; l < len; ++l)
      for (int64_t j = 0; j < g; ++j) {
        const float* query = queries + j * d;
        const float* key = keys + l * stride;
        Vec acc(0.f);
        int64_t e = 0;
        for (; e + Vec::size() <= d; e += Vec::size()) acc = at::vec::fmadd(Vec::loadu(query + e), Vec::loadu(key + e), acc);
        float sum = sum_of(acc);
        for (; e < d; ++e) sum += query[e] * key[e];
        scores[j * len + l] = sum;
      }
  }
}

// Each query's scores in place as its softmax weights.
void softmax(float* scores, int64_t len, int64_t g) {
  for (int64_t j = 0; j < g; ++j) {
    float* s = scores + j * len;
    const float top = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, s, len);
    at::vec::map([top](Vec x) { return (x - Vec(top)).exp(); }, s, s, len);
    const float inv = 1.f / at::vec::reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, s, len);
    at::vec::map([inv](Vec x) { return x * Vec(inv); }, s, s, len);
  }
}

// out[j] = sum over l of weights[j * len + l] * values[l], for the G queries.
template <int64_t D, int64_t G>
void weigh(const float* weights, const float* values, int64_t stride, int64_t len, int64_t d, int64_t g, float* out) {
  if constexpr (D > 0 && D % Vec::size() == 0) {
    constexpr int64_t C = D / Vec::size();
    Vec acc[G][C];
    for (int64_t j = 0; j < G; ++j)
      for (int64_t c = 0; c < C; ++c) acc[j][c] = Vec(0.f);
    for (int64_t l = 0; l < len; ++l) {
      Vec v[C];
      for (int64_t c = 0; c < C; ++c) v[c] = Vec::loadu(values + l * stride + c * Vec::size());
      for (int64_t j = 0; j < G; ++j) {
        const Vec w(weights[j * len + l]);
        for (int64_t c = 0; c < C; ++c) acc[j][c] = at::vec::fmadd(w, v[c], acc[j][c]);
      }
    }
    for (int64_t j = 0; j < G; ++j)
      for (int64_t c = 0; c < C; ++c) acc[j][c].store(out + j * D + c * Vec::size());
  } else {
    std::fill(out, out + g * d, 0.f);
    for (int64_t l = 0; l < len; ++l)
      for (int64_t j = 0; j < g; ++j)
        for (int64_t e = 0; e < d; ++e) out[j * d + e] += weights[j * len + l] * values[l * stride + e];
  }
}

// One (row, KV head): its G queries (scaled) over its first len slots, into out [G, d].
template <int64_t D, int64_t G>
void attend(const float* queries, const float* keys, const float* values, int64_t stride, int64_t len, int64_t d,
            int64_t g, std::vector<float>& scores, float* out) {
  scores.resize(g * len);
  score<D, G>(queries, keys, stride, len, d, g, scores.data());
  softmax(scores.data(), len, g);
  weigh<D, G>(scores.data(), values, stride, len, d, g, out);
}

using Attend = void (*)(const float*, const float*, const float*, int64_t, int64_t, int64_t, int64_t,
                        std::vector<float>&, float*);

Attend attend_for(int64_t d, int64_t g) {
  if (d == 64 && g == 4) return &attend<64, 4>;
  if (d == 64 && g == 1) return &attend<64, 1>;
  if (d == 128 && g == 4) return &attend<128, 4>;
  if (d == 128 && g == 8) return &attend<128, 8>;
  return &attend<0, 0>;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& cache_k, const at::Tensor& cache_v,
                            const at::Tensor& rows, const at::Tensor& lengths, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: contiguous fp32 [n, heads, d]");
  check_caches(cache_k, cache_v);
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = cache_k.size(1);
  TORCH_CHECK(cache_k.size(3) == d && heads % kv_heads == 0, "q's heads and size must fit the cache's");
  TORCH_CHECK(rows.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong && rows.numel() == n &&
                  lengths.numel() == n && rows.device().is_cpu() && lengths.device().is_cpu(),
              "rows, lengths: int64 on the CPU, one per query");
  const at::Tensor rows_ = rows.contiguous(), lengths_ = lengths.contiguous();
  const int64_t* row = rows_.data_ptr<int64_t>();
  const int64_t* length = lengths_.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(row[i] >= 0 && row[i] < cache_k.size(0) && length[i] >= 1 && length[i] <= cache_k.size(2),
                "query ", i, ": row ", row[i], " or length ", length[i], " outside the cache");
  const int64_t g = heads / kv_heads, row_stride = cache_k.stride(0), head_stride = cache_k.stride(1);
  const int64_t slot_stride = cache_k.stride(2);
  const at::Tensor queries = at::mul(q, scale);
  at::Tensor out = at::empty_like(q);
  const float* qs = queries.data_ptr<float>();
  const float* ks = cache_k.data_ptr<float>();
  const float* vs = cache_v.data_ptr<float>();
  float* os = out.data_ptr<float>();
  const Attend kernel = attend_for(d, g);
  at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / kv_heads, kv = task % kv_heads;
      const int64_t cache = row[i] * row_stride + kv * head_stride, first = (i * heads + kv * g) * d;
      kernel(qs + first, ks + cache, vs + cache, slot_stride, length[i], d, g, scores, os + first);
    }
  });
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() >= 1, "x: contiguous fp32 [..., h]");
  const int64_t h = x.size(-1), n = h ? x.numel() / h : 0;
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == h, "weight: fp32 [h]");
  at::Tensor out = at::empty_like(x);
  const float* xs = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* os = out.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* row = xs + i * h;
      const float squares = at::vec::map_reduce_all<float>(
          [](Vec a) { return a * a; }, [](Vec a, Vec b) { return a + b; }, row, h);
      const float scale = 1.f / std::sqrt(squares / static_cast<float>(h) + static_cast<float>(eps));
      at::vec::map2([scale](Vec a, Vec b) { return a * Vec(scale) * b; }, os + i * h, row, w, h);
    }
  });
  return out;
}

// x [d] rotated by the angles of one position (cos, sin [d], Llama's halves layout) into out [d].
inline void rotate(const float* x, const float* cos, const float* sin, int64_t d, float* out) {
  const int64_t half = d / 2;
  for (int64_t e = 0; e < half; ++e) {
    out[e] = x[e] * cos[e] - x[e + half] * sin[e];
    out[e + half] = x[e + half] * cos[e + half] + x[e] * sin[e + half];
  }
}

at::Tensor rope_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                      at::Tensor& cache_k, at::Tensor& cache_v, const at::Tensor& rows, const at::Tensor& slots,
                      int64_t heads) {
  check_caches(cache_k, cache_v);
  const int64_t kv_heads = cache_k.size(1), d = cache_k.size(3), width = (heads + 2 * kv_heads) * d;
  TORCH_CHECK(d % 2 == 0, "an even head size");
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && qkv.is_contiguous() && qkv.size(-1) == width,
              "qkv: contiguous fp32 [..., (heads + 2 kv_heads) d]");
  const int64_t n = qkv.numel() / width;
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && cos.dim() == 2 && cos.size(1) == d &&
                  sin.sizes() == cos.sizes() && sin.scalar_type() == at::kFloat && sin.is_contiguous(),
              "cos, sin: contiguous fp32 [positions, d]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && rows.scalar_type() == at::kLong &&
                  slots.scalar_type() == at::kLong && positions.numel() == n && rows.numel() == n &&
                  slots.numel() == n, "positions, rows, slots: int64, one per token");
  const at::Tensor positions_ = positions.contiguous(), rows_ = rows.contiguous(), slots_ = slots.contiguous();
  const int64_t* position = positions_.data_ptr<int64_t>();
  const int64_t* row = rows_.data_ptr<int64_t>();
  const int64_t* slot = slots_.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(position[t] >= 0 && position[t] < cos.size(0) && row[t] >= 0 && row[t] < cache_k.size(0) &&
                    slot[t] >= 0 && slot[t] < cache_k.size(2),
                "token ", t, ": position ", position[t], ", row ", row[t], " or slot ", slot[t], " outside the tables");
  at::Tensor q = at::empty({n, heads, d}, qkv.options());
  const float* in = qkv.data_ptr<float>();
  const float* cs = cos.data_ptr<float>();
  const float* ss = sin.data_ptr<float>();
  float* qs = q.data_ptr<float>();
  float* ks = cache_k.data_ptr<float>();
  float* vs = cache_v.data_ptr<float>();
  const int64_t s_row = cache_k.stride(0), s_head = cache_k.stride(1), s_slot = cache_k.stride(2);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* x = in + t * width;
      const float* c = cs + position[t] * d;
      const float* s = ss + position[t] * d;
      for (int64_t h = 0; h < heads; ++h) rotate(x + h * d, c, s, d, qs + (t * heads + h) * d);
      const int64_t at_slot = row[t] * s_row + slot[t] * s_slot;
      for (int64_t j = 0; j < kv_heads; ++j) {
        rotate(x + (heads + j) * d, c, s, d, ks + at_slot + j * s_head);
        std::copy_n(x + (heads + kv_heads + j) * d, d, vs + at_slot + j * s_head);
      }
    }
  });
  return q;
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat && gate_up.is_contiguous() && gate_up.dim() >= 1 &&
                  gate_up.size(-1) % 2 == 0, "gate_up: contiguous fp32 [..., 2 i]");
  const int64_t i = gate_up.size(-1) / 2, n = i ? gate_up.numel() / (2 * i) : 0;
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = i;
  at::Tensor out = at::empty(shape, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* os = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      at::vec::map2([](Vec g, Vec u) { return g / (Vec(1.f) + g.neg().exp()) * u; }, os + r * i, in + 2 * r * i,
                    in + 2 * r * i + i, i);
  });
  return out;
}

#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t PANEL = 16;  // output columns per panel: one zmm of fp32
constexpr int PANEL_ROWS = 8;  // rows per block: 8 x 3 accumulators, 3 panel rows and a broadcast in 32 zmm

inline __m512 widen(const c10::BFloat16* p) {  // 16 bf16 -> fp32, exactly (bf16 is fp32's upper half)
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// rows x (NP panels) of the output, over all of k
template <int ROWS, int NP>
inline void panel_tile(const float* x, int64_t k, const c10::BFloat16* panels, int64_t first, float* y, int64_t out) {
  __m512 acc[ROWS][NP];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_setzero_ps();
  const c10::BFloat16* w[NP];
  for (int j = 0; j < NP; ++j) w[j] = panels + (first + j) * k * PANEL;
  for (int64_t t = 0; t < k; ++t) {
    __m512 b[NP];
    for (int j = 0; j < NP; ++j) b[j] = widen(w[j] + t * PANEL);
    for (int r = 0; r < ROWS; ++r) {
      __m512 a = _mm512_set1_ps(x[r * k + t]);
      for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_fmadd_ps(a, b[j], acc[r][j]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < NP; ++j) _mm512_storeu_ps(y + r * out + (first + j) * PANEL, acc[r][j]);
}

template <int ROWS>
void panel_rows(const float* x, int64_t k, const c10::BFloat16* panels, int64_t begin, int64_t end, float* y,
                int64_t out) {
  int64_t p = begin;
  for (; p + 3 <= end; p += 3) panel_tile<ROWS, 3>(x, k, panels, p, y, out);
  for (; p < end; ++p) panel_tile<ROWS, 1>(x, k, panels, p, y, out);
}

using PanelRows = void (*)(const float*, int64_t, const c10::BFloat16*, int64_t, int64_t, float*, int64_t);
constexpr PanelRows PANEL_BLOCKS[PANEL_ROWS + 1] = {nullptr,       panel_rows<1>, panel_rows<2>,
                                                    panel_rows<3>, panel_rows<4>, panel_rows<5>,
                                                    panel_rows<6>, panel_rows<7>, panel_rows<8>};

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2, "x: contiguous fp32 [n, k]");
  TORCH_CHECK(panels.scalar_type() == at::kBFloat16 && panels.is_contiguous() && panels.dim() == 3 &&
                  panels.size(1) == x.size(1) && panels.size(2) == PANEL,
              "panels: contiguous bf16 [out / 16, k, 16]");
  const int64_t n = x.size(0), k = x.size(1), count = panels.size(0), out = count * PANEL;
  at::Tensor y = at::empty({n, out}, x.options());
  const float* xs = x.data_ptr<float>();
  const c10::BFloat16* ws = panels.data_ptr<c10::BFloat16>();
  float* ys = y.data_ptr<float>();
  at::parallel_for(0, count, 12, [&](int64_t begin, int64_t end) {
    for (int64_t r = 0; r < n; r += PANEL_ROWS) {
      const int64_t rows = std::min<int64_t>(PANEL_ROWS, n - r);
      PANEL_BLOCKS[rows](xs + r * k, k, ws, begin, end, ys + r * out, out);
    }
  });
  return y;
}
#endif

}  // namespace

TORCH_LIBRARY(ace_engine, m) {
  m.def("decode_attention(Tensor q, Tensor cache_k, Tensor cache_v, Tensor rows, Tensor lengths, float scale) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def(
      "rope_write(Tensor qkv, Tensor cos, Tensor sin, Tensor positions, Tensor(a!) cache_k, Tensor(b!) cache_v, "
      "Tensor rows, Tensor slots, int heads) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.impl("decode_attention", c10::DispatchKey::CPU, &decode_attention);
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.impl("rope_write", c10::DispatchKey::CPU, &rope_write);
  m.impl("silu_mul", c10::DispatchKey::CPU, &silu_mul);
#if defined(CPU_CAPABILITY_AVX512)
  m.def("panel_linear(Tensor x, Tensor panels) -> Tensor");
  m.impl("panel_linear", c10::DispatchKey::CPU, &panel_linear);
#endif
}
