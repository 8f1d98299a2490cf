// Memory for what a decode step streams whole: the packed weights (quant_pack) and the read-bandwidth probe
// (bench membw). It comes from 2 MiB-aligned chunks advised as transparent huge pages, so the stream walks one
// TLB entry per 2 MiB instead of per 4 KiB (where the kernel has THP in "madvise" or "always" mode; elsewhere the
// advice fails, and where memory is too fragmented the kernel falls back, to ordinary pages). Matrices are carved
// one after the other from the current chunk: one 2 MiB page per small matrix would waste up to 2 MiB each, and
// only the pages written are resident.
//
//   empty_huge_paged(rows, cols): uint8 [rows, cols], 64-byte aligned, uninitialised.

#include <ATen/ATen.h>
#include <sys/mman.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>

#include "common.h"

namespace {

constexpr size_t kHugePage = size_t{2} << 20;
constexpr size_t kChunk = size_t{64} << 20;  // address space; pages cost memory only once written
constexpr size_t kAlign = 64;

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// One mapping; unmapped when the last tensor carved from it (and the arena) lets go.
struct Chunk {
  uint8_t* base = nullptr;
  size_t size = 0, used = 0;
  ~Chunk() {
    if (base != nullptr) munmap(base, size);
  }
};

std::shared_ptr<Chunk> map_chunk(size_t bytes) {
  const size_t size = round_up(std::max(bytes, kChunk), kHugePage);
  void* raw = mmap(nullptr, size + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  // trim to a 2 MiB-aligned range so every page of it can be huge
  const uintptr_t start = reinterpret_cast<uintptr_t>(raw), aligned = round_up(start, kHugePage);
  if (aligned > start) munmap(raw, aligned - start);
  const size_t tail = start + size + kHugePage - (aligned + size);
  if (tail > 0) munmap(reinterpret_cast<void*>(aligned + size), tail);
  auto chunk = std::make_shared<Chunk>();
  chunk->base = reinterpret_cast<uint8_t*>(aligned);
  chunk->size = size;
#ifdef MADV_HUGEPAGE
  madvise(chunk->base, size, MADV_HUGEPAGE);  // advice only: an error leaves ordinary pages
#endif
  return chunk;
}

std::mutex arena_mutex;
std::weak_ptr<Chunk> current;  // weak: a chunk whose tensors are all gone is unmapped, not kept for later

}  // namespace

namespace pagedllm {

at::Tensor empty_huge_paged(int64_t rows, int64_t cols) {
  TORCH_CHECK(rows >= 0 && cols >= 0, "empty_huge_paged: negative size");
  const size_t bytes = round_up(static_cast<size_t>(rows) * static_cast<size_t>(cols), kAlign);
  std::shared_ptr<Chunk> chunk;
  uint8_t* data = nullptr;
  {
    std::lock_guard<std::mutex> lock(arena_mutex);
    chunk = current.lock();
    if (chunk == nullptr || chunk->size - chunk->used < bytes) {
      std::shared_ptr<Chunk> fresh = map_chunk(bytes);
      if (fresh == nullptr) return at::empty({rows, cols}, at::kByte);  // no mapping: torch's allocator
      // keep carving from whichever chunk has more room left
      if (chunk == nullptr || fresh->size - bytes > chunk->size - chunk->used) current = fresh;
      chunk = fresh;
    }
    data = chunk->base + chunk->used;
    chunk->used += bytes;
  }
  return at::from_blob(data, {rows, cols}, [chunk](void*) {}, at::TensorOptions().dtype(at::kByte));
}

}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) { m.def("empty_huge_paged", &pagedllm::empty_huge_paged); }
