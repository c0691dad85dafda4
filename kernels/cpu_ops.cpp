// Small fused ops for the CPU forward, in the same library as the decode attention
// (cpu_attention.py builds both; wrappers and fallbacks in cpu_ops.py). Each replaces a chain
// of torch ops that reads and writes a [tokens, hidden] tensor several times and runs below
// torch's parallel grain at decode sizes (SmolLM2 at batch 64: ~10 ms of a ~95 ms bf16 step).
//
//   argmax_rows(x [rows, n] f32 or bf16)    -> int64 [rows]: torch.argmax(x, -1) exactly (the
//                                              first maximum; the first NaN when a row has one)
//   rms_norm(x, w, eps, out)                 float32 or bfloat16 [T, n]: transformers'
//                                              LlamaRMSNorm with its roundings (float32
//                                              statistics, the normalized row rounded to the
//                                              dtype, then w * it rounded)
//   add_rms_norm(h, r, w, eps, out)          h += r (rounded, as torch's add), then
//                                              out = rms_norm(h)
//   silu_mul(gate_up [T, 2n], out [T, n])    out = silu(gate) * up, each rounded as
//                                              F.silu(gate) * up rounds
//   rope_write_kv(qkv, cos, sin, ...)         q and k rotated (bit-identical to torch's chain),
//                                              k and v written to their cache slots
//   sample_rows(x, rows, temps, top_k, top_p,  one draw from softmax(x[row] / T) with top-k, top-p
//               min_p, u)                      and min-p, by the inverse CDF at u (sampler.py's
//                                              `_filter` then `_draw`, without sorting the row)
// The norms' sums of squares run in another order than torch's mean, and silu's exp is
// glibc's, not Sleef's: those two differ from torch in the last bit now and then.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "cpu_simd.h"

namespace {

inline float bf2f(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// round to nearest even, as c10::BFloat16 does (NaN stays a NaN)
inline uint16_t f2bf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// a float32 or bfloat16 value as float32, and whether its bits are a NaN's
inline float as_f(float v) { return v; }
inline float as_f(uint16_t v) { return bf2f(v); }
inline bool is_nan(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return (u & 0x7fffffffu) > 0x7f800000u;  // by the bits: under -ffast-math, x != x is false
}
inline bool is_nan(uint16_t v) { return (v & 0x7fffu) > 0x7f80u; }

// A row's maximum into m; true when the row holds a NaN (the maximum then means nothing).
template <typename T>
inline bool max_or_nan(const T* row, int64_t n, float& m) {
  float mx = as_f(row[0]);
  uint32_t nan = 0;
#pragma omp simd reduction(max : mx) reduction(| : nan)
  for (int64_t i = 0; i < n; ++i) {
    const float v = as_f(row[i]);
    mx = v > mx ? v : mx;
    nan |= static_cast<uint32_t>(is_nan(row[i]));
  }
  m = mx;
  return nan != 0;
}

template <typename T>
inline int64_t first_nan(const T* row) {  // of a row that holds one
  int64_t at = 0;
  while (!is_nan(row[at])) ++at;
  return at;
}

template <typename T>
void argmax_rows_of(const T* xp, int64_t R, int64_t n, int64_t rs, int64_t* op) {
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = xp + r * rs;
      float m;
      int64_t at = 0;
      if (max_or_nan(row, n, m)) {
        at = first_nan(row);
      } else {
        // the first m: 64 values at a time tested together, then that chunk one by one
        for (; at < n; at += 64) {
          const int64_t e = std::min(n, at + 64);
          uint32_t hit = 0;
#pragma omp simd reduction(| : hit)
          for (int64_t i = at; i < e; ++i) hit |= static_cast<uint32_t>(as_f(row[i]) == m);
          if (hit) break;
        }
        at = std::min(at, n);
        while (at < n && as_f(row[at]) != m) ++at;
        if (at == n) {  // the reduction started below every value (a row of -inf): scan plainly
          at = 0;
          for (int64_t i = 1; i < n; ++i)
            if (as_f(row[i]) > as_f(row[at])) at = i;
        }
      }
      op[r] = at;
    }
  });
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0,
              "argmax_rows: a CPU float32 or bfloat16 [rows, n > 0] tensor, rows contiguous");
  const int64_t R = x.size(0), n = x.size(1), rs = x.stride(0);
  at::Tensor out = at::empty({R}, x.options().dtype(at::kLong));
  if (x.scalar_type() == at::kFloat) {
    argmax_rows_of(x.data_ptr<float>(), R, n, rs, out.data_ptr<int64_t>());
  } else {
    argmax_rows_of(reinterpret_cast<const uint16_t*>(x.data_ptr()), R, n, rs, out.data_ptr<int64_t>());
  }
  return out;
}

