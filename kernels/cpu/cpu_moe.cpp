// The kittens MoE layer on the CPU: expert rows and the fixed-order top-k combine.
//
// Computes the function documented in reference.py. What makes it batch invariant: every output
// element of a GEMM is summed over k in one fixed order on every code path, whatever the number of
// rows of its expert, its row block, its column tile and the thread that runs it. No BLAS library
// picks a kernel by row count, so a row's result never depends on how many rows share its expert
// or the call.
//
// The order: every term is one fused multiply-add (acc = round(acc + a[k] * w[k])), acc from 0, and
// - bf16 activations, PAIR ORDER: k in pairs (0, 1), (2, 3), ..., in each pair the odd term first:
//     for p: acc = fma(a[2p+1], w[2p+1], acc); acc = fma(a[2p], w[2p], acc)
//   (an odd K ends with the lone last term). It is the order of the AVX-512 BF16 dot-product
//   instruction: vdpbf16ps computes per lane acc + odd product, rounded, then + even product,
//   rounded, the two products exact (measured on 3.2 million random lanes of an AMD EPYC with
//   AVX-512 BF16, all equal to that; the order of Intel's SDM pseudocode).
//   tests/kernels/test_cpu_moe_isa.py checks the two ISAs' agreement on each CPU it runs on;
// - fp16 and fp32 activations, K ORDER: k = 0, 1, 2, ... (these run on the generic path only).
// So the two ISAs below give the same bits for bf16 on normal numbers:
//
// - `generic` (every CPU): GCC vector extensions, eight floats (an AVX2 register), weights
//   widened to fp32, FMAs by contraction (`gemm_tile` is compiled with fp-contract=fast, the rest of
//   the file with -ffp-contract=off, so the compiler cannot fuse a multiply and an add in one path
//   and not another). Runs every dtype.
// - `avx512_bf16` (CPUs with AVX-512 F/BW/VL/BF16, chosen at load time by CPUID; bf16 activations):
//   vdpbf16ps on 16 columns x 1 k-pair at a time; bf16 products are exact in fp32, so each of its two
//   steps is the generic path's FMA. Differences: vdpbf16ps treats subnormal inputs as zero and
//   flushes subnormal results, the FMA does not (bits can differ only where a subnormal occurs).
//   fp16 and fp32 activations take the generic path on every CPU.
//
// The ISA is process-wide, set once at load (`set_isa`, from cpu/moe.py's MOK_SERVE_CPU_ISA) and
// never chosen by row count or thread count.
//
// Around the GEMMs: rows sorted by expert (stable counting sort), cut into blocks of up to 8
// (avx512_bf16) or 4 (generic) rows of one expert; torch's intra-op threads take blocks one at a time
// (the extension is built with OpenMP; without it at::parallel_for runs serially). Per block: GEMM1,
// SiLU(gate) * up (bf16: `exp8`, IEEE operations shared by both ISAs; fp16/fp32: libm's expf), GEMM2,
// the expert output rounded to the activation dtype. Then the top-k combine in fp32, k in order.
// Scratch buffers are per thread and kept, so a warm call allocates only its output.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define MOK_X86_64 1
#endif

