// Causal attention of one sequence's new tokens over its paged context, for MLX's CPU backend.
//
// MLX's CPU backend computes `exp` one element at a time (~12 ns) and materialises each step of an
// unfused softmax as its own array. Here each block of BLOCK queries, one KV head's group of query heads
// at a time: the scores with the BLAS MLX itself uses (OpenBLAS's cblas_sgemm, passed in), the masked
// softmax's numerators with glibc's vectorised expf (libmvec) on every core, the values' product, and the
// output rows divided by their sums. A block sees the keys up to its own last position (fully masked key
// blocks are never computed); a sliding window starts its keys at its first query's window. Decode tokens
// (few rows) take plain loops instead of BLAS, the KV heads side by side, each key and value read once.
// The context is read in place from the pools through its runs of consecutive slots: no gather, no copy.
//
// kernels/cpu_attention.py builds this file with the system compiler and calls it through ctypes;
// tests/test_paged_attention.py checks it against a dense reference, tests/test_long_context.py the
// engine's tokens against mlx-lm's with it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <thread>
#include <vector>

namespace {

// cblas_sgemm(order, transA, transB, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)
typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float*, int, const float*, int, float,
                         float*, int);
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;

sgemm_fn sgemm = nullptr;
int threads = 1;

struct Piece {
  int64_t slot;  // first pool slot
  int64_t len;   // consecutive slots
};

// The pieces of the context holding positions [first, limit), from its runs (first slot, slots).
std::vector<Piece> pieces(const int64_t* run_slot, const int64_t* run_len, int n_runs, int64_t first,
                          int64_t limit) {
  std::vector<Piece> out;
  int64_t position = 0;  // the context position of the run's first slot
  for (int i = 0; i < n_runs && position < limit; ++i) {
    int64_t lo = std::max(first, position), hi = std::min(limit, position + run_len[i]);
    if (lo < hi) out.push_back({run_slot[i] + lo - position, hi - lo});
    position += run_len[i];
  }
  return out;
}

// Rows [r0, r1) of a block's scores: softmax numerators in place over the visible keys, zero elsewhere;
// sums[r] gets each row's denominator. sinks: the group's query heads' sink logits (gpt-oss's: one more
// term of each row's denominator, with no value), or null.
void softmax_rows(float* scores, int64_t width, int r0, int r1, int rows_per_head, int64_t first,
                  int64_t first_query, int64_t window, const float* sinks, float* sums) {
  for (int r = r0; r < r1; ++r) {
    float* row = scores + r * width;
    int64_t position = first_query + r % rows_per_head;
    int64_t hi = std::min(width, position - first + 1);  // keys after the query's own are hidden
    int64_t lo = window > 0 ? std::max<int64_t>(0, position - window + 1 - first) : 0;
    float m = row[lo];
    for (int64_t j = lo + 1; j < hi; ++j) m = std::max(m, row[j]);
    const float sink = sinks ? sinks[r / rows_per_head] : 0.f;
    if (sinks) m = std::max(m, sink);
    float s = sinks ? expf(sink - m) : 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t j = lo; j < hi; ++j) {
      float e = expf(row[j] - m);
      row[j] = e;
      s += e;
    }
    std::fill(row, row + lo, 0.f);
    std::fill(row + hi, row + width, 0.f);
    sums[r] = s;
  }
}

// fn(r0, r1) over [0, rows) on up to n_threads threads (the calling one included).
template <typename F>
void parallel_rows(int rows, int n_threads, F fn) {
  int n = std::max(1, std::min(n_threads, rows));
  std::vector<std::thread> pool;
  for (int t = 1; t < n; ++t) pool.emplace_back(fn, t * rows / n, (t + 1) * rows / n);
  fn(0, rows / n);
  for (auto& th : pool) th.join();
}

// One block of a KV head's group: the `rows_per_head` queries from token b0 of each of the group's `rep`
// query heads over the context positions [first, first + width). softmax_threads: threads for the
// softmax (1 where the groups themselves run side by side).
struct Block {
  const float* q;
  const float* k_head;
  const float* v_head;
  const float* sinks;  // the group's query heads' sink logits, or null
  int H, D, rep, group, rows_per_head;
  bool few;  // few rows: plain loops, not BLAS
  int64_t b0, first, first_query, width, window;
  float scale;
  float* out;
};

// Few rows (decode): the products as plain loops over the keys, each key and value row read once (a BLAS
// call packs the whole K or V first, reading it twice); the compiler vectorises the head dimension.
void few_rows_scores(const float* q_rows, int M, int D, const float* k, int64_t len, float scale,
                     float* scores, int64_t width) {
  for (int64_t j = 0; j < len; ++j, k += D)
    for (int r = 0; r < M; ++r) {
      const float* qr = q_rows + r * D;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int d = 0; d < D; ++d) acc += qr[d] * k[d];
      scores[r * width + j] = acc * scale;
    }
}

void few_rows_values(const float* probs, int M, int D, const float* v, int64_t len, int64_t width,
                     float* out) {
  for (int64_t j = 0; j < len; ++j, v += D)
    for (int r = 0; r < M; ++r) {
      const float p = probs[r * width + j];
      float* o = out + r * D;
#pragma omp simd
      for (int d = 0; d < D; ++d) o[d] += p * v[d];
    }
}

// A group's buffers, kept by the calling thread across calls (workers are new threads each call: their
// own thread_local buffers would be allocated, and page-faulted, every time).
struct Workspace {
  std::vector<float> scores, q_rows, o_rows, sums;
};

