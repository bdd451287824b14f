// Decode attention read in place from the paged KV pool (CPU, fp32).
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
//                                a page's rows contiguous, pages `stride(0)` floats apart
//   rows     [B, >= max(lens)]   int64, contiguous rows: each position's row offset in floats
//                                (KVPool.row_offsets of the req_to_token rows: one table per
//                                step for every layer, so no division per row here)
//   seq_lens [B]                 int64
//   out      [B, H, D]           float32, contiguous, written
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
template <int C>
void attend(const float* q, const float* k, const float* v, const int64_t* row, int64_t L,
            int64_t G, int64_t max_row, float scale, float* score, float* out) {
  float max_score[kMaxGroup];
  std::fill(max_score, max_score + G, -INFINITY);
  for (int64_t j = 0; j < L; ++j) {  // scores: q . k_j for every head of the group
    TORCH_CHECK(row[j] >= 0 && row[j] <= max_row, "paged_decode: row out of range");
    const float* kj = k + row[j];
    Vec kr[C];
    for (int c = 0; c < C; ++c) kr[c] = load(kj + c * kLanes);
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
    const float* vj = v + row[j];
    Vec vr[C];
    for (int c = 0; c < C; ++c) vr[c] = load(vj + c * kLanes);
    for (int64_t h = 0; h < G; ++h) {
      const float p = score[h * L + j];
      for (int c = 0; c < C; ++c) acc[h][c] += p * vr[c];
    }
  }
  for (int64_t h = 0; h < G; ++h)
    for (int c = 0; c < C; ++c) store(out + h * C * kLanes + c * kLanes, acc[h][c] / denom[h]);
}

using AttendFn = decltype(&attend<1>);

AttendFn pick(int64_t head_dim) {
  switch (head_dim) {
    case 32: return &attend<2>;
    case 64: return &attend<4>;
    case 96: return &attend<6>;
    case 128: return &attend<8>;
    case 256: return &attend<16>;
    default: return nullptr;
  }
}

void paged_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& rows, const at::Tensor& seq_lens, double scale,
                  at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.dim() == 4 && out.sizes() == q.sizes(),
              "paged_decode: q/out [B, H, D], k/v [P, PS, KVH, D]");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &k, &v, &out})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu(),
                "paged_decode: q, k, v, out must be float32 CPU tensors");
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
  const AttendFn fn = pick(D);
  TORCH_CHECK(fn != nullptr, "paged_decode: head_dim ", D, " not compiled (32/64/96/128/256)");

  const int64_t G = H / KVH, table_stride = rows.stride(0);
  const int64_t max_row = (k.size(0) - 1) * k.stride(0) + (k.size(1) - 1) * k.stride(1);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= rows.size(1), "paged_decode: bad seq_len ", lens[b]);
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  float* op = out.mutable_data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> score;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / KVH, g = item % KVH, L = lens[b];
      score.resize(G * L);
      const int64_t head0 = b * H + g * G;
      fn(qp + head0 * D, kp + g * D, vp + g * D, rp + b * table_stride, L, G, max_row, sc,
         score.data(), op + head0 * D);
    }
  });
}

}  // namespace

TORCH_LIBRARY(baton, m) {
  m.def("paged_decode(Tensor q, Tensor k, Tensor v, Tensor rows, Tensor seq_lens, float scale, "
        "Tensor(a!) out) -> ()");
  m.impl("paged_decode", c10::DispatchKey::CPU, &paged_decode);
}