namespace {

// ---------------------------------------------------------------------------------------------
// ISA selection

enum class Isa : int { GENERIC = 0, AVX512_BF16 = 1 };

constexpr std::array<std::string_view, 2> ISA_NAMES = {"generic", "avx512_bf16"};

bool cpu_supports(Isa isa) {
  if (isa == Isa::GENERIC) return true;
#ifdef MOK_X86_64
  __builtin_cpu_init();  // CPUID, and XGETBV for the OS's support of the 512-bit state
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

Isa best_isa() { return cpu_supports(Isa::AVX512_BF16) ? Isa::AVX512_BF16 : Isa::GENERIC; }

std::atomic<int>& isa_slot() {
  static std::atomic<int> isa{static_cast<int>(best_isa())};
  return isa;
}

Isa active_isa() { return static_cast<Isa>(isa_slot().load(std::memory_order_relaxed)); }

// ---------------------------------------------------------------------------------------------
// Shared by both ISAs

// Rounds through the activation dtype, as a GEMM in that dtype returns its result.
template <typename T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// Per-thread scratch, grown on demand and kept: no allocation per call once warm.
template <typename V>
V* scratch(std::vector<V>& buf, size_t n) {
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

// ---------------------------------------------------------------------------------------------
// Generic path

// Eight floats, one AVX register; GCC/Clang vector extensions keep this portable.
typedef float vec8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
constexpr int GENERIC_ROW_BLOCK = 4;  // rows of one expert computed together, sharing weight loads

inline vec8 bits_to_float(u32x8 bits) {
  vec8 v;
  __builtin_memcpy(&v, &bits, sizeof(v));
  return v;
}

typedef int32_t i32x8 __attribute__((vector_size(32)));

// exp(x) on 8 floats: Cephes' expf (n = round(x / ln 2), x - n ln 2 in two parts, a degree-5
// polynomial, times 2^n), in IEEE operations only, without contraction: every lane gives the same
// bits on every ISA and vector width. Relative error about 1e-7; x is clamped to [-87.3, 88] (2^n
// stays a normal number); NaN stays NaN.
inline vec8 exp8(vec8 x) {
  const vec8 hi = vec8{} + 88.0f, lo = vec8{} - 87.33654475f;
  x = x > hi ? hi : x;  // a NaN lane compares false and is kept
  x = x < lo ? lo : x;
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const vec8 t = x * 1.44269504088896341f + magic;
  const vec8 n = t - magic;
  vec8 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  const vec8 z = r * r;
  vec8 y = r * 1.9875691500e-4f + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * z + r + 1.0f;
  // t's bits are those of 1.5 * 2^23 plus n: n + 127 is 2^n's exponent field.
  const i32x8 e = ((i32x8)t - 0x4B400000 + 127) << 23;
  return y * (vec8)e;
}

// v rounded through T (c10's conversions: to nearest even, NaN to a quiet NaN), as floats.
template <typename T>
inline vec8 round8(vec8 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const i32x8 u = (i32x8)v;
    const i32x8 r = (u + 0x7FFF + ((u >> 16) & 1)) & static_cast<int32_t>(0xFFFF0000u);
    return (vec8)(v != v ? 0x7FC00000 : r);
  } else {
    for (int j = 0; j < 8; ++j) v[j] = round_to<T>(v[j]);
    return v;
  }
}

// act[i] = T(SiLU(T(gate[i])) * T(up[i])) for i < n, as floats: the GEMM1 outputs rounded to T,
// SiLU(g) = g / (1 + exp(-g)), the product rounded to T. bf16 (both ISAs): eight at a time with
// exp8 (the last group padded with zeros). fp16 and fp32: one at a time with libm's expf, as before
// (the reference's torch SiLU gives the same bits on fp32 tests that compare the two exactly).
template <typename T>
inline vec8 silu_mul8(vec8 g, vec8 u) {
  g = round8<T>(g);
  u = round8<T>(u);
  return round8<T>(g / (1.0f + exp8(-g)) * u);
}

template <typename T>
void silu_mul(const float* gate, const float* up, int64_t n, float* act) {
  if constexpr (!std::is_same_v<T, c10::BFloat16>) {
    for (int64_t i = 0; i < n; ++i) {
      const float g = round_to<T>(gate[i]), u = round_to<T>(up[i]);
      act[i] = round_to<T>(g / (1.0f + std::exp(-g)) * u);
    }
    return;
  }
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    vec8 g, u;
    __builtin_memcpy(&g, gate + i, sizeof(g));
    __builtin_memcpy(&u, up + i, sizeof(u));
    const vec8 a = silu_mul8<T>(g, u);
    __builtin_memcpy(act + i, &a, sizeof(a));
  }
  if (i < n) {
    vec8 g = {}, u = {};
    for (int64_t j = i; j < n; ++j) {
      g[j - i] = gate[j];
      u[j - i] = up[j];
    }
    const vec8 a = silu_mul8<T>(g, u);
    for (int64_t j = i; j < n; ++j) act[j] = a[j - i];
  }
}

// Sixteen consecutive weights as two vec8. For float and half: columns 0-7 and 8-15. For
// bfloat16, the top half of a float32: one 32-byte load holds 16 values in pairs, and a shift
// and a mask give the even columns and the odd columns, exactly (`INTERLEAVED` says so).
template <typename W>
struct Load16 {
  static constexpr bool INTERLEAVED = false;
  static void load(const W* p, vec8& lo, vec8& hi) {
    for (int j = 0; j < 8; ++j) {
      lo[j] = static_cast<float>(p[j]);
      hi[j] = static_cast<float>(p[8 + j]);
    }
  }
};

template <>
struct Load16<float> {
  static constexpr bool INTERLEAVED = false;
  static void load(const float* p, vec8& lo, vec8& hi) {
    __builtin_memcpy(&lo, p, sizeof(lo));
    __builtin_memcpy(&hi, p + 8, sizeof(hi));
  }
};

template <>
struct Load16<c10::BFloat16> {
  static constexpr bool INTERLEAVED = true;
  static void load(const c10::BFloat16* p, vec8& even, vec8& odd) {
    u32x8 pairs;
    __builtin_memcpy(&pairs, p, sizeof(pairs));
    even = bits_to_float(pairs << 16);
    odd = bits_to_float(pairs & 0xFFFF0000u);
  }
};

#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
// out[r][n] = sum over k of a[r][k] * wt[k][n] in PAIR ORDER (Pairs) or K ORDER, for the R rows and
// the 16 * P columns from n0; wt is the weight transposed, [K, N]. Every term is one fused multiply-add (this
// block is compiled with contraction on; the scalar tail of gemm_rows too), on every code path.
// 2 * P vec8 accumulators per row: enough independent additions in flight to hide their latency,
// few enough to stay in registers.
template <bool Pairs, int R, int P, typename W>
inline void gemm_tile(const float* const* a, const W* wt, int64_t K, int64_t N, int64_t n0, float* const* out) {
  vec8 acc[R][2 * P] = {};
  auto term = [&](int64_t k) {
    vec8 w[2 * P];
    for (int p = 0; p < P; ++p) Load16<W>::load(wt + k * N + n0 + 16 * p, w[2 * p], w[2 * p + 1]);
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 2 * P; ++v) acc[r][v] += w[v] * a[r][k];
  };
  int64_t k = 0;
  if (Pairs)
    for (; k + 1 < K; k += 2) {
      term(k + 1);
      term(k);
    }
  for (; k < K; ++k) term(k);
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p)
      for (int j = 0; j < 8; ++j) {
        const int64_t n = n0 + 16 * p;
        if (Load16<W>::INTERLEAVED) {
          out[r][n + 2 * j] = acc[r][2 * p][j];
          out[r][n + 2 * j + 1] = acc[r][2 * p + 1][j];
        } else {
          out[r][n + j] = acc[r][2 * p][j];
          out[r][n + 8 + j] = acc[r][2 * p + 1][j];
        }
      }
}

// out[r] = a[r] @ wt for R rows. Every element is summed in the same order on every code path (wide
// tiles, narrow tiles, the scalar tail), so it does not depend on R, on the other rows or on its tile.
template <bool Pairs, int R, typename W>
void gemm_rows(const float* const* a, const W* wt, int64_t K, int64_t N, float* const* out) {
  constexpr int P = R == 1 ? 4 : R == 2 ? 2 : 1;
  int64_t n = 0;
  for (; n + 16 * P <= N; n += 16 * P) gemm_tile<Pairs, R, P>(a, wt, K, N, n, out);
  for (; n + 16 <= N; n += 16) gemm_tile<Pairs, R, 1>(a, wt, K, N, n, out);
  for (; n < N; ++n)
    for (int r = 0; r < R; ++r) {
      float acc = 0.0f;
      int64_t k = 0;
      if (Pairs)
        for (; k + 1 < K; k += 2) {
          acc += static_cast<float>(wt[(k + 1) * N + n]) * a[r][k + 1];
          acc += static_cast<float>(wt[k * N + n]) * a[r][k];
        }
      for (; k < K; ++k) acc += static_cast<float>(wt[k * N + n]) * a[r][k];
      out[r][n] = acc;
    }
}

