// Block-sparse attention on CPU: only the blocks of the layout are computed and stored.
//
// Forward, one task per block row i of one (batch, head):
//   SDD      S_n = scale * Q_i K_j^T            for every block n = (i, j) of the layout row
//   softmax  P_n = softmax over the whole row of (S_n + key padding + attention bias, causal)
//   DSD      O_i = sum_n P_n V_j
// P is written to `probs` ([batch, nnz, block, block] float32) for the backward pass, or kept in a
// per-thread row buffer when no gradient is needed. Backward, per (batch, head):
//   dV_j = sum_i P_ij^T dO_i                    (by key block, over the layout's columns)
//   dP_n = dO_i V_j^T, dS_n = scale * P_n (dP_n - rowsum(P dP))   (by query block, in place of P)
//   dQ_i = sum_j dS_ij K_j,  dK_j = sum_i dS_ij^T Q_i
// Memory beyond the inputs and outputs: nnz * block^2 floats for P plus O(seq * head_dim) scratch;
// nothing is ever seq x seq.
#pragma once

#include <array>
#include <cstdint>

namespace ds {

// A [batch, heads, seq, head_dim] tensor: data pointer and element strides of the first three
// dimensions (the last is contiguous).
using Dense = std::array<int64_t, 4>;
// batch, heads, seq, head_dim, block
using Shape = std::array<int64_t, 5>;
// The layout: row_ptr [heads, nb + 1], col_idx [nnz] (CSR, block index n = position in col_idx,
// numbered over all heads), col_ptr [heads, nb + 1], csc_row [nnz], csc_nnz [nnz] (CSC: query block
// and CSR index of each block, by key block), nnz, the most blocks in one row. Indices are int32.
using Layout = std::array<int64_t, 7>;
// Additive float32 masks, 0 when absent: key padding [batch, seq] (pointer, batch stride) and an
// attention bias [heads or 1, seq, seq] (pointer, head stride, row stride).
using Masks = std::array<int64_t, 5>;

void sparse_attention_forward(const Dense& q, const Dense& k, const Dense& v, const Dense& out, int64_t probs,
                              const Shape& shape, const Layout& layout, const Masks& masks, float scale,
                              bool causal, int dtype, int num_threads);

// `probs` (from the forward) is overwritten with dS.
void sparse_attention_backward(const Dense& q, const Dense& k, const Dense& v, const Dense& grad_out,
                               const Dense& grad_q, const Dense& grad_k, const Dense& grad_v, int64_t probs,
                               const Shape& shape, const Layout& layout, float scale, int dtype, int num_threads);

}  // namespace ds
