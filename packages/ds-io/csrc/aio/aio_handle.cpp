// See aio_handle.h for the design.
#include "aio_handle.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <stdio.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <system_error>

#ifdef DS_IO_HAVE_LIBAIO
#include <libaio.h>
#endif

#include "errors.h"

namespace ds_io {

void Operation::wait_done() {
  std::unique_lock<std::mutex> lock(mutex);
  cv.wait(lock, [&] { return done; });
  if (!errors.empty()) throw IoError(join(errors));
}

namespace {

std::string describe(const Operation& op, int64_t begin, int64_t length) {
  return std::string(op.write ? "write of " : "read of ") + std::to_string(length) + " bytes " +
         (op.write ? "to '" : "from '") + op.path + "' at file offset " + std::to_string(op.file_offset + begin) +
         " (operation: " + std::to_string(op.nbytes) + " bytes at offset " + std::to_string(op.file_offset) + ")";
}

// Gives `from` the name `to` atomically. A file already named `to` is not removed: it takes the
// name `from` (renameat2 RENAME_EXCHANGE), so that its blocks can be written again instead of
// being freed (and, on a filesystem mounted with online discard, trimmed) and allocated anew.
// Plain rename() where there is no such file or the filesystem cannot exchange. False: errno set.
bool swap_names(const std::string& from, const std::string& to) {
#if defined(SYS_renameat2) && defined(RENAME_EXCHANGE)
  if (::syscall(SYS_renameat2, AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_EXCHANGE) == 0) return true;
  if (errno != ENOENT && errno != EINVAL && errno != ENOSYS && errno != EOPNOTSUPP) return false;
#endif
  return ::rename(from.c_str(), to.c_str()) == 0;
}

std::string errno_text(int err) { return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")"; }

// pread/pwrite the whole range, retrying short transfers and EINTR. Returns "" or the error.
std::string move_posix(const Operation& op, int fd, char* mem, int64_t begin, int64_t end, int64_t piece) {
  int64_t pos = begin;
  while (pos < end) {
    const int64_t want = std::min(piece, end - pos);
    int64_t done = 0;
    while (done < want) {
      const ssize_t n = op.write ? ::pwrite(fd, mem + pos + done, want - done, op.file_offset + pos + done)
                                 : ::pread(fd, mem + pos + done, want - done, op.file_offset + pos + done);
      if (n < 0) {
        if (errno == EINTR) continue;
        return describe(op, pos + done, want - done) + " failed: " + errno_text(errno);
      }
      if (n == 0)
        return describe(op, pos + done, want - done) + " failed: the file ends at byte " +
               std::to_string(op.file_offset + pos + done);
      done += n;
    }
    pos += want;
  }
  return "";
}

struct AlignedBuffer {
  char* data = nullptr;
  int64_t size = 0;
  void ensure(int64_t n) {
    if (size >= n) return;
    std::free(data);
    if (posix_memalign(reinterpret_cast<void**>(&data), kAlign, n) != 0) throw std::bad_alloc();
    size = n;
  }
  ~AlignedBuffer() { std::free(data); }
};

// O_DIRECT from/to memory that is not aligned: each piece goes through an aligned bounce buffer.
std::string move_bounced(const Operation& op, int fd, char* mem, int64_t begin, int64_t end, int64_t piece) {
  thread_local AlignedBuffer bounce;
  bounce.ensure(piece);
  for (int64_t pos = begin; pos < end; pos += piece) {
    const int64_t want = std::min(piece, end - pos);
    if (op.write) std::memcpy(bounce.data, mem + pos, want);
    Operation view;  // one piece, addressed relative to the bounce buffer
    view.write = op.write;
    view.path = op.path;
    view.nbytes = op.nbytes;
    view.file_offset = op.file_offset + pos;
    std::string err = move_posix(view, fd, bounce.data, 0, want, want);
    if (!err.empty()) return describe(op, pos, want) + " failed: " + err.substr(err.find(" failed: ") + 9);
    if (!op.write) std::memcpy(mem + pos, bounce.data, want);
  }
  return "";
}

#ifdef DS_IO_HAVE_LIBAIO
struct AioContext {
  io_context_t ctx = 0;
  int depth = 0;
  std::string error;
  bool ensure(int queue_depth) {
    if (depth == queue_depth) return true;
    if (depth) io_destroy(ctx);
    ctx = 0;
    depth = 0;
    const int rc = io_setup(queue_depth, &ctx);
    if (rc < 0) {
      error = "io_setup(" + std::to_string(queue_depth) + ") failed: " + errno_text(-rc);
      return false;
    }
    depth = queue_depth;
    return true;
  }
  ~AioContext() {
    if (depth) io_destroy(ctx);
  }
};

// Linux AIO: keep up to queue_depth pieces in flight. overlap_events: refill as soon as one
// completes; otherwise submit a batch and reap all of it. single_submit: one io_submit per piece.
std::string move_libaio(io_context_t ctx, int queue_depth, bool single_submit, bool overlap_events,
                        const Operation& op, int fd, char* mem, int64_t begin, int64_t end, int64_t piece) {
  std::vector<iocb> cbs(queue_depth);
  std::vector<iocb*> free_cbs;
  for (auto& cb : cbs) free_cbs.push_back(&cb);
  std::vector<io_event> events(queue_depth);
  std::vector<iocb*> batch;
  std::string error;
  int64_t next = begin;
  int inflight = 0;
  while ((next < end && error.empty()) || inflight > 0) {
    batch.clear();
    while (error.empty() && next < end && !free_cbs.empty()) {
      iocb* cb = free_cbs.back();
      free_cbs.pop_back();
      const int64_t len = std::min(piece, end - next);
      if (op.write)
        io_prep_pwrite(cb, fd, mem + next, len, op.file_offset + next);
      else
        io_prep_pread(cb, fd, mem + next, len, op.file_offset + next);
      cb->data = reinterpret_cast<void*>(static_cast<uintptr_t>(next));
      batch.push_back(cb);
      next += len;
    }
    size_t submitted = 0;
    while (submitted < batch.size()) {
      const long count = single_submit ? 1 : static_cast<long>(batch.size() - submitted);
      const int rc = io_submit(ctx, count, batch.data() + submitted);
      if (rc == -EAGAIN || rc == -EINTR) continue;
      if (rc < 0) {
        const int64_t at = reinterpret_cast<uintptr_t>(batch[submitted]->data);
        error = describe(op, at, batch[submitted]->u.c.nbytes) + " failed at io_submit: " + errno_text(-rc);
        for (size_t k = submitted; k < batch.size(); ++k) free_cbs.push_back(batch[k]);
        break;
      }
      submitted += rc;
    }
    inflight += static_cast<int>(submitted);
    if (inflight == 0) break;
    const int min_nr = overlap_events ? 1 : inflight;
    const int got = io_getevents(ctx, min_nr, queue_depth, events.data(), nullptr);
    if (got == -EINTR) continue;
    if (got < 0) {
      // Cannot reap: the buffers may still be in use, so this is fatal for the process's safety.
      error = describe(op, begin, end - begin) + " failed at io_getevents: " + errno_text(-got);
      std::abort();
    }
    for (int k = 0; k < got; ++k) {
      iocb* cb = events[k].obj;
      const int64_t at = reinterpret_cast<uintptr_t>(cb->data);
      const int64_t want = static_cast<int64_t>(cb->u.c.nbytes);
      const long res = static_cast<long>(events[k].res);
      if (res < 0 && error.empty()) {
        error = describe(op, at, want) + " failed: " + errno_text(static_cast<int>(-res));
      } else if (res >= 0 && res < want && error.empty()) {
        // A short transfer (end of file on a read): finish the piece with pread/pwrite, which
        // either completes it or reports where the file ends.
        error = move_posix(op, fd, mem, at + res, at + want, want);
      }
      free_cbs.push_back(cb);
    }
    inflight -= got;
  }
  return error;
}
#endif

}  // namespace

namespace {
int64_t in_range(const char* name, int64_t value, int64_t lo, int64_t hi) {
  if (value < lo || value > hi)
    throw std::invalid_argument(std::string(name) + " must be an integer in [" + std::to_string(lo) + ", " +
                                std::to_string(hi) + "], got " + std::to_string(value));
  return value;
}
}  // namespace

AioHandle::AioHandle(int64_t block_size, int64_t queue_depth, bool single_submit, bool overlap_events,
                     int64_t intra_op_parallelism, bool use_libaio)
    : block_size_(in_range("block_size", block_size, kMinBlockSize, kMaxBlockSize)),
      queue_depth_(static_cast<int>(in_range("queue_depth", queue_depth, kMinQueueDepth, kMaxQueueDepth))),
      single_submit_(single_submit),
      overlap_events_(overlap_events),
      threads_(static_cast<int>(
          in_range("intra_op_parallelism", intra_op_parallelism, kMinIntraOpParallelism, kMaxIntraOpParallelism))),
      use_libaio_(use_libaio && have_libaio()) {
  try {
    for (int k = 0; k < threads_; ++k) workers_.emplace_back([this, k] { worker_loop(k); });
  } catch (const std::system_error& e) {
    // Never leave a joinable std::thread behind (that would terminate the process).
    const size_t started = workers_.size();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    work_cv_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
    throw std::runtime_error("cannot start " + std::to_string(threads_) + " worker threads (intra_op_parallelism; " +
                             std::to_string(started) + " started): " + e.what() +
                             "; use fewer threads or raise the process/thread limit");
  }
}

AioHandle::~AioHandle() { close(); }

void AioHandle::close() {
  {
    std::unique_lock<std::mutex> lock(mutex_);
    if (stopping_) return;
    done_cv_.wait(lock, [&] { return queue_.empty() && tracked_in_flight_ == 0; });
    stopping_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
  workers_.clear();
}

void AioHandle::note(const std::string& text) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (notes_.size() < 1000) notes_.push_back(text);
}

std::vector<std::string> AioHandle::take_notes() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::string> out;
  out.swap(notes_);
  return out;
}