// Storage types: uint16_t (bfloat16's bits) or float. st() stores a float32 result in the
// type (rounded to bf16, or as it is); rnd() is that rounding kept as a float32.
inline uint16_t st(float f, uint16_t) { return f2bf(f); }
inline float st(float f, float) { return f; }
inline float rnd(float f, uint16_t) { return bf2f(f2bf(f)); }
inline float rnd(float f, float) { return f; }

void check_rows(const at::Tensor& t, const char* what, int64_t T, int64_t n, at::ScalarType dt) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dt && t.dim() == 2 && t.size(0) == T && t.size(1) == n &&
                  t.stride(1) == 1, what, ": a CPU ", dt, " [", T, ", ", n, "] tensor, rows contiguous");
}

at::ScalarType float_or_bf16(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, what,
              ": float32 or bfloat16, not ", t.scalar_type());
  return t.scalar_type();
}

// one row: out = w * rnd(x * rsqrt(mean(x^2) + eps)), each product rounded to the storage type
template <typename E>
inline void norm_row(const E* x, const E* w, E* o, int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) {
    const float f = as_f(x[i]);
    ss += f * f;
  }
  // in double: -ffast-math would make a float 1/sqrt an approximation (rsqrt + a Newton step),
  // which turns an overflowed sum of squares (inf) into NaN where torch's rsqrt gives 0
  const float k = static_cast<float>(1.0 / std::sqrt(static_cast<double>(ss) / static_cast<double>(n) + eps));
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) o[i] = st(as_f(w[i]) * rnd(as_f(x[i]) * k, E{}), E{});
}

template <typename E>
void rms_norm_of(const at::Tensor& x, const at::Tensor& w, double eps, const at::Tensor& out) {
  const int64_t T = x.size(0), n = x.size(1), xs = x.stride(0), os = out.stride(0);
  const E* xp = static_cast<const E*>(x.data_ptr());
  const E* wp = static_cast<const E*>(w.data_ptr());
  E* op = static_cast<E*>(out.data_ptr());
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) norm_row(xp + t * xs, wp, op + t * os, n, static_cast<float>(eps));
  });
}

void rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, const at::Tensor& out) {
  const at::ScalarType dt = float_or_bf16(x, "rms_norm x");
  const int64_t T = x.size(0), n = x.dim() == 2 ? x.size(1) : -1;
  check_rows(x, "rms_norm x", T, n, dt);
  check_rows(out, "rms_norm out", T, n, dt);
  TORCH_CHECK(w.scalar_type() == dt && w.dim() == 1 && w.size(0) == n && w.is_contiguous(),
              "rms_norm w: ", dt, " [", n, "]");
  if (dt == at::kFloat) rms_norm_of<float>(x, w, eps, out);
  else rms_norm_of<uint16_t>(x, w, eps, out);
}

template <typename E>
void add_rms_norm_of(const at::Tensor& h, const at::Tensor& r, const at::Tensor& w, double eps, const at::Tensor& out) {
  const int64_t T = h.size(0), n = h.size(1), hs = h.stride(0), rs = r.stride(0), os = out.stride(0);
  E* hp = static_cast<E*>(h.data_ptr());
  const E* rp = static_cast<const E*>(r.data_ptr());
  const E* wp = static_cast<const E*>(w.data_ptr());
  E* op = static_cast<E*>(out.data_ptr());
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      E* hr = hp + t * hs;
      const E* rr = rp + t * rs;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) hr[i] = st(as_f(hr[i]) + as_f(rr[i]), E{});
      norm_row(hr, wp, op + t * os, n, static_cast<float>(eps));
    }
  });
}

