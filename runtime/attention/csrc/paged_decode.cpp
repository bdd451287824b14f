// Decode attention read in place from the paged KV pool (CPU, fp32; K/V pages fp32 or fp8).
//
// One query token per request attends to its first seq_lens[b] positions, whose K/V rows start
// rows[b, 0:seq_lens[b]] floats past k (and v). Nothing is gathered or padded: each
// (request, kv head) item walks its own rows, so the work is the K/V bytes it really reads.
// GQA: the G = H / KVH query heads of a kv head share one pass over its keys and values.
// Vectors are GCC vector extensions (AVX-512 with -march=native where the CPU has it); the
// softmax's exp is vectorized too (exp_nonpositive). Accuracy against float64 is at least that
// of torch's SDPA (tests/attention).
//
//   q        [B, H, D]           float32, contiguous
//   k, v     [P, PS, KVH, D]     float32, one layer of the page-major pool: pages of PS slots,
//                                a page's rows contiguous, pages `stride(0)` elements apart
//   rows     [B, >= max(lens)]   int64, contiguous rows: each position's row offset in elements
//                                (KVPool.row_offsets of the req_to_token rows: one table per
//                                step for every layer, so no division per row here)
//   seq_lens [B]                 int64
//   out      [B, H, D]           float32, contiguous, written
//
// paged_decode_fp8 takes the same arguments, k and v float8_e4m3fn pages (--kv-cache-dtype
// fp8_e4m3), and two more: k_lut, v_lut [256] float32, the value of each fp8 byte under the
// layer's K (V) scale (float(byte) * scale: what KVPool's dequantize gives, so the kernel reads
// exactly the values the torch backend attends to).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <vector>

namespace {

constexpr int kLanes = 16;
constexpr int kMaxGroup = 16;
// aligned(4): loads and stores from any float address
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float)), aligned(sizeof(float))));

inline Vec load(const float* p) { return *reinterpret_cast<const Vec*>(p); }
inline void store(float* p, Vec x) { *reinterpret_cast<Vec*>(p) = x; }
typedef int32_t IVec __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef float Vec8 __attribute__((vector_size(8 * sizeof(float))));
typedef float Vec4 __attribute__((vector_size(4 * sizeof(float))));

// A layer's K (or V) rows as the pool stores them; plus(n): the same, n elements on (a kv head).
struct F32Rows {
  const float* base;
  Vec at(int64_t offset) const { return load(base + offset); }
  F32Rows plus(int64_t n) const { return {base + n}; }
};
struct Fp8Rows {  // one byte an element, its value looked up under the layer's scale
  const uint8_t* base;
  const float* lut;  // [256]
  Vec at(int64_t offset) const {
    const uint8_t* p = base + offset;
    Vec x;
    for (int i = 0; i < kLanes; ++i) x[i] = lut[p[i]];
    return x;
  }
  Fp8Rows plus(int64_t n) const { return {base + n, lut}; }
};

