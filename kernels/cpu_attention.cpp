// Paged attention for decode rows on CPU: each sequence's one new query attends to its whole
// context, read in place from the paged cache through its block table (no gather, no padding).
// Built and loaded by cpu_attention.py (g++ -O3 -march=native); checked against reference.py.
//
//   q            [num_tokens, num_heads, head_dim]         float32 or bfloat16
//   k/v_cache    [num_blocks, block_size, kv_heads, head_dim], blocks strided (block-major cache)
//   block_tables [num_seqs, max_blocks] int32, seq_lens [num_seqs] int64, rows [num_seqs] int64
//   out          [num_tokens, num_heads, head_dim] (rows[s] written for each s)
//
// One sequence per task (at::parallel_for, torch's own OpenMP pool): its blocks are walked in
// order, every KV head of a token at once, each K/V row read (and converted to float32) once
// for the G query heads that share it. Scores, softmax and the weighted sum of V are float32
// whatever the cache's dtype. GQA: head h reads kv head h / (num_heads / kv_heads).
//
// bfloat16 with head dim 64 or 128 and G <= 4, on a CPU with AVX512_BF16 (decode_seq_bf16):
// products by vdpbf16ps instead (K and V never converted), one KV head at a time so that all
// of its accumulators stay in registers, and the next sequence's K/V prefetched while this one
// is computed (that order would otherwise wait on memory at each block: they sit at random).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#include <immintrin.h>

#include "cpu_simd.h"

namespace {

// One sequence's context, walked block by block (no division per token): f(position, the
// token's K or V row base for this layer). Blocks sit at random places, where the hardware's
// prefetcher cannot follow: while token t of a block is used, the same token's row of the
// next block (`row` elements: every KV head) is asked for ahead.
template <typename T, typename F>
inline void for_each_token(const T* base, const int32_t* tab, int64_t L, int64_t bs, int64_t stride_b,
                           int64_t stride_t, int64_t row, F f) {
  const int64_t nb = (L + bs - 1) / bs;
  for (int64_t b = 0, p = 0; p < L; ++b) {
    const T* blk = base + static_cast<int64_t>(tab[b]) * stride_b;
    const char* next = b + 1 < nb ? reinterpret_cast<const char*>(base + static_cast<int64_t>(tab[b + 1]) * stride_b)
                                  : nullptr;
    for (int64_t t = 0; t < bs && p < L; ++t, ++p) {
      if (next != nullptr)
        for (int64_t c = 0; c < row * static_cast<int64_t>(sizeof(T)); c += 64)
          __builtin_prefetch(next + t * stride_t * static_cast<int64_t>(sizeof(T)) + c);
      f(p, blk + t * stride_t);
    }
  }
}

// A K/V row as float32: the row itself when it is float32, else converted once into `buf`
// (bfloat16 is the top half of a float32: a shift, which the compiler vectorizes).
inline const float* as_floats(const float* row, float*, int64_t) { return row; }
__attribute__((always_inline)) inline const float* as_floats(const c10::BFloat16* row, float* buf, int64_t n) {
  const uint16_t* r = reinterpret_cast<const uint16_t*>(row);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(r[i]) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    buf[i] = f;
  }
  return buf;
}

__attribute__((always_inline)) inline float dot(const float* a, const float* b, int64_t n) {
  float d = 0.f;
#pragma omp simd reduction(+ : d)
  for (int64_t i = 0; i < n; ++i) d += a[i] * b[i];
  return d;
}

// The G query heads of one KV head against a row: G dots that share the row's loads.
// Written out for the common group sizes so each keeps its own accumulator.
__attribute__((always_inline)) inline void dots(const float* q, const float* k, int64_t G, int64_t D, float* out, int64_t out_stride) {
  if (G == 1) {
    out[0] = dot(q, k, D);
  } else if (G == 2) {
    float a = 0.f, b = 0.f;
#pragma omp simd reduction(+ : a, b)
    for (int64_t i = 0; i < D; ++i) a += q[i] * k[i], b += q[D + i] * k[i];
    out[0] = a, out[out_stride] = b;
  } else if (G == 3) {
    float a = 0.f, b = 0.f, c = 0.f;
#pragma omp simd reduction(+ : a, b, c)
    for (int64_t i = 0; i < D; ++i) a += q[i] * k[i], b += q[D + i] * k[i], c += q[2 * D + i] * k[i];
    out[0] = a, out[out_stride] = b, out[2 * out_stride] = c;
  } else {
    for (int64_t g = 0; g < G; ++g) out[g * out_stride] = dot(q + g * D, k, D);
  }
}


