// Paged attention for prefill rows on CPU (more than one new token per sequence: a prompt, a
// chunk of one after its cached part, a prompt after a prefix-cache hit). Flash-style: every
// query row's softmax is kept online over tiles of 64 keys, so no score matrix larger than a
// tile is ever written. Built into cpu_attention.py's library; checked against reference.py.
//
//   q            [num_tokens, num_heads, head_dim]          float32 or bfloat16
//   k/v_cache    [num_blocks, block_size, kv_heads, head_dim], blocks strided (block-major cache)
//   block_tables [num_seqs, max_blocks] int32; seq_lens (context incl. the new tokens),
//   q_starts, q_lens [num_seqs] int64: sequence s's new tokens are q rows
//   [q_starts[s], q_starts[s] + q_lens[s]) at positions seq_lens[s] - q_lens[s] + t.
//   out          [num_tokens, num_heads, head_dim] (those rows written)
//
// Two passes, each over torch's OpenMP pool:
//   1. every (sequence, KV head)'s context is read once from its blocks and packed as float32:
//      K transposed by tile ([tile][head_dim][64]: products with lanes over keys; a whole
//      context's [head_dim][context] would put a tile's rows 4 KiB apart at 1,024 tokens, all
//      in one set of the L1 cache) and V as rows.
//      Cost: one read of the context per layer, against a compute that grows with its square.
//   2. tasks of (sequence, KV head, 32 positions), longest first, taken by the threads as they
//      come free (causal work is uneven: a late block of a prompt reads 16x the keys of an
//      early one). A task's rows are its positions x the G query heads that share the KV head
//      (GQA folded into rows: K and V read once for all G). Per tile of 64 keys:
//        S = Q K^T (4 rows x 64 keys of accumulators: lanes over keys),
//        the causal mask on the diagonal tile, running max and sum, O rescaled,
//        O += P V (rows x head_dim accumulators: lanes over the head dim).
// Everything is float32 whatever the cache's dtype: q, K and V are converted once when packed.
// The head dim is padded to a multiple of 16 with zeros in the packed copies (any head dim up
// to 256). No infinities (the library is built with -ffast-math): masked keys are never
// scored; a row's state starts empty (sum 0) rather than at -inf.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_simd.h"

