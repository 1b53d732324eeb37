// bfloat16 weight products for few rows on the CPU: y [M, N] float32 = x [M, K] bfloat16 times a
// bfloat16 weight, as an XLA FFI handler (see native_product.py; native.py builds and registers it).
//
// Why: XLA's CPU dot reads bfloat16 weights at about 15 GB/s when a decode step has a handful of
// rows (and converts every weight to float32 for a single row), while such a product is a stream
// over the weights: each weight is read once, widened to float32 (a 16-bit shift) and multiplied
// into every row. The products of two bfloat16 values are exact in float32, so the result is the
// bfloat16-operand, float32-accumulation product XLA computes, up to the order of the sums.
//
// Two layouts: "in_out" weights are [K, N] (a Dense kernel), "out_in" weights are [N, K] (a tied
// embedding read as the output layer). The work is split among the caller and helper threads (one
// per CPU the process may run on, less the caller; DEW_NATIVE_THREADS overrides): in_out by weight
// rows, out_in by output rows, so each thread reads one contiguous stretch of the weight.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "native_threads.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

using dew_native::Helpers;
using dew_native::Job;

inline float widen(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// The float32 vectors the widening kernels (InOut, OutIn) compute in: 16 lanes with AVX-512, 8 with AVX2 and FMA.
// Without AVX-512 the scalar loops alone took 7 times XLA's time on a 2-core AMD EPYC (four of SmolLM2's layer
// products and its tied output layer at 2 rows: 27 ms against 4; in AVX2 vectors 2.7 to 3.3 ms). Where neither
// is there, DEW_WIDENING_VECTORS is undefined and the scalar loops do all the work.
#if defined(__AVX512F__)
#define DEW_WIDENING_VECTORS 1
struct Vec {
  using T = __m512;
  static constexpr int64_t kLanes = 16;
  static T Widen(const uint16_t* w) {  // kLanes bfloat16 weights as float32 (a 16-bit shift)
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
  }
  static T Load(const float* p) { return _mm512_loadu_ps(p); }
  static void Store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static T Set1(float v) { return _mm512_set1_ps(v); }
  static T Zero() { return _mm512_setzero_ps(); }
  static T Fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static float Sum(T v) { return _mm512_reduce_add_ps(v); }
};
#elif defined(__AVX2__) && defined(__FMA__)
#define DEW_WIDENING_VECTORS 1
struct Vec {
  using T = __m256;
  static constexpr int64_t kLanes = 8;
  static T Widen(const uint16_t* w) {
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
  }
  static T Load(const float* p) { return _mm256_loadu_ps(p); }
  static void Store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static T Set1(float v) { return _mm256_set1_ps(v); }
  static T Zero() { return _mm256_setzero_ps(); }
  static T Fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static float Sum(T v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
};
#endif

// y[m, n] = sum over k in [k0, k1) of x[m, k] w[k, n] for the columns [n0, n1), one by one (the columns
// past the vector kernels' last whole step).
void InOutColumns(const uint16_t* x, const uint16_t* w, float* y, int64_t rows, int64_t K, int64_t N, int64_t k0,
                  int64_t k1, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < rows; ++m) {
      float acc = 0.0f;
      for (int64_t k = k0; k < k1; ++k) acc += widen(x[m * K + k]) * widen(w[k * N + n]);
      y[m * N + n] = acc;
    }
}

constexpr int64_t kRowsPerPass = 8;  // rows of x multiplied into each weight read (registers)
constexpr int64_t kDepth = 4;        // weight rows (in_out) summed before an accumulator is stored

// in_out: y[m, :] = sum over k in [k0, k1) of x[m, k] w[k, :], for m in [0, rows). The weight rows
// [k0, k1) are one contiguous stretch of memory, read front to back.
void InOut(const float* x, const uint16_t* w, float* y, int64_t rows, int64_t K, int64_t N, int64_t k0,
           int64_t k1) {
  for (int64_t m = 0; m < rows; ++m) std::fill(y + m * N, y + m * N + N, 0.0f);
  for (int64_t k = k0; k < k1; k += kDepth) {
    const int64_t depth = std::min(kDepth, k1 - k);
    int64_t n = 0;
#if defined(DEW_WIDENING_VECTORS)
    for (; n + Vec::kLanes <= N; n += Vec::kLanes) {
      Vec::T wk[kDepth];
      for (int64_t d = 0; d < depth; ++d) wk[d] = Vec::Widen(w + (k + d) * N + n);
      for (int64_t m = 0; m < rows; ++m) {
        Vec::T acc = Vec::Load(y + m * N + n);
        const float* xm = x + m * K + k;
        for (int64_t d = 0; d < depth; ++d) acc = Vec::Fma(Vec::Set1(xm[d]), wk[d], acc);
        Vec::Store(y + m * N + n, acc);
      }
    }
#endif
    for (; n < N; ++n) {
      for (int64_t m = 0; m < rows; ++m) {
        float acc = y[m * N + n];
        for (int64_t d = 0; d < depth; ++d) acc += x[m * K + k + d] * widen(w[(k + d) * N + n]);
        y[m * N + n] = acc;
      }
    }
  }
}

#if defined(__AVX512BF16__)
// With AVX512-BF16, vdpbf16ps multiplies 32 bfloat16 pairs into 16 float32 sums without widening:
// twice the products per instruction of a float32 FMA. The in_out weights ([K, N]) pair along K, so
// each 16 columns of two weight rows are interleaved into (w[k, n], w[k + 1, n]) couples first.
//
// Two in_out kernels, because this machine's memory reads weight rows front to back at twice the rate
// of short stretches of many rows: up to kStreamRows rows, InOutStream reads whole weight rows and keeps
// the rows' sums in y (in cache while the rows are few); above, InOutPanel packs 128-column blocks into
// an interleaved panel and multiplies 6 rows at a time into sums held in registers, reading the weights
// once for all the rows. Measured on one core at 1024 x 6144 (0.6B's gate and up projections): Stream
// 22.6 GB/s at 1 row, 10 GB/s at 8; Panel 4.1 GB/s at 32 rows against Stream's 1.9.
constexpr int64_t kStreamRows = 8;
constexpr int kPairs = 4;           // Stream: pairs of weight rows read side by side
constexpr int kWide = 4;            // Stream: 16-column vectors per step
constexpr int64_t kTile = 64;       // Panel: columns per tile, 4 vectors of 16 sums
constexpr int64_t kBlock = 128;     // Panel: columns packed per pass
constexpr int64_t kRun = 128;       // Panel: weight-row pairs packed per pass (128 x 128 x 4 bytes: 64 KB)
constexpr int kGroup = 6;           // Panel: rows per tile pass (6 x 4 sums, 4 weight vectors: 28 registers)

// The 16 columns at low (weight row k) and low + N (row k + 1) as 16 (w[k, n], w[k + 1, n]) pairs.
inline __m512bh PairUp(const uint16_t* low, int64_t N) {
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i both =
      _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(low))),
                         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(low + N)), 1);
  return (__m512bh)_mm512_permutexvar_epi16(interleave, both);
}