// Softmax's numerators in place: exp(score - max), float32; returns 1 / their sum.
#ifdef __AVX512F__
// (16 lanes at a time, with cpu_simd.h's exp: the attention op 5 % faster than through glibc's
// expf on the AMX Xeon, SmolLM2's decode shape)
inline float exp_scores(float* sh, int64_t L) {
  __m512 mv = _mm512_set1_ps(std::numeric_limits<float>::lowest());
  int64_t p = 0;
  for (; p + 16 <= L; p += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(sh + p));
  float m = _mm512_reduce_max_ps(mv);
  for (; p < L; ++p) m = std::max(m, sh[p]);
  return 1.f / folio_simd::exp_minus_sum(sh, L, m);
}
#else
inline float exp_scores(float* sh, int64_t L) {
  float m = sh[0];
  for (int64_t p = 1; p < L; ++p) m = std::max(m, sh[p]);
  float t = 0.f;
#pragma omp simd reduction(+ : t)
  for (int64_t p = 0; p < L; ++p) {
    sh[p] = expf(sh[p] - m);
    t += sh[p];
  }
  return 1.f / t;
}
#endif

// Brings the next sequence's K/V into the cache while this one is computed: a few lines at a
// time, from the loops (a burst of prefetches would stall on the core's miss buffers).
#ifndef PUMP_LINES
#define PUMP_LINES 16
#endif
#ifndef PUMP_BYTES
#define PUMP_BYTES (384 << 10)
#endif
struct Pump {
  std::vector<std::pair<const char*, int64_t>> ranges;  // (start, bytes)
  size_t i = 0;
  int64_t off = 0;
  void clear() { ranges.clear(), i = 0, off = 0; }
  void add(const void* p, int64_t bytes) { ranges.emplace_back(static_cast<const char*>(p), bytes); }
  __attribute__((always_inline)) inline void step(int n) {
    while (n-- > 0 && i < ranges.size()) {
      __builtin_prefetch(ranges[i].first + off, 0, 2);
      off += 64;
      if (off >= ranges[i].second) ++i, off = 0;
    }
  }
};
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define FOLIO_BF16_DOT 1
// bfloat16 on a CPU with AVX512_BF16: the dots by vdpbf16ps (pairs of bf16 products summed
// into float32 lanes; no conversion of K), and the weighted sum of V the same way over pairs
// of tokens (two V rows interleaved by vpunpck{l,h}wd, the pair's two weights rounded to
// bf16, as torch's CPU SDPA rounds them before its bf16 product with V). One KV head at a
// time for all its G query heads, so every accumulator stays in a register.

