// The native core of ds-io: a handle owning a pool of worker threads that move raw memory to and
// from files. No torch headers: Python passes (data_ptr, nbytes) and keeps the tensor alive until
// the operation completes; the handle only sees bytes.
//
// One operation (a read or a write of one buffer at one file offset) is cut into at most
// `intra_op_parallelism` contiguous ranges, one per worker; a worker moves its range in
// `block_size` pieces, either through Linux AIO (libaio, `queue_depth` pieces in flight, when
// built with DS_IO_HAVE_LIBAIO and the file is opened with O_DIRECT) or with pread/pwrite.
//
// O_DIRECT needs the file offset, the length and the memory address aligned to kAlign. An
// unaligned offset, or a filesystem that refuses O_DIRECT (tmpfs), makes the whole operation
// buffered; an unaligned address goes direct through per-worker aligned bounce buffers; an
// unaligned length moves its aligned body direct and its last < kAlign bytes buffered. Each such
// fallback is recorded as a note that Python logs (never a silent fallback).
//
// Buffered reads (O_DIRECT off, or an unaligned file offset) read block_size x queue_depth bytes
// (at most kMaxBlockSize) per call, with POSIX_FADV_SEQUENTIAL: the kernel's readahead then keeps
// many large reads in flight (asking for each next piece with WILLNEED measured slower).
//
// Every operation is an `Operation` the caller may hold and wait for on its own (`done()`,
// `wait()`); a whole-file write may name `rename_to`, the final name the file gets once all its
// bytes are written (never when the write fails). A file that had that name is not removed but
// takes the written file's old name (an atomic exchange where the filesystem allows it; removed
// by a plain rename where not): the caller reuses its blocks for the next write or removes it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace ds_io {

constexpr int64_t kAlign = 4096;

// The settings' allowed ranges (ds_io/_limits.py holds the same numbers; a test compares them).
constexpr int64_t kMinBlockSize = 512;  // one sector; O_DIRECT pieces are rounded up to kAlign
constexpr int64_t kMaxBlockSize = int64_t(256) << 20;  // 256 MiB
constexpr int64_t kMinQueueDepth = 1;
constexpr int64_t kMaxQueueDepth = 65536;             // the default of /proc/sys/fs/aio-max-nr
constexpr int64_t kMinIntraOpParallelism = 1;
constexpr int64_t kMaxIntraOpParallelism = 256;

struct Operation {
  bool write = false;
  uintptr_t ptr = 0;
  int64_t nbytes = 0;
  std::string path;
  std::string rename_to;   // a write: the name the file gets once written (the old one's: path)
  int64_t file_offset = 0;
  bool want_direct = false;  // O_DIRECT asked for (where alignment allows)
  bool direct = false;     // the body [0, tail_begin) moves through fd_direct
  int64_t tail_begin = 0;  // bytes from here on move through fd_buffered
  bool truncate = false;   // a write at offset 0 makes the file exactly nbytes long
  bool keep_size = false;  // ...unless asked not to (a write in place inside a larger file)
  bool track = false;
  int fd_direct = -1;
  int fd_buffered = -1;
  std::atomic<int> remaining{0};
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  std::vector<std::string> errors;

  void fail(const std::string& what) {
    std::lock_guard<std::mutex> lock(mutex);
    errors.push_back(what);
  }
  bool failed() {
    std::lock_guard<std::mutex> lock(mutex);
    return !errors.empty();
  }
  bool is_done() {
    std::lock_guard<std::mutex> lock(mutex);
    return done;
  }
  // Blocks until the operation completes; throws IoError with its errors, if any.
  void wait_done();
};

struct Task {
  std::shared_ptr<Operation> op;
  int64_t begin;  // byte range of the operation's buffer (and file, shifted by the file offset);
  int64_t end;    // begin < 0: open the (deferred) operation's files and queue its ranges
};

class AioHandle {
 public:
  // Throws std::invalid_argument (ValueError) for a setting outside its range, and
  // std::runtime_error when the worker threads cannot be started.
  AioHandle(int64_t block_size, int64_t queue_depth, bool single_submit, bool overlap_events,
            int64_t intra_op_parallelism, bool use_libaio);
  ~AioHandle();
  AioHandle(const AioHandle&) = delete;
  AioHandle& operator=(const AioHandle&) = delete;

  // Starts an operation; returns at once. `direct` asks for O_DIRECT where alignment allows;
  // `track` counts it in wait()/pending(); `rename_to` (writes only, may be empty) see above.
  // `defer_open`: the files are opened by a worker when the operation's turn comes (so that any
  // number of queued operations hold no file descriptors; open errors then end the operation)
  // instead of now (errors thrown here). `keep_size`: a write at offset 0 leaves a longer file
  // as long as it was (by default it is truncated to the bytes written, DeepSpeed's pwrite).
  std::shared_ptr<Operation> submit(bool write, uintptr_t ptr, int64_t nbytes, const std::string& path,
                                    int64_t file_offset, bool direct, bool track, const std::string& rename_to,
                                    bool defer_open, bool keep_size = false);
  // Runs an operation to completion on the pool; throws std::runtime_error naming path/offset/size.
  void run(bool write, uintptr_t ptr, int64_t nbytes, const std::string& path, int64_t file_offset, bool direct);
  // Waits for every tracked operation; returns how many completed; throws the errors, if any.
  int64_t wait();
  int64_t pending() const;
  std::vector<std::string> take_notes();
  void close();

  int64_t block_size() const { return block_size_; }
  int queue_depth() const { return queue_depth_; }
  bool single_submit() const { return single_submit_; }
  bool overlap_events() const { return overlap_events_; }
  int intra_op_parallelism() const { return threads_; }
  bool uses_libaio() const { return use_libaio_; }

  void note(const std::string& text);
  void finish(const std::shared_ptr<Operation>& op);

 private:
  std::shared_ptr<Operation> start(bool write, uintptr_t ptr, int64_t nbytes, const std::string& path,
                                   int64_t file_offset, bool direct, bool track, const std::string& rename_to,
                                   bool defer_open, bool keep_size);
  void open_op(Operation& op);  // throws IoError naming the path; closes what it opened
  static void close_fds(Operation& op);
  void enqueue_tasks_locked(const std::shared_ptr<Operation>& op, bool front);
  void worker_loop(int index);

  const int64_t block_size_;
  const int queue_depth_;
  const bool single_submit_;
  const bool overlap_events_;
  const int threads_;
  const bool use_libaio_;

  mutable std::mutex mutex_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::deque<Task> queue_;
  std::vector<std::thread> workers_;
  bool stopping_ = false;
  int64_t tracked_in_flight_ = 0;
  int64_t tracked_completed_ = 0;
  std::vector<std::string> errors_;
  std::vector<std::string> notes_;
};

// Page-aligned memory, mlock()ed when the limit allows (a note says when it does not).
uintptr_t alloc_locked(int64_t nbytes, std::string* note);
void free_locked(uintptr_t ptr, int64_t nbytes);
bool have_libaio();

}  // namespace ds_io