void add_rms_norm(const at::Tensor& h, const at::Tensor& r, const at::Tensor& w, double eps, const at::Tensor& out) {
  const at::ScalarType dt = float_or_bf16(h, "add_rms_norm h");
  const int64_t T = h.size(0), n = h.dim() == 2 ? h.size(1) : -1;
  check_rows(h, "add_rms_norm h", T, n, dt);
  check_rows(r, "add_rms_norm r", T, n, dt);
  check_rows(out, "add_rms_norm out", T, n, dt);
  TORCH_CHECK(w.scalar_type() == dt && w.dim() == 1 && w.size(0) == n && w.is_contiguous(),
              "add_rms_norm w: ", dt, " [", n, "]");
  if (dt == at::kFloat) add_rms_norm_of<float>(h, r, w, eps, out);
  else add_rms_norm_of<uint16_t>(h, r, w, eps, out);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define FOLIO_SILU_AVX512 1
// 16 lanes of the loop below, with cpu_simd.h's exp (glibc's expf here: 0.76 ns an element,
// 2.4 ms for a 2,048-token prefill's [2048, 1536] on a 2-core Xeon, most of it exp).
using folio_simd::exp16;
using folio_simd::first_lanes;
__attribute__((always_inline)) inline __mmask16 nan16(__m512 f) {  // by the bits, as is_nan
  return _mm512_cmpgt_epu32_mask(_mm512_and_si512(_mm512_castps_si512(f), _mm512_set1_epi32(0x7fffffff)),
                                 _mm512_set1_epi32(0x7f800000));
}
#ifdef __AVX512BF16__
// f2bf on 16 lanes: vcvtneps2bf16 rounds to nearest even; a NaN becomes 0x7fc0 as in f2bf
__attribute__((always_inline)) inline __m256i f2bf16(__m512 f) {
  return _mm256_mask_mov_epi16((__m256i)_mm512_cvtneps_pbh(f), nan16(f), _mm256_set1_epi16(0x7fc0));
}
#else
__attribute__((always_inline)) inline __m256i f2bf16(__m512 f) {
  const __m512i u = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan16(f), _mm512_set1_epi32(0x7fc0)));
}
#endif
__attribute__((always_inline)) inline __m512 bf16x16(__m256i b) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}
// the first lanes of `m` loaded (the others 0; nothing past them is read) or stored
__attribute__((always_inline)) inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
__attribute__((always_inline)) inline __m512 load16(const uint16_t* p, __mmask16 m) {
  return bf16x16(_mm256_maskz_loadu_epi16(m, p));
}
__attribute__((always_inline)) inline __m512 rnd16(__m512 f, float) { return f; }
__attribute__((always_inline)) inline __m512 rnd16(__m512 f, uint16_t) { return bf16x16(f2bf16(f)); }
__attribute__((always_inline)) inline void store16(float* p, __m512 f, __mmask16 m) { _mm512_mask_storeu_ps(p, m, f); }
__attribute__((always_inline)) inline void store16(uint16_t* p, __m512 f, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, f2bf16(f));
}

// silu(x) * up for the lanes of `m`, as the scalar loop computes it (a NaN gate gives NaN here,
// which -ffast-math does not promise there)
template <typename E>
__attribute__((always_inline)) inline void silu_mul16(const E* g, const E* u, E* o, __mmask16 m) {
  const __m512 x = load16(g, m);
  // exp16's argument within [-104, 88] (where its reduction holds; e^-104 is 0 in float32)
  const __m512 e = exp16(_mm512_max_ps(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), x), _mm512_set1_ps(88.f)),
                                       _mm512_set1_ps(-104.f)));
  // x / d by a reciprocal: vdivps takes ~10 cycles a vector here; rcp14 and one Newton step
  // are within an ulp or two of it
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), e), y = _mm512_rcp14_ps(d);
  __m512 sx = _mm512_mul_ps(x, _mm512_fmadd_ps(y, _mm512_fnmadd_ps(d, y, _mm512_set1_ps(1.f)), y));
  sx = _mm512_mask_mov_ps(sx, _mm512_cmp_ps_mask(x, _mm512_set1_ps(-88.f), _CMP_LT_OQ), _mm512_set1_ps(-0.f));
  store16(o, _mm512_mul_ps(rnd16(sx, E{}), load16(u, m)), m);
}
#endif