int64_t AioHandle::pending() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return tracked_in_flight_ + tracked_completed_;
}

std::shared_ptr<Operation> AioHandle::start(bool write, uintptr_t ptr, int64_t nbytes, const std::string& path,
                                            int64_t file_offset, bool direct, bool track,
                                            const std::string& rename_to, bool defer_open, bool keep_size) {
  if (!write && !rename_to.empty()) throw std::invalid_argument("rename_to applies to writes only");
  if (nbytes < 0 || file_offset < 0)
    throw std::invalid_argument("'" + path + "': size and file offset must be >= 0, got size " + std::to_string(nbytes) +
                                " at offset " + std::to_string(file_offset));
  auto op = std::make_shared<Operation>();
  op->write = write;
  op->ptr = ptr;
  op->nbytes = nbytes;
  op->path = path;
  op->file_offset = file_offset;
  op->track = track;
  op->rename_to = rename_to;
  op->want_direct = direct;
  op->keep_size = keep_size;
  if (!defer_open) open_op(*op);  // errors reach the caller now
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) {
      close_fds(*op);
      throw std::invalid_argument("the aio handle is closed");
    }
    if (track) ++tracked_in_flight_;
    if (defer_open) {
      op->remaining = 1;
      queue_.push_back(Task{op, -1, -1});  // a worker opens it when it gets there
    } else {
      enqueue_tasks_locked(op, false);
    }
  }
  work_cv_.notify_all();
  return op;
}