#pragma GCC pop_options

// One block of R rows of one expert: GEMM1, SiLU(gate) * up, GEMM2, into out_rows[rows[r]]. w13t
// is that expert's [H, 2I], w2t its [I, H].
template <typename T, typename W, int R>
void generic_block(const T* x, int64_t hidden, int64_t inter, const W* w13t, const W* w2t, const int64_t* tokens,
                   const int64_t* rows, T* out_rows) {
  thread_local std::vector<float> buf;
  float* xs = scratch(buf, R * (2 * hidden + 3 * inter));
  float *gate_up = xs + R * hidden, *act = gate_up + R * 2 * inter, *y = act + R * inter;
  const float *xr[R], *ar[R];
  float *gr[R], *yr[R];
  for (int r = 0; r < R; ++r) {
    for (int64_t h = 0; h < hidden; ++h) xs[r * hidden + h] = static_cast<float>(x[tokens[r] * hidden + h]);
    xr[r] = xs + r * hidden;
    gr[r] = gate_up + r * 2 * inter;
    ar[r] = act + r * inter;
    yr[r] = y + r * hidden;
  }
  constexpr bool Pairs = std::is_same_v<T, c10::BFloat16>;  // the order vdpbf16ps has, for bf16
  gemm_rows<Pairs, R>(xr, w13t, hidden, 2 * inter, gr);
  for (int r = 0; r < R; ++r)
    silu_mul<T>(gr[r], gr[r] + inter, inter, act + r * inter);
  gemm_rows<Pairs, R>(ar, w2t, inter, hidden, yr);
  for (int r = 0; r < R; ++r)
    for (int64_t h = 0; h < hidden; ++h) out_rows[rows[r] * hidden + h] = static_cast<T>(yr[r][h]);
}

// ---------------------------------------------------------------------------------------------
// AVX-512 BF16 path (compiled for those extensions whatever -march says; run only where CPUID
// has them)

#ifdef MOK_X86_64
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")

constexpr int AVX512_ROW_BLOCK = 8;

inline uint32_t load_u32(const uint16_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// The B operand of vdpbf16ps for 32 columns from n of weight rows k and k + 1: dword j holds the
// pair (w[k][n'], w[k+1][n']) of one column n' (row k in the low half: the even term). `Tail`:
// K is odd and this is row K - 1 alone (zeros for row K). `Masked`: only the columns of `m`.
//
// bf16 weights: two 64-byte loads and one unpack per vector, which leaves the columns in the lane
// order of vpunpck{l,h}wd (v0: columns 0-3, 8-11, 16-19, 24-27; v1: the others); the tile puts
// them back in order when it stores (`PERMUTED`).
struct PairsBF16 {
  static constexpr bool PERMUTED = true;
  template <bool Tail, bool Masked>
  static inline void load(const c10::BFloat16* k0, int64_t N, __mmask32 m, __m512i& v0, __m512i& v1) {
    const __m512i a = Masked ? _mm512_maskz_loadu_epi16(m, k0) : _mm512_loadu_si512(k0);
    const __m512i b =
        Tail ? _mm512_setzero_si512() : Masked ? _mm512_maskz_loadu_epi16(m, k0 + N) : _mm512_loadu_si512(k0 + N);
    v0 = _mm512_unpacklo_epi16(a, b);
    v1 = _mm512_unpackhi_epi16(a, b);
  }
};

// float32 weights, an exact upcast of bf16 (reference.py's contract): the bf16 of a float is its
// top half, so a shift and a mask make the pairs, in column order.
struct PairsF32 {
  static constexpr bool PERMUTED = false;
  template <bool Tail, bool Masked>
  static inline void load(const float* k0, int64_t N, __mmask32 m, __m512i& v0, __m512i& v1) {
    const __mmask16 m0 = static_cast<__mmask16>(m), m1 = static_cast<__mmask16>(m >> 16);
    const __m512i top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    const __m512i a0 = Masked ? _mm512_maskz_loadu_epi32(m0, k0) : _mm512_loadu_si512(k0);
    const __m512i a1 = Masked ? _mm512_maskz_loadu_epi32(m1, k0 + 16) : _mm512_loadu_si512(k0 + 16);
    __m512i b0 = _mm512_setzero_si512(), b1 = _mm512_setzero_si512();
    if (!Tail) {
      b0 = Masked ? _mm512_maskz_loadu_epi32(m0, k0 + N) : _mm512_loadu_si512(k0 + N);
      b1 = Masked ? _mm512_maskz_loadu_epi32(m1, k0 + N + 16) : _mm512_loadu_si512(k0 + N + 16);
    }
    v0 = _mm512_or_si512(_mm512_and_si512(b0, top), _mm512_srli_epi32(a0, 16));
    v1 = _mm512_or_si512(_mm512_and_si512(b1, top), _mm512_srli_epi32(a1, 16));
  }
};

template <typename W>
using Pairs = std::conditional_t<std::is_same_v<W, float>, PairsF32, PairsBF16>;

// out[r][n] = sum over k of a[r][k] * wt[k][n] in PAIR ORDER (one vdpbf16ps per k-pair) for R rows
// of bf16 bits a[r] and the 32 * C columns from n0 (those of `mask` if Masked). 2 * C accumulators
// of 16 columns per row.
template <int R, int C, bool Masked, typename W>
inline void bf16_tile(const uint16_t* const* a, const W* wt, int64_t K, int64_t N, int64_t n0, __mmask32 mask,
                      float* const* out) {
  using L = Pairs<W>;
  __m512 acc[R][2 * C];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 2 * C; ++v) acc[r][v] = _mm512_setzero_ps();
  auto step = [&](const W* w, auto tail, const __m512i* av) {
    for (int c = 0; c < C; ++c) {
      __m512i v0, v1;
      L::template load<decltype(tail)::value, Masked>(w + 32 * c, N, mask, v0, v1);
      for (int r = 0; r < R; ++r) {
        acc[r][2 * c] = _mm512_dpbf16_ps(acc[r][2 * c], (__m512bh)av[r], (__m512bh)v0);
        acc[r][2 * c + 1] = _mm512_dpbf16_ps(acc[r][2 * c + 1], (__m512bh)av[r], (__m512bh)v1);
      }
    }
  };
  const W* w = wt + n0;
  int64_t k = 0;
  for (; k + 1 < K; k += 2, w += 2 * N) {
    __m512i av[R];
    for (int r = 0; r < R; ++r) av[r] = _mm512_set1_epi32(static_cast<int>(load_u32(a[r] + k)));
    step(w, std::false_type{}, av);
  }
  if (k < K) {  // odd K: the pair (a[K-1], 0) x (w[K-1], 0); adding 0 * 0 leaves acc as it is
    __m512i av[R];
    for (int r = 0; r < R; ++r) av[r] = _mm512_set1_epi32(a[r][k]);
    step(w, std::true_type{}, av);
  }
  const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      __m512 c0 = acc[r][2 * c], c1 = acc[r][2 * c + 1];
      if (L::PERMUTED) {
        c0 = _mm512_permutex2var_ps(acc[r][2 * c], lo, acc[r][2 * c + 1]);
        c1 = _mm512_permutex2var_ps(acc[r][2 * c], hi, acc[r][2 * c + 1]);
      }
      float* o = out[r] + n0 + 32 * c;
      if (Masked) {
        _mm512_mask_storeu_ps(o, static_cast<__mmask16>(mask), c0);
        _mm512_mask_storeu_ps(o + 16, static_cast<__mmask16>(mask >> 16), c1);
      } else {
        _mm512_storeu_ps(o, c0);
        _mm512_storeu_ps(o + 16, c1);
      }
    }
}

