// bfloat16 linear layers on AMX's tiles, y = x @ w.T + b (float32 sums, one rounding to bf16 at
// the end, as oneDNN's and torch's bf16 matmuls round). Wrappers and the choice in linear.py.
//
//   pack_linear_tiles(w [N, K] bf16)              -> bf16 [P, K' / 32, 16, 16, 2]: 16-column
//                                                    panels (P = N rounded up to 32, over 16;
//                                                    K' = K rounded up to 32), each k step's 16 x
//                                                    32 slice in AMX's pair layout (VNNI), zeros
//                                                    past N and K
//   linear_tiles(x [M, K] bf16, tiles, N, bias?)  -> bf16 [M, N]
//   linear_tiles_available()                      -> this build has AMX-BF16 and the kernel
//                                                    allows this process its tile state
//
// Why not oneDNN: at decode sizes a layer's weight comes from memory once a step, and oneDNN's
// AMX kernel leaves most of the memory's rate unused (SmolLM2-135M's four layer linears at 64
// rows, every layer its own weights: ~800 GFLOP/s, ~1,150 with the weights in cache, on the
// 2-core Xeon with AMX). Here a thread works through its pairs of panels in order, 32 rows x 32
// columns at a time (2 x 2 tiles: four float32 accumulators, two x tiles, two weight tiles), and
// prefetches the pair two ahead into L2, spread over the k steps. Two more things it needs:
//   - the epilogue (tiles stored, bias added, rounded to bf16, written) overlaps the next block:
//     a block's sums wait in a buffer and are written a few rows per k step of the next block,
//     on the vector units while AMX computes. Done after each block, it cost ~25 % at K = 576
//     (18 k steps a block).
//   - past ROWS rows (a prefill chunk) a thread's pairs go in chunks of CHUNK bytes, each kept in
//     L2 while 64 rows of x at a time pass over it, so the weight comes from memory once and y is
//     written in runs. One pass of 256 rows over all of a thread's pairs at 2,048 rows pushed x
//     out of L2 with the weight and wrote y a 64-byte line a row at a time (~1,140 GFLOP/s
//     against oneDNN's ~2,440; now ~2,260). The LM head (49,152 columns) at 128 rows wanted the
//     chunks too: its rows 96 KiB apart share a few cache sets.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define FOLIO_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t KSTEP = 32;        // bf16 k per tile row (64 bytes)
constexpr int64_t TILE_BYTES = 1024; // one weight tile: 16 k pairs x 16 columns x 2
constexpr int64_t AHEAD = 2;         // pairs of panels prefetched ahead
#ifndef FOLIO_TILE_ROWS
#define FOLIO_TILE_ROWS 64
#endif
constexpr int64_t ROWS = FOLIO_TILE_ROWS;  // rows of x per pass over the panels
constexpr int64_t CHUNK = 1 << 20;        // bytes of a thread's panels kept in L2 past ROWS rows

