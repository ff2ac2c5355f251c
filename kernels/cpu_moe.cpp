// The kittens MoE layer on the CPU: expert rows and the fixed-order top-k combine.
//
// Computes the function documented in reference.py. What makes it batch invariant: every output
// element of a GEMM is summed over k in order, k = 0 first (`gemm_rows`), on every code path. No
// BLAS library picks a kernel by row count, so a row's result never depends on how many rows
// share its expert or the call. Built with -ffp-contract=off, except the GEMM block (`gemm_tile`,
// `gemm_rows`), compiled with contraction on so that every term there is one fused multiply-add
// on every path: the compiler must not fuse a multiply and an add in one path and not another.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace {

// Eight floats, one AVX register; GCC/Clang vector extensions keep this portable.
typedef float vec8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
constexpr int ROW_BLOCK = 4;  // rows of one expert computed together, sharing weight loads

inline vec8 bits_to_float(u32x8 bits) {
  vec8 v;
  __builtin_memcpy(&v, &bits, sizeof(v));
  return v;
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
// out[r][n] = sum over k = 0, 1, ..., K-1 in that order of a[r][k] * wt[k][n] for the R rows and
// the 16 * P columns from n0; wt is the weight transposed, [K, N]. Every term is one fused
// multiply-add (this block is compiled with contraction on; the scalar tail of gemm_rows too), on
// every code path. 2 * P vec8 accumulators per row: enough independent additions in flight to
// hide their latency, few enough to stay in registers.
template <int R, int P, typename W>
inline void gemm_tile(const float* const* a, const W* wt, int64_t K, int64_t N, int64_t n0, float* const* out) {
  vec8 acc[R][2 * P] = {};
  for (int64_t k = 0; k < K; ++k) {
    vec8 w[2 * P];
    for (int p = 0; p < P; ++p) Load16<W>::load(wt + k * N + n0 + 16 * p, w[2 * p], w[2 * p + 1]);
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 2 * P; ++v) acc[r][v] += w[v] * a[r][k];
  }
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

// out[r] = a[r] @ wt for R rows. Every element is summed in the same order on every code path
// (wide tiles, narrow tiles, the scalar tail), so it does not depend on R, on the other rows or
// on its tile.
template <int R, typename W>
void gemm_rows(const float* const* a, const W* wt, int64_t K, int64_t N, float* const* out) {
  constexpr int P = R == 1 ? 4 : R == 2 ? 2 : 1;
  int64_t n = 0;
  for (; n + 16 * P <= N; n += 16 * P) gemm_tile<R, P>(a, wt, K, N, n, out);
  for (; n + 16 <= N; n += 16) gemm_tile<R, 1>(a, wt, K, N, n, out);
  for (; n < N; ++n)
    for (int r = 0; r < R; ++r) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) acc += static_cast<float>(wt[k * N + n]) * a[r][k];
      out[r][n] = acc;
    }
}

#pragma GCC pop_options

// Rounds through the activation dtype, as a GEMM in that dtype returns its result.
template <typename T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// One block of up to ROW_BLOCK rows of one expert: GEMM1, SiLU(gate) * up, GEMM2. w13t is that
// expert's [H, 2I], w2t its [I, H].
template <typename T, typename W, int R>
void expert_block(const T* x, int64_t hidden, int64_t inter, const W* w13t, const W* w2t, const int64_t* tokens,
                  const int64_t* rows, T* out_rows) {
  std::vector<float> xs(R * hidden), gate_up(R * 2 * inter), act(R * inter), y(R * hidden);
  const float *xr[R], *ar[R];
  float *gr[R], *yr[R];
  for (int r = 0; r < R; ++r) {
    for (int64_t h = 0; h < hidden; ++h) xs[r * hidden + h] = static_cast<float>(x[tokens[r] * hidden + h]);
    xr[r] = xs.data() + r * hidden;
    gr[r] = gate_up.data() + r * 2 * inter;
    ar[r] = act.data() + r * inter;
    yr[r] = y.data() + r * hidden;
  }
  gemm_rows<R>(xr, w13t, hidden, 2 * inter, gr);
  for (int r = 0; r < R; ++r)
    for (int64_t i = 0; i < inter; ++i) {
      const float gate = round_to<T>(gr[r][i]), up = round_to<T>(gr[r][inter + i]);
      act[r * inter + i] = round_to<T>(gate / (1.0f + std::exp(-gate)) * up);
    }
  gemm_rows<R>(ar, w2t, inter, hidden, yr);
  for (int r = 0; r < R; ++r)
    for (int64_t h = 0; h < hidden; ++h) out_rows[rows[r] * hidden + h] = static_cast<T>(yr[r][h]);
}

