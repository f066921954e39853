// Block quantization (ZeRO++'s qwZ and qgZ) on CPU buffers: symmetric int8 and int4 with one float32
// scale per block ("group") of `group_size` consecutive elements. Python owns the buffers and passes
// raw pointers (as integers) and element counts; every kernel releases the GIL and threads with
// OpenMP over whole groups, so the bytes do not depend on the thread count.
//
// The contract (ds_ops.quantize's module note and the README's "Quantization" section):
//   scale = absmax / qmax (float32 division; qmax = 127 for int8, 7 for int4; absmax over the group)
//   q     = clamp(round_half_even(x / scale), -qmax, qmax)           (float32 division)
//   x'    = float(q) * scale                                          (float32, then the output dtype)
// A group holding inf or nan gets scale nan and q = 0 (it dequantizes to nan: an overflow stays
// visible); a group whose scale is 0 (all zeros, or absmax below 127 * 2^-150) gets q = 0. Subnormal
// inputs and scales are kept (IEEE, whatever the thread's FTZ/DAZ bits: parallel.h).
// int8: one signed byte per element. int4: two per byte, element 2j in the high nibble and 2j+1 in
// the low one (two's complement nibbles, DeepSpeed's PackedInt4 order); an odd count leaves the last
// low nibble 0; group_size must be even, so no byte holds two groups.
#pragma once

#include <cstdint>

namespace ds {

// x: n elements of dtype `dtype` (dtype.h codes) -> q: quantized_bytes(n, bits) bytes, scales: one
// float per group (ceil(n / group_size)).
void block_quantize(int64_t x, int dtype, int64_t n, int64_t group_size, int bits, int64_t q, int64_t scales,
                    int num_threads);

// The inverse: out (n elements of dtype `out_dtype`) = float(q) * scale of its group.
void block_dequantize(int64_t q, int64_t scales, int64_t n, int64_t group_size, int bits, int64_t out,
                      int out_dtype, int num_threads);

// k quantized tensors of n elements each, stored one after another (tensor t's bytes at
// q + t * quantized_bytes(n, bits), its scales at scales + 4 * t * groups), dequantized and summed in
// float32 in tensor order (((x'_0 + x'_1) + x'_2) ...). Then either requantized (out_q != 0: into
// out_q / out_scales with out_bits, same group size) or stored (out: n elements of out_dtype).
void block_dequantize_sum(int64_t q, int64_t scales, int64_t k, int64_t n, int64_t group_size, int bits,
                          int64_t out_q, int64_t out_scales, int out_bits, int64_t out, int out_dtype,
                          int num_threads);

}  // namespace ds