#ifdef FOLIO_AMX
// Linux hands out AMX's tile state per process on request (arch_prctl ARCH_REQ_XCOMP_PERM);
// oneDNN asks the same way. Once granted it stays.
bool tiles_permitted() {
  static const bool ok = [] {
    constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// A 32 x 32 block's float32 sums, stored from the tiles and waiting to be written to y as bf16
// (+ bias): written a few rows at a time while the next block's tiles compute, so the vector
// units' conversion overlaps AMX's work instead of following it.
struct Pending {
  alignas(64) float c[4][16][16];
  int64_t m0 = 0, c0 = 0, done = 32;  // rows of the block written so far (32: nothing pending)
};

struct Out {
  int64_t M, N;
  const float* bias;
  uint16_t* y;
};

// rows [p.done, until) of the pending block: 32 columns a row from tiles (t, t + 1)
inline void write_rows(Pending& p, int64_t until, const Out& o) {
  const int64_t cols = std::min<int64_t>(32, o.N - p.c0);
  const __mmask32 m = cols >= 32 ? __mmask32(0xffffffffu) : __mmask32((1u << cols) - 1);
  const __mmask16 lo = __mmask16(m), hi = __mmask16(m >> 16);
  const __m512 b0 = o.bias != nullptr ? _mm512_maskz_loadu_ps(lo, o.bias + p.c0) : _mm512_setzero_ps();
  const __m512 b1 = o.bias != nullptr && cols > 16 ? _mm512_maskz_loadu_ps(hi, o.bias + p.c0 + 16) : _mm512_setzero_ps();
  for (int64_t r = p.done; r < until; ++r) {
    const int64_t row = p.m0 + r;
    if (row >= o.M) break;
    const int t = static_cast<int>(r >> 4) * 2, i = static_cast<int>(r & 15);
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_add_ps(_mm512_load_ps(p.c[t + 1][i]), b1),
                                           _mm512_add_ps(_mm512_load_ps(p.c[t][i]), b0));
    _mm512_mask_storeu_epi16(o.y + row * o.N + p.c0, m, (__m512i)v);
  }
  p.done = std::max(p.done, until);
}

// rows [m0, m0 + 32) of x (row stride ldx, in bf16) times the pair of panels (w0, w1), k steps
// `ks`, into y's columns [c0, c0 + 32): finishes the block `prev` left pending on the way, and
// leaves this one pending in `next`
void pair_block(const uint16_t* xa, int64_t ldx, const uint16_t* w0, const uint16_t* w1, int64_t ks,
                const char* pf, int64_t m0, int64_t c0, Pending& prev, Pending& next, const Out& o) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t per_step = (32 - prev.done + ks - 1) / ks;
  for (int64_t s = 0; s < ks; ++s) {
    if (pf != nullptr)
      for (int l = 0; l < 16; ++l) {
        _mm_prefetch(pf + s * TILE_BYTES + l * 64, _MM_HINT_T1);
        _mm_prefetch(pf + (ks + s) * TILE_BYTES + l * 64, _MM_HINT_T1);
      }
    _tile_loadd(6, w0 + s * TILE_BYTES / 2, 64);
    _tile_loadd(7, w1 + s * TILE_BYTES / 2, 64);
    _tile_loadd(4, xa + s * KSTEP, ldx * 2);
    _tile_loadd(5, xa + 16 * ldx + s * KSTEP, ldx * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
    if (prev.done < 32) write_rows(prev, std::min<int64_t>(32, prev.done + per_step), o);
  }
  if (prev.done < 32) write_rows(prev, 32, o);
  _tile_stored(0, next.c[0], 64);
  _tile_stored(1, next.c[1], 64);
  _tile_stored(2, next.c[2], 64);
  _tile_stored(3, next.c[3], 64);
  next.m0 = m0, next.c0 = c0, next.done = 0;
}

void run_tiles(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t P, int64_t KS, int64_t N,
               const float* bias, uint16_t* y) {
  const int64_t Kp = KS * KSTEP, full = M / 32 * 32;
  // rows that do not fill a 32-row block, and any x whose K is not a multiple of 32: copied into a
  // zero-padded buffer (the tiles read 32 rows x Kp)
  const bool direct = Kp == K;
  const int64_t first_copied = direct ? full : 0;
  std::vector<uint16_t> pad(static_cast<size_t>((M - first_copied + 31) / 32 * 32 * Kp), 0);
  for (int64_t r = first_copied; r < M; ++r)
    std::memcpy(pad.data() + (r - first_copied) * Kp, x + r * K, K * 2);
  const int64_t pairs = P / 2, per_panel = KS * TILE_BYTES / 2;  // bf16 per panel
  // up to ROWS rows: each pair of panels once, all rows against it (its weight from memory once).
  // More rows (a prefill chunk): the thread's pairs in chunks of CHUNK bytes, which stay in L2
  // while 64 rows of x at a time (in L1) pass over them.
  const bool big = M > ROWS;
  const int64_t RB = big ? 64 : ROWS, CH = big ? std::max<int64_t>(1, CHUNK / (per_panel * 4)) : pairs;
  at::parallel_for(0, pairs, 1, [&](int64_t b, int64_t e) {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
    const Out o{M, N, bias, y};
    Pending pend[2];
    int cur = 0;
    for (int64_t cb = b; cb < e; cb += CH) {
      const int64_t ce = std::min(e, cb + CH);
      for (int64_t mb = 0; mb < M; mb += RB) {
        const bool first = mb == 0, last = mb + RB >= M;
        for (int64_t q = cb; q < ce; ++q) {
          const uint16_t* w0 = w + 2 * q * per_panel;
          const int64_t t = q + AHEAD;
          const bool want = t < e && ((first && t < ce) || (last && t >= ce));
          const char* pf = want ? reinterpret_cast<const char*>(w + 2 * t * per_panel) : nullptr;
          for (int64_t m0 = mb; m0 < std::min(M, mb + RB); m0 += 32) {
            const bool from_x = m0 < first_copied;
            const uint16_t* xa = from_x ? x + m0 * K : pad.data() + (m0 - first_copied) * Kp;
            pair_block(xa, from_x ? K : Kp, w0, w0 + per_panel, KS, m0 == mb ? pf : nullptr, m0, 32 * q, pend[cur],
                       pend[cur ^ 1], o);
            cur ^= 1;
          }
        }
      }
    }
    write_rows(pend[cur], 32, o);
    _tile_release();
  });
}
#endif

bool linear_tiles_available() {
#ifdef FOLIO_AMX
  return tiles_permitted();
#else
  return false;
#endif
}

at::Tensor pack_linear_tiles(const at::Tensor& w_in) {
  TORCH_CHECK(w_in.device().is_cpu() && w_in.scalar_type() == at::kBFloat16 && w_in.dim() == 2 && w_in.size(0) > 0 &&
                  w_in.size(1) > 0,
              "pack_linear_tiles: a CPU bfloat16 [out_features > 0, in_features > 0] weight");
  const at::Tensor w = w_in.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = (N + 31) / 32 * 2, KS = (K + KSTEP - 1) / KSTEP;
  at::Tensor out = at::zeros({P, KS, 16, 16, 2}, w.options());
  const uint16_t* s = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint16_t* d = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n)
      for (int64_t k = 0; k < K; ++k)  // panel n / 16, k step k / 32, pair row (k % 32) / 2, column n % 16
        d[(((n / 16 * KS + k / KSTEP) * 16 + (k % KSTEP) / 2) * 16 + n % 16) * 2 + k % 2] = s[n * K + k];
  });
  return out;
}