template <int D, int G>
void decode_seq_bf16(const c10::BFloat16* qrow, int64_t qh, c10::BFloat16* orow, int64_t oh,
                     const c10::BFloat16* const* krows, const c10::BFloat16* const* vrows, int64_t L,
                     int64_t KVH, int64_t kh, int64_t vh, float sc, std::vector<float>& scores,
                     std::vector<uint16_t>& w16, Pump& pump) {
  constexpr int C = D / 32;  // 32-bf16 chunks per row
  scores.resize(G * L);
  w16.resize(G * (L + 1));
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t j = 0; j < KVH; ++j) {
    __m512bh qv[G][C];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c)
        qv[g][c] = (__m512bh)_mm512_loadu_si512(qrow + (j * G + g) * qh + 32 * c);
    float* s = scores.data();
    int64_t p = 0;
    for (; p + 4 <= L; p += 4) {  // four tokens' dots summed across lanes together
      pump.step(12);
      __m512 a[G][4];
      for (int u = 0; u < 4; ++u) {
        const c10::BFloat16* k = krows[p + u] + j * kh;
        __m512bh kc[C];
        for (int c = 0; c < C; ++c) kc[c] = (__m512bh)_mm512_loadu_si512(k + 32 * c);
        for (int g = 0; g < G; ++g) {
          a[g][u] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], kc[0]);
          for (int c = 1; c < C; ++c) a[g][u] = _mm512_dpbf16_ps(a[g][u], qv[g][c], kc[c]);
        }
      }
      for (int g = 0; g < G; ++g) {
        const __m512 t01 = _mm512_add_ps(_mm512_unpacklo_ps(a[g][0], a[g][1]), _mm512_unpackhi_ps(a[g][0], a[g][1]));
        const __m512 t23 = _mm512_add_ps(_mm512_unpacklo_ps(a[g][2], a[g][3]), _mm512_unpackhi_ps(a[g][2], a[g][3]));
        // each 128-bit lane: [u0, u1, u2, u3] partial sums
        const __m512 t = _mm512_add_ps(_mm512_shuffle_ps(t01, t23, 0x44), _mm512_shuffle_ps(t01, t23, 0xEE));
        const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(t), _mm512_extractf32x8_ps(t, 1));
        const __m128 r = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
        _mm_storeu_ps(s + g * L + p, _mm_mul_ps(r, _mm_set1_ps(sc)));
      }
    }
    for (; p < L; ++p) {
      pump.step(3);
      const c10::BFloat16* k = krows[p] + j * kh;
      __m512bh kc[C];
      for (int c = 0; c < C; ++c) kc[c] = (__m512bh)_mm512_loadu_si512(k + 32 * c);
      for (int g = 0; g < G; ++g) {
        __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], kc[0]);
        for (int c = 1; c < C; ++c) a = _mm512_dpbf16_ps(a, qv[g][c], kc[c]);
        s[g * L + p] = _mm512_reduce_add_ps(a) * sc;
      }
    }
    for (int g = 0; g < G; ++g) {
      float* sh = s + g * L;
      const float inv = exp_scores(sh, L);
      uint16_t* w = w16.data() + g * (L + 1);
      const __m512 iv = _mm512_set1_ps(inv);
      int64_t p = 0;
      for (; p + 16 <= L; p += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + p),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(sh + p), iv)));
      for (; p < L; ++p) w[p] = c10::BFloat16(sh[p] * inv).x;
      w[L] = 0;
    }
    __m512 acc[G][2 * C];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < 2 * C; ++c) acc[g][c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < L; p += 2) {
      pump.step(3);
      const c10::BFloat16* a = vrows[p] + j * vh;
      const c10::BFloat16* b = p + 1 < L ? vrows[p + 1] + j * vh : nullptr;
      __m512i lo[C], hi[C];
      for (int c = 0; c < C; ++c) {
        const __m512i va = _mm512_loadu_si512(a + 32 * c);
        const __m512i vb = b != nullptr ? _mm512_loadu_si512(b + 32 * c) : zero;
        lo[c] = _mm512_unpacklo_epi16(va, vb);
        hi[c] = _mm512_unpackhi_epi16(va, vb);
      }
      for (int g = 0; g < G; ++g) {
        const uint16_t* w = w16.data() + g * (L + 1) + p;
        const __m512bh pw = (__m512bh)_mm512_set1_epi32(static_cast<int>(w[0] | (static_cast<uint32_t>(w[1]) << 16)));
        for (int c = 0; c < C; ++c) {
          acc[g][2 * c] = _mm512_dpbf16_ps(acc[g][2 * c], pw, (__m512bh)lo[c]);
          acc[g][2 * c + 1] = _mm512_dpbf16_ps(acc[g][2 * c + 1], pw, (__m512bh)hi[c]);
        }
      }
    }
    // lane m of the lo accumulator of chunk c holds dim 32c + 8(m/4) + m%4; of the hi one, + 4
    for (int g = 0; g < G; ++g) {
      c10::BFloat16* o = orow + (j * G + g) * oh;
      for (int c = 0; c < C; ++c) {
        alignas(64) float lo[16], hi[16];
        _mm512_store_ps(lo, acc[g][2 * c]);
        _mm512_store_ps(hi, acc[g][2 * c + 1]);
        for (int m = 0; m < 16; ++m) {
          const int d = 32 * c + 8 * (m / 4) + m % 4;
          o[d] = c10::BFloat16(lo[m]);
          o[d + 4] = c10::BFloat16(hi[m]);
        }
      }
    }
  }
}
#endif

