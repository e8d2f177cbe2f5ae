#pragma once
// WEFT_UNDER_SANITIZER: defined when this translation unit is built under AddressSanitizer,
// ThreadSanitizer or MemorySanitizer (GCC's and Clang's spellings). Code that keeps memory for reuse or
// writes it by means a sanitizer does not see (non-temporal stores) takes the plain path then, so that a
// use after release or an unsynchronised write stays visible.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define WEFT_UNDER_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(memory_sanitizer)
#define WEFT_UNDER_SANITIZER 1
#endif
#endif

// WEFT_UNDER_THREAD_SANITIZER: ThreadSanitizer alone. It runs the plain copies above about 100x slower
// (a shm ring moves ~5 MB/s under it here), so a test whose outcome depends on a large frame going out
// within a time limit says what it can still expect there.
#if defined(__SANITIZE_THREAD__)
#define WEFT_UNDER_THREAD_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define WEFT_UNDER_THREAD_SANITIZER 1
#endif
#endif
