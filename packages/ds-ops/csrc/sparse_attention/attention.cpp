// Block-sparse attention kernels (see attention.h). Every block product is a small GEMM on float32
// operands made once per (batch, head): K^T by block for the scores, V, and in the backward Q, K,
// dO and V^T. bf16/fp16 inputs are widened on that copy and outputs rounded once, so all sums are
// float32. Threads share the block rows of one (batch, head) (dynamic schedule: rows differ in
// length), and the key blocks for dK and dV, so no two threads ever write the same output.
#include "attention.h"

#include <omp.h>

#include <algorithm>
#include <array>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "dtype.h"
#include "parallel.h"
#include "simd.h"

namespace ds {
namespace {

using B = Simd;
using V = B::V;
constexpr int64_t W = B::W;
constexpr int64_t kMaxBlock = 128;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Scratch of the calling thread, kept between calls: the per-(batch, head) copies are megabytes at
// long sequences, and fresh allocations that size page-fault on every call.
float* cached_scratch(size_t slot, int64_t n) {
  thread_local std::array<std::vector<float>, 4> buffers;
  std::vector<float>& buffer = buffers.at(slot);
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(static_cast<size_t>(n));
  return buffer.data();
}

// One register tile of matmul: R rows x C vectors of O; each vector of X loaded feeds R fused
// multiply-adds whose A operand is a broadcast from memory. ARS is A's row stride when known at
// compile time (then the R addresses are constant offsets, not R registers), 0 when it is not.
template <int R, int C, int64_t ARS>
inline void matmul_tile(int64_t K, const float* A, int64_t a_rs, int64_t a_cs, const float* X, int64_t ldx, float* O,
                        int64_t ldo, bool accumulate) {
  const int64_t rs = ARS ? ARS : a_rs;
  V acc[R][C];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < C; ++c) acc[i][c] = accumulate ? B::load(O + i * ldo + c * W) : B::set1(0.f);
  for (int64_t k = 0; k < K; ++k, A += a_cs, X += ldx) {
    V x[C];
    for (int c = 0; c < C; ++c) x[c] = B::load(X + c * W);
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const V a = B::set1(A[i * rs]);
      for (int c = 0; c < C; ++c) acc[i][c] = B::fmadd(a, x[c], acc[i][c]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < C; ++c) B::store(O + i * ldo + c * W, acc[i][c]);
}

template <int64_t ARS>
void matmul_tiles(int64_t M, int64_t N, int64_t K, const float* A, int64_t a_rs, int64_t a_cs, const float* X,
                  int64_t ldx, float* O, int64_t ldo, bool accumulate) {
  constexpr bool kWide = W == 16;  // AVX-512: 32 registers, room for 16 accumulators
  int64_t n0 = 0;
  if constexpr (kWide) {
    for (; n0 + 2 * W <= N; n0 += 2 * W)
      for (int64_t m0 = 0; m0 < M; m0 += 8)
        matmul_tile<8, 2, ARS>(K, A + m0 * a_rs, a_rs, a_cs, X + n0, ldx, O + m0 * ldo + n0, ldo, accumulate);
  }
  for (; n0 < N; n0 += W)
    for (int64_t m0 = 0; m0 < M; m0 += (kWide ? 16 : 8)) {
      if constexpr (kWide) matmul_tile<16, 1, ARS>(K, A + m0 * a_rs, a_rs, a_cs, X + n0, ldx, O + m0 * ldo + n0, ldo, accumulate);
      else matmul_tile<8, 1, ARS>(K, A + m0 * a_rs, a_rs, a_cs, X + n0, ldx, O + m0 * ldo + n0, ldo, accumulate);
    }
}

// O[m][n] = (accumulate ? O[m][n] : 0) + sum_k A(m, k) X[k][n], A(m, k) = A[m * a_rs + k * a_cs],
// for m < M (a multiple of 16), n < N (a multiple of W), k < K. Every A here has a row stride of
// 1 or the block, so those get their own compiled tiles.
void matmul(int64_t M, int64_t N, int64_t K, const float* A, int64_t a_rs, int64_t a_cs, const float* X,
            int64_t ldx, float* O, int64_t ldo, bool accumulate) {
  switch (a_rs) {
    case 1: return matmul_tiles<1>(M, N, K, A, a_rs, a_cs, X, ldx, O, ldo, accumulate);
    case 16: return matmul_tiles<16>(M, N, K, A, a_rs, a_cs, X, ldx, O, ldo, accumulate);
    case 32: return matmul_tiles<32>(M, N, K, A, a_rs, a_cs, X, ldx, O, ldo, accumulate);
    case 64: return matmul_tiles<64>(M, N, K, A, a_rs, a_cs, X, ldx, O, ldo, accumulate);
    case 128: return matmul_tiles<128>(M, N, K, A, a_rs, a_cs, X, ldx, O, ldo, accumulate);
    default: return matmul_tiles<0>(M, N, K, A, a_rs, a_cs, X, ldx, O, ldo, accumulate);
  }
}

// rows x cols of float32 (row stride src_ld) -> cols x rows
void transpose(const float* src, int64_t rows, int64_t cols, int64_t src_ld, float* dst) {
  for (int64_t k = 0; k < cols; ++k)
    for (int64_t r = 0; r < rows; ++r) dst[k * rows + r] = src[r * src_ld + k];
}

// dst[0, padded) = mult * src[0, D) as float32, zeros after D.
template <class T>
void load_row(const T* src, int64_t D, int64_t padded, float mult, float* dst) {
  const V m = B::set1(mult);
  int64_t d = 0;
  for (; d + W <= D; d += W) B::store(dst + d, B::mul(B::load(src + d), m));
  for (; d < D; ++d) dst[d] = Scalar::load(src + d) * mult;
  for (; d < padded; ++d) dst[d] = 0.f;
}

template <class T>
void store_row(const float* src, int64_t D, T* dst) {
  int64_t d = 0;
  for (; d + W <= D; d += W) B::store(dst + d, B::load(src + d));
  for (; d < D; ++d) Scalar::store(dst + d, src[d]);
}

// The rows of one (batch, head) of a Dense tensor.
template <class T>
struct Rows {
  T* base;
  int64_t stride;
  T* row(int64_t s) const { return base + s * stride; }
};

template <class T>
Rows<T> rows_of(const Dense& t, int64_t b, int64_t h) {
  return {as_ptr<T>(t[0]) + b * t[1] + h * t[2], t[3]};
}

struct Dims {
  int64_t batch, heads, seq, D, blk, nb, Dp, bb;
  explicit Dims(const Shape& s)
      : batch(s[0]), heads(s[1]), seq(s[2]), D(s[3]), blk(s[4]), nb(s[2] / s[4]), Dp(round_up(s[3], W)),
        bb(s[4] * s[4]) {}
};

struct Blocks {
  const int32_t *row_ptr, *col_idx, *col_ptr, *csc_row, *csc_nnz;
  int64_t nnz, max_row, nb;
  Blocks(const Layout& l, int64_t num_blocks)
      : row_ptr(as_ptr<const int32_t>(l[0])), col_idx(as_ptr<const int32_t>(l[1])),
        col_ptr(as_ptr<const int32_t>(l[2])), csc_row(as_ptr<const int32_t>(l[3])),
        csc_nnz(as_ptr<const int32_t>(l[4])), nnz(l[5]), max_row(l[6]), nb(num_blocks) {}
  int64_t row_begin(int64_t h, int64_t i) const { return row_ptr[h * (nb + 1) + i]; }
  int64_t col_begin(int64_t h, int64_t j) const { return col_ptr[h * (nb + 1) + j]; }
};

// Block row `j` of `src` as float32 [blk][padded] rows.
template <class T>
void load_block(const Rows<const T>& src, int64_t j, const Dims& d, int64_t padded, float* dst) {
  for (int64_t r = 0; r < d.blk; ++r) load_row(src.row(j * d.blk + r), d.D, padded, 1.f, dst + r * padded);
}

// Block row `j` of `src` transposed: float32 [D][blk]; `tmp` holds blk * D floats.
template <class T>
void load_block_transposed(const Rows<const T>& src, int64_t j, const Dims& d, float* dst, float* tmp) {
  load_block(src, j, d, d.D, tmp);
  transpose(tmp, d.blk, d.D, d.D, dst);
}

// float32 rows of one (batch, head), the X operands of the products: the input itself when it is
// float32 with head_dim a multiple of the vector width, else a widened, zero-padded copy.
struct F32Rows {
  const float* base;
  int64_t ld;
  const float* block(int64_t j, int64_t blk) const { return base + j * blk * ld; }
};

template <class T>
bool used_directly(const Dims& d) { return std::is_same_v<T, float> && d.D == d.Dp; }

template <class T>
F32Rows f32_rows(const Dense& t, int64_t b, int64_t h, const Dims& d, const float* copy) {
  if (used_directly<T>(d)) return {as_ptr<const float>(t[0]) + b * t[1] + h * t[2], t[3]};
  return {copy, d.Dp};
}

void mask_causal(float* block, int64_t blk, bool whole) {
  for (int64_t r = 0; r < blk; ++r)
    std::fill(block + r * blk + (whole ? 0 : r + 1), block + (r + 1) * blk, kNegInf);
}

// Softmax along every row of one block row: `count` blocks of scores at P (keys `cols`), masks
// added first. A row that is masked everywhere gets probabilities 0 (not nan). `vec`: 2 * blk vectors.
void softmax_block_row(float* P, int64_t count, const int32_t* cols, int64_t blk, const float* key_padding,
                       const float* bias_rows, int64_t bias_ss, V* vec) {
  const int64_t bb = blk * blk;
  for (int64_t r = 0; r < blk; ++r) vec[r] = B::set1(kNegInf);
  for (int64_t e = 0; e < count; ++e) {
    const int64_t col0 = int64_t(cols[e]) * blk;
    for (int64_t r = 0; r < blk; ++r) {
      float* p = P + e * bb + r * blk;
      const float* kp = key_padding ? key_padding + col0 : nullptr;
      const float* bias = bias_rows ? bias_rows + r * bias_ss + col0 : nullptr;
      for (int64_t c = 0; c < blk; c += W) {
        V s = B::load(p + c);
        if (kp) s = B::add(s, B::load(kp + c));
        if (bias) s = B::add(s, B::load(bias + c));
        if (kp || bias) B::store(p + c, s);
        vec[r] = B::max(vec[r], s);
      }
    }
  }
  for (int64_t r = 0; r < blk; ++r) {
    const float m = B::reduce_max(vec[r]);
    vec[r] = B::set1(m == kNegInf ? 0.f : m);
  }
  V* sums = vec + blk;
  for (int64_t r = 0; r < blk; ++r) sums[r] = B::set1(0.f);
  for (int64_t e = 0; e < count; ++e)
    for (int64_t r = 0; r < blk; ++r) {
      float* p = P + e * bb + r * blk;
      for (int64_t c = 0; c < blk; c += W) {
        const V x = B::exp(B::sub(B::load(p + c), vec[r]));
        B::store(p + c, x);
        sums[r] = B::add(sums[r], x);
      }
    }
  for (int64_t r = 0; r < blk; ++r) {
    const float total = B::sum(sums[r]);
    vec[r] = B::set1(total > 0.f ? 1.f / total : 0.f);
  }
  for (int64_t e = 0; e < count; ++e)
    for (int64_t r = 0; r < blk; ++r) {
      float* p = P + e * bb + r * blk;
      for (int64_t c = 0; c < blk; c += W) B::store(p + c, B::mul(B::load(p + c), vec[r]));
    }
}

template <class T>
void forward(const Dense& qd, const Dense& kd, const Dense& vd, const Dense& od, float* probs, const Dims& d,
             const Blocks& L, const Masks& masks, float scale, bool causal, int num_threads) {
  float* kt = cached_scratch(0, d.seq * d.D);  // K^T by block [nb][D][blk]
  float* vf = used_directly<T>(d) ? nullptr : cached_scratch(1, d.seq * d.Dp);
  const float* key_padding = as_ptr<const float>(masks[0]);
  const float* bias = as_ptr<const float>(masks[2]);
#pragma omp parallel num_threads(num_threads)
  {
    const IeeeDenormals ieee;  // the denormal policy (parallel.h)
    std::vector<float> qs(d.blk * d.D), acc(d.blk * d.Dp), tmp(d.blk * d.D);
    std::vector<float> local(probs ? 0 : L.max_row * d.bb);
    std::vector<V> vec(2 * d.blk);  // the softmax's row maxima and sums
    for (int64_t bh = 0; bh < d.batch * d.heads; ++bh) {
      const int64_t b = bh / d.heads, h = bh % d.heads;
      const auto Q = rows_of<const T>(qd, b, h), K = rows_of<const T>(kd, b, h), Vr = rows_of<const T>(vd, b, h);
      const auto O = rows_of<T>(od, b, h);
      const F32Rows Vf = f32_rows<T>(vd, b, h, d, vf);
#pragma omp for schedule(static)
      for (int64_t j = 0; j < d.nb; ++j) {
        load_block_transposed(K, j, d, kt + j * d.D * d.blk, tmp.data());
        if (vf) load_block(Vr, j, d, d.Dp, vf + j * d.blk * d.Dp);
      }
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < d.nb; ++i) {
        const int64_t n0 = L.row_begin(h, i), count = L.row_begin(h, i + 1) - n0;
        const int32_t* cols = L.col_idx + n0;
        float* P = probs ? probs + (b * L.nnz + n0) * d.bb : local.data();
        for (int64_t r = 0; r < d.blk; ++r) load_row(Q.row(i * d.blk + r), d.D, d.D, scale, tmp.data() + r * d.D);
        transpose(tmp.data(), d.blk, d.D, d.D, qs.data());  // [D][blk]: A of the scores with row stride 1
        for (int64_t e = 0; e < count; ++e) {
          const int64_t j = cols[e];
          if (causal && j > i) {
            mask_causal(P + e * d.bb, d.blk, true);
            continue;
          }
          matmul(d.blk, d.blk, d.D, qs.data(), 1, d.blk, kt + j * d.D * d.blk, d.blk, P + e * d.bb, d.blk, false);
          if (causal && j == i) mask_causal(P + e * d.bb, d.blk, false);
        }
        const float* bias_rows = bias ? bias + h * masks[3] + i * d.blk * masks[4] : nullptr;
        softmax_block_row(P, count, cols, d.blk, key_padding ? key_padding + b * masks[1] : nullptr, bias_rows,
                          masks[4], vec.data());
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t e = 0; e < count; ++e)
          matmul(d.blk, d.Dp, d.blk, P + e * d.bb, d.blk, 1, Vf.block(cols[e], d.blk), Vf.ld, acc.data(), d.Dp, true);
        for (int64_t r = 0; r < d.blk; ++r) store_row(acc.data() + r * d.Dp, d.D, O.row(i * d.blk + r));
      }
    }
  }
}

