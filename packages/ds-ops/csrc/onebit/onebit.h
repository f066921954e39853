// 1-bit compression with error feedback (1-bit Adam, Tang et al. 2021) on float32 buffers: the
// kernels of ds_comm.compressed_allreduce. Python owns the buffers and passes raw pointers (as
// integers) and element counts; every kernel releases the GIL and threads with OpenMP.
//
// A *frame* is one chunk of `chunk` values compressed: their signs (bit 1 for >= 0, 8 per byte,
// least significant bit first: element 8j+i is bit i of byte j, as ds_comm.pack_signs) followed by
// the chunk's scale, its root mean square, as a float32 in native byte order: chunk/8 + 4 bytes.
// Decompressed, an element is +scale or -scale; the compression error, value - that, is kept by the
// caller and added to the next call's values (error feedback).
#pragma once

#include <cstdint>

namespace ds {

constexpr int64_t kScaleBytes = 4;
inline int64_t frame_bytes(int64_t chunk) { return chunk / 8 + kScaleBytes; }

// Worker side. w = x + error, where x holds n elements and counts as 0 beyond them, cut into
// `chunks` chunks of `chunk` elements (chunk a multiple of 8, n <= chunks * chunk = error's size).
// Frame c of `frames` receives chunk c of w: signs and scale_c = sqrt(sum w^2 / chunk) (the sum in
// double); error becomes w - scale_c * sign(w). Two passes, since the scales are needed before the
// first error is written: the sums of squares (reads x, error), then the frames and the new error
// (reads x, error; writes error, frames).
void onebit_compress(int64_t x, int64_t n, int64_t error, int64_t chunks, int64_t chunk, int64_t frames,
                     int num_threads);

// Server side: the `world` frames of one chunk (one from every rank, contiguous) averaged,
// a = (sign_0 * scale_0 + ... + sign_{world-1} * scale_{world-1}) / world + server_error (added in
// rank order, divided, then the error added), compressed into `out_frame` as above;
// server_error becomes a - scale * sign(a). Two passes as onebit_compress: the sum of squares
// (reads the frames and server_error), then the frame and the new error (reads both, writes
// server_error and the frame).
void onebit_average(int64_t frames, int64_t world, int64_t chunk, int64_t server_error, int64_t out_frame,
                    int num_threads);

// out[i] = +scale or -scale of element i of `chunks` contiguous frames, for i < n (n <= chunks *
// chunk: the padding of the last chunk is not written). One pass: reads the frames, writes out.
void onebit_decompress(int64_t frames, int64_t chunks, int64_t chunk, int64_t out, int64_t n, int num_threads);

}  // namespace ds