#ifdef __AVX512F__
#define FOLIO_F32_DECODE 1
// float32 with head dim 64 or 128 and G <= 4 (decode_seq_f32): the same order of work as the
// bfloat16 kernel above, in float32 FMAs. One KV head at a time: its G queries (scaled) in
// registers, four tokens' dots summed across lanes together, the softmax's weights times V
// accumulated in registers, and the next sequence's K/V pumped in meanwhile. The generic loop
// below it summed each dot across lanes on its own and kept the V sums in memory: SmolLM2's
// decode (batch 64 x ~195, 3 KV heads of 64) took 1.13 ms a layer there, 17 GB/s of K/V on a
// host whose memory gives ~30-38.
template <int D, int G>
void decode_seq_f32(const float* qrow, int64_t qh, float* orow, int64_t oh, const float* const* krows,
                    const float* const* vrows, int64_t L, int64_t KVH, int64_t kh, int64_t vh, float sc,
                    std::vector<float>& scores, Pump& pump) {
  constexpr int C = D / 16;  // 16-float chunks per row
  scores.resize(G * L);
  const __m512 scv = _mm512_set1_ps(sc);
  for (int64_t j = 0; j < KVH; ++j) {
    __m512 qv[G][C];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) qv[g][c] = _mm512_mul_ps(_mm512_loadu_ps(qrow + (j * G + g) * qh + 16 * c), scv);
    float* s = scores.data();
    int64_t p = 0;
    for (; p + 4 <= L; p += 4) {
      pump.step(4 * C);  // float32 K/V is twice bf16's: the next sequence's lines over this one's loops
      __m512 a[G][4];
      for (int u = 0; u < 4; ++u) {
        const float* k = krows[p + u] + j * kh;
        __m512 kc[C];
        for (int c = 0; c < C; ++c) kc[c] = _mm512_loadu_ps(k + 16 * c);
        for (int g = 0; g < G; ++g) {
          a[g][u] = _mm512_mul_ps(qv[g][0], kc[0]);
          for (int c = 1; c < C; ++c) a[g][u] = _mm512_fmadd_ps(qv[g][c], kc[c], a[g][u]);
        }
      }
      for (int g = 0; g < G; ++g) {
        const __m512 t01 = _mm512_add_ps(_mm512_unpacklo_ps(a[g][0], a[g][1]), _mm512_unpackhi_ps(a[g][0], a[g][1]));
        const __m512 t23 = _mm512_add_ps(_mm512_unpacklo_ps(a[g][2], a[g][3]), _mm512_unpackhi_ps(a[g][2], a[g][3]));
        const __m512 t = _mm512_add_ps(_mm512_shuffle_ps(t01, t23, 0x44), _mm512_shuffle_ps(t01, t23, 0xEE));
        const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(t), _mm512_extractf32x8_ps(t, 1));
        _mm_storeu_ps(s + g * L + p, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
      }
    }
    for (; p < L; ++p) {
      pump.step(2);
      const float* k = krows[p] + j * kh;
      for (int g = 0; g < G; ++g) {
        __m512 a = _mm512_mul_ps(qv[g][0], _mm512_loadu_ps(k));
        for (int c = 1; c < C; ++c) a = _mm512_fmadd_ps(qv[g][c], _mm512_loadu_ps(k + 16 * c), a);
        s[g * L + p] = _mm512_reduce_add_ps(a);
      }
    }
    float inv[G];
    for (int g = 0; g < G; ++g) inv[g] = exp_scores(s + g * L, L);
    __m512 acc[G][C];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < L; ++p) {
      pump.step(C);
      const float* v = vrows[p] + j * vh;
      __m512 vc[C];
      for (int c = 0; c < C; ++c) vc[c] = _mm512_loadu_ps(v + 16 * c);
      for (int g = 0; g < G; ++g) {
        const __m512 w = _mm512_set1_ps(s[g * L + p]);
        for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(w, vc[c], acc[g][c]);
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m512 iv = _mm512_set1_ps(inv[g]);
      float* o = orow + (j * G + g) * oh;
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(acc[g][c], iv));
    }
  }
}
#endif