// out_j = sum over the blocks n = (i, j) of key block j: A_n^T X_i (A = P or dS, X = dO or Q).
template <class T>
void by_key_block(const float* A, const F32Rows& X, const Rows<T>& out, int64_t b, int64_t h, int64_t j,
                  const Dims& d, const Blocks& L, float* acc) {
  const int64_t e0 = L.col_begin(h, j), e1 = L.col_begin(h, j + 1);
  std::fill(acc, acc + d.blk * d.Dp, 0.f);
  for (int64_t e = e0; e < e1; ++e) {
    const float* An = A + (b * L.nnz + L.csc_nnz[e]) * d.bb;
    matmul(d.blk, d.Dp, d.blk, An, 1, d.blk, X.block(L.csc_row[e], d.blk), X.ld, acc, d.Dp, true);
  }
  for (int64_t r = 0; r < d.blk; ++r) store_row(acc + r * d.Dp, d.D, out.row(j * d.blk + r));
}

template <class T>
void backward(const Dense& qd, const Dense& kd, const Dense& vd, const Dense& dod, const Dense& dqd,
              const Dense& dkd, const Dense& dvd, float* probs, const Dims& d, const Blocks& L, float scale,
              int num_threads) {
  // float32 copies of one (batch, head): V^T by block, K, Q, dO ([seq][Dp])
  const bool copy = !used_directly<T>(d);
  float* vt = cached_scratch(0, d.seq * d.D);
  float *kf = nullptr, *qf = nullptr, *dof = nullptr;
  if (copy) {
    kf = cached_scratch(1, d.seq * d.Dp);
    qf = cached_scratch(2, d.seq * d.Dp);
    dof = cached_scratch(3, d.seq * d.Dp);
  }
#pragma omp parallel num_threads(num_threads)
  {
    const IeeeDenormals ieee;
    std::vector<float> acc(d.blk * d.Dp), tmp(d.blk * d.Dp), dp(L.max_row * d.bb);
    std::vector<V> vec(d.blk);
    for (int64_t bh = 0; bh < d.batch * d.heads; ++bh) {
      const int64_t b = bh / d.heads, h = bh % d.heads;
#pragma omp for schedule(static)
      for (int64_t j = 0; j < d.nb; ++j) {
        load_block_transposed(rows_of<const T>(vd, b, h), j, d, vt + j * d.D * d.blk, tmp.data());
        if (!copy) continue;
        load_block(rows_of<const T>(kd, b, h), j, d, d.Dp, kf + j * d.blk * d.Dp);
        load_block(rows_of<const T>(qd, b, h), j, d, d.Dp, qf + j * d.blk * d.Dp);
        load_block(rows_of<const T>(dod, b, h), j, d, d.Dp, dof + j * d.blk * d.Dp);
      }
      const F32Rows Kf = f32_rows<T>(kd, b, h, d, kf), Qf = f32_rows<T>(qd, b, h, d, qf),
                    dOf = f32_rows<T>(dod, b, h, d, dof);
#pragma omp for schedule(dynamic, 1)
      for (int64_t j = 0; j < d.nb; ++j) by_key_block(probs, dOf, rows_of<T>(dvd, b, h), b, h, j, d, L, acc.data());
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < d.nb; ++i) {
        const int64_t n0 = L.row_begin(h, i), count = L.row_begin(h, i + 1) - n0;
        const int32_t* cols = L.col_idx + n0;
        float* P = probs + (b * L.nnz + n0) * d.bb;
        for (int64_t r = 0; r < d.blk; ++r) vec[r] = B::set1(0.f);
        transpose(dOf.block(i, d.blk), d.blk, d.D, dOf.ld, tmp.data());  // dO_i^T [D][blk]
        for (int64_t e = 0; e < count; ++e) {  // dP = dO V^T, and rowsum(P * dP)
          float* dpn = dp.data() + e * d.bb;
          matmul(d.blk, d.blk, d.D, tmp.data(), 1, d.blk, vt + cols[e] * d.D * d.blk, d.blk, dpn, d.blk, false);
          for (int64_t r = 0; r < d.blk; ++r)
            for (int64_t c = 0; c < d.blk; c += W)
              vec[r] = B::fmadd(B::load(P + e * d.bb + r * d.blk + c), B::load(dpn + r * d.blk + c), vec[r]);
        }
        for (int64_t r = 0; r < d.blk; ++r) vec[r] = B::set1(B::sum(vec[r]));
        const V vscale = B::set1(scale);
        for (int64_t e = 0; e < count; ++e)  // dS = scale * P (dP - rowsum), in place of P
          for (int64_t r = 0; r < d.blk; ++r) {
            float* p = P + e * d.bb + r * d.blk;
            const float* g = dp.data() + e * d.bb + r * d.blk;
            for (int64_t c = 0; c < d.blk; c += W)
              B::store(p + c, B::mul(B::mul(B::load(p + c), B::sub(B::load(g + c), vec[r])), vscale));
          }
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t e = 0; e < count; ++e)
          matmul(d.blk, d.Dp, d.blk, P + e * d.bb, d.blk, 1, Kf.block(cols[e], d.blk), Kf.ld, acc.data(), d.Dp, true);
        const auto dQ = rows_of<T>(dqd, b, h);
        for (int64_t r = 0; r < d.blk; ++r) store_row(acc.data() + r * d.Dp, d.D, dQ.row(i * d.blk + r));
      }
#pragma omp for schedule(dynamic, 1)
      for (int64_t j = 0; j < d.nb; ++j) by_key_block(probs, Qf, rows_of<T>(dkd, b, h), b, h, j, d, L, acc.data());
    }
  }
}