template <typename E>
void silu_mul_of(const at::Tensor& gate_up, const at::Tensor& out) {
  const int64_t T = gate_up.size(0), n = out.size(1), gs = gate_up.stride(0), os = out.stride(0);
  const E* gp = static_cast<const E*>(gate_up.data_ptr());
  E* op = static_cast<E*>(out.data_ptr());
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const E* g = gp + t * gs;
      const E* u = g + n;
      E* o = op + t * os;
#ifdef FOLIO_SILU_AVX512
      for (int64_t i = 0; i < n; i += 16)
        silu_mul16(g + i, u + i, o + i, first_lanes(n - i));
#else
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const float x = as_f(g[i]);
        // below x = -88 silu is -0 here (it is under 1e-36 in magnitude): -ffast-math's division of x
        // by an infinite 1 + exp(-x) gives NaN, so exp's argument is bounded and the result chosen
        // (a NaN is told by its bits: under -ffast-math, x < -88 may hold for it)
        const float sx = is_nan(x) ? x : x < -88.f ? -0.f : x / (1.f + expf(std::min(-x, 88.f)));
        o[i] = st(rnd(sx, E{}) * as_f(u[i]), E{});
      }
#endif
    }
  });
}

void silu_mul(const at::Tensor& gate_up, const at::Tensor& out) {
  const at::ScalarType dt = float_or_bf16(gate_up, "silu_mul gate_up");
  const int64_t T = gate_up.size(0), n = out.dim() == 2 ? out.size(1) : -1;
  check_rows(gate_up, "silu_mul gate_up", T, 2 * n, dt);
  check_rows(out, "silu_mul out", T, n, dt);
  if (dt == at::kFloat) silu_mul_of<float>(gate_up, out);
  else silu_mul_of<uint16_t>(gate_up, out);
}


// Rotary embedding (rotate-half, the whole head dim) of q and k straight out of the fused qkv
// projection, with k and v written to their cache slots: transformers' three roundings per
// value (x * cos, rotate_half(x) * sin, their sum), so the result is torch's to the bit (this
// file is compiled without FMA contraction: a fused x * cos + y * sin would round once, not
// three times), and write_kv's scatter, one pass instead of ~8 ops.
//   qkv [T, (H + 2 KVH) * D]; cos, sin [T, D] (the positions' rows); caches [blocks,
//   block_size, KVH, D] (strided blocks); slots [T] int64 (< 0: not written); q_out [T, H, D];
//   all float32 or all bfloat16
template <typename E>
void rope_write_kv_of(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t H, int64_t KVH,
                      const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
                      const at::Tensor& q_out) {
  const int64_t T = qkv.size(0), D = q_out.size(2), half = D / 2;
  const int64_t bs = k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const E* xp = static_cast<const E*>(qkv.data_ptr());
  const E* cp = static_cast<const E*>(cos.data_ptr());
  const E* snp = static_cast<const E*>(sin.data_ptr());
  E* qo = static_cast<E*>(q_out.data_ptr());
  E* kc = static_cast<E*>(k_cache.data_ptr());
  E* vc = static_cast<E*>(v_cache.data_ptr());
  const int64_t xs = qkv.stride(0), cs = cos.stride(0), ss = sin.stride(0);
  const int64_t kb = k_cache.stride(0), kt = k_cache.stride(1), vb = v_cache.stride(0), vt = v_cache.stride(1);
  at::parallel_for(0, T, 8, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const E* x = xp + t * xs;
      const E* c = cp + t * cs;
      const E* sn = snp + t * ss;
      const int64_t slot = sp[t];
      E* krow = slot >= 0 ? kc + (slot / bs) * kb + (slot % bs) * kt : nullptr;
      E* vrow = slot >= 0 ? vc + (slot / bs) * vb + (slot % bs) * vt : nullptr;
      for (int64_t h = 0; h < H + KVH; ++h) {
        const E* xh = x + h * D;
        E* o = h < H ? qo + (t * H + h) * D : krow != nullptr ? krow + (h - H) * D : nullptr;
        if (o == nullptr) continue;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {  // rotate_half: [-x2, x1]
          o[i] = st(rnd(as_f(xh[i]) * as_f(c[i]), E{}) + rnd(-as_f(xh[i + half]) * as_f(sn[i]), E{}), E{});
          o[i + half] = st(rnd(as_f(xh[i + half]) * as_f(c[i + half]), E{}) +
                               rnd(as_f(xh[i]) * as_f(sn[i + half]), E{}), E{});
        }
      }
      if (vrow != nullptr) std::memcpy(vrow, x + (H + KVH) * D, KVH * D * sizeof(E));
    }
  });
}