inline float sum_lanes(Vec x) {  // a fixed pairwise tree: vector adds, reproducible order
  Vec8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  Vec4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// exp for x <= 0 (scores minus their max), 16 lanes at once: x = n ln2 + r, |r| <= ln2 / 2,
// exp(r) by Cephes' expf polynomial (about 1 ulp), times 2^n built in the exponent bits.
// Below -87 the result is clamped to ~1e-38 instead of a denormal: nothing next to the max's 1.
inline Vec exp_nonpositive(Vec x) {
  const Vec lo = Vec{} - 87.0f;
  x = x < lo ? lo : x;
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to the nearest integer
  const Vec t = x * 1.44269504088896341f + magic;
  const Vec n = t - magic;
  const Vec r = x - n * 0.693359375f + n * 2.12194440e-4f;  // ln2 split in two for accuracy
  Vec p = 1.9875691500e-4f * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const IVec ni = __builtin_convertvector(n, IVec);
  const IVec scale_bits = (ni + 127) << 23;
  Vec scale;
  __builtin_memcpy(&scale, &scale_bits, sizeof(scale));
  return p * scale;
}

// One (request, kv head): G query heads of C * 16 dims over L positions.
// score: scratch of G * L floats.
template <int C, typename Rows>
void attend(const float* q, Rows k, Rows v, const int64_t* row, int64_t L, int64_t G,
            int64_t max_row, float scale, float* score, float* out) {
  float max_score[kMaxGroup];
  std::fill(max_score, max_score + G, -INFINITY);
  for (int64_t j = 0; j < L; ++j) {  // scores: q . k_j for every head of the group
    TORCH_CHECK(row[j] >= 0 && row[j] <= max_row, "paged_decode: row out of range");
    Vec kr[C];
    for (int c = 0; c < C; ++c) kr[c] = k.at(row[j] + c * kLanes);
    for (int64_t h = 0; h < G; ++h) {
      const float* qh = q + h * C * kLanes;
      Vec acc = load(qh) * kr[0];
      for (int c = 1; c < C; ++c) acc += load(qh + c * kLanes) * kr[c];
      const float s = sum_lanes(acc) * scale;
      score[h * L + j] = s;
      max_score[h] = std::max(max_score[h], s);
    }
  }
  float denom[kMaxGroup];
  for (int64_t h = 0; h < G; ++h) {  // softmax numerators, in place
    float* s = score + h * L;
    Vec sum{};
    int64_t j = 0;
    for (; j + kLanes <= L; j += kLanes) {
      const Vec e = exp_nonpositive(load(s + j) - max_score[h]);
      store(s + j, e);
      sum += e;
    }
    float total = sum_lanes(sum);
    for (; j < L; ++j) {  // the tail, through the same vector code
      Vec one{};
      one[0] = s[j] - max_score[h];
      s[j] = exp_nonpositive(one)[0];
      total += s[j];
    }
    denom[h] = total;
  }
  Vec acc[kMaxGroup][C];
  for (int64_t h = 0; h < G; ++h)
    for (int c = 0; c < C; ++c) acc[h][c] = Vec{};
  for (int64_t j = 0; j < L; ++j) {  // weighted sum of the values
    Vec vr[C];
    for (int c = 0; c < C; ++c) vr[c] = v.at(row[j] + c * kLanes);
    for (int64_t h = 0; h < G; ++h) {
      const float p = score[h * L + j];
      for (int c = 0; c < C; ++c) acc[h][c] += p * vr[c];
    }
  }
  for (int64_t h = 0; h < G; ++h)
    for (int c = 0; c < C; ++c) store(out + h * C * kLanes + c * kLanes, acc[h][c] / denom[h]);
}

template <typename Rows>
using AttendFn = void (*)(const float*, Rows, Rows, const int64_t*, int64_t, int64_t, int64_t,
                          float, float*, float*);

template <typename Rows>
AttendFn<Rows> pick(int64_t head_dim) {
  switch (head_dim) {
    case 32: return &attend<2, Rows>;
    case 64: return &attend<4, Rows>;
    case 96: return &attend<6, Rows>;
    case 128: return &attend<8, Rows>;
    case 256: return &attend<16, Rows>;
    default: return nullptr;
  }
}

void check(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
           const at::Tensor& rows, const at::Tensor& seq_lens, const at::Tensor& out,
           at::ScalarType kv_type) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.dim() == 4 && out.sizes() == q.sizes(),
              "paged_decode: q/out [B, H, D], k/v [P, PS, KVH, D]");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &out})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu(),
                "paged_decode: q, out must be float32 CPU tensors");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&k, &v})
    TORCH_CHECK(t->scalar_type() == kv_type && t->device().is_cpu(), "paged_decode: k, v must be ",
                kv_type, " CPU tensors");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous(), "paged_decode: q, out must be contiguous");
  TORCH_CHECK(k.strides() == v.strides() && k.stride(3) == 1 && k.stride(2) == k.size(3) &&
                  k.stride(1) == k.size(2) * k.size(3),
              "paged_decode: k/v pages must have contiguous rows and the same strides");
  TORCH_CHECK(rows.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  rows.dim() == 2 && rows.stride(1) == 1 && seq_lens.is_contiguous(),
              "paged_decode: rows [B, L] and seq_lens [B] must be int64 with contiguous rows");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(2);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(3) == D && H % KVH == 0 && H / KVH <= kMaxGroup,
              "paged_decode: head counts/dims do not match");
  TORCH_CHECK(rows.size(0) == B && seq_lens.size(0) == B, "paged_decode: batch sizes differ");
  TORCH_CHECK(pick<F32Rows>(D) != nullptr, "paged_decode: head_dim ", D,
              " not compiled (32/64/96/128/256)");
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= rows.size(1), "paged_decode: bad seq_len ", lens[b]);
}

// Every (request, kv head) in parallel, over K/V rows `k`, `v` (at the layer's first element).
template <typename Rows>
void decode(const at::Tensor& q, const at::Tensor& k_pages, Rows k, Rows v,
            const at::Tensor& rows, const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_pages.size(2);
  const int64_t G = H / KVH, table_stride = rows.stride(0);
  const int64_t max_row =
      (k_pages.size(0) - 1) * k_pages.stride(0) + (k_pages.size(1) - 1) * k_pages.stride(1);
  const AttendFn<Rows> fn = pick<Rows>(D);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const float* qp = q.data_ptr<float>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  float* op = out.mutable_data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> score;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / KVH, g = item % KVH, L = lens[b];
      score.resize(G * L);
      const int64_t head0 = b * H + g * G;
      fn(qp + head0 * D, k.plus(g * D), v.plus(g * D), rp + b * table_stride, L, G, max_row, sc,
         score.data(), op + head0 * D);
    }
  });
}

void paged_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& rows, const at::Tensor& seq_lens, double scale,
                  at::Tensor& out) {
  check(q, k, v, rows, seq_lens, out, at::kFloat);
  decode(q, k, F32Rows{k.data_ptr<float>()}, F32Rows{v.data_ptr<float>()}, rows, seq_lens, scale,
         out);
}

void paged_decode_fp8(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& rows, const at::Tensor& seq_lens, double scale,
                      const at::Tensor& k_lut, const at::Tensor& v_lut, at::Tensor& out) {
  check(q, k, v, rows, seq_lens, out, at::kFloat8_e4m3fn);
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&k_lut, &v_lut})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == 256,
                "paged_decode_fp8: k_lut, v_lut must be 256 contiguous float32 values");
  const float* kl = k_lut.data_ptr<float>();
  const float* vl = v_lut.data_ptr<float>();
  decode(q, k, Fp8Rows{static_cast<const uint8_t*>(k.data_ptr()), kl},
         Fp8Rows{static_cast<const uint8_t*>(v.data_ptr()), vl}, rows, seq_lens, scale, out);
}

}  // namespace

TORCH_LIBRARY(baton, m) {
  m.def("paged_decode(Tensor q, Tensor k, Tensor v, Tensor rows, Tensor seq_lens, float scale, "
        "Tensor(a!) out) -> ()");
  m.def("paged_decode_fp8(Tensor q, Tensor k, Tensor v, Tensor rows, Tensor seq_lens, "
        "float scale, Tensor k_lut, Tensor v_lut, Tensor(a!) out) -> ()");
  m.impl("paged_decode", c10::DispatchKey::CPU, &paged_decode);
  m.impl("paged_decode_fp8", c10::DispatchKey::CPU, &paged_decode_fp8);
}