// Tiles of 32 * C columns, C halving down to 1, then one masked tile for the last N % 32 columns.
template <int R, int C, typename W>
inline void bf16_tiles(const uint16_t* const* a, const W* wt, int64_t K, int64_t N, int64_t& n, float* const* out) {
  for (; n + 32 * C <= N; n += 32 * C) bf16_tile<R, C, false>(a, wt, K, N, n, 0, out);
  if constexpr (C > 1) bf16_tiles<R, C / 2>(a, wt, K, N, n, out);
}

template <int R, typename W>
void bf16_gemm(const uint16_t* const* a, const W* wt, int64_t K, int64_t N, float* const* out) {
  constexpr int C = R == 1 ? 8 : R == 2 ? 4 : R <= 4 ? 2 : 1;
  int64_t n = 0;
  bf16_tiles<R, C>(a, wt, K, N, n, out);
  if (n < N) bf16_tile<R, 1, true>(a, wt, K, N, n, static_cast<__mmask32>((1ull << (N - n)) - 1), out);
}

// c10::BFloat16(float)'s rounding (to nearest even, NaN to 0x7FC0) on 16 floats.
inline __m256i bf16_round(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7FFF));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

// One block of R rows of one expert, bf16 activations: GEMM1 straight from x's rows, SiLU(gate) *
// up, GEMM2, into out_rows[rows[r]].
template <typename W, int R>
void bf16_block(const c10::BFloat16* x, int64_t hidden, int64_t inter, const W* w13t, const W* w2t,
                const int64_t* tokens, const int64_t* rows, c10::BFloat16* out_rows) {
  thread_local std::vector<float> fbuf;
  thread_local std::vector<uint16_t> hbuf;
  float* gate_up = scratch(fbuf, R * (3 * inter + hidden));
  float *y = gate_up + R * 2 * inter, *act_f = y + R * hidden;
  uint16_t* act = scratch(hbuf, R * inter);
  const uint16_t *xr[R], *ar[R];
  float *gr[R], *yr[R];
  for (int r = 0; r < R; ++r) {
    xr[r] = reinterpret_cast<const uint16_t*>(x + tokens[r] * hidden);
    gr[r] = gate_up + r * 2 * inter;
    ar[r] = act + r * inter;
    yr[r] = y + r * hidden;
  }
  bf16_gemm<R>(xr, w13t, hidden, 2 * inter, gr);
  for (int r = 0; r < R; ++r) {
    silu_mul<c10::BFloat16>(gr[r], gr[r] + inter, inter, act_f);
    for (int64_t i = 0; i < inter; ++i) act[r * inter + i] = c10::BFloat16(act_f[i]).x;  // exact: act_f is bf16
  }
  bf16_gemm<R>(ar, w2t, inter, hidden, yr);
  for (int r = 0; r < R; ++r) {
    uint16_t* o = reinterpret_cast<uint16_t*>(out_rows + rows[r] * hidden);
    int64_t h = 0;
    for (; h + 16 <= hidden; h += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + h), bf16_round(_mm512_loadu_ps(yr[r] + h)));
    for (; h < hidden; ++h) o[h] = c10::BFloat16(yr[r][h]).x;
  }
}

#pragma GCC pop_options
#endif  // MOK_X86_64

// ---------------------------------------------------------------------------------------------
// Rows to experts, in parallel

struct Block {
  int64_t expert, begin, size;
};

// Stable counting sort of the rows by local expert (each expert sees its rows in the given order),
// cut into blocks of at most max_rows rows of one expert, as even as possible. One per thread,
// rebuilt on each call in the same buffers.
struct RowPlan {
  std::vector<int64_t> row, token, start, fill;
  std::vector<Block> blocks;