void attend_group(const Block& b, const std::vector<Piece>& ps, int softmax_threads, Workspace& w) {
  auto &scores = w.scores, &q_rows = w.q_rows, &o_rows = w.o_rows, &sums = w.sums;
  const int M = b.rep * b.rows_per_head, D = b.D;
  scores.resize((size_t)M * b.width);
  q_rows.resize((size_t)M * D);
  o_rows.resize((size_t)M * D);
  sums.resize(M);
  // the group's query heads stacked: row j * rows_per_head + i is head group * rep + j, token b0 + i
  for (int j = 0; j < b.rep; ++j)
    for (int i = 0; i < b.rows_per_head; ++i)
      std::copy_n(b.q + ((b.b0 + i) * b.H + b.group * b.rep + j) * D, D,
                  &q_rows[(j * b.rows_per_head + i) * D]);
  const bool few = b.few;
  int64_t column = 0;
  for (const Piece& p : ps) {
    if (few)
      few_rows_scores(q_rows.data(), M, D, b.k_head + p.slot * D, p.len, b.scale, scores.data() + column,
                      b.width);
    else
      sgemm(kRowMajor, kNoTrans, kTrans, M, (int)p.len, D, b.scale, q_rows.data(), D, b.k_head + p.slot * D,
            D, 0.f, scores.data() + column, (int)b.width);
    column += p.len;
  }
  float *scores_data = scores.data(), *sums_data = sums.data();
  const Block* bp = &b;
  parallel_rows(M, softmax_threads, [=](int r0, int r1) {
    softmax_rows(scores_data, bp->width, r0, r1, bp->rows_per_head, bp->first, bp->first_query, bp->window,
                 bp->sinks, sums_data);
  });
  column = 0;
  if (few) std::fill(o_rows.begin(), o_rows.end(), 0.f);
  for (size_t i = 0; i < ps.size(); ++i) {
    if (few)
      few_rows_values(scores.data() + column, M, D, b.v_head + ps[i].slot * D, ps[i].len, b.width,
                      o_rows.data());
    else
      sgemm(kRowMajor, kNoTrans, kNoTrans, M, D, (int)ps[i].len, 1.f, scores.data() + column, (int)b.width,
            b.v_head + ps[i].slot * D, D, i == 0 ? 0.f : 1.f, o_rows.data(), D);
    column += ps[i].len;
  }
  for (int j = 0; j < b.rep; ++j)
    for (int i = 0; i < b.rows_per_head; ++i) {
      const int r = j * b.rows_per_head + i;
      const float inv = 1.f / sums[r];
      float* dst = b.out + ((b.b0 + i) * b.H + b.group * b.rep + j) * D;
      for (int d = 0; d < D; ++d) dst[d] = o_rows[r * D + d] * inv;
    }
}

}  // namespace

extern "C" {

void minivllm_attention_init(void* cblas_sgemm, int num_threads) {
  sgemm = reinterpret_cast<sgemm_fn>(cblas_sgemm);
  threads = std::max(1, num_threads);
}

// q: [n, H, D] (the sequence's n new tokens, at positions start .. start + n - 1); k_pool, v_pool:
// [Hkv, slots, D]; runs: the context's (first slot, slots) in order, covering positions 0 .. start + n
// - 1; window: a sliding window's size, 0 for none; sinks: [H] sink logits, or null; block: queries per
// causal block; few_rows: a group's query rows (heads sharing a KV head x the block's queries) up to which
// the groups run side by side, each on one core with plain loops (decode), where above it they run one
// after the other with BLAS and the softmax on every core. out: [n, H, D].
void minivllm_attention(const float* q, const float* k_pool, const float* v_pool, int64_t slots, int H,
                        int Hkv, int D, int64_t n, int64_t start, const int64_t* run_slot,
                        const int64_t* run_len, int n_runs, int64_t window, const float* sinks, float scale,
                        int block, int few_rows, float* out) {
  const int rep = H / Hkv;
  thread_local std::vector<Workspace> workspaces;
  workspaces.resize(std::max<size_t>(workspaces.size(), Hkv));
  Workspace* ws = workspaces.data();  // a lambda run on a worker would name the worker's own thread_local
  for (int64_t b0 = 0; b0 < n; b0 += block) {
    const int rows_per_head = (int)std::min<int64_t>(block, n - b0);
    const int64_t first_query = start + b0, visible = first_query + rows_per_head;
    const int64_t first = window > 0 ? std::max<int64_t>(0, first_query - window + 1) : 0;
    const std::vector<Piece> ps = pieces(run_slot, run_len, n_runs, first, visible);
    std::vector<Block> blocks;
    for (int g = 0; g < Hkv; ++g)
      blocks.push_back({q, k_pool + (int64_t)g * slots * D, v_pool + (int64_t)g * slots * D,
                        sinks ? sinks + g * rep : nullptr, H, D, rep, g, rows_per_head,
                        rep * rows_per_head <= few_rows, b0, first, first_query, visible - first, window,
                        scale, out});
    if (blocks[0].few) {
      parallel_rows(Hkv, threads, [&](int g0, int g1) {
        for (int g = g0; g < g1; ++g) attend_group(blocks[g], ps, 1, ws[g]);
      });
    } else {
      for (int g = 0; g < Hkv; ++g) attend_group(blocks[g], ps, threads, ws[g]);
    }
  }
}

}  // extern "C"