void rope_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t H, int64_t KVH,
                   const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
                   const at::Tensor& q_out) {
  const at::ScalarType dt = float_or_bf16(qkv, "rope_write_kv qkv");
  const int64_t T = qkv.size(0), D = q_out.dim() == 3 ? q_out.size(2) : -1;
  check_rows(qkv, "rope_write_kv qkv", T, (H + 2 * KVH) * D, dt);
  check_rows(cos, "rope_write_kv cos", T, D, dt);
  check_rows(sin, "rope_write_kv sin", T, D, dt);
  TORCH_CHECK(D > 0 && D % 2 == 0 && q_out.scalar_type() == dt && q_out.is_contiguous() && q_out.size(0) == T &&
                  q_out.size(1) == H, "rope_write_kv q_out: contiguous ", dt, " [", T, ", ", H, ", D]");
  for (const at::Tensor* c : {&k_cache, &v_cache})
    TORCH_CHECK(c->scalar_type() == dt && c->dim() == 4 && c->size(2) == KVH && c->size(3) == D &&
                    c->stride(3) == 1 && c->stride(2) == D, "rope_write_kv caches: ", dt, " [blocks, block_size, ", KVH,
                " kv heads, ", D, "], heads contiguous");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "rope_write_kv: the caches' shapes differ");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == T && slots.is_contiguous(),
              "rope_write_kv slots: contiguous int64 [", T, "]");
  const int64_t nslots = k_cache.size(0) * k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] < nslots, "rope_write_kv: slot ", sp[t], " outside the cache's ", nslots);
  if (dt == at::kFloat) rope_write_kv_of<float>(qkv, cos, sin, H, KVH, k_cache, v_cache, slots, q_out);
  else rope_write_kv_of<uint16_t>(qkv, cos, sin, H, KVH, k_cache, v_cache, slots, q_out);
}

// ---- sampling: the inverse CDF of softmax(x / T), top-k, top-p and min-p applied ---------------
// Per row: m = max x; e_i = exp((x_i - m) / T), 0 for x = -inf (a masked token) and 80 below m.
// Then sampler._filter's filters in its order, on e (unnormalized: each filter's test is
// invariant to the normalization):
//   top-k: the k largest e;
//   top-p: of those, in decreasing e, a token stays while the mass before it is < top_p * their sum;
//   min-p: e >= min_p (the maximum's e is 1, so "p >= min_p * p_max").
// The k largest and the nucleus are found without sorting the row: a histogram of -d (d the
// scaled logit, log e) in bins of 1/16 gives the bin where each cut falls, and only that bin's
// tokens are sorted (by e, then index). Last, the first i whose cumulative kept e exceeds
// u * their sum: chunk sums of 64 entries (double), then one chunk. A row with a NaN takes its
// first NaN (argmax_rows' rule: the caller's NaN check sees it); a row of -inf (all masked) 0.
constexpr int64_t CHUNK = 64;
constexpr int NBINS = 1024;  // -d in [0, 64) by 1/16, the rest (e < 1.6e-28) in the last bin
constexpr float BINS_PER_UNIT = 16.f;

struct RowScratch {
  std::vector<float> e;
  std::vector<uint16_t> bin;
  std::vector<double> sums;
  std::vector<int32_t> count;
  std::vector<double> mass;
  std::vector<std::pair<float, int64_t>> sel;
};

