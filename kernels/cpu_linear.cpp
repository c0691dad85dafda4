// float32 linear layers on AVX-512, y = x @ w.T + b, with the weight packed once at load into
// panels of 48 output columns ([N / 48][K][48], the last panel padded with zeros). Wrappers and
// the choice of backend in linear.py.
//
//   pack_linear_weight(w [N, K] f32)             -> f32 [ceil(N / 48), K, 48]
//   linear_panels(x [M, K] f32, panels, N, bias?) -> f32 [M, N]
//   linear_panels_available()                     -> whether this build has the kernel (AVX-512)
//
// Why not oneDNN here: at decode sizes (a few to a few hundred rows) a layer's weight is read
// from memory once a step and oneDNN's kernel waits on it. SmolLM2-135M's four layer linears at
// 64 rows, each layer's own weights (so from memory, as in a step), on the 2-core Xeon with AMX:
// oneDNN 194-200 GFLOP/s, these panels 248-267 (the same weights kept in cache: 265-280 and
// 295-319). What the kernel does about it: while a thread works through one panel, it prefetches
// the next panel of its range into L2 (_MM_HINT_T1), spread over the panel's k steps, so the
// weight streams in beside the FMAs instead of in front of them.
//
// The micro-kernel: 8 rows x 48 columns (24 accumulators), per k three weight vectors and eight
// broadcasts of x; k unrolled by two. Rows run in blocks of 128 so that the block's x stays in
// L2 across the panels (up to 512 rows; past that, see CHUNKED_ROWS). Each output is one sequential float32 sum over k in FMA (the bias added
// last), where oneDNN and MKL split their sums otherwise: the results differ in the last bits.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t PANEL = 48;      // output columns per panel: three 16-lane vectors
constexpr int64_t ROW_BLOCK = 128; // rows whose x stays in L2 while every panel passes over it
// Past CHUNKED_ROWS rows (a prefill chunk) the order turns around: a thread's panels go in chunks
// of CHUNK_BYTES, each kept in L2 while every row passes over it 8 at a time, so each weight
// comes from memory once instead of once per 128 rows (SmolLM2's layers at 2,048 rows, each
// layer its own weights: 279-300 -> 314-322 GFLOP/s, oneDNN 310-335; 1,024 rows 301 -> 322; at
// 192-256 rows the chunks ran ~6 % slower, at 512 level).
constexpr int64_t CHUNKED_ROWS = 512;
constexpr int64_t CHUNK_BYTES = 1 << 20;

void check_weight(const at::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 2 && w.size(0) > 0 && w.size(1) > 0,
              "pack_linear_weight: a CPU float32 [out_features > 0, in_features > 0] weight");
}

at::Tensor pack_linear_weight(const at::Tensor& w_in) {
  check_weight(w_in);
  const at::Tensor w = w_in.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = (N + PANEL - 1) / PANEL;
  at::Tensor out = at::zeros({P, K, PANEL}, w.options());
  const float* s = w.data_ptr<float>();
  float* d = out.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p)
      for (int64_t c = 0; c < PANEL && p * PANEL + c < N; ++c) {
        const float* row = s + (p * PANEL + c) * K;
        float* col = d + p * K * PANEL + c;
        for (int64_t k = 0; k < K; ++k) col[k * PANEL] = row[k];
      }
  });
  return out;
}

#ifdef __AVX512F__

// Prefetch of the next panel: `lines` cache lines of it per k pair, from `line` up to `end`.
struct Prefetch {
  const char* base;
  int64_t per_pair, line, end;
};

// y[0:MR, 0:cols] = x[0:MR, :] @ panel (+ bias), x rows `ldx` apart, y rows `ldy` apart
template <int MR>
void block(const float* x, int64_t ldx, const float* panel, int64_t K, const float* bias, float* y, int64_t ldy,
           int64_t cols, Prefetch pf) {
  __m512 acc[MR][3];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = acc[i][2] = _mm512_setzero_ps();
  auto step = [&](int64_t k) __attribute__((always_inline)) {
    const float* wk = panel + k * PANEL;
    const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16), w2 = _mm512_loadu_ps(wk + 32);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512 xi = _mm512_set1_ps(x[i * ldx + k]);
      acc[i][0] = _mm512_fmadd_ps(xi, w0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(xi, w1, acc[i][1]);
      acc[i][2] = _mm512_fmadd_ps(xi, w2, acc[i][2]);
    }
  };
  int64_t k = 0;
  if (pf.base != nullptr) {
    for (; k + 2 <= K; k += 2) {
      for (int64_t j = 0; j < pf.per_pair && pf.line < pf.end; ++j, ++pf.line)
        _mm_prefetch(pf.base + pf.line * 64, _MM_HINT_T1);
      step(k);
      step(k + 1);
    }
  } else {
    for (; k + 2 <= K; k += 2) {
      step(k);
      step(k + 1);
    }
  }
  for (; k < K; ++k) step(k);
  __m512 b[3];
  float tail[PANEL];
  const float* bp = bias;
  if (bias != nullptr && cols < PANEL) {
    std::fill(tail, tail + PANEL, 0.f);
    std::copy(bias, bias + cols, tail);
    bp = tail;
  }
  for (int j = 0; j < 3; ++j) b[j] = bp != nullptr ? _mm512_loadu_ps(bp + 16 * j) : _mm512_setzero_ps();
  for (int i = 0; i < MR; ++i) {
    float* yi = y + i * ldy;
    for (int j = 0; j < 3; ++j) {
      const int64_t left = cols - 16 * j;
      if (left <= 0) break;
      const __mmask16 m = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
      _mm512_mask_storeu_ps(yi + 16 * j, m, bias != nullptr ? _mm512_add_ps(acc[i][j], b[j]) : acc[i][j]);
    }
  }
}

using BlockFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t, int64_t,
                         Prefetch);
constexpr BlockFn BLOCKS[9] = {nullptr,  block<1>, block<2>, block<3>, block<4>,
                               block<5>, block<6>, block<7>, block<8>};

void run_panels(const float* x, int64_t M, int64_t K, const float* panels, int64_t P, int64_t N, const float* bias,
                float* y) {
  const int64_t panel_lines = K * PANEL * 4 / 64;
  const bool big = M > CHUNKED_ROWS;
  at::parallel_for(0, P, 1, [&](int64_t b, int64_t e) {
    if (big) {  // the thread's panels in L2-sized chunks, every row passing over each chunk
      const int64_t per = std::max<int64_t>(1, CHUNK_BYTES / (K * PANEL * 4));
      const int64_t per_pair = std::max<int64_t>(1, (panel_lines + K / 2 - 1) / std::max<int64_t>(1, K / 2));
      for (int64_t cb = b; cb < e; cb += per) {
        const int64_t ce = std::min(e, cb + per);
        for (int64_t m = 0; m < M; m += 8) {
          const int64_t mr = std::min<int64_t>(8, M - m);
          for (int64_t p = cb; p < ce; ++p) {
            const float* panel = panels + p * K * PANEL;
            const int64_t cols = std::min(PANEL, N - p * PANEL);
            Prefetch pf{m == 0 && p + 1 < e ? reinterpret_cast<const char*>(panel + K * PANEL) : nullptr, per_pair, 0,
                        panel_lines};
            BLOCKS[mr](x + m * K, K, panel, K, bias != nullptr ? bias + p * PANEL : nullptr, y + m * N + p * PANEL, N,
                       cols, pf);
          }
        }
      }
      return;
    }
    for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
      const int64_t rows = std::min(ROW_BLOCK, M - m0), blocks = (rows + 7) / 8;
      // the next panel's lines, spread over this panel's (blocks x K / 2) k pairs
      const int64_t per_pair = std::max<int64_t>(1, (panel_lines + blocks * (K / 2) - 1) / std::max<int64_t>(1, blocks * (K / 2)));
      for (int64_t p = b; p < e; ++p) {
        const float* panel = panels + p * K * PANEL;
        const int64_t cols = std::min(PANEL, N - p * PANEL);
        Prefetch pf{p + 1 < e ? reinterpret_cast<const char*>(panel + K * PANEL) : nullptr, per_pair, 0, panel_lines};
        for (int64_t r = 0; r < blocks; ++r) {
          const int64_t m = m0 + r * 8, mr = std::min<int64_t>(8, M - m);
          BLOCKS[mr](x + m * K, K, panel, K, bias != nullptr ? bias + p * PANEL : nullptr, y + m * N + p * PANEL, N,
                     cols, pf);
          if (pf.base != nullptr) pf.line = std::min(panel_lines, pf.line + per_pair * (K / 2));
        }
      }
    }
  });
}

#endif

bool linear_panels_available() {
#ifdef __AVX512F__
  return true;
#else
  return false;
#endif
}

at::Tensor linear_panels(const at::Tensor& x_in, const at::Tensor& panels, int64_t N,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(linear_panels_available(), "linear_panels: this build has no AVX-512");
  TORCH_CHECK(panels.device().is_cpu() && panels.scalar_type() == at::kFloat && panels.dim() == 3 &&
                  panels.size(2) == PANEL && panels.is_contiguous(),
              "linear_panels: panels from pack_linear_weight");
  const int64_t P = panels.size(0), K = panels.size(1);
  TORCH_CHECK(N > (P - 1) * PANEL && N <= P * PANEL, "linear_panels: ", N, " output features do not fit ", P,
              " panels");
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat && x_in.dim() == 2 && x_in.size(1) == K,
              "linear_panels: x must be a CPU float32 [rows, ", K, "] tensor, got ", x_in.scalar_type(), " ",
              x_in.sizes());
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat && bias->dim() == 1 &&
                    bias->size(0) == N && bias->is_contiguous(),
                "linear_panels: bias must be a contiguous CPU float32 [", N, "]");
    bp = bias->data_ptr<float>();
  }
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
#ifdef __AVX512F__
  if (M > 0) run_panels(x.data_ptr<float>(), M, K, panels.data_ptr<float>(), P, N, bp, y.data_ptr<float>());
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(folio_cpu, m) {
  m.def("pack_linear_weight(Tensor w) -> Tensor");
  m.def("linear_panels(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor");
  m.def("linear_panels_available() -> bool", &linear_panels_available);
  m.impl("pack_linear_weight", c10::DispatchKey::CPU, TORCH_FN(pack_linear_weight));
  m.impl("linear_panels", c10::DispatchKey::CPU, TORCH_FN(linear_panels));
}