at::Tensor linear_tiles(const at::Tensor& x_in, const at::Tensor& tiles, int64_t N,
                        const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(linear_tiles_available(), "linear_tiles: this build or process has no AMX");
  TORCH_CHECK(tiles.device().is_cpu() && tiles.scalar_type() == at::kBFloat16 && tiles.dim() == 5 &&
                  tiles.size(0) % 2 == 0 && tiles.size(2) == 16 && tiles.size(3) == 16 && tiles.size(4) == 2 &&
                  tiles.is_contiguous(),
              "linear_tiles: tiles from pack_linear_tiles");
  const int64_t P = tiles.size(0), KS = tiles.size(1);
  TORCH_CHECK(N > (P - 2) * 16 && N <= P * 16, "linear_tiles: ", N, " output features do not fit ", P, " panels");
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kBFloat16 && x_in.dim() == 2 &&
                  x_in.size(1) > (KS - 1) * KSTEP && x_in.size(1) <= KS * KSTEP,
              "linear_tiles: x must be a CPU bfloat16 [rows, in_features] tensor, got ", x_in.scalar_type(), " ",
              x_in.sizes());
  std::vector<float> b32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->dim() == 1 && bias->size(0) == N, "linear_tiles: bias must be [", N,
                "]");
    const at::Tensor bf = bias->to(at::kFloat).contiguous();
    b32.assign(bf.data_ptr<float>(), bf.data_ptr<float>() + N);
  }
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
#ifdef FOLIO_AMX
  if (M > 0)
    run_tiles(reinterpret_cast<const uint16_t*>(x.data_ptr()), M, x.size(1), reinterpret_cast<const uint16_t*>(tiles.data_ptr()),
              P, KS, N, b32.empty() ? nullptr : b32.data(), reinterpret_cast<uint16_t*>(y.data_ptr()));
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(folio_cpu, m) {
  m.def("pack_linear_tiles(Tensor w) -> Tensor");
  m.def("linear_tiles(Tensor x, Tensor tiles, int n, Tensor? bias) -> Tensor");
  m.def("linear_tiles_available() -> bool", &linear_tiles_available);
  m.impl("pack_linear_tiles", c10::DispatchKey::CPU, TORCH_FN(pack_linear_tiles));
  m.impl("linear_tiles", c10::DispatchKey::CPU, TORCH_FN(linear_tiles));
}
