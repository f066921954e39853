// 1-bit compression with error feedback (1-bit Adam, Tang et al. 2021) on float32 buffers: the
// kernels of ds_comm.compressed_allreduce. Python owns the buffers and passes raw pointers (as
// integers) and element counts; every kernel releases the GIL and threads with OpenMP.
//
// A *frame* is one chunk of `chunk` values compressed: their signs (bit 1 for >= 0, 8 per byte,
// least significant bit first: element 8j+i is bit i of byte j, as ds_comm.pack_signs) followed by
// the chunk's scale, its root mean square, as a float32 in native byte order: chunk/8 + 4 bytes.
// Decompressed, an element is +scale or -scale.
//
// The error feedback is kept lazily, in a *state*: the values last compressed (w, the input plus
// the error before it) and each chunk's scale. The error they stand for, w - scale * sign(w)
// (sign(w) = +1 where w >= 0), is recomputed on the next call as it reads the state, so a
// compression is one pass over memory: the error is never written, only w. A zero state is no
// error (0 - (+0) = 0).
#pragma once

#include <cstdint>

namespace ds {

constexpr int64_t kScaleBytes = 4;
inline int64_t frame_bytes(int64_t chunk) { return chunk / 8 + kScaleBytes; }

// Worker side. `values` holds chunks * chunk floats and `scales` one float per chunk: the state.
// w = x + (values - scales[c] * sign(values)), where x holds n elements and counts as 0 beyond them
// (there w is the error alone), cut into `chunks` chunks of `chunk` elements (chunk a multiple of 8,
// n <= chunks * chunk). Frame c of `frames` receives chunk c of w: signs and scale_c = sqrt(sum w^2 /
// chunk) (the sum in double); w is written over `values` and scale_c over scales[c]. One pass: reads
// x and values, writes values and the frames.
void onebit_compress(int64_t x, int64_t n, int64_t values, int64_t scales, int64_t chunks, int64_t chunk,
                     int64_t frames, int num_threads);

// Server side: the `world` frames of one chunk (one from every rank, contiguous) averaged and the
// server's error added, a = (sign_0 * scale_0 + ... + sign_{world-1} * scale_{world-1}) / world +
// (values - *scale * sign(values)) (added in rank order, divided, then the error added), compressed
// into `out_frame` as above; a is written over `values` (chunk floats) and its scale over *scale.
// One pass: reads the frames and values, writes values and the frame.
void onebit_average(int64_t frames, int64_t world, int64_t chunk, int64_t values, int64_t scale, int64_t out_frame,
                    int num_threads);

// out[i] = +scale or -scale of element i of `chunks` contiguous frames, for i < n (n <= chunks *
// chunk: the padding of the last chunk is not written). One pass: reads the frames, writes out.
void onebit_decompress(int64_t frames, int64_t chunks, int64_t chunk, int64_t out, int64_t n, int num_threads);

}  // namespace ds