// f(std::integral_constant<int, G>) for a group size of 1..4 (4 for anything larger)
template <typename F>
void with_group(int64_t G, F&& f) {
  switch (G) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    default: return f(std::integral_constant<int, 4>{});
  }
}

// DC: the head dim when known at compile time (64, 128: fixed trip counts, no remainder
// loops), 0 for any other (the run-time head dim).
template <typename T, int DC>
void decode_rows(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& rows,
                 const at::Tensor& out, double scale) {
  const int64_t S = rows.size(0), H = q.size(1), D = DC > 0 ? DC : q.size(2);
  const int64_t num_blocks = k_cache.size(0), bs = k_cache.size(1), KVH = k_cache.size(2);
  const int64_t G = H / KVH, max_blocks = block_tables.size(1);
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
  const int64_t* rw = rows.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);
  const int64_t num_rows = q.size(0);
  for (int64_t s = 0; s < S; ++s) {  // checked before any task runs: a bad table cannot read out of bounds
    TORCH_CHECK(sl[s] >= 1 && sl[s] <= max_blocks * bs, "sequence ", s, ": context length ", sl[s],
                " outside 1..", max_blocks * bs, " (its block table's width)");
    TORCH_CHECK(rw[s] >= 0 && rw[s] < num_rows, "sequence ", s, ": query row ", rw[s], " outside 0..", num_rows - 1);
    const int64_t nb = (sl[s] + bs - 1) / bs;
    for (int64_t j = 0; j < nb; ++j) {
      const int32_t b = bt[s * bts + j];
      TORCH_CHECK(b >= 0 && b < num_blocks, "sequence ", s, ": block ", b, " outside the cache's ", num_blocks);
    }
  }
  // the blocks of sequence s (when it is this task's) into the pump, K and V
  auto next_into = [&](Pump& pump, int64_t s, int64_t end) {
    pump.clear();
    if (s >= end) return;
    const int32_t* nt = bt + s * bts;
    const int64_t nL = sl[s];
    int64_t budget = PUMP_BYTES;  // a long context's first part only: the rest would evict it
    for (int64_t b = 0; b * bs < nL && budget > 0; ++b) {
      const int64_t bytes = ((std::min(bs, nL - b * bs) - 1) * kt + (KVH - 1) * kh + D) * static_cast<int64_t>(sizeof(T));
      pump.add(kp + nt[b] * kb, bytes);
      pump.add(vp + nt[b] * vb, bytes);
      budget -= 2 * bytes;
    }
  };
  // the specialised kernels' walk: each sequence's K/V rows by position, the next sequence pumped
  auto by_rows = [&](int64_t begin, int64_t end, auto&& seq) {
    std::vector<const T*> kr, vr;
    Pump pump;
    for (int64_t s = begin; s < end; ++s) {
      const int64_t L = sl[s];
      const int32_t* tab = bt + s * bts;
      kr.resize(L), vr.resize(L);
      for (int64_t p = 0; p < L; ++p) {
        const int64_t b = tab[p / bs], t = p % bs;
        kr[p] = kp + b * kb + t * kt;
        vr[p] = vp + b * vb + t * vt;
      }
      next_into(pump, s + 1, end);
      seq(qp + rw[s] * qs, op + rw[s] * os, kr.data(), vr.data(), L, pump);
    }
  };
  at::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
#ifdef FOLIO_BF16_DOT
    if constexpr (std::is_same_v<T, c10::BFloat16> && (DC == 64 || DC == 128)) {
      if (G >= 1 && G <= 4) {
        std::vector<float> sbuf;
        std::vector<uint16_t> wbuf;
        return with_group(G, [&](auto g) {
          by_rows(begin, end, [&](const T* q, T* o, const T* const* kr, const T* const* vr, int64_t L, Pump& pump) {
            decode_seq_bf16<DC, decltype(g)::value>(q, qh, o, oh, kr, vr, L, KVH, kh, vh, sc, sbuf, wbuf, pump);
          });
        });
      }
    }