  void build(const int64_t* tokens, const int64_t* experts, int64_t num_rows, int64_t num_local, int64_t max_rows) {
    start.assign(num_local + 1, 0);
    for (int64_t r = 0; r < num_rows; ++r)
      if (experts[r] >= 0) ++start[experts[r] + 1];
    for (int64_t e = 0; e < num_local; ++e) start[e + 1] += start[e];
    row.resize(start[num_local]);
    token.resize(start[num_local]);
    fill.assign(start.begin(), start.end() - 1);
    for (int64_t r = 0; r < num_rows; ++r)
      if (experts[r] >= 0) {
        row[fill[experts[r]]] = r;
        token[fill[experts[r]]++] = tokens[r];
      }
    blocks.clear();
    for (int64_t e = 0; e < num_local; ++e) {
      const int64_t n = start[e + 1] - start[e], count = (n + max_rows - 1) / max_rows;
      for (int64_t b = 0, begin = start[e]; b < count; ++b) {
        const int64_t size = n / count + (b < n % count);
        blocks.push_back({e, begin, size});
        begin += size;
      }
    }
  }
};

// The calling thread's plan (thread_local: calls from several threads do not share one).
RowPlan& caller_plan() {
  thread_local RowPlan plan;
  return plan;
}

// Runs fn(i) for i in [0, n) on torch's intra-op threads, each taking the next i when done (the
// blocks differ in size); inline when one thread or one item. Which thread runs an item never
// changes its result.
template <typename Fn>
void run_parallel(int64_t n, const Fn& fn) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || at::in_parallel_region()) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) fn(i);
  });
}

// Runs `count` blocks of rows through the experts: block(R, expert, tokens, rows) for R = 1..MaxR.
template <int MaxR, typename Fn>
void dispatch_rows(int64_t size, const Fn& fn) {
  if constexpr (MaxR >= 1) {
    if (size == MaxR) return fn(std::integral_constant<int, MaxR>{});
    if constexpr (MaxR > 1) dispatch_rows<MaxR - 1>(size, fn);
  }
}

template <typename T, typename W>
void expert_rows_impl(const T* x, int64_t hidden, int64_t inter, const int64_t* token, const int64_t* expert,
                      int64_t num_rows, const W* w13t, const W* w2t, int64_t num_local, T* out, Isa isa) {
  // Rows routed to no local expert are zero.
  for (int64_t r = 0; r < num_rows; ++r)
    if (expert[r] < 0) std::fill(out + r * hidden, out + (r + 1) * hidden, T(0));
#ifdef MOK_X86_64
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (isa == Isa::AVX512_BF16) {
      RowPlan& plan = caller_plan();  // a reference: the workers must see this thread's plan, not theirs
      plan.build(token, expert, num_rows, num_local, AVX512_ROW_BLOCK);
      run_parallel(static_cast<int64_t>(plan.blocks.size()), [&](int64_t i) {
        const Block& b = plan.blocks[i];
        dispatch_rows<AVX512_ROW_BLOCK>(b.size, [&](auto R) {
          bf16_block<W, decltype(R)::value>(x, hidden, inter, w13t + b.expert * hidden * 2 * inter,
                                            w2t + b.expert * inter * hidden, plan.token.data() + b.begin,
                                            plan.row.data() + b.begin, out);
        });
      });
      return;
    }
  }
#endif
  RowPlan& plan = caller_plan();
  plan.build(token, expert, num_rows, num_local, GENERIC_ROW_BLOCK);
  run_parallel(static_cast<int64_t>(plan.blocks.size()), [&](int64_t i) {
    const Block& b = plan.blocks[i];
    dispatch_rows<GENERIC_ROW_BLOCK>(b.size, [&](auto R) {
      generic_block<T, W, decltype(R)::value>(x, hidden, inter, w13t + b.expert * hidden * 2 * inter,
                                              w2t + b.expert * inter * hidden, plan.token.data() + b.begin,
                                              plan.row.data() + b.begin, out);
    });
  });
}

void check_weights(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2) {
  TORCH_CHECK(x.dim() == 2 && w13.dim() == 3 && w2.dim() == 3, "kittens CPU kernel: bad ranks");
  TORCH_CHECK(w13.size(1) == 2 * w2.size(2) && w13.size(2) == x.size(1) && w2.size(1) == x.size(1) &&
                  w13.size(0) == w2.size(0),
              "kittens CPU kernel: weight shapes do not match hidden_states");
  TORCH_CHECK(w13.scalar_type() == w2.scalar_type() &&
                  (w13.scalar_type() == x.scalar_type() || w13.scalar_type() == at::kFloat),
              "kittens CPU kernel: weights must both have x's dtype or float32");
}

// Calls fn(T{}) for the activation dtypes kittens supports.
template <typename Fn>
void dispatch_dtype(at::ScalarType dtype, const char* op, Fn fn) {
  switch (dtype) {
    case at::kBFloat16: fn(c10::BFloat16{}); break;
    case at::kHalf: fn(c10::Half{}); break;
    case at::kFloat: fn(float{}); break;
    default: TORCH_CHECK(false, op, ": dtype ", dtype, " is not one of bfloat16, float16, float32");
  }
}

// reference.py's SUPPORTED_DTYPES and SUPPORTED_ACTIVATIONS.
constexpr std::array<at::ScalarType, 3> SUPPORTED_DTYPES = {at::kBFloat16, at::kHalf, at::kFloat};
constexpr std::array<std::string_view, 1> SUPPORTED_ACTIVATIONS = {"silu"};

// What Python prints for a dtype, a str (repr; escapes ASCII only), a tuple: the checks below
// repeat reference.py's messages word for word.
std::string py(at::ScalarType dtype) { return "torch." + std::string(c10::getDtypeNames(dtype).first); }
std::string py(int64_t n) { return std::to_string(n); }
std::string py(std::string_view s) {
  const char quote = s.find('\'') != s.npos && s.find('"') == s.npos ? '"' : '\'';
  std::string out(1, quote);
  for (const unsigned char c : s) {
    if (c == quote || c == '\\') {
      out += '\\';
      out += c;
    } else if (c == '\n' || c == '\r' || c == '\t') {
      out += c == '\n' ? "\\n" : c == '\r' ? "\\r" : "\\t";
    } else if (c < 0x20 || c == 0x7f) {
      char hex[5];
      std::snprintf(hex, sizeof(hex), "\\x%02x", c);
      out += hex;
    } else {
      out += c;
    }
  }
  return out + quote;
}
template <typename Items>
std::string py_tuple(const Items& items) {
  std::string out = "(";
  for (const auto& item : items) out += (out.size() > 1 ? ", " : "") + py(item);
  return out + (std::size(items) == 1 ? ",)" : ")");
}