inline __m512bh Pair(const uint32_t* xpairs, int64_t p) {
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(xpairs[p]));
}

// y[m, c..c + 16 * V) = (first ? 0 : y) + sum over pairs [p0, p0 + depth) of x pair . weight pair.
template <int V>
inline void StreamStep(const uint32_t* xpairs, const uint16_t* w, float* y, int64_t rows, int64_t K, int64_t N,
                       int64_t p0, int depth, bool first, int64_t c) {
  __m512bh wv[V][kPairs];
  for (int v = 0; v < V; ++v)
    for (int d = 0; d < depth; ++d) wv[v][d] = PairUp(w + 2 * (p0 + d) * N + c + 16 * v, N);
  for (int64_t m = 0; m < rows; ++m) {
    const uint32_t* xm = xpairs + m * (K / 2);
    __m512 acc[V];
    for (int v = 0; v < V; ++v) acc[v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + m * N + c + 16 * v);
    if (depth == kPairs) {
      for (int d = 0; d < kPairs; ++d) {
        const __m512bh b = Pair(xm, p0 + d);
        for (int v = 0; v < V; ++v) acc[v] = _mm512_dpbf16_ps(acc[v], b, wv[v][d]);
      }
    } else {
      for (int d = 0; d < depth; ++d)
        for (int v = 0; v < V; ++v) acc[v] = _mm512_dpbf16_ps(acc[v], Pair(xm, p0 + d), wv[v][d]);
    }
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(y + m * N + c + 16 * v, acc[v]);
  }
}