void AioHandle::close_fds(Operation& op) {
  if (op.fd_direct >= 0) ::close(op.fd_direct);
  if (op.fd_buffered >= 0) ::close(op.fd_buffered);
  op.fd_direct = op.fd_buffered = -1;
}

void AioHandle::open_op(Operation& op) {
  const std::string& path = op.path;
  const bool write = op.write;
  const int64_t nbytes = op.nbytes;
  const int64_t file_offset = op.file_offset;
  bool direct = op.want_direct;
  const int base = write ? (O_WRONLY | O_CREAT) : O_RDONLY;
  const std::string what = "cannot open '" + path + "' to " + (write ? "write " : "read ") + std::to_string(nbytes) +
                           " bytes at offset " + std::to_string(file_offset) + ": ";

  if (direct && file_offset % kAlign != 0) {
    note("'" + path + "': file offset " + std::to_string(file_offset) + " is not a multiple of " +
         std::to_string(kAlign) + ": buffered I/O instead of O_DIRECT");
    direct = false;
  }
  if (direct && nbytes >= kAlign) {
    op.fd_direct = ::open(path.c_str(), base | O_DIRECT | O_CLOEXEC, 0644);
    if (op.fd_direct < 0 && errno == EINVAL) {
      note("'" + path + "': the filesystem refuses O_DIRECT: buffered I/O instead");
      direct = false;
    } else if (op.fd_direct < 0) {
      throw IoError(what + errno_text(errno));
    }
  } else {
    direct = false;
  }
  op.direct = direct;
  op.tail_begin = direct ? nbytes / kAlign * kAlign : 0;
  if (direct && op.tail_begin < nbytes)
    note("'" + path + "': size " + std::to_string(nbytes) + " is not a multiple of " + std::to_string(kAlign) +
         ": the last " + std::to_string(nbytes - op.tail_begin) + " bytes go through buffered I/O");
  if (op.tail_begin < nbytes || nbytes == 0) {
    op.fd_buffered = ::open(path.c_str(), base | O_CLOEXEC, 0644);
    if (op.fd_buffered < 0) {
      const int err = errno;
      close_fds(op);
      throw IoError(what + errno_text(err));
    }
    if (!write && !direct) ::posix_fadvise(op.fd_buffered, 0, 0, POSIX_FADV_SEQUENTIAL);  // a hint
  }
  struct stat st {};
  ::fstat(op.fd_direct >= 0 ? op.fd_direct : op.fd_buffered, &st);
  if (!write && st.st_size < file_offset + nbytes) {
    close_fds(op);
    throw IoError("'" + path + "' is " + std::to_string(st.st_size) + " bytes, too short to read " +
                  std::to_string(nbytes) + " bytes at offset " + std::to_string(file_offset));
  }
  op.truncate = write && !op.keep_size && file_offset == 0 && st.st_size > nbytes;
}

