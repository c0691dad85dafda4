// Paged attention for decode rows on CPU: each sequence's one new query attends to its whole
// context, read in place from the paged cache through its block table (no gather, no padding).
// Built and loaded by cpu_attention.py (g++ -O3 -march=native); checked against reference.py.
//
//   q            [num_tokens, num_heads, head_dim]         float32 or bfloat16
//   k/v_cache    [num_blocks, block_size, kv_heads, head_dim], blocks strided (block-major cache)
//   block_tables [num_seqs, max_blocks] int32, seq_lens [num_seqs] int64, rows [num_seqs] int64
//   out          [num_tokens, num_heads, head_dim] (rows[s] written for each s)
//
// One sequence per task (at::parallel_for, torch's own OpenMP pool): its blocks are read
// whole, every KV head of a token at once. Scores, softmax and the weighted sum of V are
// float32 whatever the cache's dtype. GQA: head h reads kv head h / (num_heads / kv_heads).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

template <typename T>
inline float as_float(T x) { return static_cast<float>(x); }

template <typename T>
void decode_rows(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& rows,
                 const at::Tensor& out, double scale) {
  const int64_t S = rows.size(0), H = q.size(1), D = q.size(2);
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
  at::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(H * D), qv(H * D), inv(H);
    for (int64_t s = begin; s < end; ++s) {
      const int64_t L = sl[s], row = rw[s];
      const int32_t* tab = bt + s * bts;
      scores.resize(H * L);
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < D; ++i) qv[h * D + i] = as_float(qp[row * qs + h * qh + i]) * sc;
      for (int64_t p = 0; p < L; ++p) {
        const T* kblk = kp + static_cast<int64_t>(tab[p / bs]) * kb + (p % bs) * kt;
        for (int64_t j = 0; j < KVH; ++j) {
          const T* kr = kblk + j * kh;
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qv.data() + (j * G + g) * D;
            float d = 0.f;
#pragma omp simd reduction(+ : d)
            for (int64_t i = 0; i < D; ++i) d += qg[i] * as_float(kr[i]);
            scores[(j * G + g) * L + p] = d;
          }
        }
      }
      for (int64_t h = 0; h < H; ++h) {
        float* sh = scores.data() + h * L;
        float m = sh[0];
        for (int64_t p = 1; p < L; ++p) m = std::max(m, sh[p]);
        float t = 0.f;
#pragma omp simd reduction(+ : t)
        for (int64_t p = 0; p < L; ++p) {
          sh[p] = expf(sh[p] - m);
          t += sh[p];
        }
        inv[h] = 1.f / t;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p = 0; p < L; ++p) {
        const T* vblk = vp + static_cast<int64_t>(tab[p / bs]) * vb + (p % bs) * vt;
        for (int64_t h = 0; h < H; ++h) {
          const T* vr = vblk + (h / G) * vh;
          const float w = scores[h * L + p];
          float* a = acc.data() + h * D;
#pragma omp simd
          for (int64_t i = 0; i < D; ++i) a[i] += w * as_float(vr[i]);
        }
      }
      for (int64_t h = 0; h < H; ++h) {
        T* o = op + row * os + h * oh;
        for (int64_t i = 0; i < D; ++i) o[i] = static_cast<T>(acc[h * D + i] * inv[h]);
      }
    }
  });
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
    decode_rows<float>(q, k_cache, v_cache, block_tables, seq_lens, rows, out, scale);
  } else if (q.scalar_type() == at::kBFloat16) {
    decode_rows<c10::BFloat16>(q, k_cache, v_cache, block_tables, seq_lens, rows, out, scale);
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