// in_out over the weight-row pairs [q0, q1) into y (every column; K even).
void InOutStream(const uint16_t* x, const uint16_t* w, float* y, int64_t rows, int64_t K, int64_t N, int64_t q0,
                 int64_t q1) {
  const auto* xpairs = reinterpret_cast<const uint32_t*>(x);
  const int64_t width = N / 16 * 16, wide = N / (16 * kWide) * (16 * kWide);
  for (int64_t p0 = q0; p0 < q1; p0 += kPairs) {
    const int depth = static_cast<int>(std::min<int64_t>(kPairs, q1 - p0));
    int64_t c = 0;
    for (; c < wide; c += 16 * kWide) StreamStep<kWide>(xpairs, w, y, rows, K, N, p0, depth, p0 == q0, c);
    for (; c < width; c += 16) StreamStep<1>(xpairs, w, y, rows, K, N, p0, depth, p0 == q0, c);
  }
  InOutColumns(x, w, y, rows, K, N, 2 * q0, 2 * q1, width, N);
}

// Panel: y[m, tile] (+)= sum over pairs p of x[m, 2p..2p+1] . panel[p] for MB rows of one 64-column tile.
template <int MB>
inline void TileRows(const uint32_t* xpairs, int64_t xstride, const __m512bh* panel, int64_t pairs, float* y,
                     int64_t N, bool first) {
  __m512 acc[MB][4];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + m * N + 16 * j);
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = panel[4 * p + j];
    for (int m = 0; m < MB; ++m) {
      const __m512bh b = Pair(xpairs + m * xstride, p);
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], b, wv[j]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(y + m * N + 16 * j, acc[m][j]);
}

using TileFn = void (*)(const uint32_t*, int64_t, const __m512bh*, int64_t, float*, int64_t, bool);
constexpr TileFn kTileRows[kGroup + 1] = {nullptr, TileRows<1>, TileRows<2>, TileRows<3>,
                                          TileRows<4>, TileRows<5>, TileRows<6>};

// in_out for the columns [n0, n1) (n0 a multiple of 64; K even). Columns past the last whole tile are
// summed one by one.
void InOutPanel(const uint16_t* x, const uint16_t* w, float* y, int64_t rows, int64_t K, int64_t N, int64_t n0,
                int64_t n1) {
  const int64_t width = (n1 - n0) / kTile * kTile;
  thread_local std::vector<__m512bh> panel;
  panel.resize(kBlock / 16 * kRun);
  const auto* xpairs = reinterpret_cast<const uint32_t*>(x);
  for (int64_t block = n0; block < n0 + width; block += kBlock) {
    const int64_t tiles = std::min(kBlock, n0 + width - block) / kTile;
    for (int64_t p0 = 0; p0 < K / 2; p0 += kRun) {
      const int64_t pairs = std::min(kRun, K / 2 - p0);
      for (int64_t p = 0; p < pairs; ++p)
        for (int64_t c = 0; c < tiles * kTile; c += 16)
          panel[((c / kTile) * pairs + p) * 4 + (c % kTile) / 16] = PairUp(w + 2 * (p0 + p) * N + block + c, N);
      for (int64_t t = 0; t < tiles; ++t)
        for (int64_t m = 0; m < rows; m += kGroup) {
          const int group = static_cast<int>(std::min<int64_t>(kGroup, rows - m));
          kTileRows[group](xpairs + m * (K / 2) + p0, K / 2, panel.data() + t * pairs * 4, pairs,
                           y + m * N + block + t * kTile, N, p0 == 0);
        }
    }
  }
  InOutColumns(x, w, y, rows, K, N, 0, K, n0 + width, n1);
}