// Splits an opened operation into at most threads_ contiguous ranges of whole pieces and queues
// them (in front of the queue for a deferred operation, which was its turn already).
void AioHandle::enqueue_tasks_locked(const std::shared_ptr<Operation>& op, bool front) {
  const int64_t nbytes = op->nbytes;
  const int64_t piece = op->direct ? (block_size_ + kAlign - 1) / kAlign * kAlign : block_size_;
  const int64_t pieces = std::max<int64_t>(1, (nbytes + piece - 1) / piece);
  const int64_t tasks = std::min<int64_t>(threads_, pieces);
  op->remaining = static_cast<int>(tasks);
  for (int64_t k = 0; k < tasks; ++k) {
    const int64_t t = front ? tasks - 1 - k : k;
    const int64_t b = std::min(nbytes, pieces * t / tasks * piece);
    const int64_t e = t + 1 == tasks ? nbytes : std::min(nbytes, pieces * (t + 1) / tasks * piece);
    if (front)
      queue_.push_front(Task{op, b, e});
    else
      queue_.push_back(Task{op, b, e});
  }
}

std::shared_ptr<Operation> AioHandle::submit(bool write, uintptr_t ptr, int64_t nbytes, const std::string& path,
                                             int64_t file_offset, bool direct, bool track,
                                             const std::string& rename_to, bool defer_open, bool keep_size) {
  return start(write, ptr, nbytes, path, file_offset, direct, track, rename_to, defer_open, keep_size);
}

void AioHandle::run(bool write, uintptr_t ptr, int64_t nbytes, const std::string& path, int64_t file_offset,
                    bool direct) {
  start(write, ptr, nbytes, path, file_offset, direct, false, "", false, false)->wait_done();
}

int64_t AioHandle::wait() {
  std::unique_lock<std::mutex> lock(mutex_);
  if (tracked_in_flight_ == 0 && tracked_completed_ == 0)
    throw std::invalid_argument("wait() called with no asynchronous operation pending: start one with "
                                "async_pread/async_pwrite (or pread/pwrite with async_op=True) first");
  done_cv_.wait(lock, [&] { return tracked_in_flight_ == 0; });
  const int64_t completed = tracked_completed_;
  tracked_completed_ = 0;
  std::vector<std::string> errors;
  errors.swap(errors_);
  if (!errors.empty())
    throw IoError(std::to_string(errors.size()) + " of " + std::to_string(completed) +
                  " operations failed: " + join(errors));
  return completed;
}

void AioHandle::finish(const std::shared_ptr<Operation>& op) {
  if (op->truncate && !op->failed()) {
    const int fd = op->fd_buffered >= 0 ? op->fd_buffered : op->fd_direct;
    if (::ftruncate(fd, op->nbytes) != 0) op->fail(describe(*op, 0, op->nbytes) + ": ftruncate failed: " + errno_text(errno));
  }
  for (int* fd : {&op->fd_direct, &op->fd_buffered}) {
    if (*fd >= 0 && ::close(*fd) != 0 && op->write)
      op->fail(describe(*op, 0, op->nbytes) + ": close failed: " + errno_text(errno));
    *fd = -1;
  }
  if (!op->rename_to.empty() && !op->failed() && !swap_names(op->path, op->rename_to))
    op->fail(describe(*op, 0, op->nbytes) + ": renaming it to '" + op->rename_to + "' failed: " + errno_text(errno));
  if (op->track) {
    std::lock_guard<std::mutex> lock(mutex_);
    --tracked_in_flight_;
    ++tracked_completed_;
    for (auto& e : op->errors) errors_.push_back(e);
  }
  {
    std::lock_guard<std::mutex> lock(op->mutex);
    op->done = true;
  }
  op->cv.notify_all();
  done_cv_.notify_all();  // close() waits for the queue to drain, untracked operations included
}