#endif
#ifdef FOLIO_F32_DECODE
    if constexpr (std::is_same_v<T, float> && (DC == 64 || DC == 128)) {
      if (G >= 1 && G <= 4) {
        std::vector<float> sbuf;
        return with_group(G, [&](auto g) {
          by_rows(begin, end, [&](const T* q, T* o, const T* const* kr, const T* const* vr, int64_t L, Pump& pump) {
            decode_seq_f32<DC, decltype(g)::value>(q, qh, o, oh, kr, vr, L, KVH, kh, vh, sc, sbuf, pump);
          });
        });
      }
    }
#endif
    std::vector<float> scores, acc(H * D), qv(H * D), inv(H), row(D);
    Pump pump;
    for (int64_t s = begin; s < end; ++s) {
      const int64_t L = sl[s], r = rw[s];
      const int32_t* tab = bt + s * bts;
      next_into(pump, s + 1, end);
      scores.resize(H * L);
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < D; ++i) qv[h * D + i] = static_cast<float>(qp[r * qs + h * qh + i]) * sc;
      // scores[h * L + p]: each K row read (and converted) once for its G query heads
      for_each_token(kp, tab, L, bs, kb, kt, (KVH - 1) * kh + D, [&](int64_t p, const T* krow) {
        pump.step(PUMP_LINES);
        for (int64_t j = 0; j < KVH; ++j)
          dots(qv.data() + j * G * D, as_floats(krow + j * kh, row.data(), D), G, D,
               scores.data() + j * G * L + p, L);
      });
      for (int64_t h = 0; h < H; ++h) inv[h] = exp_scores(scores.data() + h * L, L);
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_token(vp, tab, L, bs, vb, vt, (KVH - 1) * vh + D, [&](int64_t p, const T* vrow) {
        pump.step(PUMP_LINES);
        for (int64_t j = 0; j < KVH; ++j) {
          const float* v = as_floats(vrow + j * vh, row.data(), D);
          for (int64_t g = 0; g < G; ++g) {
            const int64_t h = j * G + g;
            const float w = scores[h * L + p];
            float* a = acc.data() + h * D;
#pragma omp simd
            for (int64_t i = 0; i < D; ++i) a[i] += w * v[i];
          }
        }
      });
      for (int64_t h = 0; h < H; ++h) {
        T* o = op + r * os + h * oh;
        for (int64_t i = 0; i < D; ++i) o[i] = static_cast<T>(acc[h * D + i] * inv[h]);
      }
    }
  });
}

template <typename T>
void by_head_dim(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& rows,
                 const at::Tensor& out, double scale) {
  if (q.size(2) == 64) {
    decode_rows<T, 64>(q, k_cache, v_cache, block_tables, seq_lens, rows, out, scale);
  } else if (q.size(2) == 128) {
    decode_rows<T, 128>(q, k_cache, v_cache, block_tables, seq_lens, rows, out, scale);
  } else {
    decode_rows<T, 0>(q, k_cache, v_cache, block_tables, seq_lens, rows, out, scale);
  }
}

void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& rows,
                      const at::Tensor& out, double scale) {
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
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && rows.scalar_type() == at::kLong && seq_lens.is_contiguous() &&
                  rows.is_contiguous() && seq_lens.numel() == rows.numel() && block_tables.size(0) == rows.numel(),
              "seq_lens and rows: contiguous int64, one per block table row");
  if (rows.numel() == 0) return;
  if (q.scalar_type() == at::kFloat) {
    by_head_dim<float>(q, k_cache, v_cache, block_tables, seq_lens, rows, out, scale);
  } else if (q.scalar_type() == at::kBFloat16) {
    by_head_dim<c10::BFloat16>(q, k_cache, v_cache, block_tables, seq_lens, rows, out, scale);
  } else {
    TORCH_CHECK(false, "dtype ", q.scalar_type(), " is not supported (float32, bfloat16)");
  }
}

}  // namespace

TORCH_LIBRARY(folio_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor rows, Tensor(a!) out, float scale) -> ()");
  m.impl("decode_attention", c10::DispatchKey::CPU, TORCH_FN(decode_attention));
}