// out_in for the output rows [n0, n1) (K a multiple of 32): y[m, n] = dot(x[m, :], w[n, :]), R weight rows at a
// time (in L1 after the first group of rows reads them), four rows of x per pass.
void OutInPairs(const uint16_t* x, const uint16_t* w, float* y, int64_t rows, int64_t K, int64_t N, int64_t n0,
                int64_t n1) {
  constexpr int R = 4, G = 4;
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    for (int64_t m0 = 0; m0 < rows; m0 += G) {
      const int64_t group = std::min<int64_t>(G, rows - m0);
      __m512 acc[G][R];
      for (int64_t m = 0; m < group; ++m)
        for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 32) {
        __m512bh wr[R];
        for (int r = 0; r < R; ++r) wr[r] = (__m512bh)_mm512_loadu_si512(w + (n + r) * K + k);
        for (int64_t m = 0; m < group; ++m) {
          __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (m0 + m) * K + k);
          for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wr[r]);
        }
      }
      for (int64_t m = 0; m < group; ++m)
        for (int r = 0; r < R; ++r) y[(m0 + m) * N + n + r] = _mm512_reduce_add_ps(acc[m][r]);
    }
  }
  for (; n < n1; ++n)
    for (int64_t m = 0; m < rows; ++m) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) acc += widen(x[m * K + k]) * widen(w[n * K + k]);
      y[m * N + n] = acc;
    }
}
#endif

// out_in: y[m, n] = dot(x[m, :], w[n, :]) for n in [n0, n1), m in [0, rows) (rows <= kRowsPerPass),
// R weight rows at a time.
template <int R>
void OutIn(const float* x, const uint16_t* w, float* y, int64_t rows, int64_t K, int64_t N, int64_t n0,
           int64_t n1) {
  int64_t n = n0;
#if defined(DEW_WIDENING_VECTORS)
  if (K % Vec::kLanes == 0) {
    for (; n + R <= n1; n += R) {
      Vec::T acc[kRowsPerPass][R];
      for (int64_t m = 0; m < rows; ++m)
        for (int r = 0; r < R; ++r) acc[m][r] = Vec::Zero();
      for (int64_t k = 0; k < K; k += Vec::kLanes) {
        Vec::T wr[R];
        for (int r = 0; r < R; ++r) {
          _mm_prefetch(reinterpret_cast<const char*>(w + (n + R + r) * K + k), _MM_HINT_T0);
          wr[r] = Vec::Widen(w + (n + r) * K + k);
        }
        for (int64_t m = 0; m < rows; ++m) {
          const Vec::T xv = Vec::Load(x + m * K + k);
          for (int r = 0; r < R; ++r) acc[m][r] = Vec::Fma(xv, wr[r], acc[m][r]);
        }
      }
      for (int64_t m = 0; m < rows; ++m)
        for (int r = 0; r < R; ++r) y[m * N + n + r] = Vec::Sum(acc[m][r]);
    }
  }
#endif
  for (; n < n1; ++n) {
    for (int64_t m = 0; m < rows; ++m) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) acc += x[m * K + k] * widen(w[n * K + k]);
      y[m * N + n] = acc;
    }
  }
}