// The kept set after top-k and top-p: every token of a bin < cut_bin, and those of cut_bin that
// sort (e descending, index ascending) at or before (cut_e, cut_i). cut_bin = NBINS: no cut.
struct Cut {
  int cut_bin = NBINS;
  float cut_e = 0.f;
  int64_t cut_i = 0;
};

inline bool sorts_before(const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

// the sorted tokens of bin `b` (e descending, index ascending)
void bin_tokens(RowScratch& w, int64_t n, int b) {
  w.sel.clear();
  for (int64_t i = 0; i < n; ++i)
    if (w.bin[i] == b && w.e[i] > 0.f) w.sel.emplace_back(w.e[i], i);
  std::sort(w.sel.begin(), w.sel.end(), sorts_before);
}

Cut truncate(RowScratch& w, int64_t n, int64_t top_k, float top_p) {
  int32_t* count = w.count.data();
  double* mass = w.mass.data();
  std::fill(count, count + NBINS, 0);
  std::fill(mass, mass + NBINS, 0.0);
  int64_t live = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = w.e[i];
    if (v > 0.f) {
      count[w.bin[i]] += 1;
      mass[w.bin[i]] += v;
      ++live;
    }
  }
  Cut cut;
  // top-k: the bin where the k-th largest falls, and how many of that bin stay
  double kept_mass = 0.0;
  for (int b = 0; b < NBINS; ++b) kept_mass += mass[b];
  int64_t kbin_keep = -1;  // tokens of cut.cut_bin kept by top-k (-1: top-k cuts nothing)
  if (top_k > 0 && top_k < live) {
    int64_t before = 0;
    int b = 0;
    for (; before + count[b] < top_k; ++b) before += count[b];
    kbin_keep = top_k - before;
    bin_tokens(w, n, b);
    kept_mass = 0.0;
    for (int c = 0; c < b; ++c) kept_mass += mass[c];
    for (int64_t j = 0; j < kbin_keep; ++j) kept_mass += w.sel[j].first;
    cut.cut_bin = b;
    cut.cut_e = w.sel[kbin_keep - 1].first;
    cut.cut_i = w.sel[kbin_keep - 1].second;
  }
  if (top_p < 1.f) {
    const double target = static_cast<double>(top_p) * kept_mass;
    double before = 0.0;
    const int last = cut.cut_bin < NBINS ? cut.cut_bin : NBINS - 1;
    for (int b = 0; b <= last; ++b) {
      const bool kbin = b == cut.cut_bin;
      double bm = mass[b];
      if (kbin) {
        bm = 0.0;
        for (int64_t j = 0; j < kbin_keep; ++j) bm += w.sel[j].first;
      }
      if (before + bm < target) {  // the whole bin stays (and the next bin's first token too)
        before += bm;
        continue;
      }
      // the nucleus ends in this bin: its tokens in order while the mass before them < target
      if (!kbin) bin_tokens(w, n, b);
      const int64_t avail = kbin ? kbin_keep : static_cast<int64_t>(w.sel.size());
      int64_t j = 0;
      while (j < avail && before < target) before += w.sel[j++].first;
      if (j > 0) {  // j >= 1: before < target held for the bin's first token
        cut.cut_bin = b;
        cut.cut_e = w.sel[j - 1].first;
        cut.cut_i = w.sel[j - 1].second;
      }
      break;
    }
  }
  return cut;
}

// e outside `cut` or below min-p set to 0, the chunk sums of what stays; returns their total.
double keep(float* ep, const uint16_t* bp, double* sums, int64_t n, int64_t nchunks, const Cut& cut, float floor_e) {
  double total = 0.0;
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t b = c * CHUNK, en = std::min(n, b + CHUNK);
    float s = 0.f;
    for (int64_t i = b; i < en; ++i) {
      const int bin = bp[i];
      const bool in = bin < cut.cut_bin ||
                      (bin == cut.cut_bin && (ep[i] > cut.cut_e || (ep[i] == cut.cut_e && i <= cut.cut_i)));
      ep[i] = in && ep[i] >= floor_e ? ep[i] : 0.f;
      s += ep[i];
    }
    sums[c] = s;
    total += s;
  }
  return total;
}

