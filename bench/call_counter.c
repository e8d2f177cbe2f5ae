// bench/calls.sh's preload: counts the calls a process makes through the dynamic linker to malloc and free,
// pthread_mutex_lock and the condition-variable signals, and appends them to the file CALLS_OUT at exit
// (rank 0 of weft-run or mpirun only: the launchers themselves write nothing). Not part of weft.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static atomic_ulong n_malloc, n_free, n_lock, n_signal;
static void* (*real_malloc)(size_t);
static void (*real_free)(void*);
static int (*real_lock)(pthread_mutex_t*);
static int (*real_signal)(pthread_cond_t*);
static int (*real_broadcast)(pthread_cond_t*);
extern void* __libc_malloc(size_t);
extern void __libc_free(void*);

void* malloc(size_t n) { atomic_fetch_add_explicit(&n_malloc, 1, memory_order_relaxed); return __libc_malloc(n); }
void free(void* p) { if (p) atomic_fetch_add_explicit(&n_free, 1, memory_order_relaxed); __libc_free(p); }
int pthread_mutex_lock(pthread_mutex_t* m) {
  if (!real_lock) real_lock = dlsym(RTLD_NEXT, "pthread_mutex_lock");
  atomic_fetch_add_explicit(&n_lock, 1, memory_order_relaxed);
  return real_lock(m);
}
int pthread_cond_signal(pthread_cond_t* c) {
  if (!real_signal) real_signal = dlvsym(RTLD_NEXT, "pthread_cond_signal", "GLIBC_2.3.2");
  atomic_fetch_add_explicit(&n_signal, 1, memory_order_relaxed);
  return real_signal(c);
}
int pthread_cond_broadcast(pthread_cond_t* c) {
  if (!real_broadcast) real_broadcast = dlvsym(RTLD_NEXT, "pthread_cond_broadcast", "GLIBC_2.3.2");
  atomic_fetch_add_explicit(&n_signal, 1, memory_order_relaxed);
  return real_broadcast(c);
}
__attribute__((destructor)) static void report(void) {
  const char* out = getenv("CALLS_OUT");
  const char* rank = getenv("WEFT_RANK");
  if (!rank) rank = getenv("OMPI_COMM_WORLD_RANK");
  if (!out || !rank || strcmp(rank, "0") != 0) return;
  FILE* f = fopen(out, "a");
  if (!f) return;
  fprintf(f, "%lu %lu %lu %lu\n", (unsigned long)n_malloc, (unsigned long)n_free, (unsigned long)n_lock, (unsigned long)n_signal);
  fclose(f);
}