// Runs run(begin, end, out) on the caller and the helpers over spans of [0, split), each a multiple of 64. With
// partial, the spans are weight rows: every thread but the caller sums into an M x N buffer of its own, added into
// y at the end, so each reads one contiguous stretch of the weight; without, the spans are columns of y.
void Split(int64_t split, bool partial, int64_t M, int64_t N, float* y,
           const std::function<void(int64_t, int64_t, float*)>& run) {
  Helpers& helpers = Helpers::Get();
  auto job = std::make_shared<Job>();
  job->parts = std::max<int64_t>(1, std::min<int64_t>(helpers.threads(), split / 64));
  const int64_t span = ((split + job->parts - 1) / job->parts + 63) / 64 * 64;
  std::vector<float> sums(partial ? (job->parts - 1) * M * N : 0);
  job->run = [&, scratch = sums.data()](int64_t part) {
    const int64_t begin = std::min(split, part * span), end = std::min(split, begin + span);
    run(begin, end, partial && part ? scratch + (part - 1) * M * N : y);
  };
  helpers.Run(job);
  for (int64_t i = 0; i < static_cast<int64_t>(sums.size()); ++i) y[i % (M * N)] += sums[i];
}

ffi::Error Product(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y, bool out_in) {
  if (x.element_type() != ffi::DataType::BF16 || w.element_type() != ffi::DataType::BF16 ||
      y->element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("dew_bf16_product takes bfloat16 operands and returns float32");
  auto wd = w.dimensions();
  auto xd = x.dimensions();
  if (wd.size() != 2 || xd.size() < 1) return ffi::Error::InvalidArgument("dew_bf16_product: a 2-D weight");
  const int64_t K = xd.back();
  const int64_t N = out_in ? wd[0] : wd[1];
  if ((out_in ? wd[1] : wd[0]) != K) return ffi::Error::InvalidArgument("dew_bf16_product: contraction sizes differ");
  const int64_t M = static_cast<int64_t>(x.element_count()) / std::max<int64_t>(K, 1);
  const auto* xs = reinterpret_cast<const uint16_t*>(x.untyped_data());
  const auto* ws = reinterpret_cast<const uint16_t*>(w.untyped_data());
  auto* ys = reinterpret_cast<float*>(y->untyped_data());
#if defined(__AVX512BF16__)
  // Paired products: the stream kernel splits the weight-row pairs, the panel and out_in kernels the output
  // columns (out_in: output rows).
  if (K > 0 && (out_in ? K % 32 == 0 : K % 2 == 0)) {
    const bool stream = !out_in && M <= kStreamRows;
    Split(stream ? K / 2 : N, stream, M, N, ys, [&](int64_t begin, int64_t end, float* out) {
      if (out_in)
        OutInPairs(xs, ws, out, M, K, N, begin, end);
      else if (stream)
        InOutStream(xs, ws, out, M, K, N, begin, end);
      else
        InOutPanel(xs, ws, out, M, K, N, begin, end);
    });
    return ffi::Error::Success();
  }
#endif
  std::vector<float> xf(M * K);  // x widened once
  for (int64_t i = 0; i < M * K; ++i) xf[i] = widen(xs[i]);
  Split(out_in ? N : K, !out_in, M, N, ys, [&](int64_t begin, int64_t end, float* out) {
    for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass) {
      const int64_t rows = std::min(kRowsPerPass, M - m0);
      if (out_in && rows <= 2)
        OutIn<8>(xf.data() + m0 * K, ws, out + m0 * N, rows, K, N, begin, end);
      else if (out_in)
        OutIn<4>(xf.data() + m0 * K, ws, out + m0 * N, rows, K, N, begin, end);
      else
        InOut(xf.data() + m0 * K, ws, out + m0 * N, rows, K, N, begin, end);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

// Whether this build multiplies bfloat16 pairs (AVX512-BF16): then the kernel reads the weights once for any
// number of rows, else once per 8 rows, widening them to float32 (native_product.py sets its rows from this).
extern "C" int DewPairedProducts() {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(DewBf16Product, Product,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("out_in"));