template <typename T, typename W>
void expert_rows_impl(const at::Tensor& x, const int64_t* token, const int64_t* expert, int64_t num_rows,
                      const at::Tensor& w13t, const at::Tensor& w2t, at::Tensor& out) {
  const int64_t num_local = w13t.size(0), inter = w2t.size(1), hidden = x.size(1);
  // Stable counting sort of the rows by expert: each expert sees its rows in the given order.
  std::vector<int64_t> start(num_local + 1, 0);
  for (int64_t r = 0; r < num_rows; ++r)
    if (expert[r] >= 0) ++start[expert[r] + 1];
  for (int64_t e = 0; e < num_local; ++e) start[e + 1] += start[e];
  std::vector<int64_t> sorted(start[num_local]), sorted_token(start[num_local]);
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t r = 0; r < num_rows; ++r)
    if (expert[r] >= 0) {
      sorted[fill[expert[r]]] = r;
      sorted_token[fill[expert[r]]++] = token[r];
    }
  struct Block {
    int64_t expert, begin, size;
  };
  std::vector<Block> blocks;
  for (int64_t e = 0; e < num_local; ++e)
    for (int64_t b = start[e]; b < start[e + 1]; b += ROW_BLOCK)
      blocks.push_back({e, b, std::min<int64_t>(ROW_BLOCK, start[e + 1] - b)});

  const T* xp = x.data_ptr<T>();
  const W* w13p = w13t.data_ptr<W>();
  const W* w2p = w2t.data_ptr<W>();
  T* outp = out.data_ptr<T>();
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const Block& blk = blocks[i];
      const W* a = w13p + blk.expert * hidden * 2 * inter;
      const W* b = w2p + blk.expert * inter * hidden;
      const int64_t* tok = sorted_token.data() + blk.begin;
      const int64_t* rows = sorted.data() + blk.begin;
      switch (blk.size) {
        case 4: expert_block<T, W, 4>(xp, hidden, inter, a, b, tok, rows, outp); break;
        case 3: expert_block<T, W, 3>(xp, hidden, inter, a, b, tok, rows, outp); break;
        case 2: expert_block<T, W, 2>(xp, hidden, inter, a, b, tok, rows, outp); break;
        default: expert_block<T, W, 1>(xp, hidden, inter, a, b, tok, rows, outp); break;
      }
    }
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

}  // namespace