void check(const Shape& shape, int num_threads) {
  const int64_t blk = shape[4];
  if (blk < 16 || blk > kMaxBlock || blk % 16 != 0)
    throw std::invalid_argument("sparse attention: block must be 16, 32, 48, ... or 128, got " + std::to_string(blk));
  if (shape[2] % blk != 0)
    throw std::invalid_argument("sparse attention: sequence length " + std::to_string(shape[2]) +
                                " is not a multiple of the block " + std::to_string(blk));
  for (int a = 0; a < 4; ++a)
    if (shape[a] < 1) throw std::invalid_argument("sparse attention: every dimension must be >= 1");
  if (num_threads < 1) throw std::invalid_argument("sparse attention: num_threads must be >= 1");
}

}  // namespace

void sparse_attention_forward(const Dense& q, const Dense& k, const Dense& v, const Dense& out, int64_t probs,
                              const Shape& shape, const Layout& layout, const Masks& masks, float scale,
                              bool causal, int dtype, int num_threads) {
  const IeeeDenormals ieee;  // the caller's thread too (parallel.h)
  check(shape, num_threads);
  const Dims d(shape);
  const Blocks L(layout, d.nb);
  with_dtype(dtype, "sparse attention input", [&](auto tag) {
    forward<Elem<decltype(tag)>>(q, k, v, out, as_ptr<float>(probs), d, L, masks, scale, causal, num_threads);
  });
}

void sparse_attention_backward(const Dense& q, const Dense& k, const Dense& v, const Dense& grad_out,
                               const Dense& grad_q, const Dense& grad_k, const Dense& grad_v, int64_t probs,
                               const Shape& shape, const Layout& layout, float scale, int dtype, int num_threads) {
  const IeeeDenormals ieee;  // the caller's thread too (parallel.h)
  check(shape, num_threads);
  if (probs == 0) throw std::invalid_argument("sparse attention backward: the forward's probabilities are missing");
  const Dims d(shape);
  const Blocks L(layout, d.nb);
  with_dtype(dtype, "sparse attention input", [&](auto tag) {
    backward<Elem<decltype(tag)>>(q, k, v, grad_out, grad_q, grad_k, grad_v, as_ptr<float>(probs), d, L, scale,
                                  num_threads);
  });
}

}  // namespace ds