namespace {

typedef float vf __attribute__((vector_size(64)));                   // 16 float32 lanes
typedef float vfu __attribute__((vector_size(64), aligned(4)));      // the same, unaligned in memory

inline vf loadu(const float* p) { return *reinterpret_cast<const vfu*>(p); }
// A value held in a register: gcc would otherwise fold each use of a loaded vector into its
// FMA as a memory operand, one load per FMA, and the loads, not the FMAs, would set the pace.
#if defined(__x86_64__) && defined(__AVX512F__)  // (a 64-byte vector fits one register only there)
#define FOLIO_IN_REG(v) __asm__("" : "+v"(v))
#else
#define FOLIO_IN_REG(v) do {} while (0)
#endif
inline void storeu(float* p, vf v) { *reinterpret_cast<vfu*>(p) = v; }

constexpr int BK = 64;  // keys per tile
constexpr int BQ = 32;  // positions per task

inline float to_f(float v) { return v; }
inline float to_f(c10::BFloat16 v) { return static_cast<float>(v); }

// S[r][0:64] = Q[r] . Kt[:, 0:64] for `rows` rows (a multiple of 4); Kt: one tile, [Dp][64].
template <int NV>
void scores_tile(const float* Q, int64_t rows, const float* Kt, float* S) {
  constexpr int D = 16 * NV;
  for (int64_t r = 0; r < rows; r += 4) {
    vf a[4][4] = {};
    const float* q = Q + r * D;
    for (int d = 0; d < D; ++d) {
      const float* k = Kt + d * BK;
      vf k0 = loadu(k), k1 = loadu(k + 16), k2 = loadu(k + 32), k3 = loadu(k + 48);
      FOLIO_IN_REG(k0);
      FOLIO_IN_REG(k1);
      FOLIO_IN_REG(k2);
      FOLIO_IN_REG(k3);
      for (int i = 0; i < 4; ++i) {
        const float b = q[i * D + d];
        a[i][0] += b * k0, a[i][1] += b * k1, a[i][2] += b * k2, a[i][3] += b * k3;
      }
    }
    for (int i = 0; i < 4; ++i)
      for (int c = 0; c < 4; ++c) storeu(S + (r + i) * BK + 16 * c, a[i][c]);
  }
}

// O[r] += P[r][0:nk] V[0:nk] for `rows` rows (a multiple of R), V rows D floats apart.
template <int NV>
void values_tile(const float* P, int64_t rows, int64_t nk, const float* V, float* O) {
  constexpr int D = 16 * NV;
  constexpr int R = NV >= 8 ? 2 : NV >= 4 ? 4 : 8;  // R x NV accumulators (16 at most)
  for (int64_t r = 0; r < rows; r += R) {
    vf a[R][NV];
    for (int i = 0; i < R; ++i)
      for (int c = 0; c < NV; ++c) a[i][c] = loadu(O + (r + i) * D + 16 * c);
    for (int64_t k = 0; k < nk; ++k) {
      vf v[NV];
      for (int c = 0; c < NV; ++c) {
        v[c] = loadu(V + k * D + 16 * c);
        FOLIO_IN_REG(v[c]);
      }
      for (int i = 0; i < R; ++i) {
        const float p = P[(r + i) * BK + k];
        for (int c = 0; c < NV; ++c) a[i][c] += p * v[c];
      }
    }
    for (int i = 0; i < R; ++i)
      for (int c = 0; c < NV; ++c) storeu(O + (r + i) * D + 16 * c, a[i][c]);
  }
}

struct Scratch {
  std::vector<float> q, s, o, m, l;
  std::vector<int64_t> pos;
};

template <typename T, int NV>
void prefill_rows(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& q_starts,
                  const at::Tensor& q_lens, const at::Tensor& out, double scale) {
  constexpr int64_t Dp = 16 * NV;
  const int64_t S = seq_lens.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), KVH = k_cache.size(2), G = H / KVH;
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t kb = k_cache.stride(0), kt = k_cache.stride(1), kh = k_cache.stride(2);
  const int64_t vb = v_cache.stride(0), vt = v_cache.stride(1), vh = v_cache.stride(2);
  const int64_t qs = q.stride(0), qh = q.stride(1), os = out.stride(0), oh = out.stride(1);
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int64_t bts = block_tables.stride(0);
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  const int64_t* q0 = q_starts.data_ptr<int64_t>();
  const int64_t* ql = q_lens.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);

  // pass 1: the packed K^T and V of every (sequence, KV head), padded to whole tiles
  std::vector<int64_t> base(S + 1, 0), cp(S);
  for (int64_t s = 0; s < S; ++s) {
    cp[s] = (sl[s] + BK - 1) / BK * BK;
    base[s + 1] = base[s] + 2 * KVH * cp[s] * Dp;
  }
  // the calling thread's buffer, kept between calls (layers, steps) up to 64 MiB; a larger
  // need (long contexts) gets its own, freed on return
  static thread_local std::vector<float> kept;
  std::vector<float> own;
  std::vector<float>& packed = base[S] <= (16 << 20) ? kept : own;
  if (packed.size() < static_cast<size_t>(base[S])) packed.resize(base[S]);
  float* pk = packed.data();
  at::parallel_for(0, S * KVH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = i / KVH, j = i % KVH, L = sl[s], c = cp[s];
      float* Kt = pk + base[s] + j * c * Dp;      // [c / BK][Dp][BK]
      float* V = pk + base[s] + (KVH + j) * c * Dp;  // [c][Dp]
      const int32_t* tab = bt + s * bts;
      for (int64_t p = 0; p < L; ++p) {
        const int64_t b = tab[p / bs], t = p % bs;
        const T* kr = kp + b * kb + t * kt + j * kh;
        const T* vr = vp + b * vb + t * vt + j * vh;
        float* kt_p = Kt + (p / BK) * Dp * BK + p % BK;
        for (int64_t d = 0; d < D; ++d) kt_p[d * BK] = to_f(kr[d]);
        float* v = V + p * Dp;
        for (int64_t d = 0; d < D; ++d) v[d] = to_f(vr[d]);
        for (int64_t d = D; d < Dp; ++d) v[d] = 0.f;
      }
      for (int64_t d = 0; d < Dp; ++d)
        for (int64_t p = (d < D ? L : 0); p < c; ++p) Kt[(p / BK) * Dp * BK + d * BK + p % BK] = 0.f;
      std::memset(V + L * Dp, 0, (c - L) * Dp * sizeof(float));
    }
  });

  // pass 2: the tasks, longest first
  struct Task {
    int64_t s, j, t0, work;
  };
  std::vector<Task> tasks;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t t0 = 0; t0 < ql[s]; t0 += BQ) {
      const int64_t last = sl[s] - ql[s] + std::min(ql[s], t0 + BQ);  // keys [0, last)
      for (int64_t j = 0; j < KVH; ++j) tasks.push_back({s, j, t0, last});
    }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.work > b.work; });
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(tasks.size());
  const int64_t workers = std::min<int64_t>(n, at::get_num_threads());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    static thread_local Scratch w;
    const int64_t Mmax = (BQ * G + 7) / 8 * 8;
    w.q.resize(Mmax * Dp), w.s.resize(Mmax * BK), w.o.resize(Mmax * Dp), w.m.resize(Mmax), w.l.resize(Mmax);
    w.pos.resize(Mmax);
    for (int64_t ti; (ti = next.fetch_add(1)) < n;) {
      const Task& task = tasks[ti];
      const int64_t s = task.s, j = task.j, L = sl[s], c = cp[s];
      const int64_t nt = std::min<int64_t>(BQ, ql[s] - task.t0), p0 = L - ql[s] + task.t0;
      const int64_t M = nt * G, Mp = (M + 7) / 8 * 8;
      const float* Kt = pk + base[s] + j * c * Dp;
      const float* V = pk + base[s] + (KVH + j) * c * Dp;
      float* Q = w.q.data();
      for (int64_t m = 0; m < Mp; ++m) {  // rows: position-major, then the G heads of KV head j
        float* qr = Q + m * Dp;
        if (m < M) {
          const T* src = qp + (q0[s] + task.t0 + m / G) * qs + (j * G + m % G) * qh;
          for (int64_t d = 0; d < D; ++d) qr[d] = to_f(src[d]) * sc;
          for (int64_t d = D; d < Dp; ++d) qr[d] = 0.f;
          w.pos[m] = p0 + m / G;
        } else {  // padding: a copy of the last row, never written out
          std::memcpy(qr, Q + (M - 1) * Dp, Dp * sizeof(float));
          w.pos[m] = w.pos[M - 1];
        }
        w.m[m] = 0.f, w.l[m] = 0.f;
      }
      std::fill(w.o.begin(), w.o.begin() + Mp * Dp, 0.f);
      float* Sb = w.s.data();
      for (int64_t k0 = 0; k0 < task.work; k0 += BK) {
        scores_tile<NV>(Q, Mp, Kt + k0 * Dp, Sb);
        const bool diagonal = k0 + BK - 1 > p0;  // some row sees only part of this tile
        int64_t nk = 0;  // keys any row sees
        for (int64_t m = 0; m < Mp; ++m) {
          float* sr = Sb + m * BK;
          const int64_t vc = diagonal ? std::clamp<int64_t>(w.pos[m] - k0 + 1, 0, BK) : BK;
          nk = std::max(nk, vc);
          if (vc == 0) {
            std::fill(sr, sr + BK, 0.f);
            continue;
          }
          float mx = sr[0];
          for (int64_t k = 1; k < vc; ++k) mx = std::max(mx, sr[k]);
          const bool first = w.l[m] == 0.f;
          const float mnew = first ? mx : std::max(w.m[m], mx);
          float sum = 0.f;
#ifdef __AVX512F__
          sum = folio_simd::exp_minus_sum(sr, vc, mnew);  // 16 lanes (glibc's expf: a call per key)
#else
#pragma omp simd reduction(+ : sum)
          for (int64_t k = 0; k < vc; ++k) {
            sr[k] = expf(sr[k] - mnew);
            sum += sr[k];
          }
#endif
          for (int64_t k = vc; k < BK; ++k) sr[k] = 0.f;
          if (!first && mnew != w.m[m]) {
            const float alpha = expf(w.m[m] - mnew);
            float* o = w.o.data() + m * Dp;
            for (int64_t d = 0; d < Dp; ++d) o[d] *= alpha;
            w.l[m] *= alpha;
          }
          w.m[m] = mnew, w.l[m] += sum;
        }
        values_tile<NV>(Sb, Mp, nk, V + k0 * Dp, w.o.data());
      }
      for (int64_t m = 0; m < M; ++m) {
        T* dst = op + (q0[s] + task.t0 + m / G) * os + (j * G + m % G) * oh;
        const float* o = w.o.data() + m * Dp;
        const float inv = 1.f / w.l[m];
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(o[d] * inv);
      }
    }
  });
}

