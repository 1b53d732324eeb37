// Attention of a decode step on the CPU: each row's one query per head attends over the first
// count[b] positions of its cache, as an XLA FFI handler (see native_attention.py).
//
// Why: XLA runs a decode step's attention as two batched products per layer ([G, D] by [D, S], then
// [G, S] by [S, D] for every row and kv head) over every position of the cache blocks the step
// reads, whatever each row's own length, and reads the float32 cache at 7 to 11 GB/s on this
// machine. This kernel reads each row's keys and values once, only up to that row's length, and
// does the softmax in between while the row's scores sit in L1.
//
// Layout (dew's KVCache): q [B, H, G, D] (H kv heads, G query heads per kv head), counts [B] int32,
// then the cache blocks along the positions, keys first: keys[i] [B, H, D, S_i] (transposed, so a
// row's scores are a run of positions per feature), values[i] [B, H, S_i, D]. out [B, H, G, D].
// Positions [0, count[b]) of the blocks taken in order are attended; count is at least 1.

#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "native_threads.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

using dew_native::Helpers;
using dew_native::Job;

#if defined(__AVX512F__)
// e^x for x <= 0 (scores less their maximum): 2^n e^r with r in [-ln 2 / 2, ln 2 / 2] and e^r from Cephes
// expf's polynomial (within 2 ulp of e^x); below -103 it is 0, as float32's e^x is.
inline __m512 Exp(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}
#endif

// e[s] = exp(e[s] - top) for s in [0, n); returns their sum.
float ExpSum(float* e, int64_t n, float top) {
  float total = 0.0f;
  int64_t s = 0;
#if defined(__AVX512F__)
  __m512 sum = _mm512_setzero_ps();
  const __m512 shift = _mm512_set1_ps(top);
  for (; s + 16 <= n; s += 16) {
    const __m512 v = Exp(_mm512_sub_ps(_mm512_loadu_ps(e + s), shift));
    _mm512_storeu_ps(e + s, v);
    sum = _mm512_add_ps(sum, v);
  }
  if (s < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - s)) - 1);
    const __m512 v = Exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, e + s), shift));
    _mm512_mask_storeu_ps(e + s, tail, v);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(tail, v));
    s = n;
  }
  total = _mm512_reduce_add_ps(sum);
#endif
  for (; s < n; ++s) total += e[s] = std::exp(e[s] - top);
  return total;
}

struct Cache {
  std::vector<const float*> keys, values;
  std::vector<int64_t> sizes;
};

// One row b and kv head h: out[g, :] = softmax over positions [0, count) of (q[g] . key) / sqrt(D), times the
// values. scores holds G x count floats.
void Head(const float* q, const Cache& cache, int64_t b, int64_t h, int64_t H, int64_t G, int64_t D, int64_t count,
          float* out, float* scores) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  std::fill(scores, scores + G * count, 0.0f);
  for (int64_t i = 0, start = 0; i < static_cast<int64_t>(cache.sizes.size()) && start < count; ++i) {
    const int64_t S = cache.sizes[i], n = std::min(S, count - start);
    const float* keys = cache.keys[i] + (b * H + h) * D * S;
    for (int64_t d = 0; d < D; ++d) {
      const float* row = keys + d * S;
      for (int64_t g = 0; g < G; ++g) {
        const float qd = q[g * D + d];
        float* score = scores + g * count + start;
        for (int64_t s = 0; s < n; ++s) score[s] += qd * row[s];
      }
    }
    start += S;
  }
  std::vector<float> inverse(G);
  for (int64_t g = 0; g < G; ++g) {
    float* score = scores + g * count;
    float top = -INFINITY;
    for (int64_t s = 0; s < count; ++s) top = std::max(top, score[s] *= scale);
    inverse[g] = 1.0f / ExpSum(score, count, top);
  }
  std::fill(out, out + G * D, 0.0f);
  for (int64_t i = 0, start = 0; i < static_cast<int64_t>(cache.sizes.size()) && start < count; ++i) {
    const int64_t S = cache.sizes[i], n = std::min(S, count - start);
    const float* values = cache.values[i] + (b * H + h) * S * D;
    for (int64_t s = 0; s < n; ++s) {
      const float* row = values + s * D;
      for (int64_t g = 0; g < G; ++g) {
        const float weight = scores[g * count + start + s];
        float* o = out + g * D;
        for (int64_t d = 0; d < D; ++d) o[d] += weight * row[d];
      }
    }
    start += S;
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) out[g * D + d] *= inverse[g];
}

ffi::Error Attention(ffi::AnyBuffer q, ffi::AnyBuffer counts, ffi::RemainingArgs blocks,
                     ffi::Result<ffi::AnyBuffer> out) {
  auto qd = q.dimensions();
  if (q.element_type() != ffi::DataType::F32 || qd.size() != 4 || counts.element_type() != ffi::DataType::S32)
    return ffi::Error::InvalidArgument("dew_decode_attention takes float32 q [B, H, G, D] and int32 counts [B]");
  const int64_t B = qd[0], H = qd[1], G = qd[2], D = qd[3];
  if (static_cast<int64_t>(counts.element_count()) != B || blocks.size() == 0 || blocks.size() % 2)
    return ffi::Error::InvalidArgument("dew_decode_attention: counts [B] and as many value blocks as key blocks");
  Cache cache;
  const size_t n = blocks.size() / 2;
  int64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    auto keys = blocks.get<ffi::AnyBuffer>(i), values = blocks.get<ffi::AnyBuffer>(n + i);
    if (!keys.has_value() || !values.has_value()) return ffi::Error::InvalidArgument("dew_decode_attention: a block");
    auto kd = keys->dimensions(), vd = values->dimensions();
    if (keys->element_type() != ffi::DataType::F32 || values->element_type() != ffi::DataType::F32 ||
        kd.size() != 4 || vd.size() != 4 || kd[0] != B || kd[1] != H || kd[2] != D || vd[0] != B || vd[1] != H ||
        vd[2] != kd[3] || vd[3] != D)
      return ffi::Error::InvalidArgument(
          "dew_decode_attention: float32 key blocks [B, H, D, S] and value blocks [B, H, S, D]");
    cache.keys.push_back(reinterpret_cast<const float*>(keys->untyped_data()));
    cache.values.push_back(reinterpret_cast<const float*>(values->untyped_data()));
    cache.sizes.push_back(kd[3]);
    total += kd[3];
  }
  const auto* qs = reinterpret_cast<const float*>(q.untyped_data());
  const auto* lengths = reinterpret_cast<const int32_t*>(counts.untyped_data());
  auto* os = reinterpret_cast<float*>(out->untyped_data());
  Helpers& helpers = Helpers::Get();
  auto job = std::make_shared<Job>();
  // Parts of a few (row, head) pairs each, claimed in turn, so rows of different lengths spread evenly.
  const int64_t items = B * H;
  const int64_t chunk = std::max<int64_t>(1, items / (4 * helpers.threads()));
  job->parts = (items + chunk - 1) / chunk;
  job->run = [=, &cache](int64_t part) {
    thread_local std::vector<float> scores;
    scores.resize(G * total);
    for (int64_t item = part * chunk; item < std::min(items, (part + 1) * chunk); ++item) {
      const int64_t b = item / H, h = item % H;
      const int64_t count = std::clamp<int64_t>(lengths[b], 1, total);
      Head(qs + item * G * D, cache, b, h, H, G, D, count, os + item * G * D, scores.data());
    }
  };
  helpers.Run(job);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DewDecodeAttention, Attention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>());