// The first token whose cumulative e exceeds `target` (< the total): chunk sums first, then one
// chunk; the last token with mass when rounding put the target at the very end.
int64_t invert(const float* ep, const double* sums, int64_t n, int64_t nchunks, double target) {
  double acc = 0.0;
  int64_t c = 0;
  for (; c < nchunks && acc + sums[c] <= target; ++c) acc += sums[c];
  if (c < nchunks) {
    for (int64_t i = c * CHUNK, en = std::min(n, i + CHUNK); i < en; ++i) {
      acc += ep[i];
      if (ep[i] > 0.f && acc > target) return i;
    }
  }
  int64_t i = n - 1;
  while (i > 0 && !(ep[i] > 0.f)) --i;
  return i;
}

template <typename T>
void sample_rows_of(const T* xp, int64_t rs, int64_t n, const int64_t* rows, int64_t R, const float* temps,
                    const int64_t* top_k, const float* top_p, const float* min_p, const double* u, int64_t* op) {
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    thread_local RowScratch w;
    const int64_t nchunks = (n + CHUNK - 1) / CHUNK;
    if (static_cast<int64_t>(w.e.size()) < n) {
      w.e.resize(n);
      w.bin.resize(n);
    }
    if (static_cast<int64_t>(w.sums.size()) < nchunks) w.sums.resize(nchunks);
    if (w.count.empty()) {
      w.count.resize(NBINS);
      w.mass.resize(NBINS);
    }
    float* ep = w.e.data();
    uint16_t* bp = w.bin.data();
    double* sums = w.sums.data();
    for (int64_t k = begin; k < end; ++k) {
      const T* row = xp + rows[k] * rs;
      float m;
      if (max_or_nan(row, n, m)) {
        op[k] = first_nan(row);
        continue;
      }
      uint32_t mb;
      std::memcpy(&mb, &m, sizeof mb);
      if (mb == 0xff800000u) {  // every token masked (-inf): no distribution, the argmax's 0
        op[k] = 0;
        continue;
      }
      const float inv_t = 1.f / temps[k], floor_e = min_p[k];
      const bool truncates = top_k[k] > 0 || top_p[k] < 1.f;
      double total = 0.0;
      // x == m first: (m - m) * inv_t is 0 even for an infinite inv_t. A token more than 80 below
      // the maximum (d < -80: a probability under 2e-35, never drawn by a double u) is 0, as is
      // -inf, and exp's argument is clamped: libmvec's vector expf redoes a whole vector in
      // scalar code, with errno, when a lane is near underflow (a row of 48k masked tokens, an
      // allow list's, took 4x as long). A product, not a select: gcc saw that a select's taken
      // side needs no clamp, dropped it, and called exp on -inf again.
      if (truncates) {  // e and its histogram bin, then the filters' cut
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
          const float x = as_f(row[i]);
          const float d = x == m ? 0.f : (x - m) * inv_t;
          ep[i] = expf(std::max(d, -80.f)) * static_cast<float>(d >= -80.f);
          bp[i] = static_cast<uint16_t>(std::min(-d * BINS_PER_UNIT, static_cast<float>(NBINS - 1)));
        }
        total = keep(ep, bp, sums, n, nchunks, truncate(w, n, top_k[k], top_p[k]), floor_e);
      } else {  // e with min-p, and its chunk sums: all there is to do
        for (int64_t c = 0; c < nchunks; ++c) {
          const int64_t b = c * CHUNK, en = std::min(n, b + CHUNK);
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t i = b; i < en; ++i) {
            const float x = as_f(row[i]);
            const float d = x == m ? 0.f : (x - m) * inv_t;
            const float v = expf(std::max(d, -80.f)) * static_cast<float>(d >= -80.f);
            ep[i] = v < floor_e ? 0.f : v;
            s += ep[i];
          }
          sums[c] = s;
          total += s;
        }
      }
      // total >= 1: the maximum's e is 1, and every filter keeps it (min_p <= 1)
      op[k] = invert(ep, sums, n, nchunks, u[k] * total);
    }
  });
}