template <typename T>
void by_vectors(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& q_starts,
                const at::Tensor& q_lens, const at::Tensor& out, double scale) {
#define FOLIO_NV(N) \
  case N: prefill_rows<T, N>(q, k_cache, v_cache, block_tables, seq_lens, q_starts, q_lens, out, scale); break;
  switch ((q.size(2) + 15) / 16) {
    FOLIO_NV(1) FOLIO_NV(2) FOLIO_NV(3) FOLIO_NV(4) FOLIO_NV(5) FOLIO_NV(6) FOLIO_NV(7) FOLIO_NV(8)
    FOLIO_NV(10) FOLIO_NV(12) FOLIO_NV(16)
    default: TORCH_CHECK(false, "head_dim ", q.size(2), " is not supported (at most 256)");
  }
#undef FOLIO_NV
}

void prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& q_starts,
                       const at::Tensor& q_lens, const at::Tensor& out, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "q/out [tokens, heads, head_dim], caches [blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type() &&
                  q.scalar_type() == out.scalar_type(), "q, caches and out must share one dtype");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && k_cache.size(2) > 0 && q.size(1) % k_cache.size(2) == 0,
              "head_dim must match and num_heads be a multiple of kv_heads");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "the head_dim axis must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.stride(1) == 1,
              "block_tables: int32 [seqs, max_blocks], rows contiguous");
  const int64_t S = seq_lens.numel();
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && q_starts.scalar_type() == at::kLong &&
                  q_lens.scalar_type() == at::kLong && seq_lens.is_contiguous() && q_starts.is_contiguous() &&
                  q_lens.is_contiguous() && q_starts.numel() == S && q_lens.numel() == S &&
                  block_tables.size(0) == S,
              "seq_lens, q_starts and q_lens: contiguous int64, one per block table row");
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  const int64_t* q0 = q_starts.data_ptr<int64_t>();
  const int64_t* ql = q_lens.data_ptr<int64_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int64_t bs = k_cache.size(1), num_blocks = k_cache.size(0), max_blocks = block_tables.size(1);
  for (int64_t s = 0; s < S; ++s) {  // checked before any task runs: a bad table cannot read out of bounds
    TORCH_CHECK(sl[s] >= 1 && sl[s] <= max_blocks * bs, "sequence ", s, ": context length ", sl[s],
                " outside 1..", max_blocks * bs, " (its block table's width)");
    TORCH_CHECK(ql[s] >= 1 && ql[s] <= sl[s], "sequence ", s, ": ", ql[s], " new tokens outside 1..", sl[s]);
    TORCH_CHECK(q0[s] >= 0 && q0[s] + ql[s] <= q.size(0), "sequence ", s, ": query rows ", q0[s], "..",
                q0[s] + ql[s] - 1, " outside 0..", q.size(0) - 1);
    for (int64_t j = 0, nb = (sl[s] + bs - 1) / bs; j < nb; ++j) {
      const int32_t b = bt[s * block_tables.stride(0) + j];
      TORCH_CHECK(b >= 0 && b < num_blocks, "sequence ", s, ": block ", b, " outside the cache's ", num_blocks);
    }
  }
  if (S == 0) return;
  if (q.scalar_type() == at::kFloat) {
    by_vectors<float>(q, k_cache, v_cache, block_tables, seq_lens, q_starts, q_lens, out, scale);
  } else if (q.scalar_type() == at::kBFloat16) {
    by_vectors<c10::BFloat16>(q, k_cache, v_cache, block_tables, seq_lens, q_starts, q_lens, out, scale);
  } else {
    TORCH_CHECK(false, "dtype ", q.scalar_type(), " is not supported (float32, bfloat16)");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(folio_cpu, m) {
  m.def("prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor q_starts, Tensor q_lens, Tensor(a!) out, float scale) -> ()");
  m.impl("prefill_attention", c10::DispatchKey::CPU, TORCH_FN(prefill_attention));
}
