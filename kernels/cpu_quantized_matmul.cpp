// A few rows times a quantized weight matrix, for decode steps on MLX's CPU backend.
//
// A decode step is one pass over every weight matrix for a handful of rows, so its time is the bytes of
// the weights. Dequantized to float32 the default model's matrices are 2 GB a pass; their affine levels
// (2-8 bits, one scale and bias per group of weights) held one byte each are a quarter of that. MLX's own
// CPU kernel for quantized weights is slower than the float32 pass, so this one forms each group's
// weights in registers, w = level * scale + bias (in float32, as the float32 copy holds them), multiplies
// them into every row at once, and splits the output features across the cores.
//
// Plain loops over constant trip counts (rows, group size) that the compiler vectorises for the machine
// it builds on. kernels/cpu_quantized_matmul.py builds this file and calls it through ctypes;
// tests/test_cpu_quantized_matmul.py checks it against mx.dequantize and a float32 product.
#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace {

constexpr int kRowsPerPass = 8;  // rows multiplied per pass over the weights (accumulators stay in registers)

int threads = 1;

// fn(n0, n1) over [0, n) on up to n_threads threads (the calling one included).
template <typename F>
void parallel_features(int64_t n, int n_threads, F fn) {
  const int parts = (int)std::max<int64_t>(1, std::min<int64_t>(n_threads, n / 64));
  std::vector<std::thread> pool;
  for (int t = 1; t < parts; ++t) pool.emplace_back(fn, t * n / parts, (t + 1) * n / parts);
  fn(0, n / parts);
  for (auto& th : pool) th.join();
}

// Output features [n0, n1) of y [M, N] = x [M, K] @ W.T, W's rows as levels [N, K] with S-typed scales and
// biases [N, K / G].
template <int M, int G, typename S>
void features(const float* __restrict x, int64_t K, const uint8_t* __restrict levels, const S* scales,
              const S* biases, int64_t N, const float* bias, float* y, int64_t n0, int64_t n1) {
  const int64_t groups = K / G;
  for (int64_t n = n0; n < n1; ++n) {
    float acc[M][G] = {};
    const uint8_t* row = levels + n * K;
    for (int64_t g = 0; g < groups; ++g) {
      const float s = (float)scales[n * groups + g], b = (float)biases[n * groups + g];
      const uint8_t* q = row + g * G;
      float w[G];
#pragma omp simd
      for (int j = 0; j < G; ++j) w[j] = (float)q[j] * s + b;
#pragma GCC unroll 8
      for (int r = 0; r < M; ++r) {
        const float* xr = x + r * K + g * G;
#pragma omp simd
        for (int j = 0; j < G; ++j) acc[r][j] += xr[j] * w[j];
      }
    }
    for (int r = 0; r < M; ++r) {
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int j = 0; j < G; ++j) sum += acc[r][j];
      y[r * N + n] = bias ? sum + bias[n] : sum;
    }
  }
}

template <int M, int G, typename S>
void pass(const float* x, int64_t K, const uint8_t* levels, const void* scales, const void* biases, int64_t N,
          const float* bias, float* y) {
  parallel_features(N, threads, [=](int64_t n0, int64_t n1) {
    features<M, G, S>(x, K, levels, (const S*)scales, (const S*)biases, N, bias, y, n0, n1);
  });
}

template <int G, typename S>
void rows(int m, const float* x, int64_t K, const uint8_t* levels, const void* scales, const void* biases,
          int64_t N, const float* bias, float* y) {
  typedef void (*pass_fn)(const float*, int64_t, const uint8_t*, const void*, const void*, int64_t,
                          const float*, float*);
  static constexpr pass_fn by_rows[kRowsPerPass] = {pass<1, G, S>, pass<2, G, S>, pass<3, G, S>,
                                                    pass<4, G, S>, pass<5, G, S>, pass<6, G, S>,
                                                    pass<7, G, S>, pass<8, G, S>};
  for (int r0 = 0; r0 < m; r0 += kRowsPerPass) {
    const int count = std::min(kRowsPerPass, m - r0);
    by_rows[count - 1](x + r0 * K, K, levels, scales, biases, N, bias, y + r0 * N);
  }
}

template <typename S>
int by_group(int group, int m, const float* x, int64_t K, const uint8_t* levels, const void* scales,
             const void* biases, int64_t N, const float* bias, float* y) {
  switch (group) {
    case 32: rows<32, S>(m, x, K, levels, scales, biases, N, bias, y); return 0;
    case 64: rows<64, S>(m, x, K, levels, scales, biases, N, bias, y); return 0;
    case 128: rows<128, S>(m, x, K, levels, scales, biases, N, bias, y); return 0;
  }
  return 1;
}

}  // namespace

extern "C" {

void minivllm_quantized_matmul_init(int n_threads) { threads = std::max(1, n_threads); }

// y [m, N] = x [m, K] @ (levels * scales + biases).T (+ bias [N], or null). Levels are one byte each
// [N, K]; scales and biases [N, K / group] are float16 (half_scales) or float32. Returns nonzero, having
// written nothing, for a group size it has no loop for.
int minivllm_quantized_matmul(const float* x, int m, int64_t K, const uint8_t* levels, const void* scales,
                              const void* biases, int half_scales, int group, int64_t N, const float* bias,
                              float* y) {
  if (m < 1 || K % group != 0) return 1;
  if (half_scales) return by_group<_Float16>(group, m, x, K, levels, scales, biases, N, bias, y);
  return by_group<float>(group, m, x, K, levels, scales, biases, N, bias, y);
}

}  // extern "C"
