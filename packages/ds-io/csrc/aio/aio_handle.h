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

struct Operation;

struct Task {
  std::shared_ptr<Operation> op;
  int64_t begin;  // byte range of the operation's buffer (and file, shifted by the file offset)
  int64_t end;
};

class AioHandle {
 public:
  AioHandle(int64_t block_size, int queue_depth, bool single_submit, bool overlap_events,
            int intra_op_parallelism, bool use_libaio);
  ~AioHandle();
  AioHandle(const AioHandle&) = delete;
  AioHandle& operator=(const AioHandle&) = delete;

  // Starts an operation; returns at once. `direct` asks for O_DIRECT where alignment allows.
  void submit(bool write, uintptr_t ptr, int64_t nbytes, const std::string& path, int64_t file_offset,
              bool direct, bool track);
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
                                   int64_t file_offset, bool direct, bool track);
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