// Runs the rows through their experts into out ([rows, H], zero-filled). The GEMMs read each
// expert's weights transposed; weights that are already transposed views of contiguous
// [E, H, 2I] and [E, I, H] tensors (what the vLLM glue keeps) are used in place, others are
// transposed on every call.
void run_rows(const at::Tensor& x, const int64_t* token, const int64_t* expert, int64_t num_rows,
              const at::Tensor& w13, const at::Tensor& w2, at::Tensor& out) {
  check_weights(x, w13, w2);
  at::Tensor w13t = w13.transpose(1, 2).contiguous(), w2t = w2.transpose(1, 2).contiguous();
  dispatch_dtype(x.scalar_type(), "kittens CPU kernel", [&](auto tag) {
    using T = decltype(tag);
    if (w13t.scalar_type() == at::kFloat)
      expert_rows_impl<T, float>(x, token, expert, num_rows, w13t, w2t, out);
    else
      expert_rows_impl<T, T>(x, token, expert, num_rows, w13t, w2t, out);
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
  at::Tensor out = at::zeros({num_rows, x.size(1)}, x.options());
  run_rows(x, token, expert, num_rows, w13, w2, out);
  return out;
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
    using scalar_t = decltype(tag);
    const scalar_t* rp = rows.data_ptr<scalar_t>();
    const float* wp = weights.data_ptr<float>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, 16, [&](int64_t lo, int64_t hi) {
      std::vector<float> acc(hidden);
      for (int64_t t = lo; t < hi; ++t) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t k = 0; k < top_k; ++k) {
          const scalar_t* row = rp + (t * top_k + k) * hidden;
          const float w = wp[t * top_k + k];
          for (int64_t h = 0; h < hidden; ++h) acc[h] += static_cast<float>(row[h]) * w;
        }
        for (int64_t h = 0; h < hidden; ++h) op[t * hidden + h] = static_cast<scalar_t>(acc[h]);
      }
    });
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
                     const at::Tensor& topk_weights, const at::Tensor& topk_ids_in,
                     const c10::optional<at::Tensor>& expert_map_in, std::string_view activation) {
  check_fused_moe_args(x_in, w13, w2, topk_weights, topk_ids_in, expert_map_in, activation);
  at::Tensor x = x_in.contiguous(), topk_ids = topk_ids_in.to(at::kLong).contiguous();
  const int64_t tokens = topk_ids.size(0), top_k = topk_ids.size(1), num_local = w13.size(0);
  at::Tensor expert_map;
  if (expert_map_in.has_value()) expert_map = expert_map_in->to(at::kLong).contiguous();
  const int64_t num_global = expert_map.defined() ? expert_map.numel() : num_local;
  const int64_t* ids = topk_ids.data_ptr<int64_t>();
  const int64_t num_rows = tokens * top_k;
  // check_fused_moe_args' value checks (reference.check_id_values), here where the ids are read
  // anyway, with the same messages (kernels/bad_ids.py).
  if (const auto bad = outside(ids, num_rows, -1, num_global))
    TORCH_CHECK_VALUE(false, "topk_ids out of range: found ids in [", bad->first, ", ", bad->second,
                      "] outside the valid range [-1, ", num_global, ") (-1: no expert)");
  std::vector<int64_t> token(num_rows), expert(ids, ids + num_rows);
  for (int64_t r = 0; r < num_rows; ++r) token[r] = r / top_k;
  if (expert_map.defined()) {
    const int64_t* map = expert_map.data_ptr<int64_t>();
    if (const auto bad = outside(map, num_global, -1, num_local))
      TORCH_CHECK_VALUE(false, "expert_map values must be -1 or local expert ids in [0, ", num_local, "); found [",
                        bad->first, ", ", bad->second, "]");
    for (int64_t& e : expert)
      if (e >= 0) e = map[e];  // -1 (unrouted) stays -1: the row contributes nothing
  }
  at::Tensor rows = at::zeros({num_rows, x.size(1)}, x.options());
  run_rows(x, token.data(), expert.data(), num_rows, w13, w2, rows);
  return combine_topk(rows.view({tokens, top_k, x.size(1)}), topk_weights);
}

TORCH_LIBRARY(mok_serve_cpu, m) {
  m.def("expert_rows(Tensor x, Tensor row_token, Tensor row_expert, Tensor w13, Tensor w2) -> Tensor");
  m.def("combine_topk(Tensor rows, Tensor weights) -> Tensor");
}

TORCH_LIBRARY_IMPL(mok_serve_cpu, CPU, m) {
  m.impl("expert_rows", &expert_rows);
  m.impl("combine_topk", &combine_topk);
}

// kernels/__init__.py defines mok_serve::fused_moe with a Python kernel for every backend. A CPU
// kernel takes precedence over that one for CPU tensors, so once this library is loaded (on the
// first CPU call, by cpu_moe.available()) a CPU call runs no Python.
TORCH_LIBRARY_IMPL(mok_serve, CPU, m) { m.impl("fused_moe", &fused_moe); }