at::Tensor sample_rows(const at::Tensor& x, const at::Tensor& rows, const at::Tensor& temps, const at::Tensor& top_k,
                       const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& u) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0,
              "sample_rows: a CPU float32 or bfloat16 [rows, n > 0] tensor, rows contiguous");
  const int64_t R = rows.numel(), n = x.size(1);
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(),
              "sample_rows: rows a contiguous int64 vector");
  auto vec = [R](const at::Tensor& t, at::ScalarType dt) {
    return t.scalar_type() == dt && t.dim() == 1 && t.numel() == R && t.is_contiguous();
  };
  TORCH_CHECK(vec(temps, at::kFloat) && vec(top_k, at::kLong) && vec(top_p, at::kFloat) && vec(min_p, at::kFloat) &&
                  vec(u, at::kDouble),
              "sample_rows: temps, top_p and min_p contiguous float32 [", R, "], top_k int64 [", R,
              "], u float64 [", R, "]");
  const int64_t* rp = rows.data_ptr<int64_t>();
  const float* tp = temps.data_ptr<float>();
  const float* pp = top_p.data_ptr<float>();
  const float* mp = min_p.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  for (int64_t k = 0; k < R; ++k) {
    TORCH_CHECK(rp[k] >= 0 && rp[k] < x.size(0), "sample_rows: row ", rp[k], " outside [0, ", x.size(0), ")");
    // by the bits (the library is built with -ffast-math, under which NaN and infinity tests fold
    // away): a non-negative float's or double's bits order as its value, NaN and inf above all
    uint32_t tb, pb, mb;
    uint64_t ub;
    std::memcpy(&tb, &tp[k], sizeof tb);
    std::memcpy(&pb, &pp[k], sizeof pb);
    std::memcpy(&mb, &mp[k], sizeof mb);
    std::memcpy(&ub, &up[k], sizeof ub);
    TORCH_CHECK(tb != 0 && tb < 0x7f800000u, "sample_rows: temperature ", tp[k], " not finite and > 0");
    TORCH_CHECK(pb != 0 && pb <= 0x3f800000u, "sample_rows: top_p ", pp[k], " outside (0, 1]");  // 1.0f's bits
    TORCH_CHECK(mb <= 0x3f800000u || mb == 0x80000000u, "sample_rows: min_p ", mp[k], " outside [0, 1]");  // -0 too
    TORCH_CHECK(ub < 0x3ff0000000000000ull, "sample_rows: u ", up[k], " outside [0, 1)");  // 1.0's bits
  }
  at::Tensor out = at::empty({R}, rows.options());
  const int64_t* kp = top_k.data_ptr<int64_t>();
  if (x.scalar_type() == at::kFloat)
    sample_rows_of(x.data_ptr<float>(), x.stride(0), n, rp, R, tp, kp, pp, mp, up, out.data_ptr<int64_t>());
  else
    sample_rows_of(reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0), n, rp, R, tp, kp, pp, mp, up,
                   out.data_ptr<int64_t>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(folio_cpu, m) {
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps, Tensor(a!) out) -> ()");
  m.def("add_rms_norm(Tensor(a!) h, Tensor r, Tensor w, float eps, Tensor(b!) out) -> ()");
  m.def("silu_mul(Tensor gate_up, Tensor(a!) out) -> ()");
  m.def("rope_write_kv(Tensor qkv, Tensor cos, Tensor sin, int num_heads, int num_kv_heads, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slots, Tensor(c!) q_out) -> ()");
  m.def("sample_rows(Tensor x, Tensor rows, Tensor temps, Tensor top_k, Tensor top_p, Tensor min_p, Tensor u) -> Tensor");
  m.impl("argmax_rows", c10::DispatchKey::CPU, TORCH_FN(argmax_rows));
  m.impl("sample_rows", c10::DispatchKey::CPU, TORCH_FN(sample_rows));
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.impl("add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm));
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(silu_mul));
  m.impl("rope_write_kv", c10::DispatchKey::CPU, TORCH_FN(rope_write_kv));
}