template <typename T, size_t N>
bool one_of(const T& value, const std::array<T, N>& values) {
  return std::find(values.begin(), values.end(), value) != values.end();
}

// reference.check_fused_moe_args with check_values, for CPU hidden_states: same checks, same order,
// same messages, raised as ValueError. This kernel is the whole CPU path of mok_serve::fused_moe,
// with no Python in front of it.
void check_fused_moe_args(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                          const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                          const c10::optional<at::Tensor>& expert_map, std::string_view activation) {
  TORCH_CHECK_VALUE(one_of(activation, SUPPORTED_ACTIVATIONS), "activation ", py(activation),
                    " is not supported; expected one of ", py_tuple(SUPPORTED_ACTIVATIONS));
  TORCH_CHECK_VALUE(x.dim() == 2, "hidden_states must be 2-D [tokens, hidden], got shape ", py_tuple(x.sizes()));
  TORCH_CHECK_VALUE(one_of(x.scalar_type(), SUPPORTED_DTYPES), "hidden_states dtype ", py(x.scalar_type()),
                    " is not one of ", py_tuple(SUPPORTED_DTYPES));
  const int64_t tokens = x.size(0), hidden = x.size(1);
  TORCH_CHECK_VALUE(w13.dim() == 3 && w2.dim() == 3, "w13 must be [E, 2*I, H] and w2 [E, H, I]; got w13 ",
                    py_tuple(w13.sizes()), ", w2 ", py_tuple(w2.sizes()));
  const int64_t num_local = w13.size(0), two_i = w13.size(1);
  TORCH_CHECK_VALUE(two_i % 2 == 0, "w13 dim 1 (2*I) must be even, got ", two_i);
  TORCH_CHECK_VALUE(w13.size(2) == hidden, "w13 hidden size ", w13.size(2), " != hidden_states hidden size ",
                    hidden);
  const std::array<int64_t, 3> w2_shape = {num_local, hidden, two_i / 2};
  TORCH_CHECK_VALUE(w2.sizes().equals(w2_shape), "w2 shape ", py_tuple(w2.sizes()), " does not match w13 ",
                    py_tuple(w13.sizes()), ": expected ", py_tuple(w2_shape));
  const std::array<at::ScalarType, 2> weight_dtypes = {x.scalar_type(), at::kFloat};
  TORCH_CHECK_VALUE(one_of(w13.scalar_type(), weight_dtypes) && one_of(w2.scalar_type(), weight_dtypes),
                    "weights must have the dtype of hidden_states (", py(x.scalar_type()),
                    ", or float32 on the CPU); got w13 ", py(w13.scalar_type()), ", w2 ", py(w2.scalar_type()));
  TORCH_CHECK_VALUE(topk_ids.dim() == 2 && topk_ids.size(0) == tokens, "topk_ids must be [tokens=", tokens,
                    ", top_k], got shape ", py_tuple(topk_ids.sizes()));
  const std::array<at::ScalarType, 2> id_dtypes = {at::kInt, at::kLong};
  TORCH_CHECK_VALUE(one_of(topk_ids.scalar_type(), id_dtypes), "topk_ids must be int32 or int64, got ",
                    py(topk_ids.scalar_type()));
  TORCH_CHECK_VALUE(topk_weights.sizes().equals(topk_ids.sizes()), "topk_weights shape ",
                    py_tuple(topk_weights.sizes()), " != topk_ids shape ", py_tuple(topk_ids.sizes()));
  TORCH_CHECK_VALUE(topk_weights.is_floating_point(), "topk_weights must be floating point, got ",
                    py(topk_weights.scalar_type()));
  if (expert_map.has_value())
    TORCH_CHECK_VALUE(expert_map->dim() == 1 && one_of(expert_map->scalar_type(), id_dtypes),
                      "expert_map must be a 1-D int32/int64 tensor, got ", py(expert_map->scalar_type()), " ",
                      py_tuple(expert_map->sizes()));
  std::vector<std::pair<const char*, const at::Tensor*>> named = {
      {"w13", &w13}, {"w2", &w2}, {"topk_weights", &topk_weights}, {"topk_ids", &topk_ids}};
  if (expert_map.has_value()) named.emplace_back("expert_map", &*expert_map);
  for (const auto& [name, t] : named)
    TORCH_CHECK_VALUE(t->device() == x.device(), name, " is on ", t->device().str(), " but hidden_states is on ",
                      x.device().str());
}


// The expert output of every row into out ([rows, H] in x's dtype; zero where the row's expert is
// -1). The GEMMs read each expert's weights transposed; weights that are already transposed views of
// contiguous [E, H, 2I] and [E, I, H] tensors (what the vLLM glue keeps) are used in place, others
// are transposed on every call.
// w's experts transposed ([E, a, b] as [E, b, a]) and contiguous: w itself where it is such a view.
at::Tensor transposed(const at::Tensor& w) {
  const int64_t a = w.size(1), b = w.size(2);
  if (w.stride(1) == 1 && w.stride(2) == a && w.stride(0) == a * b) return w;  // no new tensor: it costs ~1 us
  return w.transpose(1, 2).contiguous().transpose(1, 2);
}