void AioHandle::worker_loop(int /*index*/) {
#ifdef DS_IO_HAVE_LIBAIO
  AioContext aio;
  bool aio_ok = use_libaio_;
#endif
  for (;;) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    Operation& op = *task.op;
    if (task.begin < 0) {  // a deferred operation's turn: open its files, then queue its ranges
      std::string error;
      try {
        open_op(op);
      } catch (const std::exception& e) {
        error = e.what();
      }
      if (error.empty()) {
        {
          std::lock_guard<std::mutex> lock(mutex_);
          enqueue_tasks_locked(task.op, true);
        }
        work_cv_.notify_all();
      } else {
        op.fail(error);
        finish(task.op);
      }
      continue;
    }
    char* mem = reinterpret_cast<char*>(op.ptr);
    std::string error;
    try {
      const int64_t body_end = op.direct ? std::min(task.end, op.tail_begin) : task.begin;
      if (task.begin < body_end) {
        const int64_t piece = (block_size_ + kAlign - 1) / kAlign * kAlign;
        if (op.ptr % kAlign != 0) {
          error = move_bounced(op, op.fd_direct, mem, task.begin, body_end, piece);
        } else {
#ifdef DS_IO_HAVE_LIBAIO
          if (aio_ok && !aio.ensure(queue_depth_)) {
            note("libaio unavailable (" + aio.error + "; queue_depth x intra_op_parallelism may exceed the "
                 "free part of /proc/sys/fs/aio-max-nr): this worker uses pread/pwrite");
            aio_ok = false;
          }
          if (aio_ok)
            error = move_libaio(aio.ctx, queue_depth_, single_submit_, overlap_events_, op, op.fd_direct, mem,
                                task.begin, body_end, piece);
          else
#endif
            error = move_posix(op, op.fd_direct, mem, task.begin, body_end, piece);
        }
      }
      const int64_t tail_start = std::max(task.begin, body_end);
      if (error.empty() && tail_start < task.end) {
        // Buffered reads ask for queue_depth pieces per call (the bytes the libaio path keeps in
        // flight): the larger the read, the more the kernel's readahead keeps in flight.
        const int64_t piece = !op.write && !op.direct ? std::min(kMaxBlockSize, block_size_ * queue_depth_) : block_size_;
        error = move_posix(op, op.fd_buffered, mem, tail_start, task.end, piece);
      }
    } catch (const std::exception& e) {
      error = describe(op, task.begin, task.end - task.begin) + " failed: " + e.what();
    }
    if (!error.empty()) op.fail(error);
    if (--op.remaining == 0) finish(task.op);
  }
}

uintptr_t alloc_locked(int64_t nbytes, std::string* note) {
  const int64_t size = std::max<int64_t>(kAlign, (nbytes + kAlign - 1) / kAlign * kAlign);
  void* p = nullptr;
  if (posix_memalign(&p, kAlign, size) != 0)
    throw std::bad_alloc();
  std::memset(p, 0, size);  // touch every page now, not during the first I/O
  if (::mlock(p, size) != 0)
    *note = "mlock of " + std::to_string(size) + " bytes failed (" + errno_text(errno) +
            "; raise `ulimit -l`): the buffer is aligned but not page-locked";
  return reinterpret_cast<uintptr_t>(p);
}

void free_locked(uintptr_t ptr, int64_t nbytes) {
  const int64_t size = std::max<int64_t>(kAlign, (nbytes + kAlign - 1) / kAlign * kAlign);
  ::munlock(reinterpret_cast<void*>(ptr), size);
  std::free(reinterpret_cast<void*>(ptr));
}

bool have_libaio() {
#ifdef DS_IO_HAVE_LIBAIO
  return true;
#else
  return false;
#endif
}

}  // namespace ds_io
