// Per-layer MoE timer on the CPU: the host twin of the Triton timer kernel in
// kernels/cuda/timer.py, with the same int64 buffer layout, so one reader serves both.
//
// Built into the same extension as cpu_moe.cpp. mok_serve.vllm.timing registers each MoE layer's
// buffers under a slot (`timer_register`); the compiled model then calls `moe_timer(t, slot,
// point)`, which stamps the clock and returns a copy of `t` for the caller to use in its place
// (the data dependency keeps a compiler from moving the stamp). A stamp costs a few
// microseconds: no Python runs in it.
//
// Buffer (int64): [0] calls, [1] tokens, then `window` x 4 stamps from `ring`, then 4 x NB
// histogram counts from `hist`, then 4 sums (ns) from `sums`. Point 0 (BEGIN) also adds each
// top-k id of `t` to `counts`.

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <chrono>
#include <vector>

namespace {

struct LayerTimer {
  at::Tensor buf, bounds, counts;
  int64_t sample_every, window, ring, hist, sums;
};

std::vector<LayerTimer>& layers() {
  static std::vector<LayerTimer> all;
  return all;
}

void timer_register(int64_t slot, const at::Tensor& buf, const at::Tensor& bounds, const at::Tensor& counts,
                    int64_t sample_every, int64_t window, int64_t ring, int64_t hist, int64_t sums) {
  TORCH_CHECK_VALUE(slot >= 0 && sample_every > 0 && window > 0, "moe timer: bad registration");
  for (const auto* t : {&buf, &bounds, &counts})
    TORCH_CHECK_VALUE(t->scalar_type() == at::kLong && t->is_contiguous() && t->device().is_cpu(),
                      "moe timer buffers must be contiguous int64 CPU tensors");
  TORCH_CHECK_VALUE(buf.numel() >= sums + 4 && ring + 4 * window <= hist, "moe timer: buffer too small");
  auto& all = layers();
  if (static_cast<int64_t>(all.size()) <= slot) all.resize(slot + 1);
  all[slot] = LayerTimer{buf, bounds, counts, sample_every, window, ring, hist, sums};
}

// Histogram bucket of a duration: the number of bounds it exceeds (the last bucket is +Inf).
void observe(const LayerTimer& L, int64_t* b, int phase, int64_t dt) {
  const int64_t* bounds = L.bounds.data_ptr<int64_t>();
  const int64_t nb = L.bounds.numel();
  int64_t bucket = 0;
  while (bucket < nb && dt > bounds[bucket]) ++bucket;
  b[L.hist + phase * (L.sums - L.hist) / 4 + bucket] += 1;
  b[L.sums + phase] += dt;
}

template <typename T>
void count_ids(const at::Tensor& ids, int64_t* counts, int64_t num_experts) {
  const T* p = ids.data_ptr<T>();
  for (int64_t i = 0, n = ids.numel(); i < n; ++i)
    if (p[i] >= 0 && p[i] < num_experts) counts[p[i]] += 1;
}

at::Tensor moe_timer(const at::Tensor& t, int64_t slot, int64_t point) {
  const int64_t now =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count();
  auto& all = layers();
  TORCH_CHECK_VALUE(slot >= 0 && slot < static_cast<int64_t>(all.size()) && all[slot].buf.defined(),
                    "moe timer: slot ", slot, " is not registered");
  const LayerTimer& L = all[slot];
  int64_t* b = L.buf.data_ptr<int64_t>();
  int64_t call;
  if (point == 0) {
    call = b[0]++;
    b[1] += t.dim() ? t.size(0) : 0;
    const at::Tensor ids = t.contiguous();
    int64_t* counts = L.counts.data_ptr<int64_t>();
    if (ids.scalar_type() == at::kLong) {
      count_ids<int64_t>(ids, counts, L.counts.numel());
    } else {
      TORCH_CHECK_VALUE(ids.scalar_type() == at::kInt, "moe timer: top-k ids must be int32 or int64");
      count_ids<int32_t>(ids, counts, L.counts.numel());
    }
  } else {
    call = b[0] - 1;
  }
  if (call >= 0 && call % L.sample_every == 0) {
    int64_t* s = b + L.ring + ((call / L.sample_every) % L.window) * 4;
    if (point == 0) {
      s[0] = now;
      s[1] = s[2] = s[3] = 0;
    } else if (point < 3) {
      s[point] = now;
    } else {
      s[3] = now;
      observe(L, b, 0, now - s[0]);
      if (s[1] > 0 && s[2] > 0) {
        observe(L, b, 1, s[1] - s[0]);
        observe(L, b, 2, s[2] - s[1]);
        observe(L, b, 3, now - s[2]);
      }
    }
  }
  return t.clone();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mok_serve_cpu, m) {
  m.def("timer_register(int slot, Tensor buf, Tensor bounds, Tensor counts, int sample_every, int window, "
        "int ring, int hist, int sums) -> ()");
  m.def("moe_timer(Tensor t, int slot, int point) -> Tensor");
}

TORCH_LIBRARY_IMPL(mok_serve_cpu, CPU, m) { m.impl("moe_timer", &moe_timer); }

TORCH_LIBRARY_IMPL(mok_serve_cpu, CompositeExplicitAutograd, m) { m.impl("timer_register", &timer_register); }