void run_rows(const at::Tensor& x, const int64_t* token, const int64_t* expert, int64_t num_rows,
              const at::Tensor& w13, const at::Tensor& w2, void* out) {
  check_weights(x, w13, w2);
  const at::Tensor w13t = transposed(w13), w2t = transposed(w2);  // data: [E, H, 2I] and [E, I, H]
  const int64_t hidden = x.size(1), inter = w2.size(2), num_local = w13.size(0);
  const Isa isa = active_isa();
  dispatch_dtype(x.scalar_type(), "kittens CPU kernel", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    T* op = static_cast<T*>(out);
    if (w13t.scalar_type() == at::kFloat)
      expert_rows_impl<T, float>(xp, hidden, inter, token, expert, num_rows, w13t.data_ptr<float>(),
                                 w2t.data_ptr<float>(), num_local, op, isa);
    else
      expert_rows_impl<T, T>(xp, hidden, inter, token, expert, num_rows, w13t.data_ptr<T>(), w2t.data_ptr<T>(),
                             num_local, op, isa);
  });
}

// Expert output of every row, [rows, H] in x's dtype: row i is x[row_token[i]] through local
// expert row_expert[i]; zero where that is -1. Weights in vLLM's layouts (w13 [E, 2I, H], w2
// [E, H, I]), in x's dtype or float32.
at::Tensor expert_rows(const at::Tensor& x_in, const at::Tensor& row_token_in, const at::Tensor& row_expert_in,
                       const at::Tensor& w13, const at::Tensor& w2) {
  at::Tensor x = x_in.contiguous(), row_token = row_token_in.contiguous(), row_expert = row_expert_in.contiguous();
  TORCH_CHECK(row_token.dim() == 1 && row_expert.sizes() == row_token.sizes(),
              "expert_rows: row_token and row_expert must be 1-D of the same length");
  TORCH_CHECK(row_token.scalar_type() == at::kLong && row_expert.scalar_type() == at::kLong,
              "expert_rows: row_token and row_expert must be int64");
  check_weights(x, w13, w2);
  const int64_t num_rows = row_token.size(0);
  const int64_t* token = row_token.data_ptr<int64_t>();
  const int64_t* expert = row_expert.data_ptr<int64_t>();
  for (int64_t r = 0; r < num_rows; ++r) {
    TORCH_CHECK_INDEX(token[r] >= 0 && token[r] < x.size(0), "expert_rows: row ", r, " has token ", token[r],
                      " outside [0, ", x.size(0), ")");
    TORCH_CHECK_INDEX(expert[r] >= -1 && expert[r] < w13.size(0), "expert_rows: row ", r, " has local expert ",
                      expert[r], " outside [-1, ", w13.size(0), ")");
  }
  at::Tensor out = at::empty({num_rows, x.size(1)}, x.options());
  run_rows(x, token, expert, num_rows, w13, w2, out.data_ptr());
  return out;
}

// out[t] = sum over k, in k order, in fp32, of rows[t, k] * weights[t, k] (a multiply, then an add:
// this file is compiled without contraction), rounded to T.
template <typename T>
void combine_rows(const T* rows, const float* weights, int64_t tokens, int64_t top_k, int64_t hidden, T* out) {
  at::parallel_for(0, tokens, 16, [&](int64_t lo, int64_t hi) {
    thread_local std::vector<float> buf;
    float* acc = scratch(buf, hidden);
    for (int64_t t = lo; t < hi; ++t) {
      std::fill(acc, acc + hidden, 0.0f);
      for (int64_t k = 0; k < top_k; ++k) {
        const T* row = rows + (t * top_k + k) * hidden;
        const float w = weights[t * top_k + k];
        for (int64_t h = 0; h < hidden; ++h) acc[h] += static_cast<float>(row[h]) * w;
      }
      for (int64_t h = 0; h < hidden; ++h) out[t * hidden + h] = static_cast<T>(acc[h]);
    }
  });
}

// sum over k, in k order, in fp32, of rows[t, k] * weights[t, k]; [T, H] in rows' dtype.
at::Tensor combine_topk(const at::Tensor& rows_in, const at::Tensor& weights_in) {
  at::Tensor rows = rows_in.contiguous(), weights = weights_in.to(at::kFloat).contiguous();
  TORCH_CHECK(rows.dim() == 3 && weights.dim() == 2 && rows.size(0) == weights.size(0) &&
                  rows.size(1) == weights.size(1),
              "combine_topk: rows must be [T, K, H] and weights [T, K]");
  const int64_t tokens = rows.size(0), top_k = rows.size(1), hidden = rows.size(2);
  at::Tensor out = at::empty({tokens, hidden}, rows.options());
  dispatch_dtype(rows.scalar_type(), "combine_topk", [&](auto tag) {
    using T = decltype(tag);
    combine_rows<T>(rows.data_ptr<T>(), weights.data_ptr<float>(), tokens, top_k, hidden, out.data_ptr<T>());
  });
  return out;
}

// The smallest and largest of the n values outside [lo, end), if any.
std::optional<std::pair<int64_t, int64_t>> outside(const int64_t* v, int64_t n, int64_t lo, int64_t end) {
  std::optional<std::pair<int64_t, int64_t>> bad;
  for (int64_t i = 0; i < n; ++i)
    if (v[i] < lo || v[i] >= end)
      bad = bad ? std::pair{std::min(bad->first, v[i]), std::max(bad->second, v[i])} : std::pair{v[i], v[i]};
  return bad;
}

// mok_serve::fused_moe on CPU tensors (reference.fused_moe_reference's contract): rows (t, k) in
// token order, each through the local expert of topk_ids[t, k], then the fixed-order combine.
at::Tensor fused_moe(const at::Tensor& x_in, const at::Tensor& w13, const at::Tensor& w2,
                     const at::Tensor& topk_weights_in, const at::Tensor& topk_ids_in,
                     const c10::optional<at::Tensor>& expert_map_in, std::string_view activation) {
  check_fused_moe_args(x_in, w13, w2, topk_weights_in, topk_ids_in, expert_map_in, activation);
  const at::Tensor x = x_in.contiguous(), topk_ids = topk_ids_in.contiguous();
  const at::Tensor topk_weights = topk_weights_in.scalar_type() == at::kFloat && topk_weights_in.is_contiguous()
                                      ? topk_weights_in
                                      : topk_weights_in.to(at::kFloat).contiguous();
  const int64_t tokens = topk_ids.size(0), top_k = topk_ids.size(1), num_local = w13.size(0);
  const int64_t num_rows = tokens * top_k, hidden = x.size(1);
  thread_local std::vector<int64_t> token, expert;
  token.resize(num_rows);
  expert.resize(num_rows);
  if (topk_ids.scalar_type() == at::kInt)
    std::copy_n(topk_ids.data_ptr<int32_t>(), num_rows, expert.begin());
  else
    std::copy_n(topk_ids.data_ptr<int64_t>(), num_rows, expert.begin());
  at::Tensor expert_map;
  if (expert_map_in.has_value()) expert_map = expert_map_in->to(at::kLong).contiguous();
  const int64_t num_global = expert_map.defined() ? expert_map.numel() : num_local;
  // check_fused_moe_args' value checks (reference.check_id_values), here where the ids are read
  // anyway, with the same messages (kernels/bad_ids.py).
  if (const auto bad = outside(expert.data(), num_rows, -1, num_global))
    TORCH_CHECK_VALUE(false, "topk_ids out of range: found ids in [", bad->first, ", ", bad->second,
                      "] outside the valid range [-1, ", num_global, ") (-1: no expert)");
  for (int64_t r = 0; r < num_rows; ++r) token[r] = r / top_k;
  if (expert_map.defined()) {
    const int64_t* map = expert_map.data_ptr<int64_t>();
    if (const auto bad = outside(map, num_global, -1, num_local))
      TORCH_CHECK_VALUE(false, "expert_map values must be -1 or local expert ids in [0, ", num_local, "); found [",
                        bad->first, ", ", bad->second, "]");
    for (int64_t& e : expert)
      if (e >= 0) e = map[e];  // -1 (unrouted) stays -1: the row contributes nothing
  }
  at::Tensor out = at::empty({tokens, hidden}, x.options());
  dispatch_dtype(x.scalar_type(), "kittens CPU kernel", [&](auto tag) {
    using T = decltype(tag);
    // The expert outputs: in a buffer kept by this thread up to 16 MiB (decode and small prefill
    // steps allocate nothing), a temporary tensor beyond, so a long prefill's rows are not kept.
    constexpr int64_t KEEP_BYTES = 16 << 20;
    thread_local std::vector<T> rows_buf;
    at::Tensor rows_tmp;
    T* rows;
    if (num_rows * hidden * static_cast<int64_t>(sizeof(T)) <= KEEP_BYTES) {
      rows = scratch(rows_buf, num_rows * hidden);
    } else {
      rows_tmp = at::empty({num_rows, hidden}, x.options());
      rows = rows_tmp.data_ptr<T>();
    }
    run_rows(x, token.data(), expert.data(), num_rows, w13, w2, rows);
    combine_rows<T>(rows, topk_weights.data_ptr<float>(), tokens, top_k, hidden, out.data_ptr<T>());
  });
  return out;
}

// The ISA of the GEMMs in this process: "generic" or "avx512_bf16". `name` "auto" picks the best
// this CPU has; "" changes nothing. cpu/moe.py calls it once at load (MOK_SERVE_CPU_ISA); tests
// call it to run both ISAs.
std::string set_isa(std::string_view name) {
  if (!name.empty()) {
    Isa isa = best_isa();
    if (name != "auto") {
      const auto it = std::find(ISA_NAMES.begin(), ISA_NAMES.end(), name);
      TORCH_CHECK_VALUE(it != ISA_NAMES.end(), "kittens CPU kernel: unknown ISA ", py(name), "; expected 'auto' or one of ",
                        py_tuple(ISA_NAMES));
      isa = static_cast<Isa>(it - ISA_NAMES.begin());
      TORCH_CHECK_VALUE(cpu_supports(isa), "kittens CPU kernel: this CPU does not support ISA ", py(name));
    }
    isa_slot().store(static_cast<int>(isa));
  }
  return std::string(ISA_NAMES[static_cast<int>(active_isa())]);
}

// How many threads run_parallel ran `items` items on, each item waiting (up to 2 s) until all have
// started: for a test that the kernel's loops do use torch's threads (built without OpenMP, the
// extension's at::parallel_for runs them one after another on the caller's thread).
int64_t parallel_workers(int64_t items) {
  std::atomic<int64_t> started{0};
  std::vector<std::thread::id> who(items);
  run_parallel(items, [&](int64_t i) {
    started.fetch_add(1);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (started.load() < items && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
    who[i] = std::this_thread::get_id();
  });
  std::sort(who.begin(), who.end());
  return std::unique(who.begin(), who.end()) - who.begin();
}

std::vector<std::string> supported_isas() {
  std::vector<std::string> out;
  for (size_t i = 0; i < ISA_NAMES.size(); ++i)
    if (cpu_supports(static_cast<Isa>(i))) out.emplace_back(ISA_NAMES[i]);
  return out;
}

}  // namespace

TORCH_LIBRARY(mok_serve_cpu, m) {
  m.def("expert_rows(Tensor x, Tensor row_token, Tensor row_expert, Tensor w13, Tensor w2) -> Tensor");
  m.def("combine_topk(Tensor rows, Tensor weights) -> Tensor");
  m.def("set_isa(str name) -> str", &set_isa);
  m.def("supported_isas() -> str[]", &supported_isas);
  m.def("parallel_workers(int items) -> int", &parallel_workers);
}

TORCH_LIBRARY_IMPL(mok_serve_cpu, CPU, m) {
  m.impl("expert_rows", &expert_rows);
  m.impl("combine_topk", &combine_topk);
}

// kernels/__init__.py defines mok_serve::fused_moe with a Python kernel for every backend. A CPU
// kernel takes precedence over that one for CPU tensors, so once this library is loaded (on the
// first CPU call, by cpu_moe.available()) a CPU call runs no Python.
TORCH_LIBRARY_IMPL(mok_serve, CPU, m) { m.impl("fused_moe", &fused_moe); }
